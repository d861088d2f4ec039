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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from lightning.pytorch.callbacks import Callback, ModelSummary, RichModelSummary
from lightning.pytorch.callbacks import model_summary as lightning_summary
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)
from lightning_utilities.core.imports import RequirementCache

from lightning_memest.report import ModuleStats, StepEstimate, format_bytes, human_flops

__all__ = [
    "RICH_AVAILABLE",
    "SAVED_HEADER",
    "estimate_columns",
    "footer_items",
    "loop_footer_items",
    "render_summary",
    "restore_summaries",
    "show_summary",
    "silence_other_summaries",
    "total_flops",
    "with_estimate",
]

#: Whether Rich is installed, as Lightning decides it when it picks ``RichModelSummary`` by default
#: (its own flag moved between releases; the requirement is the same).
RICH_AVAILABLE = RequirementCache("rich>=10.2.2")

Column = tuple[str, list[str]]

SAVED_HEADER = "Saved for bwd"
#: Lightning's per-layer FLOPs column, which the estimate's columns replace.
LIGHTNING_FLOPS_HEADER = "FLOPs"


def silence_other_summaries(
    callbacks: Iterable[Callback], keeper: ModelSummary
) -> tuple[list[tuple[ModelSummary, int]], bool | None]:
    """Turn off the other model summaries of a fit (``max_depth=0``, Lightning's "no summary"), so that
    one table is shown: the keeper's, which has every column of theirs and the estimate's. Returns
    what :func:`restore_summaries` puts back, and the style the user asked for by passing them:
    Rich for a ``RichModelSummary``, plain for a plain ``ModelSummary``, ``None`` (Lightning's
    default) for none."""
    silenced = [
        (cb, cb._max_depth)
        for cb in callbacks
        # Another MemEstimate shows its own estimate; only Lightning's summaries give way.
        if isinstance(cb, ModelSummary) and not isinstance(cb, type(keeper)) and cb._max_depth
    ]
    for cb, _ in silenced:
        cb._max_depth = 0
    kinds = [isinstance(cb, RichModelSummary) for cb, _ in silenced]
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
    saved = ["-" if m is None else format_bytes(m.saved_bytes) for m in rows]
    # In FLOP units (``19.04 GFLOP``): Lightning's counts (``19.0 B``) would read as bytes beside the
    # saved bytes.
    forward = ["-" if m is None or m.forward_flops is None else human_flops(m.forward_flops) for m in rows]
    backward = ["-" if m is None or m.backward_flops is None else human_flops(m.backward_flops) for m in rows]
    return [(SAVED_HEADER, saved), ("Fwd FLOPs/step", forward), ("Bwd FLOPs/step", backward)]


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
    if estimate.data_dependent is not None:
        items.append(
            ("Tensor values read (assumed, see MemEstimate.estimate)", str(len(estimate.data_dependent)))
        )
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
) -> None:
    """Lightning's ``summary`` (a ``ModelSummary``) with the estimate's columns and footer, and the
    other loops' estimates under it (see :func:`render_summary`)."""
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
) -> None:
    """Show the summary with the extra columns and footer: with Rich (``rich=None``: where Lightning
    would, that is where Rich is installed; ``header_style`` as ``RichModelSummary``'s), else as
    Lightning's plain summary is shown."""
    use_rich = bool(RICH_AVAILABLE) if rich is None else rich
    counts = (total_parameters, trainable_parameters, model_size, total_training_modes, total_flops)
    if use_rich:
        _render_rich(summary_data, *counts, footer, header_style or "bold magenta")
        return
    table = _format_summary_table(*counts, *summary_data)
    # The estimate's lines as in the Rich table's footer: its figures (a breakdown among them) are
    # longer than the column Lightning keeps for its own counts.
    lightning_summary.log.info("\n" + table + "".join(f"\n{label}: {value}" for label, value in footer))


def _render_rich(
    summary_data: list[Column],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    total_flops: int,
    footer: list[tuple[str, str]],
    header_style: str,
) -> None:
    # RichModelSummary hard-codes its columns; this renders any, in the same style.
    from rich import get_console
    from rich.markup import escape
    from rich.table import Table

    table = Table(header_style=header_style)
    for header, _ in summary_data:
        justify: Literal["left", "right"] = "left" if header in (" ", "Name", "Type", "Mode") else "right"
        table.add_column(
            header, justify=justify, style="dim" if header == " " else None, no_wrap=header == "Name"
        )
    for cells in zip(*(cells for _, cells in summary_data), strict=True):
        table.add_row(*cells)
    console = get_console()
    console.print(table)
    grid = Table.grid(expand=True)
    grid.add_column()
    rows = [
        f"[bold]Trainable params[/]: {get_human_readable_count(trainable_parameters)}",
        f"[bold]Non-trainable params[/]: {get_human_readable_count(total_parameters - trainable_parameters)}",
        f"[bold]Total params[/]: {get_human_readable_count(total_parameters)}",
        f"[bold]Total estimated model params size (MB)[/]: {get_formatted_model_size(model_size)}",
        f"[bold]Modules in train mode[/]: {total_training_modes['train']}",
        f"[bold]Modules in eval mode[/]: {total_training_modes['eval']}",
        f"[bold]Total FLOPs[/]: {get_human_readable_count(total_flops)}",
        *(f"[bold]{escape(label)}[/]: {escape(value)}" for label, value in footer),
    ]
    for row in rows:
        grid.add_row(row)
    console.print(grid)
