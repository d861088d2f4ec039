"""The estimate as markdown tables (TensorBoard's Text tab renders them): what each peak holds,
estimated against measured, and the layers that save and compute the most."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_memest.report import ModuleStats, StepEstimate, format_bytes, human_flops

__all__ = ["breakdown_markdown", "top_modules_markdown"]


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
