"""The scalars ``MemEstimate`` logs to every logger, and the step it logs them at.

Memory is in MiB and FLOPs in GFLOP, the unit in the tag: a chart has no unit of its own, and
TensorBoard draws raw bytes as ``3.5e+8``. Estimate and measurement are separate tags, so every
logger keeps them as two series: the estimate of a batch is logged at each step that is measured,
a flat reference line beside the measured one.

Each batch's figures go at the step Lightning logs that batch's own ``self.log`` metrics at, so a
peak lines up with the loss of the same batch. The first batch's peaks have tags of their own
(``memest/first_step/...``, :func:`first_step`): its peak holds what only the first step makes (an
optimizer's state as it is created), and on one chart with the steady state the two would be one
series, which a chart's smoothing (TensorBoard's default 0.6) averages into a value neither has.

Example:
    >>> estimate_scalars(300 * 2**20)
    {'memest/peak_MiB/estimate': 300.0}
    >>> measured_scalars(330 * 2**20, None, 300 * 2**20, None)["memest/error_pct"]
    -9.090909090909092
    >>> in_loop("validate", estimate_scalars(300 * 2**20))  # a loop besides training: its own tags
    {'memest/validate/peak_MiB/estimate': 300.0}
"""

from __future__ import annotations

from typing import Final

import lightning.pytorch as pl

from lightning_memest.report import FlopCount

__all__ = [
    "BACKWARD_GFLOP",
    "ERROR_PCT",
    "FIRST_STEP",
    "FORWARD_GFLOP",
    "PEAK_ESTIMATE",
    "PEAK_MEASURED",
    "RESERVED_ESTIMATE",
    "RESERVED_MEASURED",
    "estimate_scalars",
    "first_step",
    "hparams_metrics",
    "in_loop",
    "lightning_logs_now",
    "logging_step",
    "measured_scalars",
]

MIB: Final = 2**20
PEAK_ESTIMATE: Final = "memest/peak_MiB/estimate"
PEAK_MEASURED: Final = "memest/peak_MiB/measured"
#: CUDA only: what the caching allocator holds (``max_memory_reserved``).
RESERVED_ESTIMATE: Final = "memest/reserved_MiB/estimate"
RESERVED_MEASURED: Final = "memest/reserved_MiB/measured"
FIRST_STEP: Final = "memest/first_step/"
"""The prefix of the first batch's peak tags (:func:`first_step`)."""
ERROR_PCT: Final = "memest/error_pct"
"""``(estimate - measured) / measured`` of the peak, in percent."""
FORWARD_GFLOP: Final = "memest/GFLOP_per_batch/forward"
BACKWARD_GFLOP: Final = "memest/GFLOP_per_batch/backward"


def estimate_scalars(
    peak_bytes: int, reserved_bytes: int | None = None, flops: FlopCount | None = None
) -> dict[str, float]:
    """The estimate of one batch: its peak (and on CUDA the allocator's reserve), and its FLOPs."""
    scalars = {PEAK_ESTIMATE: peak_bytes / MIB}
    if reserved_bytes is not None:
        scalars[RESERVED_ESTIMATE] = reserved_bytes / MIB
    if flops is not None:
        scalars[FORWARD_GFLOP] = flops.forward / 1e9
        scalars[BACKWARD_GFLOP] = (flops.backward or 0) / 1e9
    return scalars


def measured_scalars(
    peak_bytes: int,
    reserved_bytes: int | None,
    estimated_bytes: int,
    estimated_reserved_bytes: int | None,
    flops: FlopCount | None = None,
) -> dict[str, float]:
    """One measured batch beside its estimate, and the error."""
    scalars = estimate_scalars(estimated_bytes, estimated_reserved_bytes, flops)
    scalars[PEAK_MEASURED] = peak_bytes / MIB
    if reserved_bytes is not None:
        scalars[RESERVED_MEASURED] = reserved_bytes / MIB
    scalars[ERROR_PCT] = 100.0 * (estimated_bytes - peak_bytes) / peak_bytes
    return scalars


def first_step(scalars: dict[str, float]) -> dict[str, float]:
    """The first training batch's scalars: its peaks under ``memest/first_step/`` (the error and the
    FLOPs keep their tags: one series over the batches).

    >>> first_step(measured_scalars(200 * 2**20, None, 200 * 2**20, None))
    {'memest/first_step/peak_MiB/estimate': 200.0, 'memest/first_step/peak_MiB/measured': 200.0, 'memest/error_pct': 0.0}
    """  # noqa: E501
    peaks = (PEAK_ESTIMATE, PEAK_MEASURED, RESERVED_ESTIMATE, RESERVED_MEASURED)
    return {FIRST_STEP + t.removeprefix("memest/") if t in peaks else t: v for t, v in scalars.items()}


def in_loop(loop: str, scalars: dict[str, float]) -> dict[str, float]:
    """The scalars of a loop besides training (``sanity_check``, ``validate``, ``test``, ``predict``):
    ``memest/<loop>/...``, so they are series of their own beside the training batches'."""
    return {f"memest/{loop}/{tag.removeprefix('memest/')}": value for tag, value in scalars.items()}


def hparams_metrics(cuda: bool) -> tuple[str, ...]:
    """The tags the HParams tab shows (each run's last value of each)."""
    reserved = (RESERVED_ESTIMATE, RESERVED_MEASURED) if cuda else ()
    return (PEAK_ESTIMATE, PEAK_MEASURED, *reserved, ERROR_PCT, FORWARD_GFLOP, BACKWARD_GFLOP)


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs the current training batch's ``self.log`` metrics at: the optimizer
    steps taken before the batch (``trainer.global_step`` already counts the batch's own step at its
    ``on_train_batch_end``, and counts each optimizer's steps)."""
    loop = getattr(trainer, "fit_loop", None)
    stepped = getattr(getattr(loop, "epoch_loop", None), "_batches_that_stepped", None)
    return int(stepped) if stepped is not None else trainer.global_step


def lightning_logs_now(trainer: pl.Trainer) -> bool:
    """Whether Lightning logs the current batch's metrics (``log_every_n_steps``; not mid-accumulation):
    the cadence for figures logged every step, checked at ``on_train_batch_end``."""
    if trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization:
        return False
    return bool(trainer._logger_connector.should_update_logs or getattr(trainer, "fast_dev_run", False))
