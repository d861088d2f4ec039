"""``MemEstimate.describe()``: what the callback found, in a few lines -- the training estimate and its
cost, each measured step against its estimate, and the first batch of each other loop.

Example:
    >>> describe_checks(None, None, [], {}, {})
    'MemEstimate: no estimate (fit has not started, or estimating failed)'
    >>> SetupCost(total=1.47, simulating=1.3, calibrating=0.02, scanning=0.11).describe()
    '1.47 s to fit start: 1.30 s simulating, 0.02 s calibrating kernels, 0.11 s finding other live tensors, 0.04 s the rest'
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_memest.adapter.summary import wrap_line
from lightning_memest.report import MeasuredStep, StepEstimate, format_bytes

__all__ = ["SetupCost", "describe_checks"]


@dataclass(frozen=True)
class SetupCost:
    """Wall seconds the first estimate added to fit start, and what they went to."""

    total: float
    simulating: float
    """Running the steps on fake tensors."""
    calibrating: float
    """Measuring the kernels' memory on the device (0 when the cache knew them)."""
    scanning: float
    """Finding the other live tensors (CPU: a scan of the garbage collector's objects)."""

    @staticmethod
    def of(estimate: StepEstimate, total: float, scanning: float) -> SetupCost:
        """The cost of ``estimate``, made in ``total`` seconds of which ``scanning`` went to the scan."""
        calibrating = estimate.calibration.seconds if estimate.calibration is not None else 0.0
        return SetupCost(total, estimate.estimate_seconds - calibrating, calibrating, scanning)

    @property
    def rest(self) -> float:
        """Reading the trainer, the accounting of the events, the report."""
        return max(0.0, self.total - self.simulating - self.calibrating - self.scanning)

    def describe(self) -> str:
        return (
            f"{self.total:.2f} s to fit start: {self.simulating:.2f} s simulating, "
            f"{self.calibrating:.2f} s calibrating kernels, {self.scanning:.2f} s finding other live "
            f"tensors, {self.rest:.2f} s the rest"
        )


def describe_checks(
    estimate: StepEstimate | None,
    setup: SetupCost | None,
    measured: Sequence[MeasuredStep],
    loop_estimates: Mapping[str, StepEstimate],
    loop_measured: Mapping[str, MeasuredStep],
) -> str:
    """The lines of ``MemEstimate.describe()`` (``setup``: what the first estimate added to fit
    start)."""
    loops = [_loop_line(name, e, loop_measured.get(name)) for name, e in loop_estimates.items()]
    if estimate is None:
        if loops:
            return "\n".join(["MemEstimate: no training estimate", *loops])
        return "MemEstimate: no estimate (fit has not started, or estimating failed)"
    cost = setup.describe() if setup is not None else "nothing to fit start (estimated before)"
    # The check first, each line within 80 columns (a terminal, a CI log); what it cost after.
    lines = [f"MemEstimate ({estimate.device}, {estimate.precision}), {len(estimate.peaks)} steps:"]
    for m in measured:
        lines.append(
            f"  step {m.step}: estimated {format_bytes(m.estimated_bytes)}, "
            f"measured {format_bytes(m.peak_bytes)} ({m.error_pct:+.2f} %)"
        )
    if not measured:
        lines += [
            f"  step {p.step}: estimated {format_bytes(p.bytes)} (not measured)" for p in estimate.peaks
        ]
    lines += wrap_line(f"  the estimate added {cost}", 80, indent="    ")
    return "\n".join(lines + loops)


def _loop_line(name: str, estimate: StepEstimate, measured: MeasuredStep | None) -> str:
    line = f"  {name}: estimated {format_bytes(estimate.peak_bytes)}"
    if measured is None:
        return line + " (not measured)"
    return line + f", measured {format_bytes(measured.peak_bytes)} ({measured.error_pct:+.2f} %)"
