"""``CheckpointPlan``: what a checkpointing plan checkpoints, what it costs, and its estimate.

Frozen dataclasses, as the estimator's reports: the plan's peak is always the re-simulated one
(:attr:`CheckpointPlan.estimate`, the step run on fake tensors with the plan applied), never the
solver's arithmetic. ``str(plan)`` is the table ``memest plan`` prints; :meth:`CheckpointPlan.to_json`
its ``--json``; :meth:`CheckpointPlan.apply` and :attr:`CheckpointPlan.policy` the ways to use it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_memest.errors import MemestError
from lightning_memest.options import check_model
from lightning_memest.plan.checkpointing import CheckpointKind, CheckpointPolicy, apply_checkpointing
from lightning_memest.report import StepEstimate, format_bytes, format_share, human_flops

__all__ = ["CandidateModule", "CheckpointPlan"]


@dataclass(frozen=True)
class CandidateModule:
    """A module the plan could checkpoint, with what each kind would free and cost (from the first
    simulation, before any plan)."""

    path: str
    type_name: str
    freed_bytes: dict[CheckpointKind, int]
    """Activation bytes each kind frees (at most; a kind freeing nothing is absent)."""
    recompute_flops: dict[CheckpointKind, int]
    """FLOPs of the forward run again in backward, per step, by kind."""
    recompute_rise_bytes: int
    """What its forward adds above the activations it keeps while it runs again in backward."""


@dataclass(frozen=True)
class CheckpointPlan:
    """A checkpointing plan, proven by re-simulation (see the module docstring)."""

    budget_bytes: int
    modules: dict[str, CheckpointKind]
    """The checkpointed modules by qualified name, in forward order, with their kind."""
    estimate: StepEstimate
    """The step with the plan applied, simulated: its peaks are the plan's."""
    baseline: StepEstimate
    """The step without the plan."""
    recompute_flops: int
    """FLOPs the plan runs again in each step (headline and other)."""
    step_flops: int
    """FLOPs of the step without the plan (forward and backward, headline and other)."""
    candidates: tuple[CandidateModule, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    """Candidate modules left out, with the reason."""
    notes: tuple[str, ...] = ()
    """What planning found along the way (a kind of checkpointing that could not run)."""
    floor_bytes: int | None = None
    """The peak with every candidate checkpointed in full, where that was simulated (nothing less
    fitted the budget)."""
    max_batch_size: int | None = None
    """The largest batch size that fits the budget with the plan (``None``: not searched)."""
    seconds: float = 0.0
    simulations: int = 0
    """Simulations the planning ran (the first estimate included)."""
    solver_seconds: float = 0.0
    _model: Callable[[], nn.Module | None] = field(default=lambda: None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """Whether the plan's re-simulated peak is within the budget."""
        return self.estimate.peak_bytes <= self.budget_bytes

    @property
    def peak_bytes(self) -> int:
        """The plan's peak: the re-simulated estimate's."""
        return self.estimate.peak_bytes

    @property
    def recompute_share(self) -> float:
        """The recompute FLOPs as a share of the step's FLOPs without the plan."""
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    def apply(self, model: nn.Module | None = None) -> nn.Module:
        """Checkpoint the planned modules of ``model`` (default: the model planned for) in place, with
        torch's ``checkpoint_wrapper`` (state-dict keys unchanged); returns the model. ``model`` is an
        ``nn.Module`` or ``None`` (a ``TypeError`` otherwise).

        Example:
            >>> import torch
            >>> from lightning_memest import plan_checkpointing
            >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
            ...                             for _ in range(6)])
            >>> batch = torch.randn(512, 256)
            >>> plan = plan_checkpointing(net, batch, plan_checkpointing(net, batch, 2**40).baseline.peak_bytes - 1)
            >>> plan.fits, type(plan.apply()[0]).__name__
            (True, 'CheckpointWrapper')
        """  # noqa: E501
        target = check_model(model) if model is not None else self._model()
        if target is None:
            raise MemestError("the model this plan was made for is gone: pass the model to apply()")
        apply_checkpointing(target, self.modules)
        return target

    @property
    def policy(self) -> CheckpointPolicy:
        """The callable for Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)`` (and for
        torch's ``apply_activation_checkpointing(..., auto_wrap_policy=...)`` in ``configure_model``):
        true for the planned modules of the model planned for. Full checkpointing only: a plan with
        selective modules says so (use :meth:`apply`)."""
        model = self._model()
        if model is None:
            raise MemestError("the model this plan was made for is gone")
        selective = [p for p, kind in self.modules.items() if kind != "full"]
        if selective:
            raise MemestError(
                f"{len(selective)} planned modules are checkpointed selectively ({selective[0]}, ...), "
                "which Lightning's activation_checkpointing_policy cannot express: use plan.apply(model), "
                "or plan with kinds=('full',)"
            )
        return CheckpointPolicy(model, tuple(self.modules))

    def describe(self) -> str:
        """One line: the modules checkpointed, the peak before and after, the FLOPs it costs."""
        kinds = [kind for kind in self.modules.values()]
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("full", "selective") if kinds.count(k))
        what = (
            f"{len(self.modules)} of {len(self.candidates)} modules ({counts})" if self.modules else "nothing"
        )
        verdict = "within" if self.fits else "over"
        return (
            f"checkpointing {what}: peak {format_bytes(self.baseline.peak_bytes)} -> "
            f"{format_bytes(self.peak_bytes)}, {verdict} the budget of {format_bytes(self.budget_bytes)}, "
            f"+{format_share(self.recompute_share)} FLOPs"
        )

    def __str__(self) -> str:
        """The table ``memest plan`` prints."""
        lines = [self.describe()]
        if self.floor_bytes is not None and not self.fits:
            floor = format_bytes(self.floor_bytes)
            lines.append(f"  nothing fits: every candidate checkpointed in full peaks at {floor}")
        if self.modules:
            by_path = {c.path: c for c in self.candidates}
            width = max(len(p) for p in self.modules)
            lines.append(f"  {'module':<{width}}  {'type':<20} {'kind':<10} {'frees':>11} {'recompute':>13}")
            for path, kind in self.modules.items():
                c = by_path.get(path)
                freed = format_bytes(c.freed_bytes.get(kind, 0)) if c is not None else "?"
                flops = human_flops(c.recompute_flops.get(kind, 0)) if c is not None else "?"
                name = c.type_name if c is not None else ""
                lines.append(f"  {path:<{width}}  {name:<20.20} {kind:<10} {freed:>11} {flops:>13}")
        if self.max_batch_size is not None:
            lines.append(
                f"  with the plan, the largest batch size within the budget is {self.max_batch_size}"
            )
        for path, why in self.skipped.items():
            lines.append(f"  not a candidate: {path} ({why})")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """What ``memest plan --json`` prints."""
        return {
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "peak_bytes": {"before": self.baseline.peak_bytes, "after": self.peak_bytes},
            "estimate": self.estimate.to_json(),
            "modules": [{"path": p, "kind": k} for p, k in self.modules.items()],
            "recompute_flops": self.recompute_flops,
            "recompute_share": round(self.recompute_share, 6),
            "candidates": [
                {
                    "path": c.path,
                    "type": c.type_name,
                    "freed_bytes": dict(c.freed_bytes),
                    "recompute_flops": dict(c.recompute_flops),
                    "recompute_rise_bytes": c.recompute_rise_bytes,
                }
                for c in self.candidates
            ],
            "skipped": dict(self.skipped),
            "notes": list(self.notes),
            "floor_bytes": self.floor_bytes,
            "max_batch_size": self.max_batch_size,
            "seconds": round(self.seconds, 3),
            "simulations": self.simulations,
            "solver_seconds": round(self.solver_seconds, 4),
        }


def model_ref(model: nn.Module) -> Callable[[], nn.Module | None]:
    """A weak reference to ``model``: a plan does not keep the model alive."""
    return weakref.ref(model)
