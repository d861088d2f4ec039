"""One walker over the event stream, with observers: roles, live bytes, and the CUDA caching allocator.

Every figure of an estimate is derived from one stream of events (``engine.events``). :func:`walk`
hands each event to the observers that want its kind (an :class:`Observer` overrides the ``on_*``
methods of the events it needs), so any number of accountings share one pass and none writes its own
dispatch. The observers here are the allocator models:

* :class:`Roles` -- each storage's role (what :func:`final_roles` returns), needed before live bytes
  can be split by role: a first pass;
* :class:`LiveBytes` -- the exact model of an allocator that hands out what is asked for and takes it
  back at once (PyTorch's CPU allocator): live bytes are the sum of the live storages' sizes, plus what
  kernel models say real kernels allocate beyond the fake ones; each op's high point, and each step's
  peak with its breakdown by role;
* :class:`CachingAllocatorReplay` -- the same stream through the CUDA caching allocator model
  (``accounting/cuda_allocator.py``): block-rounded allocated and reserved peaks per step.

FLOPs (``accounting/flops``) and per-module / per-node figures (``accounting/attribution.py``) are
observers too.

Example:
    >>> from lightning_memest.engine.events import Alloc, Free, OpEvent, Phase
    >>> events = [OpEvent(0, 0, Phase.FORWARD, "", "aten.relu.default", None, None), Alloc(0, 64),
    ...           OpEvent(1, 0, Phase.FORWARD, "", "aten.relu.default", None, None), Alloc(1, 32), Free(0)]
    >>> live = LiveBytes(final_roles(events), steps=1)
    >>> walk(events, live)
    >>> [s.live_bytes for s in live.samples], live.peaks[0].live_bytes
    ([64, 96], 96)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.accounting.kernels import KernelFn
from lightning_memest.engine.events import (
    Alloc,
    DataDependent,
    Event,
    Free,
    Mark,
    ModuleEnter,
    ModuleExit,
    OpEvent,
    Phase,
    PhaseStart,
    Resize,
    Role,
    Tag,
)

__all__ = [
    "ROLE_ORDER",
    "CachingAllocatorReplay",
    "DevicePeaks",
    "LibraryWorkspace",
    "LiveBytes",
    "Observer",
    "OpSample",
    "Roles",
    "StepPeak",
    "final_roles",
    "walk",
]

ROLE_ORDER: tuple[Role, ...] = tuple(Role)
_TEMPORARY = len(ROLE_ORDER)  # the breakdown slot of storages with no role
_WORKSPACE = _TEMPORARY + 1  # the slot of the kernel workspace held at that moment (no storage of its own)


class Observer:
    """Something :func:`walk` feeds: override the methods of the events it needs (the others are
    never called), and read the result from the observer once the walk is over."""

    def on_op(self, e: OpEvent) -> None: ...
    def on_alloc(self, e: Alloc) -> None: ...
    def on_free(self, e: Free) -> None: ...
    def on_resize(self, e: Resize) -> None: ...
    def on_tag(self, e: Tag) -> None: ...
    def on_module_enter(self, e: ModuleEnter) -> None: ...
    def on_module_exit(self, e: ModuleExit) -> None: ...
    def on_data_dependent(self, e: DataDependent) -> None: ...
    def on_mark(self, e: Mark) -> None: ...
    def on_phase_start(self, e: PhaseStart) -> None: ...
    def finish(self) -> None:
        """Called once after the last event."""


_HANDLERS: dict[type, str] = {
    OpEvent: "on_op",
    Alloc: "on_alloc",
    Free: "on_free",
    Resize: "on_resize",
    Tag: "on_tag",
    ModuleEnter: "on_module_enter",
    ModuleExit: "on_module_exit",
    DataDependent: "on_data_dependent",
    Mark: "on_mark",
    PhaseStart: "on_phase_start",
}


def walk(events: Sequence[Event], *observers: Observer) -> None:
    """Feed ``events`` in order to ``observers`` (each event to the observers that handle its kind, in
    the order given), then call their ``finish``."""
    table: dict[type, list[Callable[[Event], None]]] = {}
    for kind, name in _HANDLERS.items():
        base = getattr(Observer, name)
        calls = [getattr(o, name) for o in observers if getattr(type(o), name) is not base]
        if calls:
            table[kind] = calls
    single = {kind: calls[0] for kind, calls in table.items() if len(calls) == 1}
    many = {kind: calls for kind, calls in table.items() if len(calls) > 1}
    for e in events:
        kind = type(e)
        call = single.get(kind)
        if call is not None:
            call(e)
        elif kind in many:
            for fn in many[kind]:
                fn(e)
    for o in observers:
        o.finish()


# ------------------------------------------------------------------------------------------- roles


class Roles(Observer):
    """Each storage's role: of all tags it gets in the run, the first in ``ROLE_ORDER``."""

    def __init__(self) -> None:
        self._rank = {role: i for i, role in enumerate(ROLE_ORDER)}
        self.roles: dict[int, Role] = {}

    def on_tag(self, e: Tag) -> None:
        current = self.roles.get(e.storage)
        if current is None or self._rank[e.role] < self._rank[current]:
            self.roles[e.storage] = e.role


def final_roles(events: Sequence[Event]) -> dict[int, Role]:
    """The role of each storage handle that has one (a walk with :class:`Roles`)."""
    roles = Roles()
    walk(events, roles)
    return roles.roles


# -------------------------------------------------------------------------------------- live bytes


@dataclass(frozen=True)
class OpSample:
    """Live bytes at one op's high point (its outputs and workspace allocated, nothing freed yet)."""

    event: OpEvent
    live_bytes: int


@dataclass(frozen=True)
class StepPeak:
    step: int
    """0-based index of the simulated step."""
    live_bytes: int
    by_role: tuple[int, ...]
    """Bytes per role in ``ROLE_ORDER``, then temporaries (storages with no role), then the kernel
    workspace held at that moment."""
    event: OpEvent


class LiveBytes(Observer):
    """Live bytes as the events go by: every op's high point (:attr:`samples`) and each step's peak
    with its breakdown by role (:attr:`peaks`).

    What ops of the setup phase (optimizer construction, DDP/FSDP wrapping) leave alive counts towards
    the first step; their transient high points do not (the step's measurement starts after them).
    """

    def __init__(self, roles: dict[int, Role], steps: int, kernel_fn: KernelFn | None = None) -> None:
        self.slot_of = {handle: ROLE_ORDER.index(role) for handle, role in roles.items()}
        self.kernel_fn = kernel_fn
        self.size: dict[int, int] = {}
        self.growth: dict[int, int] = {}  # outputs a kernel model says are larger than faked
        self.by_slot = [0] * (len(ROLE_ORDER) + 2)
        self.live = 0
        self.samples: list[OpSample] = []
        self.best: list[StepPeak | None] = [None] * steps
        self.op: OpEvent | None = None
        self.workspace = 0
        self.workspace_with_outputs = True
        self.op_high = 0

    @property
    def peaks(self) -> tuple[StepPeak, ...]:
        """Each simulated step's peak (after :meth:`finish`)."""
        return tuple(p for p in self.best if p is not None)

    def on_alloc(self, e: Alloc) -> None:
        nbytes = e.nbytes + self.growth.pop(e.storage, 0)
        self.size[e.storage] = nbytes
        self.by_slot[self.slot_of.get(e.storage, _TEMPORARY)] += nbytes
        self.live += nbytes
        self._high(self.live + (self.workspace if self.workspace_with_outputs else 0))

    def on_free(self, e: Free) -> None:
        nbytes = self.size.pop(e.storage)
        self.by_slot[self.slot_of.get(e.storage, _TEMPORARY)] -= nbytes
        self.live -= nbytes

    def on_resize(self, e: Resize) -> None:
        delta = e.nbytes - self.size[e.storage]
        self.size[e.storage] = e.nbytes
        self.by_slot[self.slot_of.get(e.storage, _TEMPORARY)] += delta
        self.live += delta
        self._high(self.live)

    def on_op(self, e: OpEvent) -> None:
        self._close_op()
        self.op = e
        self.workspace, self.workspace_with_outputs = 0, True
        effect = self.kernel_fn(e.call) if self.kernel_fn is not None and e.call is not None else None
        if effect is not None:
            self.workspace = effect.workspace_bytes
            self.workspace_with_outputs = effect.workspace_after_outputs
            if effect.extra_output_bytes is not None and e.outputs is not None:
                for handle, extra in zip(e.outputs, effect.extra_output_bytes, strict=False):
                    if extra:
                        self.growth[handle] = self.growth.get(handle, 0) + extra
        elif e.workspace:  # measured where the op ran for real
            self.workspace = e.workspace
        self.op_high = -1
        self._high(self.live + self.workspace)

    def _high(self, value: int) -> None:
        op = self.op
        if op is None or value <= self.op_high:
            return
        self.op_high = value
        if op.phase is Phase.SETUP:
            return  # building the optimizer or a DDP/FSDP wrapper happens before the step is measured
        step = op.step if op.step < len(self.best) else len(self.best) - 1
        best = self.best[step]
        if best is None or value > best.live_bytes:
            by_role = list(self.by_slot)
            by_role[_WORKSPACE] = value - self.live  # the op's workspace, held beside the live storages
            self.best[step] = StepPeak(step, value, tuple(by_role), op)

    def _close_op(self) -> None:
        if self.op is not None:
            self.samples.append(OpSample(self.op, self.op_high))
        self.op = None

    def finish(self) -> None:
        self._close_op()


# ---------------------------------------------------------------------------- the caching allocator


@dataclass(frozen=True)
class DevicePeaks:
    """Per-step peaks as a device allocator model counts them (what ``torch.cuda.max_memory_*`` say)."""

    allocated: tuple[int, ...]
    reserved: tuple[int, ...]


#: ``op name -> [(library, bytes)]``: the workspaces a CUDA op's libraries take at their first use.
LibraryWorkspace = Callable[[str], "Sequence[tuple[str, int]]"]


class CachingAllocatorReplay(Observer):
    """The events through ``allocator``; peak statistics reset at each step, as ``measure`` does.

    Every storage is one ``malloc`` (rounded, carved from segments, cached on ``free``), so
    ``allocated`` counts whole blocks and ``reserved`` the segments, unlike :class:`LiveBytes`.
    A kernel's workspace is allocated after its outputs (or before, per the model) and freed before
    the next op. What lives before the first op (parameters, the batch) is allocated first. A library's
    workspace (``library_workspace(op_name)``: cuBLAS's at the first matmul, see
    ``accounting.cuda_device``) is allocated once and kept. :attr:`peaks` after the walk.
    """

    def __init__(
        self,
        allocator: CudaCachingAllocator,
        steps: int,
        kernel_fn: KernelFn | None = None,
        library_workspace: LibraryWorkspace | None = None,
    ) -> None:
        self.allocator = allocator
        self.steps = steps
        self.kernel_fn = kernel_fn
        self.library_workspace = library_workspace
        self.libraries: set[str] = set()
        self.handles: dict[int, int] = {}
        self.extra: dict[int, int] = {}
        self.allocated: list[int] = []
        self.reserved: list[int] = []
        self.step = 0
        self.setup = True
        self.workspace = 0  # the current op's, held once its outputs are allocated
        self.last_op: OpEvent | None = None
        self.out_of_memory_at: tuple[OpEvent | None, int] | None = None
        """The op (and step) during which the allocator first ran out of its capacity, if it did."""

    @property
    def peaks(self) -> DevicePeaks:
        return DevicePeaks(tuple(self.allocated), tuple(self.reserved))

    def _close_workspace(self) -> None:
        # The op's outputs are all allocated and nothing is freed yet: its high point.
        if self.workspace:
            self.allocator.free(self.allocator.malloc(self.workspace))
            self.workspace = 0

    def on_alloc(self, e: Alloc) -> None:
        self.handles[e.storage] = self.allocator.malloc(e.nbytes + self.extra.pop(e.storage, 0))

    def on_free(self, e: Free) -> None:
        self._close_workspace()
        self.allocator.free(self.handles.pop(e.storage))

    def on_resize(self, e: Resize) -> None:
        self._close_workspace()
        self.allocator.free(self.handles.pop(e.storage))
        # 0 bytes (FSDP's freed storages): no block.
        self.handles[e.storage] = self.allocator.malloc(e.nbytes)

    def _other(self, e: Event) -> None:
        self._close_workspace()

    on_tag = on_module_enter = on_module_exit = on_data_dependent = on_mark = _other

    def _note_out_of_memory(self) -> None:
        if self.out_of_memory_at is None and self.allocator.out_of_memory is not None:
            self.out_of_memory_at = (self.last_op, self.step)

    def on_op(self, e: OpEvent) -> None:
        self._close_workspace()
        self._note_out_of_memory()  # (during the op before: its outputs, frees, workspace)
        self.last_op = e
        allocator = self.allocator
        if self.setup and e.phase is not Phase.SETUP:
            self.setup = False
            allocator.reset_peak_stats()  # as measure does once the model and optimizer are built
        for library, nbytes in self.library_workspace(e.op) if self.library_workspace is not None else ():
            if library not in self.libraries:
                self.libraries.add(library)
                allocator.malloc(nbytes)
        while e.step > self.step and self.step < self.steps - 1:
            self.allocated.append(allocator.peak_allocated_bytes)
            self.reserved.append(allocator.peak_reserved_bytes)
            allocator.reset_peak_stats()
            self.step += 1
        effect = self.kernel_fn(e.call) if self.kernel_fn is not None and e.call is not None else None
        if effect is not None:
            if effect.extra_output_bytes is not None and e.outputs is not None:
                for handle, more in zip(e.outputs, effect.extra_output_bytes, strict=False):
                    self.extra[handle] = self.extra.get(handle, 0) + more
            if effect.workspace_after_outputs:
                self.workspace = effect.workspace_bytes
            elif effect.workspace_bytes:
                allocator.free(allocator.malloc(effect.workspace_bytes))
        elif e.workspace:  # measured where the op ran for real
            self.workspace = e.workspace

    def finish(self) -> None:
        self._close_workspace()
        self._note_out_of_memory()
        self.allocated.append(self.allocator.peak_allocated_bytes)
        self.reserved.append(self.allocator.peak_reserved_bytes)
