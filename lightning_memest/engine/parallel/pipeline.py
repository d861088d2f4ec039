"""Pipeline parallelism as one rank sees it: PyTorch's own ``PipelineStage`` and schedules
(``torch.distributed.pipelining``) over a fake process group.

A :class:`Pipeline` says how the job splits its model into stages (``split(model, stage, stages)``,
pruning the model in place as PyTorch's pipelining tutorial and torchtitan do, or returning the stage's
module), how many microbatches a batch is cut into and which schedule runs them. :class:`PipelineRun`
builds this rank's stage and schedule and runs one training step through ``schedule.step``, the same
way in a simulation and in a real, measured run: every buffer the schedule allocates -- the receive
buffers of each microbatch's activations and gradients, the microbatches' activations kept for their
backward (as many in flight as the schedule keeps: 1F1B's first stage holds one per stage, GPipe's
every stage holds all), the outputs it merges on the last stage -- is allocated by PyTorch's code.

What the fake run has to be helped with: a stage's input and output shapes. PyTorch infers them at
run time by sending tensors and pickled metadata between the stages, which a fake process group cannot
carry; given the shapes up front (``PipelineStage(input_args=..., output_args=...)``) the schedule
takes its static path, with or without a fake group. Those shapes are found on the meta device: a meta
copy of the whole model, split as the job splits it, each stage up to this one run on one microbatch.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_memest import Pipeline, estimate_step
    >>> def split(model, stage, stages):  # two Linear layers a stage
    ...     return model[2 * stage : 2 * stage + 2]
    >>> model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    >>> est = estimate_step(model, torch.randn(16, 64), optimizer=torch.optim.SGD,
    ...                     strategy=Pipeline(2, split=split, microbatches=4, rank=1))
    >>> est.steady_state.breakdown.parameters  # this stage's two layers
    33280
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memest.constants import PIPELINE_SCHEDULES
from lightning_memest.engine.events import Phase
from lightning_memest.errors import EstimationError
from lightning_memest.options import check_count

__all__ = [
    "PIPELINE_MESH_DIMS",
    "SCHEDULES",
    "Pipeline",
    "PipelineRun",
    "Split",
    "StageLoss",
    "stages_of",
    "works_hold_their_tensors",
]

#: The schedules a :class:`Pipeline` runs, by the names of ``torch.distributed.pipelining``'s classes
#: (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ...).
SCHEDULES = PIPELINE_SCHEDULES

#: The schedules that run several stages a rank (loop-style).
_MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: The schedules that place a rank's two stages as a V: rank ``r`` of ``n`` runs ``r`` and ``2n - 1 - r``.
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")

#: The device mesh of a :class:`Pipeline` with ``plan``: its ``plan`` is given the last two dimensions.
PIPELINE_MESH_DIMS = ("pipeline", "data_parallel", "tensor_parallel")

#: ``split(model, stage, stages)``: the module stage ``stage`` of ``stages`` runs, made from ``model``
#: (pruned in place and ``None`` or the model returned, or a part of it returned).
Split = Callable[[nn.Module, int, int], "nn.Module | None"]
#: ``loss(output, target)`` on the last stage, per microbatch (the schedule's ``loss_fn``).
StageLoss = Callable[[Any, Any], Tensor]


@dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism on ``stages`` ranks, seen from rank ``rank``: the model cut into stages by
    ``split``, each batch into ``microbatches``, run by ``schedule`` (one of :data:`SCHEDULES`).
    ``Interleaved1F1B`` and ``InterleavedZeroBubble`` (backward split into its input and weight
    gradients) give each rank ``stages_per_rank`` stages (rank ``r`` runs stages ``r``, ``r + ranks``,
    ...; ``split`` is then asked for ``ranks * stages_per_rank`` stages); the V-shaped
    ``ZBVZeroBubble`` and ``DualPipeV`` two (rank ``r`` runs ``r`` and ``2 x ranks - 1 - r``).

    With a ``loss``, the batch is ``(inputs, target)``: the first stage gets the inputs, the last the
    target, cut into microbatches alike, and ``loss(output, target)`` is each microbatch's loss (the
    schedule's ``loss_fn``). Without one, the batch is the inputs and the loss the sum of the last
    stage's output. Every rank holds the whole batch, as torchtitan's loaders hand it to every rank.

    With ``data_parallel`` or ``tensor_parallel`` above 1, the job is a 3-D mesh
    (:data:`PIPELINE_MESH_DIMS`, pipeline outermost, as torchtitan lays it out) and ``plan(stage,
    mesh)`` parallelises each stage's module on its ``("data_parallel", "tensor_parallel")`` sub-mesh
    -- the same plan :class:`~lightning_memest.engine.parallel.distributed.ModelParallel` takes.

    >>> Pipeline(4, split=lambda model, stage, stages: None, microbatches=8, rank=3).world_size
    4
    """

    stages: int
    split: Split
    microbatches: int
    schedule: str = "1F1B"
    loss: StageLoss | None = None
    rank: int = 0
    stages_per_rank: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    plan: Callable[[nn.Module, Any], Any] | None = None

    def __post_init__(self) -> None:
        check_count("stages", self.stages)
        check_count("microbatches", self.microbatches)
        check_count("stages_per_rank", self.stages_per_rank)
        check_count("data_parallel", self.data_parallel)
        check_count("tensor_parallel", self.tensor_parallel)
        check_count("rank", self.rank, minimum=0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}); got {self.rank}")
        if self.plan is not None and not callable(self.plan):
            raise TypeError(f"Pipeline(plan=...) must be callable as plan(stage, mesh); got {self.plan!r}")
        if (self.plan is None) != (self.data_parallel * self.tensor_parallel == 1):
            raise ValueError(
                "Pipeline(plan=...) parallelises each stage over data_parallel x tensor_parallel ranks: "
                "give it with either above 1, and only then"
            )
        if not callable(self.split):
            raise TypeError(
                f"Pipeline(split=...) must be callable as split(model, stage, stages); got {self.split!r}"
            )
        if self.loss is not None and not callable(self.loss):
            raise TypeError(f"Pipeline(loss=...) must be callable as loss(output, target); got {self.loss!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if self.schedule in _V_SHAPED and self.stages_per_rank != 2:
            raise ValueError(f"{self.schedule} runs two stages a rank (stages_per_rank=2), placed as a V")
        if (self.schedule in _MULTI_STAGE) != (self.stages_per_rank > 1):
            raise ValueError(
                f"{', '.join(_MULTI_STAGE)} run several stages a rank (stages_per_rank >= 2), GPipe "
                f"and 1F1B one; got schedule={self.schedule!r} with stages_per_rank={self.stages_per_rank}"
            )

    @property
    def world_size(self) -> int:
        """The ranks of the job: ``stages`` x ``data_parallel`` x ``tensor_parallel``."""
        return self.stages * self.data_parallel * self.tensor_parallel

    def groups(self) -> tuple[tuple[int, list[int]], tuple[int, list[int]], tuple[int, list[int]]]:
        """This rank's place in its pipeline, data-parallel and tensor-parallel groups: (its rank in the
        group, the group's global ranks) for each, in torchtitan's row-major layout (pipeline
        outermost: rank = stage x data_parallel x tensor_parallel + data index x tensor_parallel +
        tensor index)."""
        inner = self.data_parallel * self.tensor_parallel
        stage, rest = divmod(self.rank, inner)
        data, tensor = divmod(rest, self.tensor_parallel)
        pipeline = [p * inner + rest for p in range(self.stages)]
        data_ranks = [stage * inner + d * self.tensor_parallel + tensor for d in range(self.data_parallel)]
        tensor_ranks = [stage * inner + data * self.tensor_parallel + t for t in range(self.tensor_parallel)]
        return (stage, pipeline), (data, data_ranks), (tensor, tensor_ranks)

    @property
    def total_stages(self) -> int:
        return self.stages * self.stages_per_rank


def stages_of(strategy: Pipeline, index: int) -> tuple[int, ...]:
    """The stages the ranks of pipeline index ``index`` run, in order: loop-style (``index``,
    ``index + stages``, ...), or as a V for the V-shaped schedules (``index``, ``2 x stages - 1 -
    index``)."""
    if strategy.schedule in _V_SHAPED:
        return (index, 2 * strategy.stages - 1 - index)
    return tuple(index + k * strategy.stages for k in range(strategy.stages_per_rank))


class PipelineRun:
    """This rank's stages of ``strategy`` cut from ``model`` (in place where ``split`` prunes), each
    parallelised by ``parallelize`` (the strategy's ``plan`` on its data- and tensor-parallel mesh),
    their ``PipelineStage``s and schedule over the pipeline ``group``, built at the first step (the
    stages' shapes come from its batch). ``module`` is what this rank holds: its stage's module (a
    ``ModuleList`` of its stages' modules when interleaved)."""

    def __init__(
        self,
        model: nn.Module,
        strategy: Pipeline,
        group: Any,
        parallelize: Callable[[nn.Module], None] | None = None,
    ) -> None:
        self.strategy = strategy
        self._group = group
        self._template = _meta_copy(model)  # before split prunes it: every stage's shapes come from it
        # This rank's place in the pipeline group (a real job's, or the fake group's: the strategy's).
        self.indices = indices = stages_of(strategy, group.rank())
        # Several stages a rank: each is cut from a copy of its own, as torchtitan's split copies the
        # model per stage (a split that prunes in place would cut the second from the first's rest).
        models = [model] if len(indices) == 1 else [_copied(model, _cloned) for _ in indices]
        modules = [self._cut(m, i) for m, i in zip(models, indices, strict=True)]
        if parallelize is not None:
            for module in modules:
                parallelize(module)
        self.module: nn.Module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        self._modules = modules
        self._device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        self._schedule: Any = None
        self._built_for: tuple[tuple[int, ...], ...] = ()
        self._stages: list[Any] = []

    def _cut(self, model: nn.Module, stage: int) -> nn.Module:
        try:
            module = self.strategy.split(model, stage, self.strategy.total_stages)
        except Exception as exc:
            raise EstimationError(
                f"Pipeline split failed for stage {stage} of {self.strategy.total_stages}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if module is None:
            return model
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Pipeline split must return the stage's nn.Module or None; got {type(module).__name__}"
            )
        return module

    @property
    def is_last(self) -> bool:
        return self.strategy.total_stages - 1 in self.indices

    @property
    def is_first(self) -> bool:
        return 0 in self.indices

    def step(self, batch: Any, on_phase: Callable[[Phase], None]) -> Tensor:
        """One training step's forward and backward of every microbatch, by the schedule; the mean
        of the microbatches' losses on the last stage (as torchtitan logs it), else a ``-1`` marker."""
        inputs, target = self._parts(batch)
        shapes = tuple(tuple(t.shape) for t in inputs if isinstance(t, Tensor))
        if self._schedule is None:
            self._schedule, self._built_for = self._build(inputs, on_phase), shapes
        elif shapes != self._built_for:
            raise EstimationError(
                f"Pipeline: the stages' buffers are sized by the first batch (inputs {self._built_for}); "
                f"a batch of {shapes} needs a pipeline of its own (PipelineStage's shapes are static)"
            )
        losses: list[Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        self._schedule.step(*(inputs if self.is_first else ()), **kwargs)
        if losses:
            return torch.mean(torch.stack([loss.detach() for loss in losses]))
        return torch.tensor([-1.0], device=self._device)

    def _parts(self, batch: Any) -> tuple[tuple[Any, ...], Any]:
        if self.strategy.loss is None:
            # The schedule cuts a target for every loss it computes: the inputs stand in (views of
            # them, nothing allocated), and the sum of the output ignores it.
            inputs = batch if isinstance(batch, tuple) else (batch,)
            return inputs, inputs[0]
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise EstimationError(
                "with Pipeline(loss=...) the batch is (inputs, target); got "
                f"{type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}"
            )
        inputs, target = batch
        return (inputs if isinstance(inputs, tuple) else (inputs,)), target

    def _build(self, inputs: tuple[Any, ...], on_phase: Callable[[Phase], None]) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleDualPipeV,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        strategy = self.strategy
        shapes = self._shapes(inputs)
        for index, module in zip(self.indices, self._modules, strict=True):
            args, outputs = shapes[index]
            stage = PipelineStage(
                module,
                index,
                strategy.total_stages,
                self._device,
                input_args=args,
                output_args=outputs,
                group=self._group,
            )
            _announce_phases(stage, on_phase)
            self._stages.append(stage)
        loss = strategy.loss if strategy.loss is not None else _sum_loss
        kind = {
            "GPipe": ScheduleGPipe,
            "1F1B": Schedule1F1B,
            "Interleaved1F1B": ScheduleInterleaved1F1B,
            "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
            "ZBVZeroBubble": ScheduleZBVZeroBubble,
            "DualPipeV": ScheduleDualPipeV,
        }
        schedule = kind[strategy.schedule]
        target = self._stages if strategy.stages_per_rank > 1 else self._stages[0]
        try:
            return schedule(target, strategy.microbatches, loss_fn=loss)
        except (ValueError, RuntimeError) as exc:
            raise EstimationError(f"Schedule{strategy.schedule} refused the pipeline: {exc}") from exc

    def _shapes(self, inputs: tuple[Any, ...]) -> dict[int, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]:
        """Each of this rank's stages' (inputs, outputs) on one microbatch, as meta tensors: the meta
        model split as the job splits it, the stages from the first to this rank's last run in turn."""
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        strategy = self.strategy
        with unset_fake_temporarily():
            whole = tuple(_meta(t) if isinstance(t, Tensor) else t for t in inputs)
            for t in whole:
                if isinstance(t, Tensor) and t.dim() and t.shape[0] % strategy.microbatches:
                    raise EstimationError(
                        f"Pipeline: a batch of {t.shape[0]} does not cut into {strategy.microbatches} "
                        "equal microbatches (the stages' buffers are sized for one)"
                    )
            chunks, _ = split_args_kwargs_into_chunks(whole, {}, strategy.microbatches)
            x: tuple[Any, ...] = tuple(chunks[0])
            shapes = {}
            for index in range(max(self.indices) + 1):
                copied = copy.deepcopy(self._template)
                module = strategy.split(copied, index, strategy.total_stages) or copied
                try:
                    out = module(*x)
                except Exception as exc:
                    raise EstimationError(
                        f"Pipeline: stage {index}'s shapes are found on the meta device, where its forward "
                        f"failed: {type(exc).__name__}: {exc}"
                    ) from exc
                outputs = out if isinstance(out, tuple) else (out,)
                shapes[index] = (x, outputs)
                x = outputs
        return shapes


def _sum_loss(output: Any, target: Any) -> Tensor:
    from lightning_memest.engine.step import first_output

    return first_output(output).sum()


def _announce_phases(stage: Any, on_phase: Callable[[Phase], None]) -> None:
    """``on_phase`` before each of the stage's chunks: forward or backward. 1F1B interleaves them, and
    each microbatch's forward runs in forward's module scopes, not in the backward of the one before."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        on_phase(Phase.FORWARD)
        return forward(*args, **kwargs)

    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        on_phase(Phase.BACKWARD)
        return backward(*args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def _meta(t: Tensor) -> Tensor:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return meta.requires_grad_(t.requires_grad) if t.is_floating_point() else meta


def _cloned(t: Tensor) -> Tensor:
    return t.detach().clone()


def _copied(model: nn.Module, tensor: Callable[[Tensor], Tensor]) -> nn.Module:
    """``copy.deepcopy(model)`` with each of its tensors made by ``tensor(t)`` (parameters stay
    parameters): fake tensors do not deep-copy, and a meta copy needs none of their data."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for value in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]:
            if isinstance(value, Tensor) and id(value) not in memo:
                made = tensor(value)
                is_param = isinstance(value, nn.Parameter)
                memo[id(value)] = nn.Parameter(made, value.requires_grad) if is_param else made
    return copy.deepcopy(model, memo)


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model`` copied with every tensor on the meta device and no hooks: the stages' shapes are
    worked out on it without touching (or tracking) the model's own tensors."""
    with unset_fake_temporarily():
        copied = _copied(model, _meta)
    for m in copied.modules():
        for name, value in vars(m).items():
            if name.startswith("_") and "hooks" in name and isinstance(value, dict):
                value.clear()  # the copy's own dicts: the tracker's scope hooks stay on the model
    return copied


@contextlib.contextmanager
def works_hold_their_tensors(groups: tuple[Any, ...]) -> Iterator[None]:
    """Inside the block, a send or receive on one of the fake ``groups`` returns a work that keeps its
    tensors alive until it is dropped, as a real backend's does (gloo's ``SendWork``/``RecvWork`` hold
    the tensor; the fake group's work holds nothing). The schedules keep a send's works for a while
    after waiting on them (1F1B's ``send_work``): on a real rank the activations sent live that long,
    past the backward that would otherwise have freed them."""
    from torch._C._distributed_c10d import ProcessGroup

    fake = {id(g) for g in groups}
    originals = {name: getattr(ProcessGroup, name) for name in ("send", "recv")}

    def holding(name: str) -> Callable[..., Any]:
        original = originals[name]

        def call(self: Any, tensors: list[Tensor], *args: Any, **kwargs: Any) -> Any:
            work = original(self, tensors, *args, **kwargs)
            return _HeldWork(work, tensors) if id(self) in fake else work

        return call

    with (
        mock.patch.object(ProcessGroup, "send", holding("send")),
        mock.patch.object(ProcessGroup, "recv", holding("recv")),
    ):
        yield


class _HeldWork:
    """A fake group's work that holds its tensors, as a real backend's work does (see
    :func:`works_hold_their_tensors`)."""

    __slots__ = ("_tensors", "_work")

    def __init__(self, work: Any, tensors: list[Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
