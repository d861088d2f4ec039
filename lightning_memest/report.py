"""What an estimate reports: frozen, typed dataclasses, and their plain-data (JSON) form.

Every figure here is derived from one event stream of one simulated run (``accounting.account`` fills
these types), so peaks, breakdowns, per-module figures, FLOPs and the timeline agree. The module is a
vocabulary: it imports nothing of the package but the engine's ``Phase``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from lightning_memest.engine.events import Phase

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
    "StepEstimate",
    "TimelinePoint",
    "format_bytes",
    "format_share",
    "human_flops",
    "render_columns",
]

#: What every CUDA output says where cuDNN's convolution workspaces were not measured.
CUDNN_WORKSPACE_ASSUMED = (
    "cuDNN convolution workspaces assumed at their smallest, 0 B (measured when the kernels are "
    "calibrated on a GPU): the step may reserve more"
)


@dataclass(frozen=True)
class Breakdown:
    """Live bytes by what they hold, at one moment (a peak)."""

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    activations: int
    communication: int
    inputs: int
    temporaries: int
    """Storages of the step that hold none of the roles above (an op's intermediate results)."""
    workspaces: int = 0
    """Scratch memory of the kernel running at that moment, beyond its outputs (oneDNN's reorder
    buffers on the CPU, cuDNN's convolution workspace on CUDA): calibrated where the kernels were
    measured, else from the kernel models (``accounting.kernels``)."""
    other_tensors: int = 0
    """Tensors alive on the device that are not the step's own (other callbacks' state, datasets)."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def items(self) -> Iterator[tuple[str, int]]:
        for f in fields(self):
            yield f.name, getattr(self, f.name)

    def __str__(self) -> str:
        """What the bytes hold, in words: ``'parameters 42.65 MiB, gradients 42.65 MiB, ...'`` (roles
        holding nothing are left out)."""
        held = [f"{name.replace('_', ' ')} {format_bytes(n)}" for name, n in self.items() if n]
        return ", ".join(held) or "nothing"


@dataclass(frozen=True)
class Peak:
    """The most bytes live at once during one training step, and where that happened."""

    step: int
    """1 for the first step, 2 for the steady state (the second step)."""
    bytes: int
    """Live bytes at the peak, counting what was resident before the step."""
    breakdown: Breakdown
    op_index: int
    """Index into the timeline of the op during which the peak happened."""
    op: str
    phase: Phase
    module: str
    """Dotted path of the innermost module running then (``""`` for the root or outside any module)."""

    def __str__(self) -> str:
        """``'290.19 MiB in step 2 (aten.mm.default in fc, backward)'``."""
        where = f"{self.op} in {self.module or '(root)'}, {self.phase.value}"
        return f"{format_bytes(self.bytes)} in step {self.step} ({where})"


@dataclass(frozen=True, repr=False)
class ModuleStats:
    """One node of the per-module tree (figures of the first step; a module includes its children)."""

    path: str
    type_name: str
    parameter_bytes: int
    saved_bytes: int
    """Bytes of activations saved for backward while this module ran forward (parameters not counted)."""
    forward_peak_bytes: int | None
    """Most bytes live during its forward; ``None`` if it never ran."""
    backward_peak_bytes: int | None
    """Most bytes live during its backward; ``None`` if it had no backward."""
    forward_flops: int | None
    """Headline FLOPs (2 x MACs of matmuls, convolutions, attention) of its forward; ``None`` if it
    never ran."""
    backward_flops: int | None
    children: tuple[ModuleStats, ...] | None

    def walk(self) -> Iterator[ModuleStats]:
        """This node and all below it, depth first."""
        yield self
        for child in self.children or ():
            yield from child.walk()

    def __repr__(self) -> str:
        # The tree below is summed up, not spelled out: a model's tree runs to thousands of lines.
        below = sum(1 for _ in self.walk()) - 1
        return (
            f"<ModuleStats {self.path or '(root)'} ({self.type_name}): saved {self.saved_bytes:,} B, "
            f"{below:,} modules below>"
        )

    def __str__(self) -> str:
        """One line: the module, its parameters, what it saves for backward, its FLOPs."""
        flops = "" if self.forward_flops is None else f", forward {human_flops(self.forward_flops)}"
        if self.backward_flops is not None:
            flops += f", backward {human_flops(self.backward_flops)}"
        return (
            f"{self.path or '(root)'} ({self.type_name}): parameters {format_bytes(self.parameter_bytes)}, "
            f"saved for backward {format_bytes(self.saved_bytes)}{flops}"
        )


@dataclass(frozen=True)
class TimelinePoint:
    """Live bytes right after one op allocated its outputs (its high point)."""

    op_index: int
    step: int
    phase: Phase
    module: str
    op: str
    live_bytes: int


@dataclass(frozen=True)
class PhaseMark:
    """What a simulated step held at the end of one of its phases (``accounting.phase_marks``)."""

    step: int
    phase: Phase
    live_bytes: int
    """Bytes of the tensors alive (exact, as the breakdown counts them)."""
    allocated_bytes: int | None
    """On CUDA, the caching allocator's allocated bytes there (whole blocks); ``None`` on CPU."""


@dataclass(frozen=True)
class DataDependentRead:
    """A place where the step read a value of a tensor, which fake tensors do not have: answered
    exactly (``exact``: a value the simulation knows -- the batch's integer and boolean tensors and
    what is computed from them alone -- or the only one possible) or assumed."""

    op: str
    module: str
    assumed: str
    """What the simulation answered: the real value where ``exact``, otherwise what it used instead of
    it (see ``engine.data_dependent``)."""
    count: int
    exact: bool = False

    def describe(self) -> str:
        """The read in a user's words: ``.item()``-style scalar reads are named as such."""
        what = "a scalar read (.item(), bool(), int())" if "_local_scalar_dense" in self.op else self.op
        answer = f"exact, {self.assumed}" if self.exact else f"assumed {self.assumed}"
        return f"{what} in {self.module or '(root)'} x{self.count}: {answer}"


@dataclass(frozen=True, slots=True)
class ModuleFlops:
    """FLOPs of one module in the first step, inclusive of its children (headline and other)."""

    path: str
    forward: int
    backward: int
    other_forward: int
    other_backward: int


@dataclass(frozen=True, slots=True)
class OpFlops:
    """FLOPs of one op (overload name) in the first step, over all its calls and phases."""

    op: str
    calls: int
    flops: int
    other: int


@dataclass(frozen=True, slots=True, repr=False)
class FlopCount:
    """FLOPs of the first training step; a phase that did not run (no op in it) is ``None``."""

    forward: int
    backward: int | None
    optimizer: int | None
    other_forward: int
    other_backward: int | None
    other_optimizer: int | None
    modules: tuple[ModuleFlops, ...]
    """Per module (inclusive of children), in the order modules first ran; ``""`` is the root."""
    ops: tuple[OpFlops, ...]
    """Per op with a formula, most FLOPs (headline, then other) first."""
    uncounted: tuple[str, ...] = ()
    """Ops whose formula could not read their call (counted as 0)."""

    @property
    def total(self) -> int:
        """Headline FLOPs of the whole step (forward + backward + optimizer)."""
        return self.forward + (self.backward or 0) + (self.optimizer or 0)

    @property
    def other_total(self) -> int:
        return self.other_forward + (self.other_backward or 0) + (self.other_optimizer or 0)

    def module(self, path: str) -> ModuleFlops | None:
        """The figures of module ``path``, ``None`` when it did not run."""
        for m in self.modules:
            if m.path == path:
                return m
        return None

    def __repr__(self) -> str:
        return (
            f"<FlopCount forward {self.forward:,}, backward {self.backward or 0:,}, optimizer "
            f"{self.optimizer or 0:,}, other {self.other_total:,}; {len(self.modules):,} modules, "
            f"{len(self.ops):,} ops>"
        )

    def __str__(self) -> str:
        """``'forward 1.82 GFLOP, backward 3.52 GFLOP, optimizer 0 FLOP (other 51.20 MFLOP)'``."""
        return (
            f"forward {human_flops(self.forward)}, backward {human_flops(self.backward or 0)}, optimizer "
            f"{human_flops(self.optimizer or 0)} (other {human_flops(self.other_total)})"
        )


@dataclass(frozen=True)
class KernelSource:
    """Where the kernel memory of one op's calls came from (what real kernels allocate beyond the fake
    outputs): measured on this machine, a hand model, or neither (nothing assumed beyond outputs)."""

    op: str
    calibrated: int
    modelled: int
    uncovered: int


@dataclass(frozen=True)
class CalibrationSummary:
    """What calibrating the kernels took (``accounting/kernels/calibrate.py``)."""

    device: str
    seconds: float
    measured: int
    """Distinct op signatures measured now."""
    cached: int
    """Distinct op signatures answered from the cache."""
    failed: tuple[str, ...]
    """Ops with signatures that could not be measured (their hand models hold)."""


@dataclass(frozen=True, repr=False)
class StepEstimate:
    """The estimate of a training step's memory, for each simulated step.

    ``print(est)`` gives a few lines for people; ``repr(est)`` one line (the timeline and the module
    tree are counted, not listed).

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> est = estimate_step(torch.nn.Linear(512, 512), torch.randn(64, 512), optimizer=torch.optim.Adam)
        >>> est.steady_state.bytes > est.first_step.bytes - 1
        True
        >>> print(est)  # doctest: +ELLIPSIS
        Estimated train step (cpu, 32-true)
          peak, first step:   ... MiB in step 1 (... in (root), optimizer)
          peak, steady state: ... MiB in step 2 (... in (root), optimizer)
          at that peak: parameters 1.00 MiB, gradients 1.00 MiB, optimizer state 2.00 MiB, ...
          FLOPs: forward 33.55 MFLOP, backward 33.55 MFLOP, optimizer 0 FLOP (other ...)
        >>> est  # doctest: +ELLIPSIS
        <StepEstimate cpu 32-true: step 1 ... B, step 2 ... B, 67,108,864 FLOPs; 1 modules, ... points>
    """

    device: str
    precision: str
    peaks: tuple[Peak, ...]
    modules: ModuleStats
    timeline: tuple[TimelinePoint, ...]
    data_dependent: tuple[DataDependentRead, ...] | None
    """Where values of fake tensors were read, each answered exactly or assumed (``.exact``; the
    assumed ones alone: :attr:`assumed_reads`); ``None`` if nowhere."""
    reserved_bytes: tuple[int, ...] | None
    """Allocator-reserved peaks per step (CUDA); ``None`` where not modelled."""
    flops: FlopCount | None
    """FLOPs of the first step, from the same simulation (``accounting.flops``)."""
    estimate_seconds: float
    """Seconds the simulation took (conversion to fake tensors and the steps)."""
    approximate: bool = False
    """True for a CUDA what-if on a machine without a GPU: CPU kernels ran; CUDA's allocator, library
    workspaces, optimizer defaults, attention backend and autocast lists were modelled, cuDNN's
    convolution workspaces taken at their smallest (:attr:`cudnn_workspace_assumed`)."""
    cuda_context_bytes: int | None = None
    """On CUDA, the CUDA context outside the caching allocator (measured on a GPU, assumed in a
    what-if; see ``accounting.cuda_device``); ``None`` on CPU."""
    cuda_context_assumed: bool | None = None
    """On CUDA, whether :attr:`cuda_context_bytes` is an assumption (a what-if, where no GPU measured it
    and the user gave none: ``CudaDevice(context_bytes=..., context_given=True)``, ``memest
    --cuda-context``); ``None`` on CPU."""
    smallest_workspace_peaks: tuple[int, ...] | None = None
    """On CUDA, the allocated peak of each step if every cuDNN convolution ran the plan PyTorch falls
    back to when its preferred plan's workspace cannot be allocated (no workspace): the least the step
    can run in, slower (``accounting.kernels.cudnn_workspace``). ``None`` where no convolution holds a
    workspace (the CPU; a CUDA what-if, where no GPU measured them: see :attr:`cudnn_workspace_assumed`)."""
    cudnn_workspace_assumed: bool | None = None
    """On CUDA with convolutions, whether their cuDNN workspaces are assumed (the smallest, 0 B) rather
    than measured (calibrated on the GPU); ``None`` on the CPU or without convolutions."""
    calibration: CalibrationSummary | None = None
    """What calibrating the kernels on this machine took; ``None`` when not calibrated."""
    kernel_sources: tuple[KernelSource, ...] | None = None
    """Per op, where the kernel memory came from (calibrated estimates only; ``None`` otherwise)."""
    batch_shapes: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    """Per simulated step, the shapes of its batch's tensors: what the figures are for."""
    reads_values: bool = False
    """Whether the step's code read tensor values (the batch's lengths, masks, positions): the figures
    then hold for batches with these values, not every batch of these shapes."""
    loop: str = "train"
    """What each simulated step ran: ``"train"`` (forward, backward, optimizer step), or one batch of a
    forward-only loop, ``"validate"``, ``"test"`` or ``"predict"`` (``validation_step``, ...)."""
    real_ops: dict[str, int] | None = None
    """Ops whose fake kernel failed and that ran for real on stand-ins of their inputs, with their
    calls (``engine.real_ops``); ``None`` where none did."""
    phase_marks: tuple[PhaseMark, ...] = ()
    """What each simulated step held at the end of its forward, backward and optimizer step, in order
    (the figure published "memory after forward" numbers are): see ``accounting.phase_marks``."""
    replayed_blocks: dict[str, int] | None = None
    """Per group of repeated blocks (its container's path), how many blocks of each step were replayed
    from the events of alike blocks rather than run (``estimate_step(replay_blocks=True)``,
    ``engine.block_replay``); ``None`` where none were (replay off, or a check failed)."""

    def __repr__(self) -> str:
        peaks = ", ".join(f"step {p.step} {p.bytes:,} B" for p in self.peaks)
        flops = "" if self.flops is None else f", {self.flops.total:,} FLOPs"
        approximate = ", approximate" if self.approximate else ""
        modules = sum(1 for _ in self.modules.walk())
        return (
            f"<StepEstimate {self.device} {self.precision}: {peaks}{flops}; {modules:,} modules, "
            f"{len(self.timeline):,} timeline points{approximate}>"
        )

    def __str__(self) -> str:
        """A few lines for people: the peaks, what the higher one holds, the FLOPs, the caveats."""
        approximate = "; APPROXIMATE: a CUDA what-if, simulated on the CPU" if self.approximate else ""
        lines = [
            f"Estimated {self.loop} step ({self.device}, {self.precision}{approximate})",
            f"  peak, first step:   {self.first_step}",
            f"  peak, steady state: {self.steady_state}",
            f"  at that peak: {self.steady_state.breakdown}",
        ]
        if self.flops is not None:
            lines.append(f"  FLOPs: {self.flops}")
        if self.device_bytes is not None and self.reserved_bytes is not None:
            context = format_bytes(self.cuda_context_bytes or 0)
            said = " (assumed: no GPU measured it)" if self.cuda_context_assumed else ""
            reserved = format_bytes(max(self.reserved_bytes))
            total = format_bytes(self.device_bytes)
            lines.append(f"  device: {total} = reserved {reserved} + CUDA context {context}{said}")
        if self.smallest_workspace_peaks is not None:
            least = format_bytes(self.runnable_peak_bytes)
            lines.append(f"  with cuDNN's smallest convolution workspaces the step runs in {least} (slower)")
        if self.cudnn_workspace_assumed:
            lines.append(f"  {CUDNN_WORKSPACE_ASSUMED}")
        if self.data_dependent:
            assumed = sum(r.count for r in self.assumed_reads)
            exact = sum(r.count for r in self.data_dependent) - assumed
            lines.append(
                f"  the step read tensor values {exact + assumed} time(s): {exact} exact (known values), "
                f"{assumed} assumed (see .data_dependent)"
            )
        return "\n".join(lines)

    @property
    def assumed_reads(self) -> tuple[DataDependentRead, ...]:
        """The reads of :attr:`data_dependent` whose answer was assumed, not known (``()``: none)."""
        return tuple(r for r in self.data_dependent or () if not r.exact)

    @property
    def device_bytes(self) -> int | None:
        """On CUDA, what the device holds at the peak: the reserved peak plus the context (what
        ``nvidia-smi`` shows); ``None`` on CPU."""
        if self.reserved_bytes is None or self.cuda_context_bytes is None:
            return None
        return max(self.reserved_bytes) + self.cuda_context_bytes

    @property
    def first_step(self) -> Peak:
        return self.peaks[0]

    @property
    def steady_state(self) -> Peak:
        return self.peaks[-1]

    @property
    def peak_bytes(self) -> int:
        """The largest peak over the simulated steps."""
        return max(p.bytes for p in self.peaks)

    @property
    def runnable_peak_bytes(self) -> int:
        """The least peak the step can run in: :attr:`peak_bytes`, or on CUDA with cuDNN workspaces the
        largest of :attr:`smallest_workspace_peaks` (what the pre-check compares with the budget)."""
        if self.smallest_workspace_peaks is None:
            return self.peak_bytes
        return max(self.smallest_workspace_peaks)

    def to_json(self) -> dict[str, Any]:
        """The plain-data form that ``memest estimate --json`` prints."""
        return {
            "peak_bytes": {"first_step": self.first_step.bytes, "steady_state": self.steady_state.bytes},
            "reserved_bytes": (
                None
                if self.reserved_bytes is None
                else {"first_step": self.reserved_bytes[0], "steady_state": self.reserved_bytes[-1]}
            ),
            "cuda_context_bytes": self.cuda_context_bytes,
            "context_bytes_assumed": self.cuda_context_assumed,
            "smallest_workspace_peak_bytes": (
                None
                if self.smallest_workspace_peaks is None
                else {
                    "first_step": self.smallest_workspace_peaks[0],
                    "steady_state": self.smallest_workspace_peaks[-1],
                }
            ),
            "workspace_bytes_assumed": self.cudnn_workspace_assumed,
            "breakdown_bytes": dict(self.steady_state.breakdown.items()),
            "flops": None
            if self.flops is None
            else {
                "forward": self.flops.forward,
                "backward": self.flops.backward or 0,
                "optimizer": self.flops.optimizer or 0,
                "other": self.flops.other_total,  # elementwise, norms, softmax: apart from the headline
            },
            "estimate_seconds": round(self.estimate_seconds, 4),
            "approximate": self.approximate,
            "loop": self.loop,
            "real_ops": self.real_ops,
            "replayed_blocks": self.replayed_blocks,
            "phase_marks": [
                {
                    "step": m.step,
                    "phase": m.phase.value,
                    "live_bytes": m.live_bytes,
                    "allocated_bytes": m.allocated_bytes,
                }
                for m in self.phase_marks
            ],
            "data_dependent": self.data_dependent_json(),
            "calibration": None
            if self.calibration is None
            else {
                "seconds": round(self.calibration.seconds, 4),
                "measured": self.calibration.measured,
                "cached": self.calibration.cached,
                "failed": list(self.calibration.failed),
            },
        }

    def data_dependent_json(self) -> list[dict[str, Any]] | None:
        """The tensor values the step read, whether each was exact and what was answered (assumed where
        not exact); ``None`` when none."""
        if self.data_dependent is None:
            return None
        return [
            {"op": r.op, "module": r.module, "exact": r.exact, "assumed": r.assumed, "count": r.count}
            for r in self.data_dependent
        ]


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``'1.50 KiB'``; binary units, as memory is sized."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_flops(n: int | float) -> str:
    """``1.8e9`` -> ``'1.80 GFLOP'``; decimal units, as FLOPs are counted."""
    value = float(n)
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(value) < 1000 or unit == "P":
            return f"{int(value)} FLOP" if not unit else f"{value:.2f} {unit}FLOP"
        value /= 1000
    raise AssertionError("unreachable")


def format_share(share: float) -> str:
    """A share as a percentage: ``0.189`` -> ``'18.9 %'``; a small one keeps two figures, so that it
    does not read as nothing (``0.00042`` -> ``'0.042 %'``)."""
    value = 100 * share
    return f"{value:.1f} %" if abs(value) >= 1 or value == 0 else f"{value:.2g} %"


def render_columns(rows: Sequence[Sequence[str]], right_from: int) -> str:
    """Columns two spaces apart; those from ``right_from`` on right-aligned, except in the header.

    >>> print(render_columns([("a", "b"), ("x", "12"), ("yy", "3")], right_from=1))
    a   b
    x   12
    yy   3
    """
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [
            c.rjust(w) if i >= right_from and k > 0 else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@dataclass(frozen=True)
class MeasuredStep:
    """The real peak of one batch, as measured by ``MemEstimate`` (``step``: the training step, 1 or 2;
    1 for a loop's first batch)."""

    step: int
    peak_bytes: int
    reserved_bytes: int | None
    estimated_bytes: int

    @property
    def error_pct(self) -> float:
        """``(estimated - measured) / measured``, in percent."""
        return 100.0 * (self.estimated_bytes - self.peak_bytes) / self.peak_bytes
