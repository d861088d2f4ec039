"""Never in the way: every piece of ``MemEstimate``'s work runs guarded, a failure is one warning per fit,
and under DDP the ranks agree on a failure before anyone acts on a result.

:meth:`Guard.safely` is for work of this rank alone (printing, logging, a later batch's estimate), which
no other rank waits on; :meth:`Guard.together` for what the ranks then act on together (an estimate, a
pre-check, a measurement): a failure on any rank is ``None`` and the same warning on every rank
(``adapter/ranks.py``).

Example:
    >>> guard = Guard()
    >>> guard.safely("dividing", lambda: 1 / 0) is None  # one warning: "MemEstimate: dividing failed..."
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import lightning.pytorch as pl

from lightning_memest.adapter.ranks import first_failure
from lightning_memest.errors import EstimationError

__all__ = ["Guard", "attempt"]

_T = TypeVar("_T")


def attempt(what: str, fn: Callable[[], _T]) -> tuple[_T | None, str | None]:
    """``(fn(), None)``, or ``(None, what failed and why)``: any failure must leave training alone."""
    try:
        return fn(), None
    except Exception as exc:
        hint = _ESTIMATION_HINT if isinstance(exc, EstimationError) else ""
        return None, f"{what} failed, training goes on without it: {type(exc).__name__}: {exc}{hint}"


#: What a user can do when their step cannot be simulated (the error names the op and the module).
_ESTIMATION_HINT = (
    "; what you can do: see docs/known-limits.md for that op, give MemEstimate(example_batch=...) "
    "a batch to estimate instead, or report it with a small reproduction of the module"
)


class Guard:
    """Runs the callback's work so that a failure is one warning (per fit, or per call of a loop)."""

    def __init__(self) -> None:
        self.warned = False

    def safely(self, what: str, fn: Callable[[], _T]) -> _T | None:
        """``fn``'s result, or ``None`` and one warning where it failed: for work of this rank alone."""
        result, failure = attempt(what, fn)
        if failure is not None:
            self.warn(failure)
        return result

    def together(self, trainer: pl.Trainer, what: str, fn: Callable[[], _T]) -> _T | None:
        """``fn``'s result where it succeeded on every rank, else ``None`` on every rank and one warning
        on each, alike. A collective under DDP."""
        return self.agreed(trainer, *attempt(what, fn))

    def agreed(self, trainer: pl.Trainer, result: _T | None, failure: str | None) -> _T | None:
        """``result`` where no rank failed (``failure``: this rank's), else ``None`` and the first
        failure's warning on every rank. A collective under DDP."""
        failure = first_failure(trainer, failure)
        if failure is not None:
            self.warn(failure)
            return None
        return result

    def agreed_measurement(
        self, trainer: pl.Trainer, failure: str | None, read: Callable[[], _T], close: Callable[[], object]
    ) -> _T | None:
        """A measurement's result, as :meth:`agreed`: ``read`` where this rank's measuring has not
        failed (``failure``), else ``close`` it and keep nothing. A collective under DDP."""
        result: _T | None = None
        if failure is None:
            result, failure = attempt("measuring", read)
        else:
            attempt("measuring", close)
        return self.agreed(trainer, result, failure)

    def warn(self, failure: str) -> None:
        # One warning; on every rank (rank_zero_warn would hide rank 1's failure).
        if not self.warned:
            self.warned = True
            warnings.warn(f"MemEstimate: {failure}", UserWarning, stacklevel=3)
