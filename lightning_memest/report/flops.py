"""FLOPs of a step as reported: per phase, per module (inclusive of its children) and per op."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_memest.report.formatting import human_flops

__all__ = ["FlopCount", "ModuleFlops", "OpFlops"]


@dataclass(frozen=True, slots=True)
class ModuleFlops:
    """FLOPs of one module in the first step, inclusive of its children (headline and other)."""

    path: str
    forward: int
    backward: int
    other_forward: int
    other_backward: int


@dataclass(frozen=True, slots=True)
class OpFlops:
    """FLOPs of one op (overload name) in the first step, over all its calls and phases."""

    op: str
    calls: int
    flops: int
    other: int


@dataclass(frozen=True, slots=True, repr=False)
class FlopCount:
    """FLOPs of the first training step; a phase that did not run (no op in it) is ``None``."""

    forward: int
    backward: int | None
    optimizer: int | None
    other_forward: int
    other_backward: int | None
    other_optimizer: int | None
    modules: tuple[ModuleFlops, ...]
    """Per module (inclusive of children), in the order modules first ran; ``""`` is the root."""
    ops: tuple[OpFlops, ...]
    """Per op with a formula, most FLOPs (headline, then other) first."""
    uncounted: tuple[str, ...] = ()
    """Ops whose formula could not read their call (counted as 0)."""

    @property
    def total(self) -> int:
        """Headline FLOPs of the whole step (forward + backward + optimizer)."""
        return self.forward + (self.backward or 0) + (self.optimizer or 0)

    @property
    def other_total(self) -> int:
        return self.other_forward + (self.other_backward or 0) + (self.other_optimizer or 0)

    def module(self, path: str) -> ModuleFlops | None:
        """The figures of module ``path``, ``None`` when it did not run."""
        for m in self.modules:
            if m.path == path:
                return m
        return None

    def __repr__(self) -> str:
        return (
            f"<FlopCount forward {self.forward:,}, backward {self.backward or 0:,}, optimizer "
            f"{self.optimizer or 0:,}, other {self.other_total:,}; {len(self.modules):,} modules, "
            f"{len(self.ops):,} ops>"
        )

    def __str__(self) -> str:
        """``'forward 1.82 GFLOP, backward 3.52 GFLOP, optimizer 0 FLOP (other 51.20 MFLOP)'``."""
        return (
            f"forward {human_flops(self.forward)}, backward {human_flops(self.backward or 0)}, optimizer "
            f"{human_flops(self.optimizer or 0)} (other {human_flops(self.other_total)})"
        )
