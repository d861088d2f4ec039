"""Allocator models: the event stream replayed into live bytes.

``replay`` is the exact model of an allocator that hands out what is asked for and takes it back at
once (PyTorch's CPU allocator): live bytes are the sum of the live storages' sizes, plus what kernel
models say real kernels allocate beyond the fake ones (under-reported outputs, transient workspaces).
``replay_caching_allocator`` feeds the same stream to the CUDA caching allocator model
(``accounting/cuda_allocator.py``) for the block-rounded allocated and the reserved peaks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.engine.events import Alloc, Event, Free, OpCall, OpEvent, Resize, Role, Tag
from lightning_memest.engine.step import Phase

ROLE_ORDER: tuple[Role, ...] = tuple(Role)
_TEMPORARY = len(ROLE_ORDER)  # the breakdown slot of storages with no role


class KernelEffect(Protocol):
    """What a kernel model reports (``accounting.kernels.KernelMemory``)."""

    @property
    def workspace_bytes(self) -> int: ...

    @property
    def workspace_after_outputs(self) -> bool: ...

    @property
    def extra_output_bytes(self) -> tuple[int, ...] | None: ...


KernelFn = Callable[[OpCall], KernelEffect | None]


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
    """Bytes per role in ``ROLE_ORDER``, then temporaries (storages with no role, and workspaces)."""
    event: OpEvent


@dataclass(frozen=True)
class Replay:
    samples: tuple[OpSample, ...]
    peaks: tuple[StepPeak, ...]
    roles: dict[int, Role]
    """The role of each storage handle that has one."""


def final_roles(events: Sequence[Event]) -> dict[int, Role]:
    """Each storage's role: of all tags it gets in the run, the first in ``ROLE_ORDER``."""
    rank = {role: i for i, role in enumerate(ROLE_ORDER)}
    roles: dict[int, Role] = {}
    for e in events:
        if type(e) is Tag:
            current = roles.get(e.storage)
            if current is None or rank[e.role] < rank[current]:
                roles[e.storage] = e.role
    return roles


class _Replayer:
    """Live bytes as the events go by; one instance per replay."""

    def __init__(self, roles: dict[int, Role], steps: int, kernel_fn: KernelFn | None) -> None:
        self.slot_of = {handle: ROLE_ORDER.index(role) for handle, role in roles.items()}
        self.kernel_fn = kernel_fn
        self.size: dict[int, int] = {}
        self.growth: dict[int, int] = {}  # outputs a kernel model says are larger than faked
        self.by_slot = [0] * (len(ROLE_ORDER) + 1)
        self.live = 0
        self.samples: list[OpSample] = []
        self.best: list[StepPeak | None] = [None] * steps
        self.op: OpEvent | None = None
        self.workspace = 0
        self.workspace_with_outputs = True
        self.op_high = 0

    def feed(self, e: Event) -> None:
        kind = type(e)
        if kind is Alloc:
            assert isinstance(e, Alloc)
            nbytes = e.nbytes + self.growth.pop(e.storage, 0)
            self.size[e.storage] = nbytes
            self.by_slot[self.slot_of.get(e.storage, _TEMPORARY)] += nbytes
            self.live += nbytes
            self._high(self.live + (self.workspace if self.workspace_with_outputs else 0))
        elif kind is Free:
            assert isinstance(e, Free)
            nbytes = self.size.pop(e.storage)
            self.by_slot[self.slot_of.get(e.storage, _TEMPORARY)] -= nbytes
            self.live -= nbytes
        elif kind is Resize:
            assert isinstance(e, Resize)
            delta = e.nbytes - self.size[e.storage]
            self.size[e.storage] = e.nbytes
            self.by_slot[self.slot_of.get(e.storage, _TEMPORARY)] += delta
            self.live += delta
            self._high(self.live)
        elif kind is OpEvent:
            assert isinstance(e, OpEvent)
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
            by_role[_TEMPORARY] += value - self.live  # the workspace held at this moment
            self.best[step] = StepPeak(step, value, tuple(by_role), op)

    def _close_op(self) -> None:
        if self.op is not None:
            self.samples.append(OpSample(self.op, self.op_high))
        self.op = None

    def finish(self) -> Replay:
        self._close_op()
        peaks = tuple(p for p in self.best if p is not None)
        return Replay(tuple(self.samples), peaks, {})


def replay(events: Sequence[Event], steps: int, kernel_fn: KernelFn | None = None) -> Replay:
    """Live bytes at every op's high point, and each step's peak with its breakdown by role.

    What ops of the setup phase (optimizer construction, DDP/FSDP wrapping) leave alive counts towards
    the first step; their transient high points do not (the step's measurement starts after them).
    """
    roles = final_roles(events)
    replayer = _Replayer(roles, steps, kernel_fn)
    for e in events:
        replayer.feed(e)
    result = replayer.finish()
    return Replay(result.samples, result.peaks, roles)


@dataclass(frozen=True)
class DevicePeaks:
    """Per-step peaks as a device allocator model counts them (what ``torch.cuda.max_memory_*`` say)."""

    allocated: tuple[int, ...]
    reserved: tuple[int, ...]


#: ``op name -> [(library, bytes)]``: the workspaces a CUDA op's libraries take at their first use.
LibraryWorkspace = Callable[[str], "Sequence[tuple[str, int]]"]


def replay_caching_allocator(
    events: Sequence[Event],
    steps: int,
    allocator: CudaCachingAllocator,
    kernel_fn: KernelFn | None = None,
    library_workspace: LibraryWorkspace | None = None,
) -> DevicePeaks:
    """Replay the events through ``allocator``; peak statistics reset at each step, as ``measure`` does.

    Every storage is one ``malloc`` (rounded, carved from segments, cached on ``free``), so
    ``allocated`` counts whole blocks and ``reserved`` the segments, unlike the exact ``replay``.
    A kernel's workspace is allocated after its outputs (or before, per the model) and freed before
    the next op. What lives before the first op (parameters, the batch) is allocated first. A library's
    workspace (``library_workspace(op_name)``: cuBLAS's at the first matmul, see
    ``accounting.cuda_device``) is allocated once and kept.
    """
    libraries: set[str] = set()
    handles: dict[int, int] = {}
    extra: dict[int, int] = {}
    allocated: list[int] = []
    reserved: list[int] = []
    step = 0
    setup = True
    workspace = 0  # the current op's, held once its outputs are allocated

    def close_workspace() -> None:
        nonlocal workspace
        if workspace:
            allocator.free(allocator.malloc(workspace))
            workspace = 0

    for e in events:
        kind = type(e)
        if workspace and kind is not Alloc:
            close_workspace()  # the op's outputs are all allocated, nothing freed yet: its high point
        if kind is Alloc:
            assert isinstance(e, Alloc)
            handles[e.storage] = allocator.malloc(e.nbytes + extra.pop(e.storage, 0))
        elif kind is Free:
            assert isinstance(e, Free)
            allocator.free(handles.pop(e.storage))
        elif kind is Resize:
            assert isinstance(e, Resize)
            allocator.free(handles.pop(e.storage))
            handles[e.storage] = allocator.malloc(e.nbytes)  # 0 bytes (FSDP's freed storages): no block
        elif kind is OpEvent:
            assert isinstance(e, OpEvent)
            if setup and e.phase is not Phase.SETUP:
                setup = False
                allocator.reset_peak_stats()  # as measure does once the model and optimizer are built
            for library, nbytes in library_workspace(e.op) if library_workspace is not None else ():
                if library not in libraries:
                    libraries.add(library)
                    allocator.malloc(nbytes)
            while e.step > step and step < steps - 1:
                allocated.append(allocator.peak_allocated_bytes)
                reserved.append(allocator.peak_reserved_bytes)
                allocator.reset_peak_stats()
                step += 1
            effect = kernel_fn(e.call) if kernel_fn is not None and e.call is not None else None
            if effect is not None:
                if effect.extra_output_bytes is not None and e.outputs is not None:
                    for handle, more in zip(e.outputs, effect.extra_output_bytes, strict=False):
                        extra[handle] = extra.get(handle, 0) + more
                if effect.workspace_after_outputs:
                    workspace = effect.workspace_bytes
                elif effect.workspace_bytes:
                    allocator.free(allocator.malloc(effect.workspace_bytes))
    close_workspace()
    allocated.append(allocator.peak_allocated_bytes)
    reserved.append(allocator.peak_reserved_bytes)
    return DevicePeaks(tuple(allocated), tuple(reserved))
