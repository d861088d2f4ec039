"""The CPU allocator's events, read through ``torch.profiler``: the instrument behind the CPU ground truth
(``measure.py``) and the CPU calibration of kernels (``accounting/kernels/calibrate.py``).

PyTorch's CPU allocator reports every allocation and free to a profiler running with
``profile_memory=True``. The ``"[memory]"`` events of ``prof.profiler.kineto_results.events()``, sorted
by start time, summed in order (``nbytes`` is negative on a free), give the bytes the allocator holds
above what existed before profiling. Work to measure runs inside ``record_function(label)`` windows;
:func:`window_figures` reads, for each window, the running sum at its start, its highest point inside
and its value at the end. Cyclic garbage collection stays off while profiling (:func:`quiet_gc`).

Example:
    >>> import torch
    >>> from torch.profiler import record_function
    >>> with quiet_gc(), CpuMemoryProfile() as prof:
    ...     with record_function("work_0"):
    ...         kept = torch.empty(1024)       # 4 KiB kept
    ...         moment = torch.empty(2048)     # 8 KiB held a moment
    ...         del moment
    >>> w = window_figures(prof.allocator_events(), "work_", 1)[0]
    >>> w.peak_rise, w.end - w.start
    (12288, 4096)
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["CpuMemoryProfile", "Window", "quiet_gc", "window_figures"]


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

    def allocator_events(self) -> list[Any]:
        """Every event of the finished profile, the ``[memory]`` ones among them (kineto's list;
        ``events()`` of the profile itself holds only a few dozen memory events)."""
        assert self.profiler is not None and self.profiler.kineto_results is not None
        return list(self.profiler.kineto_results.events())


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
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


def window_figures(events: Iterable[Any], label: str, count: int) -> list[Window]:
    """The :class:`Window` of each of the ``count`` windows ``f"{label}{i}"``, in ``i`` order, from a
    profile's kineto events. The windows must not overlap; events between them carry over."""
    all_events = list(events)
    spans: dict[int, tuple[int, int]] = {}
    for e in all_events:
        name = e.name()
        if name.startswith(label) and name[len(label) :].isdigit():
            spans[int(name[len(label) :])] = (e.start_ns(), e.start_ns() + e.duration_ns())
    missing = [i for i in range(count) if i not in spans]
    if missing:
        raise RuntimeError(f"the profiler recorded no window {label}{missing[0]} ({len(missing)} missing)")
    memory = sorted(
        ((e.start_ns(), e.nbytes()) for e in all_events if e.name() == "[memory]"), key=lambda x: x[0]
    )
    windows: list[Window] = []
    held = 0
    k = 0
    for i in range(count):
        start, end = spans[i]
        while k < len(memory) and memory[k][0] < start:
            held += memory[k][1]
            k += 1
        at_start = peak = held
        while k < len(memory) and memory[k][0] <= end:
            held += memory[k][1]
            peak = max(peak, held)
            k += 1
        windows.append(Window(at_start, peak, held))
    return windows
