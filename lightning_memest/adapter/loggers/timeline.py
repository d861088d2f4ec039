"""The timeline figure: live memory over the simulated steps, op by op, phases shaded and labelled,
the estimated and measured peaks of each step drawn over the step they belong to.

The x axis is the ops in order, one unit per forward and backward op. The optimizer runs one small op
per parameter per state tensor (Adam: hundreds), which at one unit each would take most of the width
from the forward and backward passes where activations build up and fall: the optimizer, zero_grad
and setup phases are squeezed to at most a quarter of their step's forward and backward width (their
rise, the optimizer's state created in step 1, stays as tall).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from lightning_memest.engine.events import Phase
from lightning_memest.report import StepEstimate, TimelinePoint, format_bytes

__all__ = ["timeline_figure"]

PHASE_COLOURS = {
    Phase.FORWARD: "#4C72B0",
    Phase.BACKWARD: "#DD8452",
    Phase.OPTIMIZER: "#55A868",
    Phase.ZERO_GRAD: "#8C8C8C",
    Phase.SETUP: "#DDDDDD",
}
_SQUEEZED = frozenset({Phase.OPTIMIZER, Phase.ZERO_GRAD, Phase.SETUP})
_SQUEEZE_SHARE = 0.25
#: One style per measured step, so the two peaks never read as one line.
_MEASURED_STYLES: tuple[tuple[str, Literal["--", "-."]], ...] = (("#C44E52", "--"), ("#8172B3", "-."))
_GIB = 2**30


@dataclass(frozen=True)
class _Segment:
    """A run of ops of one phase in one step: ops ``[start, end)`` drawn over ``[x0, x0 + width)``."""

    step: int
    phase: Phase
    start: int
    end: int
    x0: float
    width: float

    def x(self, op: int) -> float:
        return self.x0 + (op - self.start + 0.5) * self.width / (self.end - self.start)

    @property
    def squeeze(self) -> float:
        return (self.end - self.start) / self.width


def _runs(points: Sequence[TimelinePoint]) -> list[tuple[int, Phase, int, int]]:
    """``(step, phase, start, end)`` of each run of consecutive ops in one phase of one step."""
    runs: list[tuple[int, Phase, int, int]] = []
    start = 0
    for i in range(1, len(points) + 1):
        if i == len(points) or (points[i].step, points[i].phase) != (points[start].step, points[start].phase):
            runs.append((points[start].step, points[start].phase, start, i))
            start = i
    return runs


def _segments(points: Sequence[TimelinePoint]) -> list[_Segment]:
    runs = _runs(points)
    passes: dict[int, int] = {}  # per step: forward and backward ops
    for step, phase, start, end in runs:
        if phase not in _SQUEEZED:
            passes[step] = passes.get(step, 0) + end - start
    segments, x0 = [], 0.0
    for step, phase, start, end in runs:
        width = float(end - start)
        if phase in _SQUEEZED:
            width = min(width, max(1.0, _SQUEEZE_SHARE * passes.get(step, 0)))
        segments.append(_Segment(step, phase, start, end, x0, width))
        x0 += width
    return segments


def _unit(top_bytes: float) -> tuple[float, str]:
    return (_GIB, "GiB") if top_bytes >= 4 * _GIB else (2**20, "MiB")


def _shade(ax: Axes, segments: Sequence[_Segment], total: float) -> None:
    """Each phase's band, labelled where it is wide enough to read (squeezed ones say by how much)."""
    for s in segments:
        ax.axvspan(s.x0, s.x0 + s.width, color=PHASE_COLOURS[s.phase], alpha=0.15, linewidth=0)
        if s.width < 0.04 * total:
            continue
        label = s.phase.value.replace("_", " ")
        if s.squeeze > 1.5:
            label += f"\n(squeezed {s.squeeze:.0f}:1)"
        ax.text(
            s.x0 + s.width / 2,
            0.98,
            label,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=7,
            color=PHASE_COLOURS[s.phase],
        )


def _step_spans(segments: Sequence[_Segment]) -> dict[int, tuple[float, float]]:
    spans: dict[int, tuple[float, float]] = {}
    for s in segments:
        lo, _ = spans.get(s.step, (s.x0, s.x0))
        spans[s.step] = (lo, s.x0 + s.width)
    return spans


def _steps_axis(ax: Axes, spans: dict[int, tuple[float, float]]) -> None:
    """Ticks name the steps; a thin line parts them."""
    ax.set_xticks([(lo + hi) / 2 for lo, hi in spans.values()], [f"step {step}" for step in spans])
    for lo, _ in list(spans.values())[1:]:
        ax.axvline(lo, color="#555555", linewidth=0.8)


def _peaks(
    ax: Axes,
    estimate: StepEstimate,
    segments: Sequence[_Segment],
    spans: dict[int, tuple[float, float]],
    measured: Sequence[int] | None,
    unit: float,
) -> None:
    """Per step: the estimated peak (a dot where it happens, a dotted line across the step) and the
    measured one (a line across the step, in that step's own style)."""
    for i, p in enumerate(estimate.peaks):
        lo, hi = spans.get(p.step, (0.0, 0.0))
        at = next((s.x(p.op_index) for s in segments if s.start <= p.op_index < s.end), lo)
        ax.hlines(
            p.bytes / unit,
            lo,
            hi,
            colors="black",
            linestyles=":",
            linewidth=0.9,
            label="estimated peak" if i == 0 else "_nolegend_",
        )
        ax.plot([at], [p.bytes / unit], "o", color="black", markersize=4)
        right = at > (lo + hi) / 2  # the label on the side with room, clear of the step's edge
        ax.annotate(
            f"estimated {format_bytes(p.bytes)}",
            (at, p.bytes / unit),
            textcoords="offset points",
            xytext=(-4 if right else 4, 4),
            ha="right" if right else "left",
            fontsize=7,
        )
    for i, m in enumerate(measured or ()):
        lo, hi = spans.get(i + 1, (0.0, 0.0))
        colour, style = _MEASURED_STYLES[i % len(_MEASURED_STYLES)]
        ax.hlines(
            m / unit,
            lo,
            hi,
            colors=colour,
            linestyles=style,
            linewidth=1.6,
            label=f"measured peak, step {i + 1}: {format_bytes(m)}",
        )


def timeline_figure(estimate: StepEstimate, measured: Sequence[int] | None) -> Figure:
    """Live memory over the simulated steps (see the module docstring); ``measured``: the measured
    peak of each step, where known."""
    fig = Figure(figsize=(10, 4.5), dpi=100)
    ax = fig.add_subplot()
    points = estimate.timeline
    segments = _segments(points)
    top = max([p.live_bytes for p in points] + [p.bytes for p in estimate.peaks] + list(measured or ()) + [1])
    unit, unit_name = _unit(top)
    xs = [s.x(i) for s in segments for i in range(s.start, s.end)]
    ax.plot(xs, [p.live_bytes / unit for p in points], color="black", linewidth=1, label="estimated live")
    total = sum(s.width for s in segments) or 1.0
    _shade(ax, segments, total)
    spans = _step_spans(segments)
    _steps_axis(ax, spans)
    _peaks(ax, estimate, segments, spans, measured, unit)
    ax.set_xlim(0, total)
    ax.set_ylim(0, top / unit * 1.15)  # room for the phase labels above the line
    ax.set_xlabel("ops in order (forward and backward: one unit per op; optimizer squeezed)")
    ax.set_ylabel(f"live {unit_name}")
    ax.set_title(f"lightning_memest: simulated live memory ({estimate.device}, {estimate.precision})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize="small", frameon=False)
    fig.tight_layout()
    return fig
