"""What checkpointing each candidate module would change, read from one simulation's event stream.

A module's activations -- the storages its forward allocates that are still alive when its forward
ends and die in its backward (what autograd saved) -- are alive from the end of its forward to the
start of its backward. Checkpointing the module takes them away over exactly that *window* and gives
them back while its backward runs (the forward runs again: its outputs, and for a moment its
temporaries). So the live bytes of a checkpointed run at any moment are the simulated run's, less the
activations of every checkpointed module whose window covers that moment, plus a recomputed module's
forward rise during its own backward. :func:`block_windows` reads, for each candidate and step:

* its window (op positions), the activations it would free -- all of them (full checkpointing), or
  those that selective checkpointing does not keep (the outputs of ``checkpointing.SAVED_OPS``) --,
  the rise of its forward, and the live bytes as its backward begins;
* the simulated run's live bytes, grouped by which candidates' windows cover them (the highest of each
  group is all a solver needs).

Measured against re-simulation on a 12-block decoder, for any set of checkpointed blocks: the peaks
predicted this way were within 0.05 % of the simulated ones, the gap the checkpoint's own saved RNG
state (:func:`rng_state_bytes`). The planner still re-simulates its plan; this is for choosing it.

Example:
    >>> import torch
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
    ...                               for _ in range(4)])
    >>> sim = simulate(model, torch.randn(64, 256), StepConfig())
    >>> w = block_windows(sim, ["0", "1", "2", "3"])
    >>> [c.freed["full"] for c in w.candidates]  # each block's GELU input, less the saved RNG state
    [60480, 60480, 60480, 60480]
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lightning_memest.accounting import live_bytes
from lightning_memest.accounting.kernels import Calibration
from lightning_memest.accounting.replay import LiveBytes, Observer, walk
from lightning_memest.engine.events import Alloc, Free, ModuleEnter, ModuleExit, OpEvent, Phase
from lightning_memest.engine.simulate import Simulation
from lightning_memest.plan.checkpointing import KINDS, CheckpointKind, saved_by_selective

__all__ = ["BlockWindows", "Candidate", "Region", "block_windows", "rng_state_bytes"]


def rng_state_bytes(sim: Simulation) -> int:
    """Bytes a checkpointed module keeps beside its inputs on the simulated device: the CPU generator's
    state (``torch.get_rng_state()``, 5,056 B), which non-reentrant checkpointing stashes to replay
    dropout; on CUDA that state lives on the host, not the device."""
    if sim.device.type != "cpu" or sim.what_if is not None:
        return 0
    return int(torch.get_rng_state().numel())


@dataclass(frozen=True)
class Candidate:
    """One module that could be checkpointed, as the simulation ran it."""

    path: str
    freed: dict[CheckpointKind, int]
    """Activation bytes each kind of checkpointing frees (the least over the steps; the saved RNG
    state already taken off)."""
    recompute_high: tuple[int, ...]
    """Per step: the live bytes while its forward runs again in backward, before any other module's
    checkpointing is taken off -- the simulated run's live bytes as its backward begins, less its
    activations, plus its forward's rise."""
    cover_at_recompute: tuple[frozenset[int], ...]
    """Per step: the candidates (by index) whose windows cover the start of its backward."""
    forward_end: tuple[int, ...]
    """Per step: the op position where its forward ended (the order of the candidates)."""
    transient: int = 0
    """The most its forward rises above the activations it keeps (its temporaries): what running it
    again in backward adds for a moment."""


@dataclass(frozen=True)
class Region:
    """The simulated run's highest live bytes over the moments of one step that the same candidates'
    windows cover."""

    step: int
    covered: frozenset[int]
    high: int


@dataclass(frozen=True)
class BlockWindows:
    candidates: tuple[Candidate, ...]
    regions: tuple[Region, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    """Candidates left out, with the reason (did not run once per step, had no backward, ...)."""
    steps: int = 1
    held_while_backward: int = 0
    """What a checkpointed module holds while its own backward runs that the windows do not count
    (its saved RNG state, :func:`rng_state_bytes`): at most one module's at a time."""


class _Window:
    __slots__ = ("backward_live", "bwd_end", "bwd_start", "fwd_end", "fwd_start", "live_start", "outputs")

    def __init__(self) -> None:
        self.fwd_start = self.fwd_end = self.bwd_start = self.bwd_end = -1
        self.live_start = self.backward_live = 0
        self.outputs: frozenset[int] = frozenset()


class _Reader(Observer):
    """Walks beside :class:`LiveBytes` (which it reads): the candidates' windows, every storage's life."""

    def __init__(self, live: LiveBytes, paths: Sequence[str], steps: int) -> None:
        self.live = live
        self.paths = set(paths)
        self.position = -1  # the current op's position (its index among the OpEvents)
        self.step = 0
        self.op = ""
        self.windows: dict[tuple[str, int], _Window] = {}
        self.runs: dict[tuple[str, int], int] = {}  # forward entries per module and step
        self.born: dict[int, tuple[int, str, int]] = {}  # storage -> (position, producing op, bytes)
        # (born, died, op, bytes, storage) of each freed storage
        self.lives: list[tuple[int, int, str, int, int]] = []
        self.pending: list[tuple[ModuleEnter, int]] = []
        self.steps = steps

    def on_op(self, e: OpEvent) -> None:
        self.position += 1
        self.step, self.op = e.step, e.op
        # A module's entry comes before its first op, which says the step (a step's first module is
        # entered before the step's first op): entered now, with the live bytes of the entry.
        for enter, live in self.pending:
            self._enter(enter, live)
        self.pending.clear()

    def on_alloc(self, e: Alloc) -> None:
        if not e.resident:
            self.born[e.storage] = (self.position, self.op, e.nbytes)

    def on_free(self, e: Free) -> None:
        born = self.born.pop(e.storage, None)
        if born is not None:
            self.lives.append((born[0], self.position, born[1], born[2], e.storage))

    def on_module_enter(self, e: ModuleEnter) -> None:
        if e.path in self.paths:
            self.pending.append((e, self.live.live))

    def _enter(self, e: ModuleEnter, live: int) -> None:
        key = (e.path, self.step)
        window = self.windows.setdefault(key, _Window())
        if e.phase is Phase.FORWARD:
            self.runs[key] = self.runs.get(key, 0) + 1
            window.fwd_start, window.live_start = self.position, live
        elif e.phase is Phase.BACKWARD and window.bwd_start < 0:
            window.bwd_start, window.backward_live = self.position, live

    def on_module_exit(self, e: ModuleExit) -> None:
        if e.path not in self.paths:
            return
        window = self.windows.get((e.path, self.step))
        if window is None:
            return
        if e.phase is Phase.FORWARD:
            window.fwd_end = self.position
            window.outputs = frozenset(e.outputs)
        elif e.phase is Phase.BACKWARD:
            window.bwd_end = self.position


def block_windows(
    sim: Simulation, paths: Sequence[str], calibration: Calibration | None = None
) -> BlockWindows:
    """The windows of the modules ``paths`` (qualified names) in ``sim``, and the simulated run's live
    bytes by the windows covering them (see the module docstring); ``calibration`` as the estimate's."""
    live = live_bytes(sim, calibration)
    reader = _Reader(live, paths, sim.steps)
    walk(sim.events, live, reader)
    samples = live.samples
    overhead = rng_state_bytes(sim)
    skipped: dict[str, str] = {}
    usable: list[str] = []
    for path in paths:
        keys = [(path, s) for s in range(sim.steps)]
        if any(reader.runs.get(k, 0) != 1 for k in keys):
            skipped[path] = "its forward did not run exactly once in each step"
        elif any(reader.windows[k].bwd_start < 0 or reader.windows[k].fwd_end < 0 for k in keys):
            # (no gradient reached it: frozen, or its output unused)
            skipped[path] = "it had no backward"
        else:
            usable.append(path)
    # Each storage's life, once: which window frees it (full, and selective where no saved op made it).
    freed: dict[tuple[str, int], dict[CheckpointKind, int]] = {}
    for path in usable:
        for s in range(sim.steps):
            freed[(path, s)] = dict.fromkeys(KINDS, 0)
    by_step: dict[int, list[tuple[str, _Window]]] = {
        s: [(p, reader.windows[(p, s)]) for p in usable] for s in range(sim.steps)
    }
    step_of_position = [sample.event.step for sample in samples]
    # A module whose inputs need no gradient (the first block, on the batch) never says its backward
    # ended: its window's backward runs to the end of the step.
    last = {step: t for t, step in enumerate(step_of_position)}
    for s_, ws in by_step.items():
        for _, w in ws:
            if w.bwd_end < 0:
                w.bwd_end = last.get(s_, w.bwd_start)
    # The window a storage was born in, by bisection over each step's windows in forward order.
    ordered = {s: sorted(ws, key=lambda pw: pw[1].fwd_start) for s, ws in by_step.items()}
    starts = {s: [w.fwd_start for _, w in ws] for s, ws in ordered.items()}
    kept: dict[tuple[str, int], int] = {}
    for born, died, op, nbytes, storage in reader.lives:
        if not 0 <= born < len(step_of_position):
            continue
        s = step_of_position[born]
        at = bisect.bisect_right(starts[s], born) - 1
        if at < 0:
            continue
        path, w = ordered[s][at]
        if born > w.fwd_end:
            continue
        saved = saved_by_selective(op)
        if storage in w.outputs:
            continue  # what the module returns lives on for its callers, checkpointed or not
        if died > w.fwd_end and w.bwd_start <= died <= w.bwd_end + 1:
            counts = freed[(path, s)]
            counts["full"] += nbytes
            if not saved:
                counts["selective"] += nbytes
        elif saved and died <= w.fwd_end:
            # Selective checkpointing keeps every output of its saved ops until backward, also those
            # the simulated run freed inside the forward.
            kept[(path, s)] = kept.get((path, s), 0) + nbytes
    index = {path: i for i, path in enumerate(usable)}
    candidates: list[Candidate] = []
    for path in usable:
        highs, covers, ends = [], [], []
        transient = 0
        for s in range(sim.steps):
            w = reader.windows[(path, s)]
            top = max((samples[t].live_bytes for t in range(w.fwd_start, w.fwd_end + 1)), default=0)
            rise = max(0, top - w.live_start)
            transient = max(transient, rise - freed[(path, s)]["full"])
            # (its own saved RNG state is still held as it runs again)
            highs.append(w.backward_live - freed[(path, s)]["full"] + rise + overhead)
            covers.append(
                frozenset(
                    index[p] for p, o in by_step[s] if o.fwd_end < w.bwd_start < o.bwd_start and p != path
                )
            )
            ends.append(w.fwd_end)
        amount: dict[CheckpointKind, int] = {
            "full": min(freed[(path, s)]["full"] for s in range(sim.steps)) - overhead,
            "selective": min(freed[(path, s)]["selective"] - kept.get((path, s), 0) for s in range(sim.steps))
            - overhead,
        }
        candidates.append(
            Candidate(path, amount, tuple(highs), tuple(covers), tuple(ends), max(0, transient))
        )
    return BlockWindows(tuple(candidates), _regions(samples, by_step, index), skipped, sim.steps, overhead)


def _regions(
    samples: Sequence[object], by_step: dict[int, list[tuple[str, _Window]]], index: dict[str, int]
) -> tuple[Region, ...]:
    """The highest live bytes of each step's moments by the set of windows covering them (a sweep: the
    set changes only where a window opens or closes)."""
    highs: dict[tuple[int, frozenset[int]], int] = {}
    changes: dict[int, list[tuple[int, int, bool]]] = {}  # step -> (position, candidate, opens)
    for s, windows in by_step.items():
        marks = changes.setdefault(s, [])
        for path, w in windows:
            marks.append((w.fwd_end + 1, index[path], True))
            marks.append((w.bwd_start, index[path], False))
        marks.sort()
    pointers = dict.fromkeys(changes, 0)
    covered: dict[int, set[int]] = {s: set() for s in changes}
    current: dict[int, frozenset[int]] = {s: frozenset() for s in changes}
    for t, sample in enumerate(samples):
        event = sample.event  # type: ignore[attr-defined]
        if event.phase is Phase.SETUP:
            continue
        s = event.step
        marks = changes.get(s, [])
        k = pointers.get(s, 0)
        moved = False
        while k < len(marks) and marks[k][0] <= t:
            _, i, opens = marks[k]
            (covered[s].add if opens else covered[s].discard)(i)
            k += 1
            moved = True
        if moved:
            pointers[s] = k
            current[s] = frozenset(covered[s])
        key = (s, current.get(s, frozenset()))
        value = sample.live_bytes  # type: ignore[attr-defined]
        if value > highs.get(key, -1):
            highs[key] = value
    return tuple(Region(s, c, h) for (s, c), h in highs.items())
