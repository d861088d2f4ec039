"""Which modules to checkpoint, and how: the least recompute whose predicted peak fits a budget.

The prediction is ``windows.py``'s: at every moment of the simulated run, its live bytes less the
activations of each checkpointed module whose window covers that moment, and while a checkpointed
module's forward runs again, its recompute high less the same. :func:`predicted_peak` evaluates it for
any choice. :func:`solve` finds the cheapest choice that fits:

* **Nested windows** (the usual case: a stack of blocks, whose backward runs in the reverse order of
  their forward) make every moment covered by a *prefix* of the blocks in forward order. A dynamic
  programme over the blocks in that order then carries, for each total of activations freed so far,
  the least recompute that reaches it (a Pareto front, pruned of dominated choices), checking each
  moment's bound as the prefix that covers it is decided: exact, and linear in the blocks for
  identical ones (every choice with the same count frees the same bytes).
* Otherwise every choice is enumerated up to :data:`EXHAUSTIVE` candidates, and above it blocks are
  added greedily, most bytes per FLOP first.

Costs are the recompute FLOPs per step of each kind (``kind -> FLOPs``); a kind missing from a
candidate's costs, or freeing nothing, is not offered for it.

Example:
    >>> from lightning_memest.plan.windows import BlockWindows, Candidate, Region
    >>> blocks = tuple(Candidate(str(i), {"full": 100}, (1000,), (frozenset(range(i)),), (i,))
    ...                for i in range(4))
    >>> regions = tuple(Region(0, frozenset(range(k)), 600 + 150 * k) for k in range(5))
    >>> w = BlockWindows(blocks, regions)
    >>> solve(w, [{"full": 10}] * 4, budget=1000).choices  # 1200 - 1000 needs two blocks' activations
    {'0': 'full', '1': 'full'}
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_memest.plan.checkpointing import CheckpointKind
from lightning_memest.plan.windows import BlockWindows

__all__ = ["EXHAUSTIVE", "FRONT", "Solution", "predicted_peak", "solve"]

#: Up to this many candidates, a choice the dynamic programme cannot take is found by enumeration.
EXHAUSTIVE = 10
#: The most states the dynamic programme keeps per block (bucketed by bytes freed beyond it).
FRONT = 4096


@dataclass(frozen=True)
class Solution:
    """A choice of checkpointing, what it costs and the peak it is predicted to have."""

    choices: dict[str, CheckpointKind]
    """Checkpointed modules by path, in forward order, with their kind."""
    recompute_flops: int
    predicted_peak: int
    method: str
    """``"prefix"`` (the dynamic programme), ``"exhaustive"`` or ``"greedy"``."""


Costs = Sequence[Mapping[CheckpointKind, int]]


def predicted_peak(windows: BlockWindows, choice: Mapping[int, CheckpointKind]) -> int:
    """The peak predicted with the candidates ``choice`` names (by index) checkpointed."""
    freed = {i: windows.candidates[i].freed[kind] for i, kind in choice.items()}
    peak = 0
    for region in windows.regions:
        peak = max(peak, region.high - sum(f for i, f in freed.items() if i in region.covered))
    for i in choice:
        c = windows.candidates[i]
        for s in range(windows.steps):
            high = c.recompute_high[s] - sum(f for j, f in freed.items() if j in c.cover_at_recompute[s])
            peak = max(peak, high)
    return peak


def _options(windows: BlockWindows, costs: Costs, i: int) -> list[tuple[CheckpointKind, int, int]]:
    """``(kind, bytes freed, FLOPs)`` of each kind offered for candidate ``i``."""
    c = windows.candidates[i]
    return [(kind, c.freed[kind], costs[i][kind]) for kind in costs[i] if c.freed.get(kind, 0) > 0]


def solve(windows: BlockWindows, costs: Costs, budget: int) -> Solution | None:
    """The choice with the least recompute FLOPs whose predicted peak is within ``budget`` (see the
    module docstring); ``None`` where none is (not even every candidate, each its most freeing kind)."""
    order = _prefix_order(windows)
    if order is not None:
        return _prefix_solve(windows, costs, budget, order)
    n = len(windows.candidates)
    if n <= EXHAUSTIVE:
        return _exhaustive(windows, costs, budget)
    return _greedy(windows, costs, budget)


def _solution(
    windows: BlockWindows, choice: Mapping[int, CheckpointKind], costs: Costs, method: str
) -> Solution:
    ordered = sorted(choice, key=lambda i: windows.candidates[i].forward_end[0])
    return Solution(
        {windows.candidates[i].path: choice[i] for i in ordered},
        sum(costs[i][kind] for i, kind in choice.items()),
        predicted_peak(windows, choice),
        method,
    )


def _prefix_order(windows: BlockWindows) -> list[int] | None:
    """The candidates in forward order, where every region and every recompute is covered by a prefix
    of them (nested windows); ``None`` otherwise."""
    order = sorted(range(len(windows.candidates)), key=lambda i: windows.candidates[i].forward_end[0])
    prefixes = {frozenset(order[:k]): k for k in range(len(order) + 1)}
    if any(r.covered not in prefixes for r in windows.regions):
        return None
    for k, i in enumerate(order):
        if any(cover != frozenset(order[:k]) for cover in windows.candidates[i].cover_at_recompute):
            return None
    return order


def _prefix_solve(windows: BlockWindows, costs: Costs, budget: int, order: list[int]) -> Solution | None:
    highs = [-math.inf] * (len(order) + 1)  # the highest moment covered by each prefix
    rank = {frozenset(order[:k]): k for k in range(len(order) + 1)}
    for region in windows.regions:
        k = rank[region.covered]
        highs[k] = max(highs[k], region.high)
    if highs[0] > budget:
        return None  # what no checkpointing of these candidates touches is over already
    # States: (bytes freed so far, FLOPs, choices as a tuple of (candidate, kind)).
    states: list[tuple[int, int, tuple[tuple[int, CheckpointKind], ...]]] = [(0, 0, ())]
    total = sum(max((f for _, f, _ in _options(windows, costs, i)), default=0) for i in order) or 1
    for k, i in enumerate(order):
        c = windows.candidates[i]
        grown = list(states)
        for kind, freed, flops in _options(windows, costs, i):
            for done, spent, chosen in states:
                if max(c.recompute_high) - done <= budget:
                    grown.append((done + freed, spent + flops, (*chosen, (i, kind))))
        states = _front([s for s in grown if highs[k + 1] - s[0] <= budget], total)
        if not states:
            return None
    best = min(states, key=lambda s: (s[1], len(s[2]), -s[0]))
    return _solution(windows, dict(best[2]), costs, "prefix")


def _front(
    states: list[tuple[int, int, tuple[tuple[int, CheckpointKind], ...]]], total: int
) -> list[tuple[int, int, tuple[tuple[int, CheckpointKind], ...]]]:
    """The states no other beats (frees as much or more for no more FLOPs), at most :data:`FRONT`
    (bucketed by bytes freed, rounded down: a bucket keeps its cheapest)."""
    states.sort(key=lambda s: (-s[0], s[1], len(s[2])))
    kept = []
    cheapest = math.inf
    for s in states:
        if s[1] < cheapest:
            kept.append(s)
            cheapest = s[1]
    if len(kept) <= FRONT:
        return kept
    size = max(1, total // FRONT)
    buckets: dict[int, tuple[int, int, tuple[tuple[int, CheckpointKind], ...]]] = {}
    for s in kept:
        b = s[0] // size
        if b not in buckets or s[1] < buckets[b][1]:
            buckets[b] = s
    return sorted(buckets.values(), key=lambda s: -s[0])


def _exhaustive(windows: BlockWindows, costs: Costs, budget: int) -> Solution | None:
    n = len(windows.candidates)
    offered = [[None, *[kind for kind, _, _ in _options(windows, costs, i)]] for i in range(n)]
    best: tuple[int, dict[int, CheckpointKind]] | None = None
    for picks in itertools.product(*offered):
        choice = {i: kind for i, kind in enumerate(picks) if kind is not None}
        flops = sum(costs[i][kind] for i, kind in choice.items())
        if best is not None and flops >= best[0]:
            continue
        if predicted_peak(windows, choice) <= budget:
            best = (flops, choice)
    return None if best is None else _solution(windows, best[1], costs, "exhaustive")


def _greedy(windows: BlockWindows, costs: Costs, budget: int) -> Solution | None:
    choice: dict[int, CheckpointKind] = {}
    options = {i: _options(windows, costs, i) for i in range(len(windows.candidates))}
    while predicted_peak(windows, choice) > budget:
        picks = [
            (freed / max(flops, 1), i, kind)
            for i, opts in options.items()
            if i not in choice
            for kind, freed, flops in opts
        ]
        if not picks:
            return None
        _, i, kind = max(picks)
        choice[i] = kind
    return _solution(windows, choice, costs, "greedy")
