"""Python's cyclic garbage collector during a simulation: off while its steps run
(:func:`collector_off`), and, for the walks around them, young collections run, full ones wait.

A simulation makes tens of thousands of long-lived objects (its events, the fake tensors' records)
while the process already holds hundreds of thousands (torch, the user's model and data). Python
collects the oldest generation when it has grown by a quarter, and such a full collection walks
every tracked object of the process: some 0.15 s on a 2-core machine with torch and a 64-layer
model loaded, paid by whichever simulation crosses the mark (a 64-layer decoder's did, an
8-layer one's did not). Inside :func:`full_collections_paused` the young generations are still
collected (what the step's own cycles leave behind is freed as it goes), and the full collection
that fell due runs after, at the collector's next young collection, as it would have later anyway.
The collector's settings are put back on every way out, and nothing changes where it is disabled,
nor on Python 3.14 and later, whose collector is incremental: it scans the old generation a slice at
a time, has no full collection to wait for, and ignores the third threshold.

Example:
    >>> import gc
    >>> before = gc.get_threshold()
    >>> with full_collections_paused():
    ...     pass
    >>> gc.get_threshold() == before
    True
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_off", "full_collections_paused"]

#: The oldest generation's threshold inside: more young collections than any simulation runs.
_NEVER = 1 << 30
#: Whether the collector has generations and full collections (before the incremental one of 3.14).
_GENERATIONAL = sys.version_info < (3, 14)


@contextmanager
def full_collections_paused() -> Iterator[None]:
    """Inside, Python's collector collects only its two young generations (the module's docstring)."""
    thresholds = gc.get_threshold()
    if (
        not _GENERATIONAL
        or not gc.isenabled()
        or thresholds[0] == 0
        or len(thresholds) < 3
        or thresholds[2] >= _NEVER
    ):
        yield  # incremental, disabled by the user, or paused already by an enclosing call
        return
    gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@contextmanager
def collector_off() -> Iterator[None]:
    """Inside, no cyclic collection at all: what a simulation's steps run under, as a measurement's run
    (``allocator_events.quiet_gc``). A collection that falls due in the middle of a step (the
    simulation's own objects make them fall due far more often than the run's) can leave a tensor's
    Python object owned by its C++ side, and with it the storage alive past its last use: measured on
    FSDP2 with compiled blocks, two 1 MiB activations never freed, +2.0 % at the steady state, in
    whichever process the collection fell in. The same for what must not see a collection: a
    measurement's window, the ops calibration runs, the accounting's walks. The collector is back on,
    as it was, on every way out; what ran inside left its cycles to be collected then.

    >>> import gc
    >>> with collector_off():
    ...     gc.isenabled()
    False
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
