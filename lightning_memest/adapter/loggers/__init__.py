"""The estimate in the trainer's loggers.

``scalars.py`` names the scalars every logger gets (human units, at Lightning's steps); a logger kind
that shows more has a file of its own behind ``log_scalars(logger, scalars, step)``,
``log_estimate(logger, estimate, measured, step=...)`` and ``log_hparams(logger, trainer)``: add one
by adding its file and its line in ``_WRITERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger

from lightning_memest.adapter.loggers import tensorboard, tensorboard_hparams
from lightning_memest.adapter.package import lightning_classes
from lightning_memest.report import StepEstimate

__all__ = ["log_figures", "log_hparams", "log_scalars"]

_Writer = Callable[..., None]
#: (logger class name, as ``adapter.package`` looks it up in either Lightning package; its scalars,
#: figures and hparams writers).
_WRITERS: tuple[tuple[str, _Writer, _Writer, _Writer], ...] = (
    ("TensorBoardLogger", tensorboard.log_scalars, tensorboard.log_estimate, tensorboard_hparams.log_hparams),
)


def log_scalars(loggers: Iterable[Logger], scalars: Mapping[str, float], step: int) -> None:
    """The scalars (``scalars.py``) in every logger, at Lightning's ``step``."""
    for logger in loggers:
        write = next((w for kind, w, _, _ in _WRITERS if isinstance(logger, lightning_classes(kind))), None)
        if write is not None:
            write(logger, scalars, step)
        else:
            logger.log_metrics(dict(scalars), step=step)


def log_figures(
    loggers: Iterable[Any], estimate: StepEstimate, measured: Sequence[int] | None, *, step: int
) -> None:
    """The estimate's tables and figures (with the measured peak of each step, once known) in each
    logger that knows how, at Lightning's ``step``."""
    for logger in loggers:
        for kind, _, write, _ in _WRITERS:
            if isinstance(logger, lightning_classes(kind)):
                write(logger, estimate, measured, step=step)


def log_hparams(trainer: pl.Trainer) -> None:
    """The memest metrics in each logger's hyperparameter view (at ``on_fit_start``, rank 0)."""
    for logger in trainer.loggers:
        for kind, _, _, write in _WRITERS:
            if isinstance(logger, lightning_classes(kind)):
                write(logger, trainer)
