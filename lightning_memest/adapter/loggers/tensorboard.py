"""The estimate in TensorBoard: a custom-scalars layout, markdown tables, the timeline figure, and the
figures in the HParams tab.

Everything goes through the ``SummaryWriter`` of Lightning's ``TensorBoardLogger``
(``logger.experiment``); scalars themselves are logged by the callback like any metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.figure import Figure

from lightning_memest.engine.events import Phase
from lightning_memest.report import ModuleStats, StepEstimate, format_bytes, human_flops

_PHASE_COLOURS = {
    Phase.FORWARD: "#4C72B0",
    Phase.BACKWARD: "#DD8452",
    Phase.OPTIMIZER: "#55A868",
    Phase.ZERO_GRAD: "#8C8C8C",
}
_LAYOUT_FLAG = "_memest_layout_registered"
_PEAK_NAMES = ("first_step", "steady_state")

__all__ = [
    "breakdown_markdown",
    "log_estimate",
    "log_to_tensorboard",
    "register_layout",
    "timeline_figure",
    "top_modules_markdown",
]


def register_layout(writer: Any) -> None:
    """One chart per peak with estimated and measured together (a writer takes one layout: once)."""
    if getattr(writer, _LAYOUT_FLAG, False):
        return
    charts = {
        title: ["Multiline", [f"memest/{name}/estimated_bytes", f"memest/{name}/measured_bytes"]]
        for title, name in (
            ("first-step peak (bytes)", "first_step"),
            ("steady-state peak (bytes)", "steady_state"),
        )
    }
    charts["estimate error (%)"] = [
        "Multiline",
        ["memest/first_step/error_pct", "memest/steady_state/error_pct"],
    ]
    writer.add_custom_scalars({"memest": charts})
    setattr(writer, _LAYOUT_FLAG, True)


def breakdown_markdown(estimate: StepEstimate, measured: Sequence[int] | None) -> str:
    """A markdown table: what each estimated peak holds, with the measured peaks below."""
    peaks = estimate.peaks
    header = "| | " + " | ".join(f"step {p.step} peak" for p in peaks) + " |"
    rows = [header, "|---" * (len(peaks) + 1) + "|"]
    for name, _ in peaks[0].breakdown.items():
        cells = " | ".join(format_bytes(getattr(p.breakdown, name)) for p in peaks)
        rows.append(f"| {name.replace('_', ' ')} | {cells} |")
    rows.append("| **estimated** | " + " | ".join(f"**{format_bytes(p.bytes)}**" for p in peaks) + " |")
    if measured is not None:
        rows.append("| measured | " + " | ".join(format_bytes(m) for m in measured) + " |")
        errors = (f"{100.0 * (p.bytes - m) / m:+.2f} %" for p, m in zip(peaks, measured, strict=False))
        rows.append("| error | " + " | ".join(errors) + " |")
    rows.append("")
    rows.append(
        "Peaks at: "
        + "; ".join(f"step {p.step}: `{p.op}` in `{p.module or '(root)'}` ({p.phase.value})" for p in peaks)
    )
    return "\n".join(rows)


def top_modules_markdown(estimate: StepEstimate, top: int = 10) -> str:
    """Markdown tables of the layers that save the most for backward, and that compute the most."""
    leaves = [m for m in estimate.modules.walk() if m.children is None]
    by_memory = sorted((m for m in leaves if m.saved_bytes > 0), key=lambda m: m.saved_bytes, reverse=True)
    rows = ["**By activation memory saved for backward**", "", "| module | type | saved | parameters |"]
    rows.append("|---|---|---|---|")
    rows += [
        f"| `{m.path}` | {m.type_name} | {format_bytes(m.saved_bytes)} | {format_bytes(m.parameter_bytes)} |"
        for m in by_memory[:top]
    ]

    def step_flops(m: ModuleStats) -> int:
        return (m.forward_flops or 0) + (m.backward_flops or 0)

    by_flops = sorted((m for m in leaves if step_flops(m) > 0), key=step_flops, reverse=True)
    rows += [
        "",
        "**By FLOPs of one batch (forward + backward)**",
        "",
        "| module | type | forward | backward |",
    ]
    rows.append("|---|---|---|---|")
    for m in by_flops[:top]:
        forward, backward = human_flops(m.forward_flops or 0), human_flops(m.backward_flops or 0)
        rows.append(f"| `{m.path}` | {m.type_name} | {forward} | {backward} |")
    return "\n".join(rows)


def timeline_figure(estimate: StepEstimate, measured: Sequence[int] | None) -> Figure:
    """Live bytes over the simulated steps, phases shaded, the measured peaks drawn across."""
    fig = Figure(figsize=(10, 4), dpi=100)
    ax = fig.add_subplot()
    points = estimate.timeline
    xs = list(range(len(points)))
    ax.plot(xs, [p.live_bytes / 2**20 for p in points], color="black", linewidth=1, label="estimated live")
    start = 0
    for i in range(1, len(points) + 1):
        if i == len(points) or points[i].phase != points[start].phase or points[i].step != points[start].step:
            phase = points[start].phase
            ax.axvspan(start, i, color=_PHASE_COLOURS.get(phase, "#DDDDDD"), alpha=0.15, linewidth=0)
            start = i
    for p in estimate.peaks:
        ax.axhline(p.bytes / 2**20, color="black", linestyle=":", linewidth=0.8)
    if measured is not None:
        for step, m in enumerate(measured, start=1):
            ax.axhline(
                m / 2**20, color="#C44E52", linestyle="--", linewidth=1, label=f"measured peak, step {step}"
            )
    for phase, colour in _PHASE_COLOURS.items():
        ax.axvspan(0, 0, color=colour, alpha=0.3, label=phase.value)
    ax.set_xlabel("op (two simulated steps)")
    ax.set_ylabel("live MiB")
    ax.set_title(f"lightning_memest: simulated live memory ({estimate.device}, {estimate.precision})")
    ax.legend(loc="lower right", fontsize="small", ncol=3, framealpha=0.9)
    ax.set_ylim(bottom=0)
    ax.margins(x=0)
    fig.tight_layout()
    return fig


def log_to_tensorboard(
    writer: Any, estimate: StepEstimate, measured: Sequence[int] | None, step: int
) -> None:
    """The layout, the tables and the figure, into one ``SummaryWriter``."""
    register_layout(writer)
    writer.add_text("memest/breakdown", breakdown_markdown(estimate, measured), global_step=step)
    writer.add_text("memest/top_modules", top_modules_markdown(estimate), global_step=step)
    writer.add_figure("memest/timeline", timeline_figure(estimate, measured), global_step=step)


def log_estimate(
    logger: TensorBoardLogger, estimate: StepEstimate, measured: Sequence[int] | None, *, final: bool
) -> None:
    """Everything of the estimate a ``TensorBoardLogger`` shows beyond scalars; ``final`` once the
    measured peaks (``measured``, per step) are in: then also the HParams record."""
    log_to_tensorboard(logger.experiment, estimate, measured, step=len(measured or ()))
    if not final or measured is None:
        return
    # Own tags: log_hyperparams logs its metrics at step 0, which would make TensorBoard drop the later
    # points of the same tags.
    metrics = {
        f"hparams/memest_{_PEAK_NAMES[step]}_{key}": float(value)
        for step, peak in enumerate(measured)
        for key, value in (("estimated_bytes", estimate.peaks[step].bytes), ("measured_bytes", peak))
    }
    params = {"memest/device": estimate.device, "memest/precision": estimate.precision}
    logger.log_hyperparams(params, metrics)
