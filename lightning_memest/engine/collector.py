"""Python's cyclic garbage collector during a simulation: young collections run, full ones wait.

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

__all__ = ["full_collections_paused"]

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
