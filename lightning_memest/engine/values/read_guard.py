"""A cap on assumed reads repeated at one line of code, so that no simulated loop runs forever.

Why: a loop whose exit depends on values the fake run does not have -- ``while not done.item():``,
a generation loop whose stopping criterion cannot become known -- gets the same assumed answer
(``engine.values.data_dependent``) every time it asks, and may never end where the real loop ends. The
estimate runs inside the user's training (a callback, a pre-check): it must fail, never hang.

Each read answered by an assumption (not one answered from real or exactly known values: a loop on those
repeats as the real one does) is counted per step at its call site -- the innermost frame of code that
is neither torch's nor the estimator's (the line of the user or library that reads). Past
:data:`READ_LIMIT` reads at one site in one step, the estimate fails with an ``EstimationError`` naming
the op, the module and the line. A generation loop that cannot tell whether its end-of-sequence token
came reads once per new token: the default admits 32,768 new tokens.

Example:
    >>> guard = ReadGuard(limit=2)
    >>> for _ in range(3):  # a loop whose condition reads an unknown value
    ...     guard.count("aten.is_nonzero.default", "", step=0)
    Traceback (most recent call last):
    ...
    lightning_memest.errors.EstimationError: aten.is_nonzero.default read a value ... 3 times at ...
"""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

from lightning_memest.errors import EstimationError

__all__ = ["READ_LIMIT", "ReadGuard", "call_site"]

#: The most assumed reads at one call site in one step (set it higher for longer generations).
READ_LIMIT = 1 << 15

#: Code whose frames are not a read's call site: torch's and the estimator's own.
_SKIPPED = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def call_site(frame: FrameType | None = None) -> str:
    """``file:line (function)`` of the innermost frame outside torch and the estimator (from the caller's
    frame by default), or ``"?"``."""
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_SKIPPED):
            return f"{name}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


class ReadGuard:
    """Counts assumed reads per call site and step; raises past the limit (:data:`READ_LIMIT` when none
    is given, read at each call so that it can be changed while running)."""

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self._step = -1
        self._counts: dict[str, int] = {}

    def count(self, op: str, module: str, step: int) -> None:
        """One assumed read of ``op`` inside ``module`` (``""``: outside any) in step ``step``."""
        if step != self._step:
            self._step, self._counts = step, {}
        site = call_site(sys._getframe(1))
        n = self._counts.get(site, 0) + 1
        self._counts[site] = n
        limit = self._limit if self._limit is not None else READ_LIMIT
        if n > limit:
            raise EstimationError(
                f"{op} read a value the fake run does not have {n} times at {site} in one step: a loop "
                f"that waits for it would not end here. If the real loop does run that long, raise "
                f"lightning_memest.engine.values.read_guard.READ_LIMIT (now {limit})",
                op=op,
                module=module,
            )
