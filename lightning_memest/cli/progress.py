"""Progress of long commands on stderr: one line that says what runs now, cleared when it is done.

Shown only where someone watches: stderr is a terminal and the command prints a table (not
``--json``). Anywhere else (a pipe, a file, CI, a script reading ``--json``) it says nothing, so
stderr keeps only errors and notes. With Rich installed the line is Rich's (a spinner, the time
elapsed, a bar for several models); without, a plain line rewritten in place.

Example:
    >>> with Progress(enabled=False) as progress:  # not a terminal: silent
    ...     progress.update("estimating torch.nn:Linear")
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "watched"]


def watched(json_output: bool, stream: TextIO | None = None) -> bool:
    """Whether progress is worth showing: a person reads ``stream`` (stderr), and the output is a table."""
    stream = sys.stderr if stream is None else stream
    return not json_output and stream.isatty()


class Progress:
    """One line of progress on stderr (see the module docstring).

    Args:
        enabled: show anything at all (:func:`watched`).
        total: the number of items (models) the command works through, for an ``i/total`` bar.
        threads: let Rich refresh the line from a thread of its own (its spinner and clock move while
            a long estimate runs). The batch-size search forks its worker only in a process with no
            other thread, so it asks for none. Either way the line is redrawn at each :meth:`update`.
    """

    def __init__(self, enabled: bool, *, total: int | None = None, threads: bool = True) -> None:
        self.enabled = enabled
        self._total = total
        self._threads = threads
        self._started = time.perf_counter()
        self._rich: Any = None
        self._task: Any = None
        self._shown = False

    def __enter__(self) -> Progress:
        if self.enabled and importlib.util.find_spec("rich") is not None:
            self._rich, self._task = _rich_progress(self._total, self._threads)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def update(self, text: str, done: int | None = None) -> None:
        """Say what runs now (``done``: items finished so far, of ``total``)."""
        if not self.enabled:
            return
        if self._rich is not None:
            # Drawn now, not at the refresh thread's next tick: a stage shorter than a tick is shown too.
            self._rich.update(self._task, description=text, completed=done, refresh=True)
            return
        count = f"[{done + 1}/{self._total}] " if done is not None and self._total else ""  # the one running
        seconds = time.perf_counter() - self._started
        line = f"memest: {count}{text} ({seconds:.0f} s)"
        width = shutil.get_terminal_size().columns - 1
        sys.stderr.write("\r" + line[:width] + "\x1b[K")  # rewrite the line in place, then clear its rest
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        """Clear the line (the command's output follows on stdout)."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        elif self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._shown = False


def _rich_progress(total: int | None, threads: bool) -> tuple[Any, Any]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as RichProgress

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total:
        columns += [BarColumn(bar_width=20), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    progress = RichProgress(*columns, console=Console(stderr=True), transient=True, auto_refresh=threads)
    task = progress.add_task("", total=total)
    progress.start()
    return progress, task
