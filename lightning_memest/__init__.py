"""lightning_memest: the memory and FLOPs of one training step, estimated on fake tensors, then proven.

Example:
    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> est = estimate_step(torch.nn.Linear(64, 64), torch.randn(8, 64), optimizer=torch.optim.Adam)
    >>> est.steady_state.breakdown.optimizer_state  # Adam's exp_avg and exp_avg_sq, and its step counter
    33288
"""

from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.adapter import FitBatchSize, MemEstimate
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
