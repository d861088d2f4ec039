"""The CPU allocator's events, read through ``torch.profiler``: the instrument behind the CPU ground truth
(``measure.py``) and the CPU calibration of kernels (``accounting/kernels/calibrate.py``).

PyTorch's CPU allocator reports every allocation and free to a profiler running with
``profile_memory=True``, with the block's address (the allocation events of the profile's event tree,
:meth:`CpuMemoryProfile.timeline`). Summed in time order they give the bytes the allocator holds above
what existed before profiling. Work to measure runs inside ``record_function(label)`` windows;
:func:`window_figures` reads, for each window, the running sum at its start, its highest point inside
and its value at the end. Cyclic garbage collection stays off while profiling (:func:`quiet_gc`).

A free counts only where the profile saw the block allocated, or where the caller named it resident
(counted in its baseline). The CPU allocator keeps the size of every block allocated while any
profiler ran, and forgets it only when the block is freed while a profiler runs: a block freed between
profiles leaves its size behind, and a later, unrelated block at the same address is then reported
freed with that stale size -- measured: a 4-byte free before the first step, one run in three, after
other profiled fits in the process.

Example:
    >>> import torch
    >>> from torch.profiler import record_function
    >>> with quiet_gc(), CpuMemoryProfile() as prof:
    ...     with record_function("work_0"):
    ...         kept = torch.empty(1024)       # 4 KiB kept
    ...         moment = torch.empty(2048)     # 8 KiB held a moment
    ...         del moment
    >>> w = window_figures(prof.timeline(), "work_", 1)[0]
    >>> w.peak_rise, w.end - w.start
    (12288, 4096)
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_memest.engine.collector import collector_off

__all__ = ["AllocatorTimeline", "CpuMemoryProfile", "Window", "quiet_gc", "window_figures"]


@dataclass(frozen=True)
class AllocatorTimeline:
    """What a finished profile says of the CPU allocator: each allocation (positive bytes) or free
    (negative) with the block's address, in time order, and each ``record_function`` window's span."""

    events: tuple[tuple[int, int, int], ...]
    """``(time_ns, bytes, address)``, in time order."""
    windows: Mapping[str, tuple[int, int]]
    """``name: (start_ns, end_ns)`` of each ``record_function`` window."""


class CpuMemoryProfile(profile):
    """A profiler of the CPU allocator's events (``profile_memory=True``)."""

    def __init__(self) -> None:
        super().__init__(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> CpuMemoryProfile:
        # torch 2.11's profiler warns once per process, when a profile starts, that it "clears events
        # at the end of each cycle": true and irrelevant here (one cycle per measurement), and it
        # would land in the middle of a CLI's or a fit's output.
        before = torch.empty(1)  # allocated before the profile: its free below primes a warning
        with warnings.catch_warnings(), _quiet_stderr():
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
            super().__enter__()  # type: ignore[no-untyped-call]
            # The CPU allocator warns once per process, from C++, at the first free of a block made
            # before a profile started (every measured step frees some): say it here, to no one.
            del before
        return self

    def __exit__(self, *exc: object) -> None:
        with _quiet_stderr():
            super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def timeline(self) -> AllocatorTimeline:
        """The finished profile's allocator events, with addresses, and its windows."""
        assert self.profiler is not None and self.profiler.kineto_results is not None
        events: list[tuple[int, int, int]] = []
        windows: dict[str, tuple[int, int]] = {}
        stack = list(self.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            fields = node.extra_fields
            if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):
                if fields.device.type == "cpu":
                    events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
            elif isinstance(fields, torch._C._profiler._ExtraFields_TorchOp):
                span = (node.start_time_ns, node.end_time_ns)
                windows[node.name] = min(windows.get(node.name, span), span)
        events.sort(key=lambda e: e[0])
        return AllocatorTimeline(tuple(events), windows)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Nothing written to the process's stderr (file descriptor 2) gets out while the profiler starts
    and stops: Kineto logs ``profiler_start``/``profiler_stop`` lines there each time, and on a machine
    without a GPU ``gpuGetDeviceCount failed`` once, from C++ (so neither ``sys.stderr`` nor logging
    can catch them; ``KINETO_LOG_LEVEL`` is read only when the process's first profile starts). Only
    these moments are silenced, not the work measured between them."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all (a daemon, pythonw): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def quiet_gc() -> Iterator[None]:
    """No cyclic garbage collection while profiling the CPU allocator.

    The profiler remembers the size of every block allocated while any profiler ran, and reports its
    free even in a later session. Garbage from earlier (an earlier measurement, a simulation's objects)
    collected in the middle of a window would then lower its running sum -- measured: the callback's
    first step read 24-30 % low after other profiled runs in one process. So: collect first, then keep
    the collector off until the work is measured; it is turned back on on every exit path.
    """
    gc.collect()
    with collector_off():
        yield


@dataclass(frozen=True)
class Window:
    """The allocator's running sum around one ``record_function`` window (bytes above the profile's
    start): at the window's start, at its highest point inside it, and at its end."""

    start: int
    peak: int
    end: int

    @property
    def peak_rise(self) -> int:
        """How far the running sum rose above its value at the window's start."""
        return self.peak - self.start


def window_figures(
    timeline: AllocatorTimeline, label: str, count: int, resident: Mapping[int, int] | None = None
) -> list[Window]:
    """The :class:`Window` of each of the ``count`` windows ``f"{label}{i}"``, in ``i`` order. The
    windows must not overlap; events between them carry over. A free counts where the profile saw the
    block allocated (at the size it was allocated with), or where ``resident`` (``address: bytes`` of
    blocks that existed before the profile, counted by the caller) names it; any other free is of a
    block the running sum never held (see the module docstring) and counts nothing."""
    missing = [i for i in range(count) if f"{label}{i}" not in timeline.windows]
    if missing:
        raise RuntimeError(f"the profiler recorded no window {label}{missing[0]} ({len(missing)} missing)")
    held_before = dict(resident or {})
    allocated: dict[int, int] = {}

    def change(nbytes: int, address: int) -> int:
        if nbytes > 0:
            allocated[address] = nbytes
            return nbytes
        size = allocated.pop(address, None)
        if size is None:
            size = held_before.pop(address, 0)
        return -size

    memory = timeline.events
    windows: list[Window] = []
    held = 0
    k = 0
    for i in range(count):
        start, end = timeline.windows[f"{label}{i}"]
        while k < len(memory) and memory[k][0] < start:
            held += change(memory[k][1], memory[k][2])
            k += 1
        at_start = peak = held
        while k < len(memory) and memory[k][0] <= end:
            held += change(memory[k][1], memory[k][2])
            peak = max(peak, held)
            k += 1
        windows.append(Window(at_start, peak, held))
    return windows
