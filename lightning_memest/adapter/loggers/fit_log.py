"""What ``MemEstimate`` logs during a fit, each figure at the step Lightning logs its batch at: the estimate
of the batch about to run, the measured batches beside their estimates, the tables and figures, and on
CUDA the peak of every later batch (``adapter/step_peaks.py``), at Lightning's ``log_every_n_steps``.

Example (in a callback)::

    log = FitLog()
    log.estimate(trainer, estimate, index=0)  # at the first batch's start
    log.measured_at.append(logging_step(trainer))  # each measured batch's step
    log.measured(trainer, estimate, MeasuredStep(1, peak, None, estimate.peaks[0].bytes))
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl

from lightning_memest.adapter.loggers import log_figures, log_hparams, log_scalars
from lightning_memest.adapter.loggers.scalars import (
    estimate_scalars,
    first_step,
    lightning_logs_now,
    logging_step,
    measured_scalars,
)
from lightning_memest.adapter.step_peaks import StepPeaks
from lightning_memest.report import MeasuredStep, StepEstimate

__all__ = ["FitLog"]


class FitLog:
    """One fit's logging (see the module docstring)."""

    def __init__(self) -> None:
        self.measured_at: list[int] = []
        """Lightning's logging step of each measured batch."""
        self.step_peaks = StepPeaks()

    @staticmethod
    def hparams(trainer: pl.Trainer) -> None:
        """The memest metrics in the loggers' hyperparameter views (rank 0)."""
        if trainer.is_global_zero:
            log_hparams(trainer)

    @staticmethod
    def estimate(trainer: pl.Trainer, estimate: StepEstimate, index: int) -> None:
        """The estimate of the batch about to run (its step ``index``: the first, else the steady
        state), at Lightning's step."""
        first, index = index == 0, min(index, len(estimate.peaks) - 1)
        reserved = None if estimate.reserved_bytes is None else estimate.reserved_bytes[index]
        scalars = estimate_scalars(estimate.peaks[index].bytes, reserved, estimate.flops)
        log_scalars(trainer.loggers, first_step(scalars) if first else scalars, logging_step(trainer))

    def figures(
        self, trainer: pl.Trainer, estimate: StepEstimate | None, measured: Sequence[MeasuredStep] | None
    ) -> None:
        """The tables and figures (with the measured peaks, once known), on rank 0."""
        if estimate is None or not trainer.is_global_zero:
            return
        peaks = [m.peak_bytes for m in measured] if measured is not None else None
        step = self.measured_at[len(peaks) - 1] if peaks else logging_step(trainer)
        log_figures(trainer.loggers, estimate, peaks, step=step)

    def measured(self, trainer: pl.Trainer, estimate: StepEstimate | None, measured: MeasuredStep) -> None:
        """A measured batch beside its estimate, at the step Lightning logged that batch at."""
        reserved = None
        if estimate is not None and estimate.reserved_bytes is not None:
            reserved = estimate.reserved_bytes[measured.step - 1]
        flops = None if estimate is None else estimate.flops
        scalars = measured_scalars(
            measured.peak_bytes, measured.reserved_bytes, measured.estimated_bytes, reserved, flops
        )
        if measured.step == 1:
            scalars = first_step(scalars)
        log_scalars(trainer.loggers, scalars, self.measured_at[measured.step - 1])

    @staticmethod
    def step_estimate(trainer: pl.Trainer, estimate: StepEstimate | None) -> None:
        """The estimate of a batch after the measured ones (its shapes' steady state), where Lightning
        logs that batch: the estimate is a line over the whole training, the measurement beside it
        where a batch is measured (on CUDA every logged batch, through :meth:`step_peak` instead)."""
        if estimate is None or not lightning_logs_now(trainer):
            return
        index = len(estimate.peaks) - 1
        reserved = None if estimate.reserved_bytes is None else estimate.reserved_bytes[index]
        scalars = estimate_scalars(estimate.peaks[index].bytes, reserved, estimate.flops)
        log_scalars(trainer.loggers, scalars, logging_step(trainer))

    def step_peak(self, trainer: pl.Trainer, estimate: StepEstimate | None) -> None:
        """This batch's peak into the peaks since the last logged point; logged where Lightning logs,
        beside ``estimate`` (the one for this batch's shapes)."""
        self.step_peaks.stop(trainer.strategy.root_device)
        peak = self.step_peaks.take() if lightning_logs_now(trainer) else None
        if peak is None or estimate is None:
            return
        reserved = None if estimate.reserved_bytes is None else estimate.reserved_bytes[-1]
        scalars = measured_scalars(peak[0], peak[1], estimate.peaks[-1].bytes, reserved, estimate.flops)
        log_scalars(trainer.loggers, scalars, logging_step(trainer))
