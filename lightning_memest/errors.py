"""The errors lightning_memest raises."""

from __future__ import annotations

from typing import Any

__all__ = ["EstimationError", "MemestError", "MemoryBudgetError", "SpecError", "TraceError", "one_line"]


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


class MemoryBudgetError(MemestError):
    """The estimated peak of a training step is over the memory budget.

    Raised before any real step runs. The message names the estimated peak, the budget, what the peak
    holds, the batch size in use, the largest that fits and what else would fit; the same figures are
    attributes (``None`` where unknown; ``max_batch_size`` 0 when not even one sample fits).
    """

    def __init__(
        self,
        message: str,
        *,
        peak_bytes: int,
        budget_bytes: int,
        batch_size: int | None = None,
        max_batch_size: int | None = None,
        options: tuple[Any, ...] = (),
    ) -> None:
        super().__init__(message)
        self.peak_bytes = peak_bytes
        self.budget_bytes = budget_bytes
        self.batch_size = batch_size
        self.max_batch_size = max_batch_size
        self.options = options
        """What would fit, each estimated, cheapest first (``advice.Option``: ``.change``,
        ``.peak_bytes``, ``.cost``; a checkpointing option's ``.plan`` to apply)."""


class TraceError(MemestError):
    """A model could not be traced into a ``torch.fx`` graph, so it has no node-level profile.

    The message carries fx's reason (typically Python control flow on a tensor's value). The
    module-level estimate (``estimate_step``) needs no trace and still works for such a model.
    """


class SpecError(MemestError):
    """A setting that cannot make a case (``lightning_memest.cases``, the ``memest`` command line): an
    unknown model, a bad shape, an input the model rejects."""


def one_line(e: BaseException) -> str:
    """An error's message on one line (for a CLI error, a table cell, a warning); its type's name when
    it has no message.

    >>> one_line(ValueError("Expected more than 1 value  per channel "))
    'Expected more than 1 value per channel'
    """
    return " ".join(str(e).split()) or type(e).__name__
