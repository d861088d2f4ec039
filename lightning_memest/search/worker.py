"""The batch-size search's worker process: probes in pairs on a machine with two cores.

A worker is forked when the search starts (before its own first probe) and answers one probe while
the search runs another. Forking is safe only in a process without a CUDA context, other threads or a
process group (:func:`can_fork`), and the child says at once whether it can run backward. A peak model
with a say in how it runs there (:class:`ProbeModel`: the calibrated search's) prepares itself here
and sends the worker what it needs with each probe.

Example:
    >>> worker = start_worker(lambda n: 1000 + 37 * n)
    >>> if worker is not None:  # None where forking is unsafe
    ...     worker.submit(8)
    ...     assert worker.answer() == 1296
    ...     worker.close()
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_memest.accounting import PeakProfile

__all__ = ["ProbeModel", "Worker", "can_fork", "start_worker"]


@runtime_checkable
class ProbeModel(Protocol):
    """A peak model with a say in how the search runs it (:class:`CalibratedPeaks`): a plain
    ``peak_of(n)`` is one too, with nothing to prepare or share."""

    def __call__(self, n: int) -> int | PeakProfile: ...

    def prepare(self) -> tuple[dict[int, PeakProfile], bool]:
        """Run here once the worker is forked: probes already answered, and whether the worker may
        answer probes."""
        ...

    def share(self) -> object:
        """What the worker needs for its next probe (sent with it)."""
        ...

    def receive(self, shared: Any) -> None:
        """In the worker: what :meth:`share` sent."""
        ...

    def finish(self, answer: int | PeakProfile) -> int | PeakProfile:
        """Here: the worker's answer made final."""
        ...


def can_fork() -> bool:
    """Whether probes may run in forked processes here: Linux, no CUDA context, no other Python
    thread and no process group in this process (forking any of those is unsafe)."""
    return (
        sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        and threading.active_count() == 1
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    )


def start_worker(peak_of: Callable[[int], int | PeakProfile]) -> Worker | None:
    """A worker for the search, or ``None`` where forking is unsafe or the child cannot run backward
    (autograd refuses in a child forked after this process started its device threads for other
    devices: the worker is forked before the search's own first probe, and says at once whether it
    can)."""
    if not can_fork():
        return None
    worker = Worker(peak_of)
    if worker.ready:
        return worker
    worker.close()
    return None


class Worker:
    """A forked process that answers probes for the search (``None`` for one it could not answer)."""

    def __init__(self, peak_of: Callable[[int], int | PeakProfile]) -> None:
        self._model = peak_of if isinstance(peak_of, ProbeModel) else None
        ctx = multiprocessing.get_context("fork")
        self._conn, child_end = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(peak_of, child_end), daemon=True)
        self._process.start()
        child_end.close()
        self.ready = self.result() == 0  # the child's first answer: whether it can run backward

    def submit(self, n: int) -> None:
        self._conn.send((n, self._model.share() if self._model is not None else None))

    def answer(self) -> int | PeakProfile | None:
        """The answer to the probe submitted, made final here (a :class:`ProbeModel`'s ``finish``)."""
        answer = self.result()
        if answer is None or self._model is None:
            return answer
        try:
            return self._model.finish(answer)
        except Exception:
            return None  # the search probes that size here instead

    def result(self) -> int | PeakProfile | None:
        try:
            answer: int | PeakProfile | None = self._conn.recv()
        except (EOFError, OSError):
            return None
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()


def _serve(peak_of: Callable[[int], int | PeakProfile], conn: Any) -> None:
    # A child forked after the parent started autograd's threads for other devices than the CPU cannot
    # run backward (the engine settles them first, engine/autograd_threads.py, but a process may have
    # started them itself): say so at once; the search runs alone.
    try:
        torch.ones(1, device="meta", requires_grad=True).sum().backward()  # type: ignore[no-untyped-call]
    except RuntimeError:
        conn.send(None)
        return
    conn.send(0)
    while (message := conn.recv()) is not None:
        n, shared = message
        try:
            if isinstance(peak_of, ProbeModel):
                peak_of.receive(shared)
            answer = peak_of(n)
        except BaseException:
            answer = None
        conn.send(answer)
