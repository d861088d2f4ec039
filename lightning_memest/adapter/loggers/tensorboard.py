"""The estimate in TensorBoard: the scalars as two runs, a custom-scalars layout, markdown tables and the
timeline figure (the HParams record is ``tensorboard_hparams.py``).

TensorBoard colours lines by run, not by tag: two tags of one run drawn on one chart differ only by
their markers. So an estimate and its measurement (``memest/peak_MiB/estimate`` and ``.../measured``
to other loggers) go to two runs inside the logger's own, ``memest/simulated`` and ``memest/measured``,
under one tag, ``memest/peak_MiB``: every scalar dashboard draws them on one chart, in two colours,
named in the legend. TensorBoard draws the run whose name sorts first on top: the measurement
(``measured`` < ``simulated``), a few points over the estimate's line of every logged step, so the
two read as two series where they agree. Everything else goes through Lightning's
``TensorBoardLogger`` as usual.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.tensorboard import SummaryWriter

from lightning_memest.adapter.loggers.markdown import breakdown_markdown, top_modules_markdown
from lightning_memest.adapter.loggers.scalars import (
    ERROR_PCT,
    PEAK_ESTIMATE,
    RESERVED_ESTIMATE,
)
from lightning_memest.adapter.loggers.timeline import timeline_figure
from lightning_memest.report import StepEstimate

__all__ = ["RUNS", "SERIES", "layout", "log_estimate", "log_scalars", "register_layout", "series_of"]

_LAYOUT_FLAG = "_memest_layout_registered"
_WRITERS = "_memest_series_writers"
#: The last part of a tag that names a series; each is a run of its own (``memest/<series>``).
SERIES = ("estimate", "measured")
#: The run of each series: the measurement's name sorts first, so TensorBoard draws it on top.
RUNS = {"estimate": "memest/simulated", "measured": "memest/measured"}


def series_of(tag: str) -> tuple[str, str] | None:
    """``(run, tag)`` of a series' scalar in TensorBoard, ``None`` for a scalar of the logger's run.

    >>> series_of("memest/peak_MiB/measured")
    ('memest/measured', 'memest/peak_MiB')
    >>> series_of("memest/peak_MiB/estimate")
    ('memest/simulated', 'memest/peak_MiB')
    """
    head, _, last = tag.rpartition("/")
    return (RUNS[last], head) if last in SERIES and head else None


def _series_writer(logger: TensorBoardLogger, run: str) -> SummaryWriter:
    """The writer of a run inside the logger's (one per logger and run, kept on the logger)."""
    writers: dict[str, SummaryWriter] = logger.__dict__.setdefault(_WRITERS, {})
    if run not in writers:
        writers[run] = SummaryWriter(os.path.join(logger.log_dir, run))
    return writers[run]


@rank_zero_only  # as Lightning's own log_metrics: the other ranks write nothing
def log_scalars(logger: TensorBoardLogger, scalars: Mapping[str, float], step: int) -> None:
    """The scalars at ``step``: each series' into its run, the others into the logger's."""
    own: dict[str, float] = {}
    used: set[SummaryWriter] = set()
    for name, value in scalars.items():
        place = series_of(name)
        if place is None:
            own[name] = value
            continue
        writer = _series_writer(logger, place[0])
        writer.add_scalar(place[1], value, global_step=step)
        used.add(writer)
    for writer in used:
        writer.flush()  # these writers are never closed by Lightning: nothing may wait in them
    if own:
        logger.log_metrics(own, step=step)


def _chart(tag: str) -> list[Any]:
    """A chart of one scalar and of its first step's (``memest/first_step/...``, where it has one: a
    series of its own, drawn beside the steady state's but never smoothed into it); a series' tag is
    matched in each of its runs (a regex: the whole tag)."""
    place = series_of(tag)
    head = place[1] if place else tag
    if head in (PEAK_ESTIMATE.rpartition("/")[0], RESERVED_ESTIMATE.rpartition("/")[0]):
        return ["Multiline", [f"^memest/(first_step/)?{head.removeprefix('memest/')}$"]]
    return ["Multiline", [f"^{head}$"]]


def layout(cuda: bool) -> dict[str, dict[str, list[Any]]]:
    """The memest category of the Custom Scalars tab: the memory charts (FLOPs, one constant per
    batch shape, are in the Scalars tab)."""
    charts = {"peak allocated (MiB): estimate vs measured": _chart(PEAK_ESTIMATE)}
    if cuda:
        charts["peak reserved (MiB): estimate vs measured"] = _chart(RESERVED_ESTIMATE)
    charts["estimate error (%)"] = _chart(ERROR_PCT)
    return {"memest": charts}


def register_layout(writer: Any, cuda: bool) -> None:
    """The layout, once: a writer takes one (a second call would add a second config)."""
    if getattr(writer, _LAYOUT_FLAG, False):
        return
    writer.add_custom_scalars(layout(cuda))
    setattr(writer, _LAYOUT_FLAG, True)


def log_estimate(
    logger: TensorBoardLogger, estimate: StepEstimate, measured: Sequence[int] | None, *, step: int
) -> None:
    """The layout, the tables and the timeline of ``estimate`` (with the measured peak of each step,
    once known) at ``step``: Lightning's step of the last batch they describe."""
    writer = logger.experiment
    register_layout(writer, cuda=estimate.reserved_bytes is not None)
    writer.add_text("memest/breakdown", breakdown_markdown(estimate, measured), global_step=step)
    writer.add_text("memest/top_modules", top_modules_markdown(estimate), global_step=step)
    writer.add_figure("memest/timeline", timeline_figure(estimate, measured), global_step=step)
