"""The training batches of a fit, as ``MemEstimate`` follows them: estimated from the batches training
really gets -- never one pulled from the loader, so the data stream is left as it is.

* The first batch, in hand at the first ``on_train_batch_start`` (or a batch the user gives up front):
  steps 1 and 2 on it.
* The second: where it differs from the first -- in shapes, or, when the step's code read tensor
  values, in the values of its small integer and boolean tensors (the lengths of a packed batch, a
  padding mask) -- steps 1 and 2 again on the two batches as they came: what step 2 really runs on.
* Later batches: one larger than any estimated so far in some dimension (dynamic padding: a longer
  sequence) is estimated before its step runs, once per batch shape.

What else lives on the device counts too (``Role.OTHER``): on CUDA the allocator's bytes at the batch's
start that are not the module's, its optimizer's or the batch's; on the CPU every live tensor besides
those, found by a scan of the garbage collector (another callback's copy of the weights, metric states,
a dataset held in memory, the loader's prefetched batch). The measured steps count the same way.

Example (in a callback)::

    batches = FitBatches(calibrate=True)
    estimate = batches.estimate_first(trainer, pl_module, batch)  # at the first on_train_batch_start
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_memest.adapter.fit import FitSetup, fit_setup
from lightning_memest.batches import iter_tensors, map_tensors
from lightning_memest.engine.fake import local_tensor
from lightning_memest.engine.real_path import VALUE_LIMIT
from lightning_memest.engine.step import optimizer_state_tensors
from lightning_memest.engine.values.followed_values import followable
from lightning_memest.measure import LiveTensorScan, live_tensors, module_tensors, resident_bytes
from lightning_memest.report import StepEstimate
from lightning_memest.search.sizing import SizedStep

__all__ = ["FitBatches", "batch_signature", "light_copy", "resident_at_start", "resident_besides"]

#: A batch's tensors' shapes and dtypes, in order: what decides its memory (with its values, where read).
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def batch_signature(batch: Any) -> Signature:
    """The shapes and dtypes of ``batch``'s tensors, in order.

    >>> batch_signature({"ids": torch.zeros(2, 5, dtype=torch.long)})
    (((2, 5), torch.int64),)
    """
    return tuple((tuple(t.shape), t.dtype) for t in iter_tensors(batch))


def _valued(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex()) and t.numel() <= VALUE_LIMIT


def light_copy(batch: Any, floats: bool = False) -> Any:
    """``batch`` without its memory: small integer and boolean tensors copied to the CPU (the values a
    step may read), with ``floats`` small floating-point ones too (a step followed on its values:
    ``engine.values.followed_values``), the others as meta tensors (shapes only)."""

    def light(t: Tensor) -> Tensor:
        if (_valued(t) or (floats and followable(t))) and not t.is_meta:
            return t.detach().to("cpu", copy=True)
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")

    return map_tensors(batch, light)


def _same_values(a: Any, b: Any, floats: bool = False) -> bool:
    """Whether the small integer and boolean tensors (with ``floats``, the small floating-point ones
    too) of two batches of one signature hold the same values."""
    for x, y in zip(iter_tensors(a), iter_tensors(b), strict=True):
        if (
            (_valued(x) or (floats and followable(x)))
            and (_valued(y) or (floats and followable(y)))
            and not x.is_meta
            and not y.is_meta
            and not torch.equal(x.cpu(), y.cpu())
        ):
            return False
    return True


def _own_tensors(trainer: pl.Trainer, module: pl.LightningModule, batch: Any) -> list[Tensor]:
    """The module's tensors (plain tensor attributes too: a cache a module made in the first step is
    resident in the second), its optimizers' state and the batch."""
    state = [local_tensor(t) for optimizer in trainer.optimizers for t in optimizer_state_tensors(optimizer)]
    return [*module_tensors(module), *state, *iter_tensors(batch)]


def resident_besides(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batch: Any,
    own: Any = (),
    *,
    scan: LiveTensorScan | None = None,
) -> list[Tensor]:
    """What lives on the training device besides the module's tensors, its optimizers' state and
    ``batch`` (and ``own``: tensors of the caller's): on CUDA, one meta tensor the size of the
    allocator's other bytes; on the CPU, the other live tensors (found by ``scan``, the trainer call's
    scan, or else by :func:`live_tensors` after a full collection)."""
    device = trainer.strategy.root_device
    known = [*_own_tensors(trainer, module, batch), *iter_tensors(own)]
    if device.type == "cuda":
        mine = resident_bytes(t for t in known if t.device == device)
        other = torch.cuda.memory_allocated(device) - mine
        return [torch.empty(other, dtype=torch.uint8, device="meta")] if other > 0 else []
    if scan is None:
        return live_tensors(device, besides=known)
    # Other tensors of under 1 % of the step's own resident bytes cannot move the estimate more than
    # that, garbage among them or not: no full collection for them (LiveTensorScan).
    return scan(device, besides=known, negligible=resident_bytes(known) // 100)


def resident_at_start(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batch: Any,
    own: Any = (),
    *,
    others: Sequence[Tensor] | None = None,
    young: bool = False,
) -> list[Tensor]:
    """What is resident at a batch's start, for the measured peak to start from: the module's tensors,
    the optimizers' state, the batch, and on the CPU every other live tensor (``own``, a caller's light
    copy of a batch, aside). ``others``: those other live tensors where the caller has just found them
    (:func:`resident_besides` on the CPU, with the same ``own``), so that they are not scanned twice.
    ``young``: the scan needs only a young collection (the collector has been off since a full one)."""
    mine = _own_tensors(trainer, module, batch)
    device = trainer.strategy.root_device
    if device.type != "cpu":
        return mine
    if others is None:
        others = live_tensors(device, besides=[*mine, *iter_tensors(own)], full=not young)
    return [*mine, *others]


class FitBatches:
    """The estimates of one fit's training batches (see the module docstring)."""

    def __init__(self, calibrate: bool, replay_blocks: bool = True) -> None:
        self.calibrate = calibrate
        self.replay_blocks = replay_blocks
        self.scan: LiveTensorScan | None = None
        """The trainer call's scan for other live tensors (the callback's, set at ``setup``)."""
        self.first: Any = None
        """The first batch's light copy (:func:`light_copy`), once estimated."""
        self.reads_values = False
        self.followed = False
        self.reads_index = False
        """Whether the first estimate's step read its ``batch_idx``."""
        self.scan_seconds = 0.0
        """Wall seconds the latest estimate's scan for other live tensors took."""
        self._first_index = 0
        self.checked: tuple[SizedStep, FitSetup, list[Tensor]] | None = None
        """The latest estimate's step, its batch size left open (what the pre-check's largest batch is
        searched over, so that it is the checked estimate's), its fit and the other tensors beside it
        (for the advice's variants); until the next batch starts."""
        self._others: tuple[Any, list[Tensor]] | None = None
        self._largest: list[tuple[int, ...]] | None = None
        self._estimated: dict[Signature, StepEstimate] = {}

    def _fit(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        batch: Any,
        given: bool,
        indices: Sequence[int],
    ) -> FitSetup:
        replay = self.replay_blocks
        return fit_setup(
            trainer, module, batch, transferred=not given, batch_indices=indices, replay_blocks=replay
        )

    def _calibration(self, measuring: bool) -> bool | Literal["cached"]:
        # While the CPU profiler measures a step, calibration may not run a profiler of its own.
        if not self.calibrate:
            return False
        return "cached" if measuring else True

    def estimate_first(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        batch: Any,
        *,
        given: bool = False,
        measuring: bool = False,
        batch_idx: int = 0,
    ) -> StepEstimate:
        """Steps 1 and 2 on ``batch``: the batch in hand at the first ``on_train_batch_start`` (both
        steps are given its ``batch_idx``), or one the user gave (``given``: as the dataloader would
        yield it)."""
        fit = self._fit(trainer, module, batch, given, (batch_idx,))
        self._first_index = batch_idx
        # A batch the user gave stays alive through the real steps (the callback holds it) beside the
        # batches training gets: on its device it is one of the other tensors, as the measurement finds.
        residents = self._scan(trainer, module, () if given else batch)
        self._others = None if given else (batch, residents)
        estimate = self._estimate(
            fit.sized(steps=2, calibrate=self._calibration(measuring), residents=residents), fit, residents
        )
        self.followed = estimate.followed_note is not None  # the step's path follows its floats too
        self.first = light_copy(batch, self.followed)
        self.reads_values = estimate.reads_values
        self.reads_index = fit.index_reads.read
        self._note(batch, estimate)
        return estimate

    def estimate_second(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        batch: Any,
        *,
        measuring: bool,
        batch_idx: int = 1,
    ) -> StepEstimate | None:
        """Steps 1 and 2 on the first batch and ``batch`` (with their own ``batch_idx``), where step 2
        may need other memory than the estimate of the first batch said: other shapes, other values
        the step reads, or a step that read its ``batch_idx``; ``None`` where it cannot."""
        first = self.first
        if first is None or not self.needs_second(batch):
            return None
        # (a copy of the batch in hand: transferred)
        fit = self._fit(trainer, module, first, False, (self._first_index, batch_idx))
        residents = self._scan(trainer, module, batch, own=first)
        self._others = (batch, residents)
        estimate = self._estimate(
            fit.sized(
                steps=2, calibrate=self._calibration(measuring), next_batches=[batch], residents=residents
            ),
            fit,
            residents,
        )
        self._note(batch, estimate)
        return estimate

    def needs_second(self, batch: Any) -> bool:
        """Whether step 2, on ``batch``, may need other memory than the first estimate said: ``batch``
        has other shapes, or other values where the step read values, or the step read its
        ``batch_idx`` (the estimate gave step 2 the first batch's)."""
        first = self.first
        if first is None:
            return False
        return (
            batch_signature(batch) != batch_signature(first)
            or (self.reads_values and not _same_values(first, batch, self.followed))
            or self.reads_index
        )

    def estimate_if_larger(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int = 0
    ) -> StepEstimate | None:
        """The estimate of ``batch`` (its steady state is the last peak) where it is larger than any batch
        estimated so far in some dimension; ``None`` where it is not, or was estimated before."""
        signature = batch_signature(batch)
        largest = self._largest
        if signature in self._estimated or largest is None or len(largest) != len(signature):
            return None
        if all(
            len(shape) == len(top) and all(s <= t for s, t in zip(shape, top, strict=True))
            for (shape, _), top in zip(signature, largest, strict=True)
        ):
            return None
        fit = self._fit(trainer, module, batch, False, (batch_idx,))
        residents = self._scan(trainer, module, batch)
        estimate = self._estimate(
            fit.sized(steps=2, calibrate=self._calibration(False), residents=residents), fit, residents
        )
        self._note(batch, estimate)
        return estimate

    def _estimate(self, step: SizedStep, fit: FitSetup, residents: list[Tensor]) -> StepEstimate:
        self.checked = step, fit, residents
        return step.traced()[2]  # (its simulation kept with it: a checkpointing plan reads its events)

    def _scan(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, own: Any = ()
    ) -> list[Tensor]:
        start = time.perf_counter()
        try:
            return resident_besides(trainer, module, batch, own, scan=self.scan)
        finally:
            self.scan_seconds = time.perf_counter() - start

    def take_others(self, batch: Any) -> list[Tensor] | None:
        """The other live tensors an estimate of this very ``batch`` found, in this batch's start hook,
        for its measurement to start from without a second scan; ``None`` where none did. Called at
        every batch's start, so that no batch's tensors are held past it."""
        others, self._others = self._others, None
        self.checked = None  # its residents are this batch's start's: not held past it
        return others[1] if others is not None and others[0] is batch else None

    def _note(self, batch: Any, estimate: StepEstimate) -> None:
        signature = batch_signature(batch)
        self._estimated[signature] = estimate
        shapes = [shape for shape, _ in signature]
        if self._largest is None or len(self._largest) != len(shapes):
            self._largest = shapes
            return
        self._largest = [
            tuple(max(a, b) for a, b in zip(top, shape, strict=True)) if len(top) == len(shape) else shape
            for top, shape in zip(self._largest, shapes, strict=True)
        ]

    def shapes(self) -> Sequence[tuple[int, ...]]:
        """The largest shape estimated so far of each of the batch's tensors."""
        return list(self._largest or ())
