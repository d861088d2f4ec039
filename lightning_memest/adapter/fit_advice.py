"""The pre-check of a training batch, with what to do when it does not fit: ``MemEstimate``'s advice, and
its ``checkpointing="auto"``.

:func:`training_check` compares the estimate with the budget and, where it is over, searches the largest
batch size over the estimate's own step (``sizing.SizedStep``) and estimates the other options
(``advice.advise``): an activation-checkpointing plan of the module, a lower ``activation_memory_budget``
where the step is compiled (each value tried is a recompile, said as it starts), ``bf16-mixed`` where
the fit is ``32-true``, FSDP over the GPUs of a CUDA machine with several -- each simulated as the step
was.
:func:`auto_plan` is the opt-in: the plan with the least recompute that fits, to apply before the
first step.

Example (in a callback, right after the estimate)::

    result = training_check(trainer, pl_module, batches, budget_check, estimate)
    print(result.message)  # ... what would fit, each estimated, cheapest first: (1) batch size 62: ...
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_memest.adapter.budget_check import BudgetCheck
from lightning_memest.adapter.fit import FitSetup
from lightning_memest.adapter.fit_batches import FitBatches
from lightning_memest.adapter.guard import Guard
from lightning_memest.advice import Option, advise
from lightning_memest.budget import PrecheckResult
from lightning_memest.engine.parallel.distributed import FSDP
from lightning_memest.plan import CheckpointPlan, apply_checkpointing, plan_step
from lightning_memest.plan.checkpointing import remove_checkpointing
from lightning_memest.report import StepEstimate
from lightning_memest.search import BatchSizeResult
from lightning_memest.search.sizing import SizedStep

__all__ = ["apply_plan", "auto_plan", "replan", "training_check"]


def _checked(batches: FitBatches) -> tuple[SizedStep, FitSetup, list[torch.Tensor]]:
    if batches.checked is None:
        raise RuntimeError("no estimate to check")  # (the hook estimates right before)
    return batches.checked


def _variants(
    fit: FitSetup, residents: list[torch.Tensor], step: SizedStep
) -> dict[str, tuple[str, Callable[[], SizedStep]]]:
    """The other ways to run this fit the advice estimates."""
    variants: dict[str, tuple[str, Callable[[], SizedStep]]] = {}

    def sized(variant: FitSetup) -> Callable[[], SizedStep]:
        return lambda: variant.sized(calibrate=step.calibrate, residents=residents)

    if fit.config.precision == "32-true":
        variants["precision bf16-mixed"] = (
            "bf16 autocast's numerics",
            sized(fit.varied(precision="bf16-mixed")),
        )
    gpus = torch.cuda.device_count() if fit.device.type == "cuda" and fit.config.strategy is None else 0
    if gpus > 1:
        variants[f"FSDP over {gpus} GPUs"] = (
            "sharded weights, gradients and optimizer state; their communication",
            sized(fit.varied(strategy=FSDP(gpus))),
        )
    return variants


def training_check(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batches: FitBatches,
    budget: BudgetCheck,
    estimate: StepEstimate,
) -> PrecheckResult:
    """``estimate`` (the latest of ``batches``) against the budget; where it is over, the largest batch
    size and the other options that would fit, each estimated as the step was."""
    step, fit, residents = _checked(batches)
    found: list[BatchSizeResult] = []

    def search(budget_bytes: int) -> int:
        found.append(step.largest_batch(budget_bytes))
        return found[-1].max_batch_size

    def recompiling(value: float) -> None:  # each value is a compile of the step: seconds to minutes
        rank_zero_info(
            f"MemEstimate: over the budget; simulating the compiled step under activation_memory_budget "
            f"{value:g} (a recompile)"
        )

    def options(budget_bytes: int) -> tuple[Option, ...]:
        largest = found[-1] if found else None
        return advise(
            step,
            budget_bytes,
            model=module,
            largest=largest,
            variants=_variants(fit, residents, step),
            on_budget_value=recompiling,
        )

    return budget.result(estimate, trainer.strategy.root_device, step.batch_size, search, options=options)


def auto_plan(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batches: FitBatches,
    budget: BudgetCheck,
    estimate: StepEstimate,
    *,
    fresh: bool = False,
) -> CheckpointPlan | None:
    """The checkpointing plan for the latest estimate of ``batches`` where it is over the budget and a
    plan fits (``None`` where the step fits as it is, or nothing fits); ``fresh``: the module changed
    since that estimate (a plan taken off), so the planner simulates the step anew."""
    step, _, _ = _checked(batches)
    budget_bytes = _over_budget(trainer, budget, estimate)
    if budget_bytes is None:
        return None
    plan = plan_step(step.fresh() if fresh else step, module, budget_bytes)
    return plan if plan.fits and plan.modules else None


def _over_budget(trainer: pl.Trainer, budget: BudgetCheck, estimate: StepEstimate) -> int | None:
    """The budget in bytes where ``estimate`` is over it, as the pre-check decides; ``None`` where it fits."""
    budget_bytes = budget.budget_bytes(estimate, trainer.strategy.root_device)
    return None if estimate.runnable_peak_bytes <= budget_bytes else budget_bytes


def apply_plan(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batches: FitBatches,
    budget: BudgetCheck,
    guard: Guard,
    estimate: StepEstimate,
) -> CheckpointPlan | None:
    """``MemEstimate(checkpointing="auto")``: where ``estimate`` is over the budget and a plan fits, the
    plan applied to ``module`` before the first step -- on every rank alike, or on none (the ranks
    agree) -- and said in one line; the plan, or ``None`` where none was applied."""
    plan = guard.together(
        trainer,
        "planning activation checkpointing",
        lambda: auto_plan(trainer, module, batches, budget, estimate),
    )
    if not trainer.strategy.reduce_boolean_decision(plan is not None, all=True) or plan is None:
        return None
    plan.apply(module)
    if trainer.is_global_zero:
        rank_zero_info(f"MemEstimate: {plan.describe()}; applied (checkpointing='auto')")
    return plan


def replan(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batches: FitBatches,
    budget: BudgetCheck,
    guard: Guard,
    estimate: StepEstimate,
    applied: CheckpointPlan | None,
) -> CheckpointPlan | None:
    """``checkpointing="auto"`` at a later batch whose ``estimate`` (the latest of ``batches``, made with
    ``applied`` in place) is over the budget: the module's plan made again for this batch, on the module
    as the user built it (``applied`` taken off first), and applied in its place before the batch runs;
    the new plan, or ``None`` where the batch fits, or no plan fits it (``applied`` then stays, and the
    pre-check says what else would fit). One process only: under several ranks a later batch is one
    rank's, and the module must stay alike on all of them (the pre-check warns instead)."""
    if trainer.world_size > 1 or _over_budget(trainer, budget, estimate) is None:
        return None
    before = remove_checkpointing(module, applied.modules if applied is not None else ())
    try:
        plan = guard.safely(
            "planning activation checkpointing",
            lambda: auto_plan(trainer, module, batches, budget, estimate, fresh=True),
        )
    finally:
        apply_checkpointing(module, before)  # the module trains as it did until a new plan replaces it
    if plan is None:
        return None
    remove_checkpointing(module, before)
    plan.apply(module)
    rank_zero_info(f"MemEstimate: a larger batch; {plan.describe()}; applied (checkpointing='auto')")
    return plan
