"""The errors lightning_memest raises."""

from __future__ import annotations


class MemestError(Exception):
    """Base class of every error lightning_memest raises on purpose."""


class EstimationError(MemestError):
    """The step could not be simulated on fake tensors.

    ``op`` and ``module`` name where it happened (``None`` when unknown).
    """

    def __init__(self, message: str, *, op: str | None = None, module: str | None = None) -> None:
        where = ", ".join(
            part for part in (f"op {op}" if op else "", f"module {module!r}" if module else "") if part
        )
        super().__init__(f"{message} (at {where})" if where else message)
        self.op = op
        self.module = module
