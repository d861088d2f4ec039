"""What an estimate reports: frozen, typed dataclasses, and their plain-data (JSON) form.

Every figure here is derived from one event stream of one simulated run (``accounting.account`` fills
these types), so peaks, breakdowns, per-module figures, FLOPs and the timeline agree. The package is a
vocabulary: it imports nothing of the package but the engine's ``Phase``. Where each part lives:
``step_estimate.py`` (``StepEstimate``, ``Peak``, ``Breakdown``, ...), ``modules.py`` (``ModuleStats``),
``flops.py`` (``FlopCount``), ``formatting.py`` (bytes, FLOPs, shares, columns), and, imported on their
own, ``nodes.py`` (the per-fx-node report) and ``tables.py`` (per-module text tables).
"""

from lightning_memest.report.flops import FlopCount, ModuleFlops, OpFlops
from lightning_memest.report.formatting import format_bytes, format_share, human_flops, render_columns
from lightning_memest.report.modules import ModuleStats
from lightning_memest.report.step_estimate import (
    CUDNN_WORKSPACE_ASSUMED,
    Breakdown,
    CalibrationSummary,
    DataDependentRead,
    KernelSource,
    MeasuredStep,
    Peak,
    PhaseMark,
    StepEstimate,
    TimelinePoint,
)

__all__ = [
    "CUDNN_WORKSPACE_ASSUMED",
    "Breakdown",
    "CalibrationSummary",
    "DataDependentRead",
    "FlopCount",
    "KernelSource",
    "MeasuredStep",
    "ModuleFlops",
    "ModuleStats",
    "OpFlops",
    "Peak",
    "PhaseMark",
    "StepEstimate",
    "TimelinePoint",
    "format_bytes",
    "format_share",
    "human_flops",
    "render_columns",
]
