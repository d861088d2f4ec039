"""lightning_memest: the memory and FLOPs of one training step, estimated on fake tensors, then proven.

Example:
    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> est = estimate_step(torch.nn.Linear(64, 64), torch.randn(8, 64), optimizer=torch.optim.Adam)
    >>> est.steady_state.breakdown.optimizer_state  # Adam's exp_avg and exp_avg_sq, and its step counter
    33288
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
    from lightning_memest.adapter import FitBatchSize, MemEstimate
    from lightning_memest.engine.parallel.distributed import DDP, FSDP, TP, ModelParallel
    from lightning_memest.engine.parallel.pipeline import Pipeline
    from lightning_memest.errors import EstimationError, MemestError, MemoryBudgetError, SpecError, TraceError
    from lightning_memest.estimate import estimate_step
    from lightning_memest.plan import CheckpointPlan, CompiledBudget, plan_checkpointing, plan_compiled_budget
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
    "TP",
    "BatchSizeResult",
    "Breakdown",
    "CheckpointPlan",
    "CompiledBudget",
    "CudaCachingAllocator",
    "DataDependentRead",
    "EstimationError",
    "FitBatchSize",
    "MemEstimate",
    "MemestError",
    "MemoryBudgetError",
    "ModelParallel",
    "ModuleStats",
    "Peak",
    "Pipeline",
    "SpecError",
    "StepEstimate",
    "TimelinePoint",
    "TraceError",
    "estimate_step",
    "max_batch_size",
    "plan_checkpointing",
    "plan_compiled_budget",
]
__version__ = "0.1.0.dev0"

#: Where each public name lives. Each is imported when first asked for (PEP 562): torch takes seconds
#: to import and Lightning more, and ``import lightning_memest`` should cost neither until a name that
#: needs them is used (``memest --help`` needs none; ``estimate_step`` does without Lightning).
_LAZY = {
    "DDP": "lightning_memest.engine.parallel.distributed",
    "FSDP": "lightning_memest.engine.parallel.distributed",
    "TP": "lightning_memest.engine.parallel.distributed",
    "ModelParallel": "lightning_memest.engine.parallel.distributed",
    "Pipeline": "lightning_memest.engine.parallel.pipeline",
    "BatchSizeResult": "lightning_memest.search",
    "Breakdown": "lightning_memest.report",
    "CheckpointPlan": "lightning_memest.plan",
    "CompiledBudget": "lightning_memest.plan",
    "CudaCachingAllocator": "lightning_memest.accounting.cuda_allocator",
    "DataDependentRead": "lightning_memest.report",
    "EstimationError": "lightning_memest.errors",
    "FitBatchSize": "lightning_memest.adapter",
    "MemEstimate": "lightning_memest.adapter",
    "MemestError": "lightning_memest.errors",
    "MemoryBudgetError": "lightning_memest.errors",
    "ModuleStats": "lightning_memest.report",
    "Peak": "lightning_memest.report",
    "SpecError": "lightning_memest.errors",
    "StepEstimate": "lightning_memest.report",
    "TimelinePoint": "lightning_memest.report",
    "TraceError": "lightning_memest.errors",
    "estimate_step": "lightning_memest.estimate",
    "max_batch_size": "lightning_memest.search",
    "plan_checkpointing": "lightning_memest.plan",
    "plan_compiled_budget": "lightning_memest.plan",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    globals()[name] = value = getattr(importlib.import_module(module), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
