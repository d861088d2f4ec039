"""``MemEstimate.describe()``: what the callback found, in a few lines -- the training estimate and its
cost, each measured step against its estimate, and the first batch of each other loop.

Example:
    >>> describe_checks(None, None, [], {}, {})
    'MemEstimate: no estimate (fit has not started, or estimating failed)'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_memest.report import MeasuredStep, StepEstimate, format_bytes

__all__ = ["describe_checks"]


def describe_checks(
    estimate: StepEstimate | None,
    setup_seconds: float | None,
    measured: Sequence[MeasuredStep],
    loop_estimates: Mapping[str, StepEstimate],
    loop_measured: Mapping[str, MeasuredStep],
) -> str:
    """The lines of ``MemEstimate.describe()`` (``setup_seconds``: what the estimate added to fit
    start)."""
    loops = [_loop_line(name, e, loop_measured.get(name)) for name, e in loop_estimates.items()]
    if estimate is None:
        if loops:
            return "\n".join(["MemEstimate: no training estimate", *loops])
        return "MemEstimate: no estimate (fit has not started, or estimating failed)"
    lines = [
        f"MemEstimate ({estimate.device}, {estimate.precision}): the estimate added "
        f"{setup_seconds or 0.0:.2f} s to fit start ({estimate.estimate_seconds:.2f} s simulating "
        f"{len(estimate.peaks)} steps)"
    ]
    for m in measured:
        lines.append(
            f"  step {m.step}: estimated {format_bytes(m.estimated_bytes)}, "
            f"measured {format_bytes(m.peak_bytes)} ({m.error_pct:+.2f} %)"
        )
    if not measured:
        lines += [
            f"  step {p.step}: estimated {format_bytes(p.bytes)} (not measured)" for p in estimate.peaks
        ]
    return "\n".join(lines + loops)


def _loop_line(name: str, estimate: StepEstimate, measured: MeasuredStep | None) -> str:
    line = f"  {name}: estimated {format_bytes(estimate.peak_bytes)}"
    if measured is None:
        return line + " (not measured)"
    return line + f", measured {format_bytes(measured.peak_bytes)} ({measured.error_pct:+.2f} %)"
