"""Make a compiled step fit with the compiler's own recompute: ``activation_memory_budget``, re-simulated.

Under ``torch._functorch.config.activation_memory_budget`` (1.0 by default) AOTAutograd's partitioner
saves less for backward and recomputes the rest, fused into inductor's kernels. For a step that does not
fit, a lower value is an option next to a checkpointing plan, often the cheapest: the user sets one
number and the model stays as written. What it saves is not a formula: the partitioner's choice moves
with the graph, and the peak is not even monotonic in the value (a measured MLP: 0.2 below 0.4, 0.0
above both; pytorch#197838). So each value is the step simulated again under it -- the compile
included, as the run would compile it (``engine.compiled``) -- and the values are tried from the
least recompute down, the first whose peak fits is the answer: every value tried before it peaked
above it.

Each value is a recompile (seconds for a small model; 35-60 s for a GPT-2 or ResNet-34 on two CPU
cores), hence the short ladder (:data:`LADDER`) and ``on_value`` for progress.

For a compiled model, :func:`plan_compiled_budget` takes ``estimate_step``'s arguments; the
pre-check's advice (``advice.advise``) and ``memest plan --compile`` offer the same answer.

Example:
    >>> import torch
    >>> layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(3)]
    >>> net = torch.compile(torch.nn.Sequential(*layers))
    >>> batch = torch.randn(2048, 256)
    >>> default = plan_compiled_budget(net, batch, 2**40).baseline.peak_bytes  # doctest: +SKIP
    >>> found = plan_compiled_budget(net, batch, default - 1)  # doctest: +SKIP
    >>> found.value is not None and found.value < 1.0 and found.peak_bytes < default  # doctest: +SKIP
    True

(Not run by the docstring tests: docs/compiled.md runs the same example, and each compile takes
seconds.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_memest.errors import EstimationError, MemestError
from lightning_memest.plan.planner import plan_budget_bytes, sized_step
from lightning_memest.report import StepEstimate, format_bytes, format_share
from lightning_memest.search.sizing import SizedStep

__all__ = [
    "LADDER",
    "BudgetTrial",
    "CompiledBudget",
    "compiled_budget",
    "current_budget",
    "is_compiled",
    "plan_compiled_budget",
]

#: The values tried, from the least recompute down (below the value the step was estimated under).
LADDER = (0.8, 0.6, 0.4, 0.2, 0.1)


@dataclass(frozen=True)
class BudgetTrial:
    """One value of ``activation_memory_budget``, simulated."""

    value: float
    peak_bytes: int | None
    """The step's estimated peak under it; ``None`` where its simulation failed (``failure`` says why)."""
    flops: int | None
    """The step's FLOPs under it (matrix products and convolutions: the recompute fused into generated
    kernels is not counted)."""
    failure: str | None = None


@dataclass(frozen=True)
class CompiledBudget:
    """The highest ``activation_memory_budget`` whose re-simulated step fits, and every value tried."""

    budget_bytes: int
    baseline: StepEstimate
    """The step as it was estimated (under :attr:`baseline_value`)."""
    baseline_value: float
    trials: tuple[BudgetTrial, ...]
    """The values simulated, in the order tried; the last is the answer where one fits."""

    @property
    def fits_as_it_is(self) -> bool:
        """Whether the step fits under the value it was estimated under (nothing was tried)."""
        return self.baseline.peak_bytes <= self.budget_bytes

    @property
    def fit(self) -> BudgetTrial | None:
        """The value that fits, ``None`` where none does (the step as estimated, where it fits)."""
        if self.fits_as_it_is:
            flops = None if self.baseline.flops is None else self.baseline.flops.total
            return BudgetTrial(self.baseline_value, self.baseline.peak_bytes, flops)
        last = self.trials[-1] if self.trials else None
        ok = last is not None and last.peak_bytes is not None and last.peak_bytes <= self.budget_bytes
        return last if ok else None

    @property
    def value(self) -> float | None:
        """The value to set (``torch._functorch.config.activation_memory_budget``), ``None``: none fits."""
        return None if self.fit is None else self.fit.value

    @property
    def peak_bytes(self) -> int | None:
        """The re-simulated peak under :attr:`value`."""
        return None if self.fit is None else self.fit.peak_bytes

    @property
    def extra_flops_share(self) -> float | None:
        """The FLOPs :attr:`value` adds, as a share of the baseline's (matrix products and convolutions
        run again; ``None`` where not known)."""
        fit, base = self.fit, self.baseline.flops
        if fit is None or fit.flops is None or base is None or not base.total:
            return None
        return max(fit.flops - base.total, 0) / base.total

    def describe(self) -> str:
        """The values tried and their peaks, in a line: ``'0.8: 82.1 MiB, 0.6: 76.1 MiB'``."""
        return _described(self.trials)

    @property
    def cost(self) -> str:
        """What :attr:`value` costs, in words, and what the values above it peaked at."""
        share = self.extra_flops_share
        counted = "unknown" if share is None else f"+{format_share(share)}"
        text = f"{counted} matrix-product FLOPs (the elementwise recompute fused into kernels not counted)"
        fit = self.fit
        above = [t for t in self.trials if fit is None or t.value != fit.value]
        return f"{text}; over the budget at {_described(above)}" if above else text

    def to_json(self) -> dict[str, Any]:
        """The answer and every value tried, for ``--json``."""
        share = self.extra_flops_share
        return {
            "budget_bytes": self.budget_bytes,
            "baseline_value": self.baseline_value,
            "baseline_peak_bytes": self.baseline.peak_bytes,
            "value": self.value,
            "peak_bytes": self.peak_bytes,
            "extra_flops_share": None if share is None else round(share, 6),
            "trials": [dataclasses.asdict(t) for t in self.trials],
        }


def _described(trials: Sequence[BudgetTrial]) -> str:
    def peak(t: BudgetTrial) -> str:
        return format_bytes(t.peak_bytes) if t.peak_bytes is not None else str(t.failure)

    return ", ".join(f"{t.value:g}: {peak(t)}" for t in trials)


def is_compiled(estimate: StepEstimate) -> bool:
    """Whether ``estimate`` simulated compiled code as compiled (so its compiler's budget applies)."""
    return bool(estimate.compiled) and estimate.compiled_eagerly is None


def current_budget() -> float:
    """``torch._functorch.config.activation_memory_budget`` as it is now (what a step compiles under)."""
    import torch._functorch.config

    return float(torch._functorch.config.activation_memory_budget)


def compiled_budget(
    step: SizedStep,
    budget: int,
    *,
    values: Sequence[float] = LADDER,
    on_value: Callable[[float], None] | None = None,
) -> CompiledBudget:
    """The highest of ``values`` below the current ``activation_memory_budget`` under which ``step``
    (a compiled training step) fits ``budget`` bytes, each value's step simulated anew -- compile
    included -- with everything else as ``step`` was estimated; tried from the highest down, stopping
    at the first that fits (none where the step fits as it is). ``on_value(v)`` is called before each
    value's simulation (each a recompile). A value whose simulation fails is kept with its failure,
    and the search goes on."""
    baseline = step.estimate_at()
    now = current_budget()
    trials: list[BudgetTrial] = []
    if baseline.peak_bytes <= budget:
        return CompiledBudget(budget, baseline, now, ())
    for value in sorted({v for v in values if 0.0 <= v < now}, reverse=True):
        if on_value is not None:
            on_value(value)
        trial = _trial(step, value)
        trials.append(trial)
        if trial.peak_bytes is not None and trial.peak_bytes <= budget:
            break
    return CompiledBudget(budget, baseline, now, tuple(trials))


def plan_compiled_budget(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    *,
    values: Sequence[float] = LADDER,
    on_value: Callable[[float], None] | None = None,
    **estimate_args: Any,
) -> CompiledBudget:
    """The highest ``activation_memory_budget`` of ``values`` under which the compiled training step of
    ``model`` on ``batch`` fits ``budget`` (bytes or a size, ``"2GiB"``), each value re-simulated
    (:func:`compiled_budget`); ``estimate_args`` are ``estimate_step``'s (``loss_fn``, ``optimizer``,
    ``precision``, ``device``, ``steps``, ``strategy``, ``gpu``, ``calibrate``, ``replay_blocks``).
    ``model`` is compiled (``torch.compile(model)``, a compiled submodule); a step that compiles
    nothing is an error, as a budget that is a share of a device is. Set the answer before the step
    first compiles: ``torch._functorch.config.activation_memory_budget = found.value``."""
    budget_bytes = plan_budget_bytes(budget)
    step = sized_step(model, batch, **estimate_args)
    baseline = step.estimate_at()
    if not baseline.compiled:
        raise ValueError(
            "model compiles nothing (no torch.compile'd module in it): the compiler's "
            "activation_memory_budget does not apply; plan_checkpointing plans an eager step"
        )
    if baseline.compiled_eagerly is not None:
        why = baseline.compiled_eagerly
        raise EstimationError(f"the compiled step could not be simulated as compiled: {why}")
    return compiled_budget(step, budget_bytes, values=values, on_value=on_value)


def _trial(step: SizedStep, value: float) -> BudgetTrial:
    under = dataclasses.replace(step.fresh(), simulate=_under(value, step.simulate))
    try:
        estimate = under.estimate_at()
    except (EstimationError, MemestError) as e:
        return BudgetTrial(value, None, None, f"failed: {e}".splitlines()[0][:200])
    if not is_compiled(estimate):  # compiled eagerly under this value: not its figure
        return BudgetTrial(value, None, None, f"simulated eagerly ({estimate.compiled_eagerly})")
    return BudgetTrial(value, estimate.peak_bytes, None if estimate.flops is None else estimate.flops.total)


def _under(value: float, simulate: Callable[..., Any]) -> Callable[..., Any]:
    def simulate_under(*args: Any, **kwargs: Any) -> Any:
        with _budget(value):
            return simulate(*args, **kwargs)

    return simulate_under


@contextmanager
def _budget(value: float) -> Iterator[None]:
    import torch._functorch.config

    # Read by the partitioner at each compile; AOTAutograd's cache key holds functorch's config, so
    # a graph compiled under another value is not found for this one.
    with torch._functorch.config.patch(activation_memory_budget=value):
        yield
