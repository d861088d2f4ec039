"""The estimate in the trainer's loggers, beyond the scalars every logger takes: one file per logger
kind, each behind one function ``log_estimate(logger, estimate, measured, final=...)``; add a logger
by adding its file and its line in ``_WRITERS``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning.pytorch.loggers import Logger, TensorBoardLogger

from lightning_memest.adapter.loggers import tensorboard
from lightning_memest.report import StepEstimate

__all__ = ["log_figures"]

_Writer = Callable[..., None]
#: (logger class, its writer): the writer gets ``(logger, estimate, measured, final=...)``.
_WRITERS: tuple[tuple[type[Logger], _Writer], ...] = ((TensorBoardLogger, tensorboard.log_estimate),)


def log_figures(
    loggers: Iterable[Any], estimate: StepEstimate, measured: Sequence[int] | None, *, final: bool
) -> None:
    """The estimate (and, when ``final``, the measured peaks per step) in each logger that knows how."""
    for logger in loggers:
        for kind, write in _WRITERS:
            if isinstance(logger, kind):
                write(logger, estimate, measured, final=final)
