"""The per-module tree of a step's figures: parameters, what each module saves, its peaks and FLOPs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from lightning_memest.report.formatting import format_bytes, human_flops

__all__ = ["ModuleStats"]


@dataclass(frozen=True, repr=False)
class ModuleStats:
    """One node of the per-module tree (figures of the first step; a module includes its children)."""

    path: str
    type_name: str
    parameter_bytes: int
    saved_bytes: int
    """Bytes of activations saved for backward while this module ran forward (parameters not counted)."""
    forward_peak_bytes: int | None
    """Most bytes live during its forward; ``None`` if it never ran."""
    backward_peak_bytes: int | None
    """Most bytes live during its backward; ``None`` if it had no backward."""
    forward_flops: int | None
    """Headline FLOPs (2 x MACs of matmuls, convolutions, attention) of its forward; ``None`` if it
    never ran."""
    backward_flops: int | None
    children: tuple[ModuleStats, ...] | None

    def walk(self) -> Iterator[ModuleStats]:
        """This node and all below it, depth first."""
        yield self
        for child in self.children or ():
            yield from child.walk()

    def __repr__(self) -> str:
        # The tree below is summed up, not spelled out: a model's tree runs to thousands of lines.
        below = sum(1 for _ in self.walk()) - 1
        return (
            f"<ModuleStats {self.path or '(root)'} ({self.type_name}): saved {self.saved_bytes:,} B, "
            f"{below:,} modules below>"
        )

    def __str__(self) -> str:
        """One line: the module, its parameters, what it saves for backward, its FLOPs."""
        flops = "" if self.forward_flops is None else f", forward {human_flops(self.forward_flops)}"
        if self.backward_flops is not None:
            flops += f", backward {human_flops(self.backward_flops)}"
        return (
            f"{self.path or '(root)'} ({self.type_name}): parameters {format_bytes(self.parameter_bytes)}, "
            f"saved for backward {format_bytes(self.saved_bytes)}{flops}"
        )
