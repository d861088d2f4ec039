"""What would fit: the options the pre-check offers when a step is over its budget, each estimated.

When a step does not fit, the user's next question is what to change. :func:`advise` answers with
every option it can estimate *as the step itself was estimated* (``sizing.SizedStep``: the same other
live tensors, calibration, loop): the largest batch size that fits; an activation-checkpointing plan
(``plan.plan_step``: solved, then simulated with the plan applied); for a compiled step, the compiler's
own recompute (``plan.compiled_budget``: the highest ``activation_memory_budget`` that fits, each value
tried re-simulated, compile included); other variants of the step the caller can build --
``bf16-mixed`` for a ``32-true`` run, FSDP over the GPUs there are. An option is offered only where its
estimate fits. They come cheapest first: the batch size and the plan by what they cost a step (the
share of samples given up, the share of FLOPs run again), then the compiler's budget (whose recompute
is mostly fused elementwise work, not counted in FLOPs), then the variants, whose cost is not in FLOPs
(numerics, communication), in the order given.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_memest.accounting import capture_filter
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)])
    >>> run = lambda b, *, flops, calibrate: simulate(net, b, StepConfig(), capture=capture_filter(flops=flops))
    >>> step = SizedStep(run, torch.randn(512, 256))
    >>> budget = step.estimate_at().peak_bytes - 1_000_000
    >>> [o.kind for o in advise(step, budget, model=net)]
    ['checkpointing', 'batch size']
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_memest.errors import EstimationError, MemestError
from lightning_memest.plan import CheckpointPlan, plan_step
from lightning_memest.plan.compiled_budget import LADDER, compiled_budget, is_compiled
from lightning_memest.report import format_bytes, format_share
from lightning_memest.search import BatchSizeResult
from lightning_memest.search.sizing import SizedStep

__all__ = ["Option", "advise"]


@dataclass(frozen=True)
class Option:
    """One change that would make the step fit, with its estimated peak and what it costs."""

    kind: str
    """``"batch size"``, ``"checkpointing"``, ``"compiled budget"``, or the variant's name
    (``"precision bf16-mixed"``)."""
    change: str
    """The change, in words: ``"batch size 62"``, ``"checkpoint 7 of 12 modules (4 full, 3 selective)"``."""
    peak_bytes: int
    """The estimated peak with the change (a simulation of it)."""
    cost: str
    """What it costs, in words: ``"3.1 % fewer samples a step"``, ``"+18.9 % FLOPs"``."""
    share: float | None
    """The cost as a share of the step (samples given up, FLOPs run again); ``None``: not in those terms."""
    batch_size: int | None = None
    """For ``"batch size"``: the size."""
    plan: CheckpointPlan | None = None
    """For ``"checkpointing"``: the plan (``plan.apply(model)``, ``plan.policy``)."""
    activation_memory_budget: float | None = None
    """For ``"compiled budget"``: the value to set (``torch._functorch.config.activation_memory_budget``)
    before the step compiles."""

    def __str__(self) -> str:
        return f"{self.change}: {format_bytes(self.peak_bytes)}, {self.cost}"


def advise(
    step: SizedStep,
    budget: int,
    *,
    model: nn.Module | None = None,
    largest: BatchSizeResult | None = None,
    variants: Mapping[str, tuple[str, Callable[[], SizedStep]]] | None = None,
    budget_values: Sequence[float] = LADDER,
    on_budget_value: Callable[[float], None] | None = None,
) -> tuple[Option, ...]:
    """The options that would make ``step`` fit ``budget`` bytes, cheapest first (see the module
    docstring). ``model``: the module ``step`` simulates, for a checkpointing plan (training only;
    ``None``: no plan); ``largest``: the batch-size search's result where the caller has it (else it is
    searched); ``variants``: ``name -> (cost in words, the step as that variant)``; ``budget_values``:
    the ``activation_memory_budget`` values tried for a compiled training step (``()``: none),
    ``on_budget_value(v)`` called before each (a recompile). An option whose estimate fails is left
    out."""
    options: list[Option] = []
    size = _batch_size(step)
    found = largest
    if found is None and size is not None:
        try:
            found = step.largest_batch(budget)
        except MemestError:
            found = None
    if found is not None and found.max_batch_size and size and found.peak_bytes_at_max is not None:
        n = found.max_batch_size
        fewer = 1 - n / size
        options.append(
            Option(
                "batch size",
                f"batch size {n}",
                found.peak_bytes_at_max,
                f"{100 * fewer:.1f} % fewer samples a step" if fewer > 0 else "no fewer samples",
                max(fewer, 0.0),
                batch_size=n,
            )
        )
    if model is not None and step.loop == "train":
        try:
            plan = plan_step(step, model, budget)
        except (EstimationError, MemestError):
            plan = None
        if plan is not None and plan.fits and plan.modules:
            kinds = list(plan.modules.values())
            counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("full", "selective") if kinds.count(k))
            options.append(
                Option(
                    "checkpointing",
                    f"checkpoint {len(plan.modules)} of {len(plan.candidates)} modules ({counts})",
                    plan.peak_bytes,
                    f"+{format_share(plan.recompute_share)} FLOPs",
                    plan.recompute_share,
                    plan=plan,
                )
            )
    options.sort(key=lambda o: o.share if o.share is not None else 1.0)
    if step.loop == "train" and budget_values and is_compiled(step.estimate_at()):
        found_budget = compiled_budget(step, budget, values=budget_values, on_value=on_budget_value)
        if found_budget.value is not None and found_budget.peak_bytes is not None:
            options.append(
                Option(
                    "compiled budget",
                    f"torch._functorch.config.activation_memory_budget = {found_budget.value:g}",
                    found_budget.peak_bytes,
                    found_budget.cost,
                    None,
                    activation_memory_budget=found_budget.value,
                )
            )
    for name, (cost, make) in (variants or {}).items():
        try:
            peak = make().estimate_at().peak_bytes
        except (EstimationError, MemestError):
            continue
        if peak <= budget:
            options.append(Option(name, name, peak, cost, None))
    return tuple(options)


def _batch_size(step: SizedStep) -> int | None:
    try:
        return step.batch_size
    except MemestError:
        return None
