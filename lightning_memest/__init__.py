"""lightning_memest: the memory and FLOPs of one training step, estimated on fake tensors, then proven.

Example:
    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> est = estimate_step(torch.nn.Linear(64, 64), torch.randn(8, 64), optimizer=torch.optim.Adam)
    >>> est.steady_state.breakdown.optimizer_state  # Adam's exp_avg and exp_avg_sq, and its step counter
    33288
"""

from typing import TYPE_CHECKING, Any

from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.engine.distributed import DDP, FSDP
from lightning_memest.errors import EstimationError, MemestError, MemoryBudgetError, SpecError, TraceError
from lightning_memest.estimate import estimate_step
from lightning_memest.report import (
    Breakdown,
    DataDependentRead,
    ModuleStats,
    Peak,
    StepEstimate,
    TimelinePoint,
)
from lightning_memest.search import BatchSizeResult, max_batch_size

if TYPE_CHECKING:
    from lightning_memest.adapter import FitBatchSize, MemEstimate

__all__ = [
    "DDP",
    "FSDP",
    "BatchSizeResult",
    "Breakdown",
    "CudaCachingAllocator",
    "DataDependentRead",
    "EstimationError",
    "FitBatchSize",
    "MemEstimate",
    "MemestError",
    "MemoryBudgetError",
    "ModuleStats",
    "Peak",
    "SpecError",
    "StepEstimate",
    "TimelinePoint",
    "TraceError",
    "estimate_step",
    "max_batch_size",
]
__version__ = "0.1.0.dev0"

#: The Lightning callbacks, imported when first asked for: importing Lightning takes seconds, and the
#: ``memest`` command line and ``estimate_step`` do not need it.
_ADAPTER = ("FitBatchSize", "MemEstimate")


def __getattr__(name: str) -> Any:
    if name in _ADAPTER:
        from lightning_memest import adapter

        globals()[name] = value = getattr(adapter, name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ADAPTER})
