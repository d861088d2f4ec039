"""The first batch of each loop besides training, as ``MemEstimate`` follows it: estimated with the batch in
hand before it runs, then measured.

The loops are named as the logs name them (``adapter.loops.loop_name``): ``sanity_check`` (the
validation batches a fit runs before training), ``validate`` (a fit's validation, or
``trainer.validate``), ``test`` and ``predict``. Each is estimated once per fit or call, at its first
batch's start (nothing is drawn from a loader early), with what is alive then: the module, the training
state that stays through the batch (gradients, the optimizers' state), everything else on the device.
The batch is then measured (CPU: the allocator's events in ``torch.profiler``; CUDA: the peak
statistics) unless another measurement is open (a validation inside a measured training batch).

Example (in a callback)::

    checks = LoopChecks(calibrate=True)
    started = checks.start(trainer, pl_module, batch, dataloader_idx, "validate")
    ...  # check started.estimate against the budget, log it
    checks.measure(trainer, pl_module, batch)
    ...  # the batch runs
    peak = checks.stop()  # (loop name, peak bytes, reserved bytes or None)
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl

from lightning_memest.adapter.eval_runner import Loop
from lightning_memest.adapter.fit_batches import resident_at_start, resident_besides
from lightning_memest.adapter.loops import LoopSetup, loop_name, loop_setup
from lightning_memest.measure import StepProbe
from lightning_memest.report import StepEstimate

__all__ = ["LoopChecks", "LoopStart"]


class LoopStart:
    """A loop's first batch, estimated: what the callback checks against the budget and logs."""

    def __init__(self, name: str, setup: LoopSetup, estimate: StepEstimate) -> None:
        self.name = name
        """``sanity_check``, ``validate``, ``test`` or ``predict``."""
        self.setup = setup
        self.estimate = estimate


class LoopChecks:
    """The estimates and measurements of the loops' first batches in one fit or call."""

    def __init__(self, calibrate: bool) -> None:
        self.calibrate = calibrate
        self.estimates: dict[str, StepEstimate] = {}
        """Each loop's first-batch estimate, by loop name."""
        self._tried: set[str] = set()
        self._probe: StepProbe | None = None
        self._measuring: str | None = None

    def reset(self) -> None:
        """A new fit or call: nothing of an earlier one carries over."""
        self.close()
        self.estimates, self._tried = {}, set()

    def untried(self, trainer: pl.Trainer) -> bool:
        """Whether the running loop's first batch is still to be estimated (cheap: every batch asks)."""
        return loop_name(trainer) not in self._tried

    def forget(self, name: str) -> None:
        """A new call of a loop (``trainer.validate``, ``test``, ``predict``): estimate its first batch
        again, the others' estimates kept."""
        self._tried.discard(name)
        self.estimates.pop(name, None)

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
        """At a batch's start: its loop's estimate if this is the loop's first batch (``None`` otherwise,
        or where the step ran no tensor op).
        ``profiling``: another CPU profiler is open (a validation inside a measured training batch),
        which keeps calibration to its cache. Raises what estimating raised; the loop is not tried
        again."""
        name = loop_name(trainer)
        if name in self._tried:
            return None
        self._tried.add(name)
        setup = loop_setup(trainer, module, loop, batch, dataloader_idx)
        # While a CPU profiler measures, calibration may not run one of its own: the cache answers.
        calibrate: bool | Literal["cached"] = False
        if self.calibrate:
            calibrate = "cached" if profiling else True
        estimate = setup.estimate(calibrate=calibrate, residents=resident_besides(trainer, module, batch))
        if not estimate.peaks:
            return None  # the step ran no tensor op (it only logs, say): nothing to estimate or check
        self.estimates[name] = estimate
        return LoopStart(name, setup, estimate)

    def measure(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any) -> None:
        """Start measuring the batch about to run (after its pre-check: a search is not measured)."""
        self.close()
        probe = StepProbe(trainer.strategy.root_device)
        probe.start(resident_at_start(trainer, module, batch))
        self._probe, self._measuring = probe, loop_name(trainer)

    def stop(self) -> tuple[str, int, int | None] | None:
        """At a batch's end: the loop measured and its peak (bytes, reserved bytes on CUDA), if one was
        being measured."""
        probe, name = self._probe, self._measuring
        if probe is None or name is None:
            return None
        self._probe, self._measuring = None, None
        try:
            probe.stop()
            ((peak, reserved),) = probe.finish()
        finally:
            probe.close()
        return name, peak, reserved

    def close(self) -> None:
        """Stop measuring, keep nothing (the loop failed or was interrupted)."""
        probe, self._probe, self._measuring = self._probe, None, None
        if probe is not None:
            probe.close()
