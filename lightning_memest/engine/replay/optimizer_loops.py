"""The loops of torch.optim's for-loop optimizers as ``engine.replay.optimizer_replay`` sees them: each
iteration's events (one parameter's work) renamed into a program that can be compared and replayed,
and the lists the loop is handed, which mark where each iteration begins.

Example:
    >>> from lightning_memest.engine.events import Alloc, Free
    >>> program([Alloc(7, 64), Free(5)], own=(), prev=[(5, 32)])  # a temporary; the last one's freed
    ((('alloc', ('i', 0), 64), ('free', ('prev', 0, 32))), frozenset({0}))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from lightning_memest.engine.events import Alloc, Event, Free, OpEvent, Phase, Tag
from lightning_memest.engine.fake import below
from lightning_memest.engine.replay.replay_tracker import ReplayMismatch
from lightning_memest.engine.tracker import Tracker

__all__ = [
    "OFF_FLAGS",
    "Canon",
    "Iteration",
    "Loop",
    "Program",
    "Run",
    "Slots",
    "allocation_sizes",
    "constants",
    "equal",
    "program",
]

#: A renamed handle: ``("o", m)`` the iteration's ``m``-th own tensor (its list entries), ``("i", n)``
#: the ``n``-th storage it allocated, ``("prev", n, nbytes)`` the previous iteration's, ``("ext", h)``.
Canon = tuple[Any, ...]
Program = tuple[tuple[Any, ...], frozenset[int]]  # the renamed events, and what outlives them

#: Flags under which an iteration's work depends on more than its own tensors (or is not a loop).
OFF_FLAGS = ("capturable", "differentiable", "has_complex", "has_sparse_grad", "foreach", "fused")


@dataclass(frozen=True)
class Run:
    """Where the stand-ins' parameters lie in one loop's list: ``[start, stop)``, ``q`` per block,
    block 1's from ``t1``, block 2's from ``t2``, block N-2's from ``stop``."""

    start: int
    stop: int
    q: int
    t1: int
    t2: int


@dataclass
class Iteration:
    """One iteration of a loop (one parameter's work), or the span of the stand-ins' replayed ones."""

    position: int  # in the loop's list; -1 for the stand-ins' span
    start: int  # where its events begin
    prev: list[tuple[int, int]] | None = None  # the iteration before's storages, where not the record's
    before: tuple[Tensor | None, ...] = ()  # constants (step counters) as it began
    lengths: tuple[int, ...] = ()  # the init loop's lists' lengths as it began
    had_state: bool = False


class Slots(list):  # type: ignore[type-arg]
    """A loop's per-parameter list seen in the loop's order (``enumerate``'s count -> position); the
    one the loop iterates drives it (``drive``)."""

    def __init__(self, items: list[Any], order: list[int], drive: Callable[[], Iterator[Any]] | None) -> None:
        super().__init__(items)
        self._items, self._order, self._drive = items, order, drive

    def __getitem__(self, k: Any) -> Any:
        if type(k) is not int:
            raise ReplayMismatch("an optimizer loop read its lists other than one by one")
        return self._items[self._order[k]]

    def __setitem__(self, k: Any, v: Any) -> None:
        if type(k) is not int:
            raise ReplayMismatch("an optimizer loop wrote its lists other than one by one")
        self._items[self._order[k]] = v
        list.__setitem__(self, self._order[k], v)

    def __iter__(self) -> Iterator[Any]:
        if self._drive is None or self._order:
            raise ReplayMismatch("an optimizer loop iterated its lists other than once, in order")
        return self._drive()


def program(
    events: Sequence[Event], own: Sequence[int | None], prev: Sequence[tuple[int, int]]
) -> Program | None:
    """The iteration's events renamed (see :data:`Canon`), and the storages it allocated that outlive
    it; ``None`` where an event is not one a replay makes."""
    names: dict[int, Canon] = {h: ("prev", n, nb) for n, (h, nb) in enumerate(prev)}
    names.update((h, ("o", m)) for m, h in enumerate(own) if h is not None)
    count = 0
    for e in events:
        if type(e) is Alloc:
            assert isinstance(e, Alloc)
            if e.resident or names.get(e.storage, ("",))[0] == "i":
                return None
            names[e.storage] = ("i", count)
            count += 1
    prog: list[tuple[Any, ...]] = []
    freed: set[int] = set()
    for e in events:
        kind = type(e)
        if kind is OpEvent:
            assert isinstance(e, OpEvent)
            if e.workspace or e.phase is not Phase.OPTIMIZER:
                return None
            outs = None if e.outputs is None else tuple(names.get(h, ("ext", h)) for h in e.outputs)
            prog.append(("op", e.op, e.module, e.call, outs, e.numel))
        elif kind is Alloc:
            assert isinstance(e, Alloc)
            prog.append(("alloc", names[e.storage], e.nbytes))
        elif kind is Free:
            assert isinstance(e, Free)
            c = names.get(e.storage, ("ext", e.storage))
            if c[0] in ("o", "ext"):
                return None  # a storage the replay does not own: its real death is not replayed
            if c[0] == "i":
                freed.add(c[1])
            prog.append(("free", c))
        elif kind is Tag:
            assert isinstance(e, Tag)
            prog.append(("tag", names.get(e.storage, ("ext", e.storage)), e.role, e.module))
        else:
            return None
    return tuple(prog), frozenset(range(count)) - freed


def allocation_sizes(prog: tuple[tuple[Any, ...], ...]) -> list[int]:
    return [ins[2] for ins in prog if ins[0] == "alloc" and ins[1][0] == "i"]


def constants(items: Sequence[Any]) -> tuple[Tensor | None, ...]:
    with torch._C._DisableTorchDispatch():
        return tuple(
            x.constant.clone() if isinstance(x, FakeTensor) and x.constant is not None else None
            for x in items
        )


class Loop:
    """One run of a loop over parameters: its iterations, in order."""

    def __init__(self, tracker: Tracker, lists: list[list[Any]], runs: dict[int, Run], order: list[int]):
        self.tracker = tracker
        self.lists, self.runs, self.order = lists, runs, order
        self.iters: list[Iteration] = []
        self.at: dict[int, int] = {}  # position -> index in iters
        self.end: int | None = None
        self.done: list[Run] = []
        self.pending: list[tuple[int, int]] | None = None  # the last stand-in's storages, for the next
        self.lengths_end: tuple[int, ...] = ()
        self.watch = {r.t1 + m for r in runs.values() for m in range(r.q)}

    def begin(self, it: Iteration) -> None:
        if it.position >= 0:
            self.at[it.position] = len(self.iters)
        self.iters.append(it)

    def events(self, r: int) -> list[Event]:
        stop = self.iters[r + 1].start if r + 1 < len(self.iters) else self.end
        return self.tracker.events[self.iters[r].start : stop]

    def internals(self, r: int) -> list[tuple[int, int]]:
        return [(e.storage, e.nbytes) for e in self.events(r) if isinstance(e, Alloc)]

    def prev(self, r: int) -> list[tuple[int, int]]:
        it = self.iters[r]
        if it.prev is not None:
            return it.prev
        return self.internals(r - 1) if r else []

    def own(self, position: int) -> tuple[int | None, ...]:
        handle = self.tracker.handle_of
        return tuple(
            handle(x) if isinstance(x, Tensor) else None for x in (lst[position] for lst in self.lists)
        )

    def program(self, position: int) -> Program | None:
        r = self.at.get(position)
        if r is None:
            return None
        own = self.own(position)
        held = [h for h in own if h is not None]
        if len(set(held)) != len(held):
            return None
        return program(self.events(r), own, self.prev(r))

    def facts(self, position: int) -> tuple[tuple[Any, ...], tuple[int | None, ...], tuple[Any, ...]]:
        """What an iteration's work depends on in its entries (their kinds, devices and layouts), and
        :meth:`own`, and the entries' constants (step counters), in one pass (asked of every stand-in)."""
        entry = self.tracker.handle_and_layout
        key: list[Any] = []
        own: list[int | None] = []
        consts: list[Any] = []
        for lst in self.lists:
            x = lst[position]
            if isinstance(x, Tensor):
                h, lay = entry(x)
                c = getattr(x, "constant", None)
                key.append((lay, c is None))
                own.append(h)
                consts.append(c)
            else:
                key.append(x is None)
                own.append(None)
                consts.append(None)
        return tuple(key), tuple(own), tuple(consts)

    def alike(self, template: int, key: tuple[Any, ...], facts: tuple[Any, ...]) -> bool:
        """Whether the stand-in's entries (their :meth:`facts`) are the template's (of ``key``) in all
        that its iteration depends on: layouts, step counters' values as the template's began, distinct
        storages."""
        mine, own, consts = facts
        if mine != key:
            return False
        held = [h for h in own if h is not None]
        tensors = len(key) - key.count(True) - key.count(False)  # (a tensor's entry is a tuple)
        if len(set(held)) != len(held) or len(held) != tensors:
            return False
        before = self.iters[self.at[template]].before
        for k, c in enumerate(consts):
            if c is None:
                continue
            was = before[k] if k < len(before) else None
            if was is None or not equal(c, was):
                return False
        return True

    def followconstants(self, template: int, consts: tuple[Any, ...]) -> None:
        """A stand-in's step counters (its :meth:`facts`' constants) take the values its template's
        iteration gave them (real tensors: copied below the modes)."""
        with below():
            for lst, c in zip(self.lists, consts, strict=True):
                if c is not None:
                    c.copy_(lst[template].constant)

    def templates(self, run: Run, extra: Callable[[int], Any] | None = None) -> list[Program] | None:
        """Block 1's iterations, equal to block 2's, each outliving storages the next one frees."""
        progs = []
        for m in range(run.q):
            a, b = self.program(run.t1 + m), self.program(run.t2 + m)
            if a is None or a != b:
                return None
            if extra is not None and extra(run.t1 + m) != extra(run.t2 + m):
                return None
            progs.append(a)
        return progs

    def check(self, extra: Callable[[int], Any] | None = None) -> None:
        """After the loop: block N-2's iterations are the template's (block 1's)."""
        for run in self.done:
            for m in range(run.q):
                a, b = self.program(run.t1 + m), self.program(run.stop + m)
                if a is None or a != b or (extra is not None and extra(run.t1 + m) != extra(run.stop + m)):
                    raise ReplayMismatch("an optimizer's update of a block differs from its template's")


def equal(a: Tensor, b: Tensor) -> bool:
    """Two constants' values compared as real tensors (below the modes: no op of the step)."""
    with below():
        if a.shape == b.shape and a.numel() == 1:  # a step counter: as torch.equal, a third of its time
            return bool(a.item() == b.item())
        return bool(torch.equal(a, b))
