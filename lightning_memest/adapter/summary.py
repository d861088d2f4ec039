"""The estimate in Lightning's model summary: extra columns per layer and footer lines.

Lightning's summary is a list of ``(header, [cell per layer])`` columns (``ModelSummary._get_summary_data``)
rendered as a plain table, or with Rich when it is installed (the way Lightning picks its default
summary callback). The estimate adds, per layer: the activation bytes saved for backward, and the
forward and backward FLOPs of the training batch; and below the table the estimated peaks with their
breakdown. Lightning's own ``FLOPs`` column (forward only, for ``example_input_array`` only, ``0``
without one) gives way to them, and its "Total FLOPs" line shows the estimate's forward FLOPs.

The plain table goes where Lightning's plain summary goes: an INFO record of Lightning's
``lightning.pytorch.callbacks.model_summary`` logger, which Lightning gives a console handler unless
the user configured logging -- so it is shown, and silenced, exactly as Lightning's is.

It is printed at the first training batch, while the progress bar is on the screen: through the bar
(tqdm's bars cleared and redrawn around it; Rich's live display prints it above itself), so that the
two never interleave. It fits the console's width (``COLUMNS``, Rich's console): the units are in the
headers, so a cell is a number, no cell wraps, and where the table is still too wide the columns that
matter least are left out (:data:`DROP_ORDER`), as the footnote says; the lines below the table wrap
between figures, never between a number and its unit.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.callbacks import model_summary as lightning_summary
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)
from lightning_utilities.core.imports import RequirementCache

from lightning_memest.adapter.package import lightning_classes
from lightning_memest.report import ModuleStats, StepEstimate, format_bytes, human_flops

__all__ = [
    "DROP_ORDER",
    "RICH_AVAILABLE",
    "SAVED_HEADER",
    "estimate_columns",
    "fit_columns",
    "footer_items",
    "loop_footer_items",
    "render_summary",
    "restore_summaries",
    "show_summary",
    "silence_other_summaries",
    "total_flops",
    "with_estimate",
    "wrap_line",
]

#: Whether Rich is installed, as Lightning decides it when it picks ``RichModelSummary`` by default
#: (its own flag moved between releases; the requirement is the same).
RICH_AVAILABLE = RequirementCache("rich>=10.2.2")

Column = tuple[str, list[str]]

#: The estimate's columns' headers, each followed by its unit (``Saved MiB``, ``Fwd GFLOP``).
SAVED_HEADER = "Saved"
FORWARD_HEADER = "Fwd"
BACKWARD_HEADER = "Bwd"
#: Lightning's per-layer FLOPs column, which the estimate's columns replace.
LIGHTNING_FLOPS_HEADER = "FLOPs"
#: Where the table is wider than the console, columns are left out in this order (by header's first
#: word); ``Name`` and the saved bytes always stay.
DROP_ORDER = ("Mode", " ", "In", "Out", "Type", "Params", BACKWARD_HEADER, FORWARD_HEADER)
#: What the estimate's columns mean, under the table.
FOOTNOTE = (
    "Saved: what the layer's outputs keep alive for backward (a saved tensor counts for the layer that "
    "made it: a Linear's saved input shows on the layer before). Fwd, Bwd: 2 x MACs of one training step."
)

_BYTE_UNITS = (("B", 1), ("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3), ("TiB", 1024**4))
_FLOP_UNITS = (("FLOP", 1), ("KFLOP", 10**3), ("MFLOP", 10**6), ("GFLOP", 10**9), ("TFLOP", 10**12))


def silence_other_summaries(
    callbacks: Iterable[Callback], keeper: ModelSummary
) -> tuple[list[tuple[ModelSummary, int]], bool | None]:
    """Turn off the other model summaries of a fit (``max_depth=0``, Lightning's "no summary"), so that
    one table is shown: the keeper's, which has every column of theirs and the estimate's. Returns
    what :func:`restore_summaries` puts back, and the style the user asked for by passing them:
    Rich for a ``RichModelSummary``, plain for a plain ``ModelSummary``, ``None`` (Lightning's
    default) for none."""
    summaries = lightning_classes("ModelSummary")
    silenced = [
        (cb, cb._max_depth)
        for cb in (cast(ModelSummary, c) for c in callbacks if isinstance(c, summaries))
        # Another MemEstimate shows its own estimate; only Lightning's summaries give way.
        if not isinstance(cb, type(keeper)) and cb._max_depth
    ]
    for cb, _ in silenced:
        cb._max_depth = 0
    rich = lightning_classes("RichModelSummary")
    kinds = [isinstance(cb, rich) for cb, _ in silenced]
    return silenced, (any(kinds) if kinds else None)


def restore_summaries(silenced: Iterable[tuple[ModelSummary, int]]) -> None:
    """Give the summaries :func:`silence_other_summaries` turned off their depth back (the user's
    callback objects may serve another trainer)."""
    for cb, depth in silenced:
        cb._max_depth = depth


def estimate_columns(layer_names: Sequence[str], estimate: StepEstimate) -> list[Column]:
    """The extra columns for the summary's layers (module paths relative to the LightningModule)."""
    stats: dict[str, ModuleStats] = {m.path: m for m in estimate.modules.walk()}
    rows = [stats.get(name) for name in layer_names]
    saved = [None if m is None else m.saved_bytes for m in rows]
    forward = [None if m is None else m.forward_flops for m in rows]
    backward = [None if m is None else m.backward_flops for m in rows]
    # In FLOP units (``GFLOP``): Lightning's counts (``19.0 B``) would read as bytes beside the saved
    # bytes. The unit in the header, so that a cell is a number that never wraps.
    return [
        _in_unit(SAVED_HEADER, saved, _BYTE_UNITS),
        _in_unit(FORWARD_HEADER, forward, _FLOP_UNITS),
        _in_unit(BACKWARD_HEADER, backward, _FLOP_UNITS),
    ]


def _in_unit(header: str, values: Sequence[int | None], units: Sequence[tuple[str, int]]) -> Column:
    """A column in the unit of its largest value, named in the header (``Saved MiB``); ``-`` where a
    layer has no figure, ``<0.01`` where it is not 0 but rounds to it."""
    largest = max((abs(v) for v in values if v is not None), default=0)
    unit, scale = next(((u, n) for u, n in reversed(units) if largest >= n), units[0])

    def cell(v: int | None) -> str:
        if v is None:
            return "-"
        if scale == 1 or v == 0:
            return f"{v:,}"
        return f"{v / scale:.2f}" if abs(v) >= scale / 200 else "<0.01"

    return (f"{header} {unit}", [cell(v) for v in values])


def fit_columns(columns: list[Column], width: int, measure: Callable[[list[Column]], int]) -> list[Column]:
    """``columns`` less those :data:`DROP_ORDER` names first, one at a time, until ``measure`` (the
    rendered table's width) is at most ``width``, or nothing more may go."""
    kept = list(columns)
    for key in DROP_ORDER:
        if measure(kept) <= width:
            break
        kept = [c for c in kept if _key(c[0]) != key]
    return kept


def _key(header: str) -> str:
    """A header's first word (``Saved MiB`` -> ``Saved``; Lightning's index column is ``" "``)."""
    return header.split()[0] if header.strip() else " "


#: A figure and its unit, which wrapping keeps on one line.
_UNITS = "|".join(u for u, _ in (*_BYTE_UNITS, *_FLOP_UNITS, ("B", 1)))
_TOKEN = re.compile(rf"\S+(?: (?:{_UNITS})(?![\w.])\S*)?")


def wrap_line(text: str, width: int, indent: str = "  ") -> list[str]:
    """``text`` in lines of at most ``width`` (a word longer than that stands alone), broken between
    words but never between a number and its unit; the lines after the first indented."""
    lines: list[str] = []
    lead = text[: len(text) - len(text.lstrip())]  # the first line's own indent, kept
    line = ""
    for token in _TOKEN.findall(text):
        if not line and not lines:
            line = lead + token
        elif len(line) + 1 + len(token) > width:
            lines.append(line)
            line = indent + token
        else:
            line = f"{line} {token}"
    return [*lines, line] if line else lines


def footer_items(estimate: StepEstimate) -> list[tuple[str, str]]:
    """``(label, value)`` lines below the table: each peak, and the steady state's breakdown."""
    items = [
        (f"Estimated peak memory, first step ({estimate.device})", format_bytes(estimate.first_step.bytes)),
        ("Estimated peak memory, steady state", format_bytes(estimate.steady_state.bytes)),
        ("At the steady-state peak", str(estimate.steady_state.breakdown)),
    ]
    if estimate.batch_shapes:
        items.append(("For batches of shapes", _shapes(estimate.batch_shapes)))
    if estimate.flops is not None:
        f = estimate.flops
        items.append(
            (
                "Estimated FLOPs per batch (fwd + bwd)",
                f"{human_flops(f.forward)} + {human_flops(f.backward or 0)}",
            )
        )
    if estimate.assumed_reads:  # (reads of values the batch holds were exact: nothing to say)
        items.append(
            ("Tensor values read (assumed, see MemEstimate.estimate)", str(len(estimate.assumed_reads)))
        )
    if estimate.lowering_reads:  # assumed answers that are no upper bound: where the estimate may be low
        items.append(("Of which could have lowered the estimate", str(len(estimate.lowering_reads))))
    if estimate.smallest_workspace_peaks is not None:
        items.append(
            ("Runs in, with cuDNN's smallest workspaces (slower)", format_bytes(estimate.runnable_peak_bytes))
        )
    if estimate.cudnn_workspace_assumed:
        items.append(("cuDNN convolution workspaces", "assumed 0 B (measured when calibrated on a GPU)"))
    if estimate.real_ops:
        calls = ", ".join(f"{op} ({n} calls)" if n > 1 else op for op, n in estimate.real_ops.items())
        items.append(("Run for real (their fake kernels failed)", calls))
    return items


#: How the summary names each loop besides training.
_LOOP_LABELS = {
    "sanity_check": "sanity check",
    "validate": "validation",
    "test": "test",
    "predict": "predict",
}


def loop_footer_items(estimates: Mapping[str, StepEstimate]) -> list[tuple[str, str]]:
    """A line below the table for each loop estimated before the summary (the sanity check's first
    validation batch, say): its peak and its batch shapes."""
    items = []
    for name, estimate in estimates.items():
        shapes = f" (batch of shapes {_shapes(estimate.batch_shapes)})" if estimate.batch_shapes else ""
        label = _LOOP_LABELS.get(name, name)
        items.append((f"Estimated peak memory, {label}", format_bytes(estimate.peak_bytes) + shapes))
    return items


def _shapes(per_step: tuple[tuple[tuple[int, ...], ...], ...]) -> str:
    """``(8, 3, 224, 224), (8,)``, or per step where the steps' batches differ."""

    def one(shapes: tuple[tuple[int, ...], ...]) -> str:
        return ", ".join(str(tuple(s)) for s in shapes) or "(no tensors)"

    if all(s == per_step[0] for s in per_step):
        return one(per_step[0])
    return "; ".join(f"step {i}: {one(s)}" for i, s in enumerate(per_step, 1))


def with_estimate(summary_data: list[Column], estimate: StepEstimate | None) -> list[Column]:
    """The summary's columns with the estimate's in place of Lightning's ``FLOPs`` column (which counts
    the forward of ``example_input_array`` only: ``0`` without one, beside figures in bytes)."""
    if estimate is None:
        return summary_data
    layers = next(cells for header, cells in summary_data if header == "Name")
    kept = [c for c in summary_data if c[0] != LIGHTNING_FLOPS_HEADER]
    return kept + estimate_columns(layers, estimate)


def total_flops(estimate: StepEstimate | None, lightning_total: int) -> int:
    """The summary's "Total FLOPs" (Lightning's: the forward of one batch): the estimate's, when there
    is one with FLOPs, else Lightning's own count."""
    if estimate is None or estimate.flops is None:
        return lightning_total
    return estimate.flops.forward


def show_summary(
    summary: Any,
    estimate: StepEstimate | None,
    loop_estimates: Mapping[str, StepEstimate],
    *,
    rich: bool | None = None,
    header_style: str | None = None,
    progress_bar: Callback | None = None,
) -> None:
    """Lightning's ``summary`` (a ``ModelSummary``) with the estimate's columns and footer, and the
    other loops' estimates under it (see :func:`render_summary`); ``progress_bar``: the trainer's,
    which it is printed through."""
    footer = footer_items(estimate) if estimate is not None else []
    footer += loop_footer_items(loop_estimates)
    render_summary(
        with_estimate(summary._get_summary_data(), estimate),
        summary.total_parameters,
        summary.trainable_parameters,
        summary.model_size,
        summary.total_training_modes,
        total_flops(estimate, getattr(summary, "total_flops", 0)),
        footer,
        rich=rich,
        header_style=header_style,
        progress_bar=progress_bar,
    )


def render_summary(
    summary_data: list[Column],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    total_flops: int,
    footer: list[tuple[str, str]],
    *,
    rich: bool | None = None,
    header_style: str | None = None,
    progress_bar: Callback | None = None,
) -> None:
    """Show the summary with the extra columns and footer: with Rich (``rich=None``: where Lightning
    would, that is where Rich is installed; ``header_style`` as ``RichModelSummary``'s), else as
    Lightning's plain summary is shown; beside ``progress_bar`` (the trainer's), through it."""
    use_rich = bool(RICH_AVAILABLE) if rich is None else rich
    counts = (total_parameters, trainable_parameters, model_size, total_training_modes, total_flops)
    estimated = any(h.startswith(f"{SAVED_HEADER} ") for h, _ in summary_data)
    with _beside(progress_bar):
        if use_rich:
            _render_rich(summary_data, *counts, footer, header_style or "bold magenta", estimated)
            return
        width = shutil.get_terminal_size().columns

        def measure(columns: list[Column]) -> int:
            return max(map(len, _format_summary_table(*counts, *columns).splitlines()))

        kept = fit_columns(summary_data, width, measure)
        table = _format_summary_table(*counts, *kept)
        # The estimate's lines as in the Rich table's footer: its figures (a breakdown among them) are
        # longer than the column Lightning keeps for its own counts.
        lines = [line for label, value in footer for line in wrap_line(f"{label}: {value}", width)]
        lines += _notes(summary_data, kept, width) if estimated else []
        lightning_summary.log.info("\n" + table + "".join(f"\n{line}" for line in lines))


def _notes(columns: list[Column], kept: list[Column], width: int) -> list[str]:
    """The footnote on the estimate's columns, and which columns were left out to fit ``width``."""
    dropped = [h.strip() or "#" for h, _ in columns if (h, _) not in kept]
    notes = wrap_line(FOOTNOTE, width)
    if dropped:
        notes += wrap_line(f"Left out to fit {width} columns: {', '.join(dropped)}.", width)
    return notes


@contextlib.contextmanager
def _beside(progress_bar: Callback | None) -> Iterator[None]:
    """Print beside Lightning's progress bar: tqdm's bars cleared before and drawn again after; console
    handlers of Lightning's loggers pointed at ``sys.stdout``/``sys.stderr`` as they are now (where a
    Rich live display has them, it prints above itself)."""
    handlers = _console_handlers(lightning_summary.log)
    old = [(h, h.stream) for h in handlers]
    for h, stream in old:
        h.setStream(sys.stderr if stream is sys.__stderr__ else sys.stdout)
    try:
        tqdm_bar = isinstance(progress_bar, lightning_classes("TQDMProgressBar"))
        if tqdm_bar and cast(Any, progress_bar).is_enabled:
            from tqdm import tqdm

            with tqdm.external_write_mode():
                yield
        else:
            yield
    finally:
        for h, stream in old:
            h.setStream(stream)


def _console_handlers(logger: logging.Logger) -> list[logging.StreamHandler[Any]]:
    """The handlers writing to the process's own stdout or stderr that a record of ``logger`` reaches."""
    found: list[logging.StreamHandler[Any]] = []
    current: logging.Logger | None = logger
    while current is not None:
        found += [
            h
            for h in current.handlers
            if type(h) is logging.StreamHandler and h.stream in (sys.__stdout__, sys.__stderr__)
        ]
        current = current.parent if current.propagate else None
    return found


def _render_rich(
    summary_data: list[Column],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    total_flops: int,
    footer: list[tuple[str, str]],
    header_style: str,
    estimated: bool,
) -> None:
    # RichModelSummary hard-codes its columns; this renders any, in the same style.
    from rich import get_console
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    console = get_console()

    def table_of(columns: list[Column]) -> Table:
        table = Table(header_style=header_style)
        for header, _ in columns:
            left = header in (" ", "Name", "Type", "Mode")
            justify: Literal["left", "right"] = "left" if left else "right"
            # No cell wraps: a column that does not fit is left out instead (fit_columns).
            table.add_column(header, justify=justify, style="dim" if header == " " else None, no_wrap=True)
        for cells in zip(*(cells for _, cells in columns), strict=True):
            table.add_row(*cells)
        return table

    def measure(columns: list[Column]) -> int:
        return Measurement.get(console, console.options, table_of(columns)).maximum

    kept = fit_columns(summary_data, console.width, measure)
    console.print(table_of(kept))
    rows = [
        ("Trainable params", get_human_readable_count(trainable_parameters)),
        ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
        ("Total params", get_human_readable_count(total_parameters)),
        ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
        ("Modules in train mode", str(total_training_modes["train"])),
        ("Modules in eval mode", str(total_training_modes["eval"])),
        ("Total FLOPs", get_human_readable_count(total_flops)),
        *footer,
    ]
    for label, value in rows:
        for i, line in enumerate(wrap_line(f"{label}: {value}", console.width)):
            text = Text(line)
            if i == 0:
                text.stylize("bold", 0, len(label))
            console.print(text, no_wrap=True, crop=False)
    for line in _notes(summary_data, kept, console.width) if estimated else []:
        console.print(Text(line, style="dim"), no_wrap=True, crop=False)
