"""The peak of every training batch on CUDA, after the measured first steps: what draws the measured
line over the whole of training.

Cheap: the caching allocator keeps its peak statistics on the host, so resetting them at a batch's
start and reading them at its end costs two calls and no synchronisation. Lightning logs every
``log_every_n_steps`` batches; the largest peak since the last logged point is what the next one
shows, so no batch's peak is lost between them. (On the CPU only the first steps are measured:
the profiler that sees the allocator there costs a good part of a step.)

Example (in a callback, on CUDA)::

    peaks = StepPeaks()
    peaks.start(device)        # on_train_batch_start
    peaks.stop(device)         # on_train_batch_end
    allocated, reserved = peaks.take()  # where Lightning logs
"""

from __future__ import annotations

import torch

__all__ = ["StepPeaks"]


class StepPeaks:
    """The largest allocated and reserved peaks of the batches since the last :meth:`take`."""

    def __init__(self) -> None:
        self._peak: tuple[int, int] | None = None

    def start(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def stop(self, device: torch.device) -> None:
        now = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        last = self._peak or now
        self._peak = max(last[0], now[0]), max(last[1], now[1])

    def take(self) -> tuple[int, int] | None:
        """The peaks since the last take (``None`` if no batch ended since)."""
        peak, self._peak = self._peak, None
        return peak
