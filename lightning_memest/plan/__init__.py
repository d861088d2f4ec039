"""Make it fit: activation-checkpointing plans, proven by the estimator.

``plan_checkpointing(model, batch, budget, ...)`` (``planner.py``) finds the cheapest checkpointing of a
model's repeated blocks whose re-simulated peak fits a budget, and returns a ``CheckpointPlan``
(``report.py``) to apply. Where each part lives: ``candidates.py`` (which modules), ``windows.py`` (what
checkpointing each would free, read from one simulation), ``solver.py`` (which to checkpoint, and how),
``checkpointing.py`` (torch's checkpoint wrappers, applied and put back). For a compiled step,
``plan_compiled_budget`` (``compiled_budget.py``) finds the compiler's own recompute that fits: the
highest ``activation_memory_budget`` whose re-simulated step is within the budget.
"""

from lightning_memest.plan.checkpointing import KINDS, CheckpointKind, CheckpointPolicy, apply_checkpointing
from lightning_memest.plan.compiled_budget import CompiledBudget, plan_compiled_budget
from lightning_memest.plan.planner import plan_checkpointing, plan_step
from lightning_memest.plan.report import CandidateModule, CheckpointPlan

__all__ = [
    "KINDS",
    "CandidateModule",
    "CheckpointKind",
    "CheckpointPlan",
    "CheckpointPolicy",
    "CompiledBudget",
    "apply_checkpointing",
    "plan_checkpointing",
    "plan_compiled_budget",
    "plan_step",
]
