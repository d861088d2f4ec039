"""Plans for :class:`~lightning_memest.engine.parallel.distributed.ModelParallel` built from simpler parts:
the job's own tensor-parallel plan on the mesh's tensor-parallel dimension, then FSDP2 units over its
data-parallel dimension -- what ``memest estimate --tp N --tp-plan MODULE:FUNCTION --strategy fsdp``
runs (torchtitan's order: TP inside each block, then ``fully_shard`` on the blocks and the root), and
what ``--pp`` with either gives each pipeline stage.

Example:
    >>> import torch
    >>> from lightning_memest import FSDP, ModelParallel, estimate_step
    >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    >>> def mlp(model, mesh):  # the job's own TP plan, on a 1-D mesh
    ...     parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    >>> plan = TensorThenShard(mlp, FSDP(2, units=("Linear",)))
    >>> est = estimate_step(model, torch.randn(8, 64), strategy=ModelParallel(2, 2, plan=plan))
    >>> # each rank: a quarter of the weights and the first bias (split twice), half of the last bias
    >>> est.steady_state.breakdown.parameters == 4 * ((64 * 256 + 256 + 256 * 64) // 4 + 64 // 2)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_memest.engine.parallel.distributed import FSDP, shard_units

__all__ = ["TensorThenShard"]


@dataclass(frozen=True)
class TensorThenShard:
    """``plan(model, mesh)``: ``tensor_plan(model, mesh["tensor_parallel"])``, then ``fsdp``'s units
    (their classes, policy, resharding; its world size and rank are the mesh's) sharded over
    ``mesh["data_parallel"]``, the root last. Either may be ``None`` (a pipeline's stages only
    sharded, or only split: ``memest --pp`` with ``--strategy fsdp`` or ``--tp``)."""

    tensor_plan: Callable[[nn.Module, Any], Any] | None
    fsdp: FSDP | None

    def __call__(self, model: nn.Module, mesh: Any) -> None:
        if self.tensor_plan is not None:
            self.tensor_plan(model, mesh["tensor_parallel"])
        if self.fsdp is not None:
            shard_units(model, self.fsdp, mesh["data_parallel"])
