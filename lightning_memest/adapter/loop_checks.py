"""The first batch of each loop besides training, as ``MemEstimate`` follows it: estimated with the batch in
hand before it runs, checked against the memory budget, then measured.

The loops are named as the logs name them (``adapter.loops.loop_name``): ``sanity_check`` (the
validation batches a fit runs before training), ``validate`` (a fit's validation, or
``trainer.validate``), ``test`` and ``predict``. Each is estimated once per fit or call, at its first
batch's start (nothing is drawn from a loader early), with what is alive then: the module, the training
state that stays through the batch (gradients, the optimizers' state), everything else on the device.
The batch is then measured (CPU: the allocator's events in ``torch.profiler``; CUDA: the peak
statistics) unless another measurement is open (a validation inside a measured training batch). The
estimates and measurements are logged as ``memest/<loop>/...``. Every step that decides is agreed by
the ranks first (``adapter/guard.py``), and a failure is one warning: the loop runs on.

Example (in a callback)::

    checks = LoopChecks(calibrate=True)
    # on_validation_batch_start:
    checks.on_batch_start(trainer, pl_module, batch, dataloader_idx, "validate", guard=guard,
                          budget=BudgetCheck("warn"), measure=True)
    # on_validation_batch_end:
    checks.on_batch_end(trainer, guard)
    checks.estimates["validate"], checks.measured["validate"]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_memest.adapter.budget_check import BudgetCheck
from lightning_memest.adapter.eval_runner import Loop
from lightning_memest.adapter.fit_batches import resident_at_start, resident_besides
from lightning_memest.adapter.guard import Guard, attempt
from lightning_memest.adapter.loggers import log_scalars
from lightning_memest.adapter.loggers.scalars import estimate_scalars, in_loop, logging_step, measured_scalars
from lightning_memest.adapter.loops import LoopSetup, loop_name, loop_setup
from lightning_memest.adapter.ranks import max_over_ranks
from lightning_memest.batches import batch_size_of
from lightning_memest.budget import what_runs
from lightning_memest.engine.events import NO_OP
from lightning_memest.measure import LiveTensorScan, StepProbe
from lightning_memest.report import MeasuredStep, StepEstimate, format_bytes
from lightning_memest.search.sizing import Calibrate, SizedStep

__all__ = ["LoopChecks", "LoopStart", "loop_what"]


def loop_what(name: str, estimate: StepEstimate) -> str:
    """What runs in a loop besides training, as the pre-check and the console name it: the estimate's
    step (``budget.what_runs``), and "of the sanity check" for the validation a fit runs first."""
    words = what_runs(estimate.loop)
    return f"{words} of the sanity check" if name == "sanity_check" else words


class LoopStart:
    """A loop's first batch, estimated: what the callback checks against the budget and logs."""

    def __init__(
        self,
        name: str,
        setup: LoopSetup,
        estimate: StepEstimate,
        residents: Sequence[Tensor],
        sized: SizedStep,
    ) -> None:
        self.name = name
        """``sanity_check``, ``validate``, ``test`` or ``predict``."""
        self.setup = setup
        self.estimate = estimate
        self.residents = residents
        """What else lived on the device (``resident_besides``)."""
        self.sized = sized
        """The estimate's step, its batch size left open: the pre-check's largest batch comes from it."""


class LoopChecks:
    """The estimates and measurements of the loops' first batches in one fit or call."""

    def __init__(self, calibrate: bool) -> None:
        self.calibrate = calibrate
        self.scan: LiveTensorScan | None = None
        """The trainer call's scan for other live tensors (the callback's, set at ``setup``)."""
        self.estimates: dict[str, StepEstimate] = {}
        """Each loop's first-batch estimate, by loop name."""
        self.measured: dict[str, MeasuredStep] = {}
        """Each loop's measured first batch, by loop name."""
        self._tried: set[str] = set()
        self._probe: StepProbe | None = None
        self._measuring: str | None = None  # the loop whose batch is being measured
        self._failure: str | None = None  # why this rank's measurement of it stopped, if it did

    def reset(self) -> None:
        """A new fit: nothing of an earlier one carries over."""
        self.close()
        self.estimates, self.measured, self._tried = {}, {}, set()

    def untried(self, trainer: pl.Trainer) -> bool:
        """Whether the running loop's first batch is still to be estimated (cheap: every batch asks)."""
        return loop_name(trainer) not in self._tried

    def forget(self, name: str) -> None:
        """A new call of a loop (``trainer.validate``, ``test``, ``predict``): estimate its first batch
        again, the others' estimates kept."""
        self._tried.discard(name)
        self.estimates.pop(name, None)
        self.measured.pop(name, None)

    # --- the hooks ---------------------------------------------------------------------------------------
    def on_batch_start(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        batch: Any,
        dataloader_idx: int,
        loop: Loop,
        *,
        guard: Guard,
        budget: BudgetCheck,
        measure: bool,
        profiling: bool = False,
        announce: bool = False,
    ) -> None:
        """At a batch's start, if it is its loop's first: estimate it (every rank alike), log it (and with
        ``announce``, one console line), check it against ``budget`` -- which may raise
        ``MemoryBudgetError`` -- then, with ``measure``, measure it. ``profiling``: a CPU profiler is
        open already (a validation inside a measured training batch): calibration keeps to its cache,
        and nothing is measured."""
        if not self.untried(trainer):
            return
        started = guard.together(
            trainer,
            "estimating the first batch of a loop",
            lambda: self.start(trainer, module, batch, dataloader_idx, loop, profiling=profiling),
        )
        if started is None:
            return
        estimate, name = started.estimate, started.name
        reserved = None if estimate.reserved_bytes is None else estimate.reserved_bytes[-1]
        scalars = in_loop(name, estimate_scalars(estimate.peak_bytes, reserved))
        step = logging_step(trainer)
        guard.safely("logging", lambda: log_scalars(trainer.loggers, scalars, step))
        size = batch_size_of(batch)
        if announce and trainer.is_global_zero:
            rank_zero_info(
                f"MemEstimate: {loop_what(name, estimate)} ({estimate.device}, {estimate.precision}): "
                f"estimated peak {format_bytes(estimate.peak_bytes)} at batch size {size}"
            )

        def search(budget_bytes: int) -> int:
            return started.sized.largest_batch(budget_bytes).max_batch_size

        device = started.setup.device
        budget.act(
            trainer,
            guard,
            estimate,
            lambda: budget.result(estimate, device, size, search, loop_what(name, estimate)),
        )
        if measure and not profiling:
            self._measuring = name
            residents = started.residents
            self._failure = attempt("measuring", lambda: self._measure(trainer, module, batch, residents))[1]

    def on_batch_end(self, trainer: pl.Trainer, guard: Guard) -> None:
        """At a batch's end: the measured batch, if one was, compared and logged (every rank at the same
        batch; a failure on any rank is one warning on all)."""
        name, self._measuring = self._measuring, None
        if name is None:
            return
        result = guard.agreed_measurement(trainer, self._failure, self._stop, self.close)
        estimate = self.estimates.get(name)
        if result is None or estimate is None:
            return
        peak, reserved = max_over_ranks(trainer, result)
        self.measured[name] = MeasuredStep(1, peak, reserved, estimate.peak_bytes)
        estimated_reserved = None if estimate.reserved_bytes is None else estimate.reserved_bytes[-1]
        scalars = in_loop(name, measured_scalars(peak, reserved, estimate.peak_bytes, estimated_reserved))
        step = logging_step(trainer)
        guard.safely("logging", lambda: log_scalars(trainer.loggers, scalars, step))

    # --- the work ----------------------------------------------------------------------------------------
    def start(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        batch: Any,
        dataloader_idx: int,
        loop: Loop,
        *,
        profiling: bool = False,
    ) -> LoopStart | None:
        """The running loop's estimate if this is its first batch (``None`` otherwise, or where the step
        ran no tensor op). Raises what estimating raised; the loop is not tried again."""
        name = loop_name(trainer)
        if name in self._tried:
            return None
        self._tried.add(name)
        setup = loop_setup(trainer, module, loop, batch, dataloader_idx)
        # While a CPU profiler measures, calibration may not run one of its own: the cache answers.
        calibrate: Calibrate = False
        if self.calibrate:
            calibrate = "cached" if profiling else True
        # A scan of every live tensor, once (the trainer call's: a full collection only at its first).
        residents = resident_besides(trainer, module, batch, scan=self.scan)
        sized = setup.sized(calibrate=calibrate, residents=residents)
        estimate = sized.estimate_at()
        if all(p.op == NO_OP for p in estimate.peaks):
            return None  # the step ran no tensor op (it only logs, say): nothing to estimate or check
        self.estimates[name] = estimate
        return LoopStart(name, setup, estimate, residents, sized)

    def _measure(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, others: Sequence[Tensor]
    ) -> None:
        if self._probe is not None:  # left open by a batch whose end never came
            self._probe.close()
            self._probe = None
        probe = StepProbe(trainer.strategy.root_device)
        # The other live tensors the estimate has just found: no second scan (a full collection).
        probe.start(resident_at_start(trainer, module, batch, others=others))
        self._probe = probe

    def _stop(self) -> tuple[int, int | None]:
        probe, self._probe = self._probe, None
        if probe is None:
            raise RuntimeError("no measurement was started")
        try:
            probe.stop()
            ((peak, reserved),) = probe.finish()
        finally:
            probe.close()
        return peak, reserved

    def close(self) -> None:
        """Stop measuring, keep nothing (the loop failed or was interrupted)."""
        probe, self._probe, self._measuring = self._probe, None, None
        if probe is not None:
            probe.close()
