"""``MemEstimate``'s memory pre-check: an estimate against the budget before its batch runs, and what the
ranks do about it (``memory_check``: ``"warn"``, ``"raise"``, ``"off"``).

:meth:`BudgetCheck.result` compares (``budget.precheck``, with the largest batch size that fits where
the estimate does not); :meth:`BudgetCheck.act` acts, every rank alike: under DDP one rank stopping alone
would leave the others waiting in the next collective.

Example (in a callback, the batch in hand)::

    check = BudgetCheck("raise", memory_budget="4GiB")
    check.act(trainer, guard, estimate, lambda: check.result(estimate, "cpu", 8, search))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_memest.adapter.guard import Guard
from lightning_memest.advice import Option
from lightning_memest.budget import PrecheckResult, budget_for, precheck
from lightning_memest.errors import MemoryBudgetError
from lightning_memest.report import StepEstimate
from lightning_memest.sizes import MemoryBudget

__all__ = ["BudgetCheck"]


@dataclass(frozen=True)
class BudgetCheck:
    """The callback's pre-check settings: ``memory_check`` (``"warn"``, ``"raise"``, ``"off"``), the
    budget (bytes, ``"10GiB"``, ``"80%"`` of the device; ``None``: what the device has) and the CUDA
    margin."""

    memory_check: str
    memory_budget: int | str | MemoryBudget | None = None
    margin_bytes: int | None = None

    def budget_bytes(self, estimate: StepEstimate, device: Any) -> int:
        """The budget in bytes ``estimate`` is held against on ``device`` (``budget.budget_for``)."""
        return budget_for(estimate, device, memory_budget=self.memory_budget, margin_bytes=self.margin_bytes)

    def result(
        self,
        estimate: StepEstimate,
        device: Any,
        size: int | None,
        search: Callable[[int], int],
        what: str | None = None,
        options: Callable[[int], Sequence[Option]] | None = None,
    ) -> PrecheckResult:
        """``estimate`` against the budget; ``search(budget)`` is the largest batch size that fits and
        ``options(budget)`` what else would (``advice.advise``), asked only where the estimate does not
        (searches: worth trying, not worth failing the check for). ``what`` names what runs, as
        ``budget.precheck``."""
        budget = self.budget_bytes(estimate, device)

        def max_fit() -> int | None:
            try:
                return search(budget)
            except Exception:
                return None

        def offered() -> Sequence[Option]:
            try:
                return options(budget) if options is not None else ()
            except Exception:
                return ()

        return precheck(estimate, budget, batch_size=size, max_fit=max_fit, what=what, options=offered)

    def act(
        self,
        trainer: pl.Trainer,
        guard: Guard,
        estimate: StepEstimate,
        fits: Callable[[], PrecheckResult],
        *,
        everywhere: bool = True,
    ) -> None:
        """Compare ``estimate`` with the budget (``fits()``, usually :meth:`result`); act as
        ``memory_check`` says: a warning, or the ``MemoryBudgetError`` raised. ``everywhere``: every rank
        checks its batch at this point (a loop's first batch), and all act alike on what they found; a
        later batch (``everywhere=False``) is checked on the rank that has it, and under DDP only warned
        about."""
        if self.memory_check == "off":
            return
        if not everywhere and trainer.world_size > 1:
            found = guard.safely("checking the memory budget", fits)
            if found is not None and not found.fits:
                warnings.warn(f"MemEstimate (rank {trainer.global_rank}): {found.error()}", stacklevel=3)
            return
        result = guard.together(trainer, "checking the memory budget", fits)
        if result is None:  # the check failed on some rank: every rank warned, none acts
            return
        # Under DDP every rank must decide alike, or the ranks that go on would wait for the others.
        if trainer.strategy.reduce_boolean_decision(result.fits, all=True):
            return
        if result.fits:  # fits here, not on another rank
            error = MemoryBudgetError(
                "the estimate is over the memory budget on another rank",
                peak_bytes=estimate.peak_bytes,
                budget_bytes=0,
            )
        else:
            error = result.error()
        if self.memory_check == "raise":
            raise error
        rank_zero_warn(f"MemEstimate: {error}")
