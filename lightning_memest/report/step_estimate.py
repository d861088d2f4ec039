"""The estimate of a step (``StepEstimate``) and its parts: peaks with their breakdowns by role, the
timeline, phase marks, the tensor values read, where kernel memory came from, and the measured figure
it is checked against (``MeasuredStep``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from lightning_memest.engine.events import Phase
from lightning_memest.report.flops import FlopCount
from lightning_memest.report.formatting import format_bytes
from lightning_memest.report.modules import ModuleStats

__all__ = [
    "CUDNN_WORKSPACE_ASSUMED",
    "Breakdown",
    "CalibrationSummary",
    "DataDependentRead",
    "KernelSource",
    "MeasuredStep",
    "Peak",
    "PhaseMark",
    "StepEstimate",
    "TimelinePoint",
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
    it (see ``engine.values.data_dependent``)."""
    count: int
    exact: bool = False
    bound: bool = False
    """Where not :attr:`exact`, whether the answer is an upper bound of the real one (the largest output
    the inputs allow: memory is not under-estimated there); otherwise the real values could make the
    step need more than the estimate (:attr:`may_lower`)."""

    @property
    def may_lower(self) -> bool:
        """Whether the real values could have made the step need more memory than estimated: an assumed
        answer that is no upper bound (a neutral ``.item()``, a branch, a loop count, a guessed count)."""
        return not (self.exact or self.bound)

    def describe(self) -> str:
        """The read in a user's words: ``.item()``-style scalar reads are named as such."""
        what = "a scalar read (.item(), bool(), int())" if "_local_scalar_dense" in self.op else self.op
        if self.exact:
            answer = f"exact, {self.assumed}"
        else:
            answer = f"assumed {self.assumed}, {'an upper bound' if self.bound else 'could be low'}"
        return f"{what} in {self.module or '(root)'} x{self.count}: {answer}"


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
    than measured: True unless a calibration on the GPU measured every convolution's signature (one
    that failed to calibrate keeps the assumption); ``None`` on the CPU or without convolutions."""
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
    ``engine.replay.block_replay``); ``None`` where none were (replay off, or a check failed)."""
    replay_note: str | None = None
    """Why alike blocks were not replayed (the first check that failed, per container), or that the
    step was simulated again without replay and why: where a replayed estimate would have been faster;
    ``None`` otherwise."""
    compiled: tuple[str, ...] = ()
    """The modules ``torch.compile`` compiles (their paths; ``""``: the whole model), simulated as
    compiled (``compiled_graphs``) unless ``compiled_eagerly`` says why not. Left compiled for the run."""
    compiled_eagerly: str | None = None
    """Where compiled code was simulated eagerly, why (asked for, or its compile failed on fake
    tensors): the figures are then the eager step's, and a compiled step's peak differs, in either
    direction. ``None`` where it was simulated as compiled."""
    compiled_graphs: tuple[str, ...] = ()
    """The graphs inductor compiled that the simulated steps ran, on fake tensors, in call order (their
    AOT ids: ``0_forward``, ``0_backward``); empty where none ran."""
    compile_seconds: float = 0.0
    """Of ``estimate_seconds``, what compiling took (dynamo, AOTAutograd, inductor; cache hits are
    fast: the run's first step finds the graphs the estimate compiled)."""
    eval_modules: tuple[str, ...] = ()
    """The outermost modules that were in eval mode, and were simulated so (no dropout, running
    statistics used): Lightning's fit runs each module in the mode the user left it in."""
    followed_note: str | None = None
    """Where the step failed on an assumed read and was simulated again on this batch's values and the
    model's weights (an adaptive solver's step count, a range check: ``engine.values.followed_values``),
    the failure; the figures then hold for this batch and these weights, and the reads decided by them
    are listed as ones that could lower the estimate. ``None`` otherwise."""
    out_of_memory: str | None = None
    """On CUDA with the GPU's memory known (``CudaDevice.total_bytes``, ``--gpu-memory``): where the
    caching allocator, its cache released and the request retried, still had no room -- where the real
    step raises ``torch.OutOfMemoryError``; ``None`` where it fits. The figures then say what the step
    would need."""

    def __repr__(self) -> str:
        peaks = ", ".join(f"step {p.step} {p.bytes:,} B" for p in self.peaks)
        flops = "" if self.flops is None else f", {self.flops.total:,} FLOPs"
        approximate = ", approximate" if self.approximate else ""
        modules = sum(1 for _ in self.modules.walk())
        return (
            f"<StepEstimate {self.device} {self.precision}: {peaks}{flops}; {modules:,} modules, "
            f"{len(self.timeline):,} timeline points{approximate}>"
        )

    @property
    def compiled_note(self) -> str | None:
        """How compiled code was simulated, in a line (``None`` where the step compiled nothing).

        >>> StepEstimate.__new__(StepEstimate).compiled_note is None  # (an estimate of an eager step)
        True
        """
        names = ", ".join(m or "(root)" for m in self.compiled)
        if self.compiled_eagerly is not None:
            why = f"{self.compiled_eagerly}; a compiled step's peak differs"
            return f"compiled, simulated eagerly ({why}): {names}"
        if not self.compiled_graphs:
            return f"compiled, simulated as its backend runs it: {names}" if self.compiled else None
        graphs = len(set(self.compiled_graphs))
        plan = "inductor's buffer plan"
        if self.approximate:
            plan = "inductor's CPU buffer plan: a CUDA what-if compiles for the CPU"
        where = f": {names}" if names else ""
        return f"compiled, simulated as compiled ({graphs} graphs, {plan}){where}"

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
        if self.compiled_note is not None:
            lines.append(f"  {self.compiled_note}")
        if self.eval_modules and self.loop == "train":
            lines.append(
                f"  in eval mode, simulated so: {', '.join(m or '(root)' for m in self.eval_modules)}"
            )
        if self.data_dependent:
            assumed = sum(r.count for r in self.assumed_reads)
            exact = sum(r.count for r in self.data_dependent) - assumed
            lowering = sum(r.count for r in self.lowering_reads)
            could = f"; {lowering} could have lowered the estimate (no upper bound)" if lowering else ""
            lines.append(
                f"  the step read tensor values {exact + assumed} time(s): {exact} exact (known values), "
                f"{assumed} assumed (see .data_dependent){could}"
            )
        if self.out_of_memory:
            lines.append(f"  DOES NOT FIT: {self.out_of_memory}")
        if self.followed_note:
            lines.append(
                "  followed on this batch's values and weights (its code failed on assumed ones): "
                "another batch, or weights later in training, may take another path"
            )
        return "\n".join(lines)

    @property
    def assumed_reads(self) -> tuple[DataDependentRead, ...]:
        """The reads of :attr:`data_dependent` whose answer was assumed, not known (``()``: none)."""
        return tuple(r for r in self.data_dependent or () if not r.exact)

    @property
    def lowering_reads(self) -> tuple[DataDependentRead, ...]:
        """The assumed reads that could have lowered the estimate: answered neither exactly nor with an
        upper bound (``DataDependentRead.may_lower``; ``()``: none)."""
        return tuple(r for r in self.data_dependent or () if r.may_lower)

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
            "replay_note": self.replay_note,
            "compiled": list(self.compiled),
            "compiled_eagerly": self.compiled_eagerly,
            "compiled_graphs": list(self.compiled_graphs),
            "compile_seconds": round(self.compile_seconds, 4),
            "eval_modules": list(self.eval_modules),
            "followed_note": self.followed_note,
            "out_of_memory": self.out_of_memory,
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
        """The tensor values the step read, whether each was exact, what was answered (assumed where
        not exact) and whether that answer is an upper bound (``bound``: it cannot lower the estimate);
        ``None`` when none."""
        if self.data_dependent is None:
            return None
        return [
            {
                "op": r.op,
                "module": r.module,
                "exact": r.exact,
                "assumed": r.assumed,
                "bound": r.bound,
                "count": r.count,
            }
            for r in self.data_dependent
        ]


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
