"""DDP's gradient buckets, for the CPU ground truth of a training step (``MemEstimate``'s check).

The profiler that measures a CPU step sees only what is allocated while it runs; DDP allocates its
buckets when it wraps the model, and no tensor the callback can reach names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

__all__ = ["UnseenBuckets"]


@dataclass(frozen=True)
class UnseenBuckets:
    """DDP's gradient buckets, for the CPU ground truth: allocated when DDP wrapped the model (before the
    profiler started, so it never sees them) and named by no tensor the callback can reach -- but DDP
    reports their sizes. DDP re-buckets once, early in the second step; the profiler sees the new
    buckets allocated then (and not the old ones freed), so a step in which that happened needs
    nothing added."""

    ddp: DistributedDataParallel
    rebuilt_at_start: bool
    grads_are_buckets: bool

    @staticmethod
    def at_step_start(trainer: pl.Trainer) -> UnseenBuckets | None:
        ddp = getattr(trainer.strategy, "model", None)
        if not isinstance(ddp, DistributedDataParallel) or trainer.strategy.root_device.type != "cpu":
            return None
        # With gradient_as_bucket_view, existing gradients are views of the buckets: already counted.
        views = ddp.gradient_as_bucket_view and any(p.grad is not None for p in ddp.parameters())
        return UnseenBuckets(ddp, bool(ddp._has_rebuilt_buckets), views)

    def bytes_at_step_end(self) -> int:
        if self.grads_are_buckets or bool(self.ddp._has_rebuilt_buckets) != self.rebuilt_at_start:
            return 0
        sizes = str(self.ddp._get_ddp_logging_data().get("bucket_sizes", ""))  # type: ignore[no-untyped-call]
        return sum(int(n) for n in sizes.replace(",", " ").split())
