"""cuDNN's convolution workspace is elastic: PyTorch sizes it by what the caching allocator can give.

How PyTorch runs a cuDNN convolution (``aten/src/ATen/native/cudnn/Conv_v8.cpp``: ``run_single_conv``,
``try_plans``): it takes the plans cuDNN's heuristics rank for the shapes, followed by cuDNN's
fallback list, and for each in turn allocates the plan's workspace from the caching allocator and
runs it; an allocation that fails (``OutOfMemoryError``, raised after the allocator has freed its
cached blocks and retried) moves on to the next plan. The plan that ran is cached per shape key and
tried first next time, with the same fallback. So a convolution's workspace is not one figure: it is
the heuristics' first choice when memory is free (what calibration measures on a GPU, and what
``reserved`` will likely reach), and less as memory runs short, down to the fallback engines
(implicit-GEMM kernels, which need none: taken here as 0 B -- an assumption until a GPU shows it,
``benchmarks/cuda_paths_check.py`` runs a step capped at that figure).

Hence two figures per step on CUDA: the peak with each convolution's workspace as the kernels say
(typical), and the peak with every elastic workspace at its smallest -- what the step can run in,
slower (``StepEstimate.smallest_workspace_peaks``). The pre-check uses the smallest; the batch-size
search and the advice keep the typical, so what we recommend runs at full speed.

Example:
    >>> import torch
    >>> from lightning_memest.engine.events import OpCall, TensorMeta
    >>> x = TensorMeta.of(torch.empty(8, 3, 32, 32))
    >>> conv = OpCall(torch.ops.aten.convolution.default, (x,), {}, (x,), "cuda")
    >>> elastic(conv), elastic(OpCall(torch.ops.aten.relu.default, (x,), {}, (x,), "cuda"))
    (True, False)
    >>> typical = lambda call: KernelMemory(workspace_bytes=2**20)
    >>> smallest_workspaces(typical)(conv).workspace_bytes, typical(conv).workspace_bytes
    (0, 1048576)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from lightning_memest.accounting.kernels import CalibratedKernels
from lightning_memest.accounting.kernels.model import KernelMemory, KernelModel
from lightning_memest.engine.events import OpCall, OpEvent

__all__ = [
    "ELASTIC_OPS",
    "convolutions",
    "elastic",
    "has_elastic_workspace",
    "smallest_workspaces",
    "workspaces_assumed",
]

#: The convolution ops a fake CUDA step records (``convolution`` and its backward; the cuDNN entry
#: points where a caller reaches them directly): cuDNN runs them when ``torch.backends.cudnn.enabled``.
ELASTIC_OPS = frozenset(
    {
        "aten.convolution.default",
        "aten.convolution_backward.default",
        "aten._convolution.default",
        "aten.cudnn_convolution.default",
        "aten.cudnn_convolution_transpose.default",
    }
)


def elastic(call: OpCall) -> bool:
    """Whether ``call`` is a CUDA convolution whose workspace cuDNN's plan fallback can shrink."""
    return call.device_type == "cuda" and torch.backends.cudnn.enabled and str(call.op) in ELASTIC_OPS


def smallest_workspaces(kernels: KernelModel, is_elastic: Callable[[OpCall], bool] = elastic) -> KernelModel:
    """``kernels`` with every elastic call's workspace at its smallest (0 B), outputs as they were."""

    def fn(call: OpCall) -> KernelMemory | None:
        effect = kernels(call)
        if effect is None or effect.workspace_bytes == 0 or not is_elastic(call):
            return effect
        return dataclasses.replace(effect, workspace_bytes=0)

    return fn


def convolutions(events: Iterable[object]) -> list[OpEvent]:
    """The step's convolution ops (on CUDA: where a cuDNN workspace is to speak of)."""
    return [e for e in events if isinstance(e, OpEvent) and e.op in ELASTIC_OPS]


def has_elastic_workspace(
    convs: Iterable[OpEvent], kernels: KernelModel, is_elastic: Callable[[OpCall], bool] = elastic
) -> bool:
    """Whether any of the convolutions ``convs`` is elastic and holds a workspace by ``kernels``: only
    then do the smallest-workspace peaks differ from the typical ones."""
    for e in convs:
        if e.call is not None and is_elastic(e.call):
            effect = kernels(e.call)
            if effect is not None and effect.workspace_bytes > 0:
                return True
    return False


def workspaces_assumed(convs: Iterable[OpEvent], kernels: KernelModel) -> bool:
    """Whether the cuDNN workspaces of the convolutions ``convs`` are assumed rather than measured:
    measured only where a GPU's calibration has every one's signature (one that failed to calibrate
    keeps the hand model's figure)."""
    if not isinstance(kernels, CalibratedKernels):
        return True
    return not all(e.call is not None and kernels.measured(e.call) for e in convs)
