"""The estimate in Lightning's model summary: extra columns per layer and footer lines.

Lightning's summary is a list of ``(header, [cell per layer])`` columns (``ModelSummary._get_summary_data``)
rendered as a plain table, or with Rich when it is installed (the way Lightning picks its default
summary callback). The estimate adds, per layer: the activation bytes saved for backward, and the
forward and backward FLOPs once they are counted; and below the table the estimated peaks with their
breakdown.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)

from lightning_memest.report import ModuleStats, StepEstimate, format_bytes

__all__ = ["SAVED_HEADER", "estimate_columns", "footer_items", "render_summary"]

log = logging.getLogger(__name__)

Column = tuple[str, list[str]]

SAVED_HEADER = "Saved for bwd"


def estimate_columns(layer_names: Sequence[str], estimate: StepEstimate) -> list[Column]:
    """The extra columns for the summary's layers (module paths relative to the LightningModule)."""
    stats: dict[str, ModuleStats] = {m.path: m for m in estimate.modules.walk()}
    rows = [stats.get(name) for name in layer_names]
    saved = ["-" if m is None else format_bytes(m.saved_bytes) for m in rows]
    forward = [
        "-" if m is None or m.forward_flops is None else get_human_readable_count(m.forward_flops)
        for m in rows
    ]
    backward = [
        "-" if m is None or m.backward_flops is None else get_human_readable_count(m.backward_flops)
        for m in rows
    ]
    return [(SAVED_HEADER, saved), ("Fwd FLOPs/step", forward), ("Bwd FLOPs/step", backward)]


def footer_items(estimate: StepEstimate) -> list[tuple[str, str]]:
    """``(label, value)`` lines below the table: each peak, and the steady state's breakdown."""
    items = [
        (f"Estimated peak memory, first step ({estimate.device})", format_bytes(estimate.first_step.bytes)),
        ("Estimated peak memory, steady state", format_bytes(estimate.steady_state.bytes)),
        (
            "At the steady-state peak",
            ", ".join(
                f"{name.replace('_', ' ')} {format_bytes(n)}"
                for name, n in estimate.steady_state.breakdown.items()
                if n
            ),
        ),
    ]
    if estimate.batch_shapes:
        items.append(("For batches of shapes", _shapes(estimate.batch_shapes)))
    if estimate.flops is not None:
        f = estimate.flops
        items.append(
            (
                "Estimated FLOPs per batch (fwd + bwd)",
                f"{get_human_readable_count(f.forward)} + {get_human_readable_count(f.backward or 0)}",
            )
        )
    if estimate.data_dependent is not None:
        items.append(
            ("Tensor values read (assumed, see MemEstimate.estimate)", str(len(estimate.data_dependent)))
        )
    return items


def _shapes(per_step: tuple[tuple[tuple[int, ...], ...], ...]) -> str:
    """``(8, 3, 224, 224), (8,)``, or per step where the steps' batches differ."""

    def one(shapes: tuple[tuple[int, ...], ...]) -> str:
        return ", ".join(str(tuple(s)) for s in shapes) or "(no tensors)"

    if all(s == per_step[0] for s in per_step):
        return one(per_step[0])
    return "; ".join(f"step {i}: {one(s)}" for i, s in enumerate(per_step, 1))


def render_summary(
    summary_data: list[Column],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    total_flops: int,
    footer: list[tuple[str, str]],
) -> None:
    """Print the summary with the extra columns and footer, plain or with Rich as Lightning would."""
    if _RICH_AVAILABLE:
        _render_rich(
            summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, footer
        )
        return
    table = _format_summary_table(
        total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *summary_data
    )
    log.info("\n" + table + "".join(f"\n{value:<10} {label}" for label, value in footer))


def _render_rich(
    summary_data: list[Column],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    footer: list[tuple[str, str]],
) -> None:
    # RichModelSummary hard-codes its columns; this renders any, in the same style.
    from rich import get_console
    from rich.table import Table

    table = Table(header_style="bold magenta")
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
        *(f"[bold]{label}[/]: {value}" for label, value in footer),
    ]
    for row in rows:
        grid.add_row(row)
    console.print(grid)
