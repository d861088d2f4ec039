"""Events -> ``StepEstimate``: the accounting of a simulation, composed in one place.

:func:`account` walks the simulation's event stream once with the observers that make the report --
live bytes with the models of the device's kernels (``accounting.kernels.kernel_fn``), FLOPs,
per-module figures, the tensor values read, and on CUDA the caching allocator model configured as this
process's would be (``PYTORCH_CUDA_ALLOC_CONF``) with the libraries' workspaces and the kernel models
of the device accounted for -- and builds the report. :func:`peak_bytes` and :func:`peak_profile` are
the cheap forms the batch-size search needs. :func:`capture_filter` tells the engine which ops' full
calls the accounting will read.

Example:
    >>> import torch
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> model, batch = torch.nn.Linear(8, 8), torch.randn(4, 8)
    >>> sim = simulate(model, batch, StepConfig(), capture=capture_filter(flops=True))
    >>> est = account(sim)
    >>> est.peak_bytes == peak_bytes(sim), est.flops.forward  # 2 x 4 x 8 x 8
    (True, 512)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
from torch._ops import OpOverload

from lightning_memest.accounting.attribution import DataDependentReads, ModuleFigures, module_tree
from lightning_memest.accounting.cuda_alloc_conf import environment_alloc_conf
from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.accounting.cuda_device import DEFAULT_CONTEXT_BYTES, CudaDevice, library_workspace
from lightning_memest.accounting.flops import FlopObserver, captures_flops
from lightning_memest.accounting.kernels import (
    CalibratedKernels,
    Calibration,
    KernelFn,
    captures_for_calibration,
    captures_kernel,
    kernel_fn,
)
from lightning_memest.accounting.kernels.cudnn_workspace import (
    convolutions,
    has_elastic_workspace,
    smallest_workspaces,
    workspaces_assumed,
)
from lightning_memest.accounting.phase_marks import PhaseMarks
from lightning_memest.accounting.replay import (
    ROLE_ORDER,
    CachingAllocatorReplay,
    LiveBytes,
    Observer,
    StepPeak,
    final_roles,
    walk,
)
from lightning_memest.engine.collector import collector_off, full_collections_paused
from lightning_memest.engine.events import OpEvent, Phase, Role
from lightning_memest.engine.simulate import Simulation
from lightning_memest.engine.tracker import CaptureFilter
from lightning_memest.report import Breakdown, KernelSource, Peak, StepEstimate, TimelinePoint
from lightning_memest.report.formatting import format_bytes

__all__ = ["PeakProfile", "account", "capture_filter", "live_bytes", "peak_bytes", "peak_profile"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _without_cyclic_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` with the cyclic garbage collector paused: a walk makes an object or more per event, and
    the collector's full collections of a heap holding a simulation's events (~0.3 s each with torch
    loaded) had taken two thirds of a 32-layer decoder's accounting (0.34 -> 0.12 s). Nothing here
    depends on when garbage is collected; what a walk leaves is collected once it is back."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with collector_off():
            return fn(*args, **kwargs)

    return paused


def capture_filter(*, flops: bool, calibrate: bool = False) -> CaptureFilter:
    """The ops whose full call the accounting reads: those with a kernel model, with ``calibrate``
    every op calibration can measure, and with ``flops`` those with a FLOP formula (``flops=False``
    for callers that need only memory, such as the batch-size search)."""
    kernels = captures_for_calibration if calibrate else captures_kernel
    if not flops:
        return kernels

    def with_flops(op: OpOverload) -> bool:
        return kernels(op) or captures_flops(op)

    return with_flops


def _gpu(sim: Simulation, gpu: CudaDevice | None) -> CudaDevice:
    if gpu is not None:
        return gpu
    if sim.device.type == "cuda":
        return CudaDevice.local(sim.device)
    if torch.cuda.is_available():  # a what-if on a GPU machine (to measure it): this GPU's capability
        return dataclasses.replace(
            CudaDevice.local(torch.device("cuda")), context_bytes=DEFAULT_CONTEXT_BYTES
        )
    return CudaDevice()


def _caching_allocator(sim: Simulation, gpu: CudaDevice, kernels: KernelFn) -> CachingAllocatorReplay:
    """The caching allocator configured as this process's would be (``PYTORCH_CUDA_ALLOC_CONF``),
    with the libraries' workspaces of ``gpu``."""
    # The device's memory, where known, less the context: what the allocator can reserve before it
    # releases its cache and retries, then runs out (CudaCachingAllocator.out_of_memory).
    capacity = gpu.total_bytes - gpu.context_bytes if gpu.total_bytes is not None else None
    return CachingAllocatorReplay(
        CudaCachingAllocator.from_alloc_conf(environment_alloc_conf(), capacity),
        sim.steps,
        kernels,
        lambda op: library_workspace(op, gpu.capability),
    )


@dataclass
class _Memory:
    """The memory observers of a simulation: exact live bytes, and on CUDA the caching allocator."""

    live: LiveBytes
    device: CachingAllocatorReplay | None
    gpu: CudaDevice | None
    kernels: KernelFn

    @staticmethod
    def of(
        sim: Simulation,
        gpu: CudaDevice | None,
        calibration: Calibration | None,
        roles: dict[int, Role] | None = None,
    ) -> _Memory:
        # Both the exact live bytes and the device allocator take the kernels of the device accounted
        # for: in a CUDA what-if (CPU kernels ran) the CUDA what-if models, not oneDNN's workspaces.
        cuda = _gpu(sim, gpu) if sim.is_cuda else None
        capability = cuda.capability if cuda is not None else None
        if sim.what_if is not None:
            kernels = kernel_fn("cuda", what_if=True, capability=capability)
        else:
            kernels = kernel_fn(
                sim.device.type, what_if=False, capability=capability, calibration=calibration
            )
        live = LiveBytes(final_roles(sim.events) if roles is None else roles, sim.steps, kernels)
        if cuda is None:
            return _Memory(live, None, None, kernels)
        return _Memory(live, _caching_allocator(sim, cuda, kernels), cuda, kernels)

    @property
    def observers(self) -> tuple[Observer, ...]:
        return (self.live,) if self.device is None else (self.live, self.device)

    def peak(self) -> int:
        """The largest peak: the caching allocator's on CUDA (whole blocks), else the exact one."""
        if self.device is not None:
            return max(self.device.peaks.allocated)
        return max(p.live_bytes for p in self.live.peaks)


def live_bytes(sim: Simulation, calibration: Calibration | None = None) -> LiveBytes:
    """The observer of a simulation's exact live bytes as :func:`account` configures it (the kernels
    that ran, measured ones where ``calibration`` has them), not yet walked: for a caller that walks
    the events with observers of its own beside it (the checkpointing planner)."""
    return _Memory.of(sim, None, calibration).live


@_without_cyclic_gc
def peak_bytes(sim: Simulation, gpu: CudaDevice | None = None, calibration: Calibration | None = None) -> int:
    """The largest peak over a simulation's steps, exactly as ``StepEstimate.peak_bytes`` would say,
    without building the report (``gpu``: the GPU of a CUDA simulation, as in ``estimate_step``;
    ``calibration``: the measured kernels, as in :func:`account`)."""
    memory = _Memory.of(sim, gpu, calibration)
    walk(sim.events, *memory.observers)
    return memory.peak()


@dataclass(frozen=True)
class PeakProfile:
    """A simulation's peak (as :func:`peak_bytes`) and its memory curve: the exact live bytes at each
    op's high point after setup, in op order. Two profiles of one model at different batch sizes run
    the same ops, so each point of the curve is (nearly) affine in the batch size: the batch-size
    search predicts the peak at any size as the highest of those lines, where the peak moves from
    the optimizer step to the backward pass as the batch grows."""

    peak: int
    curve: tuple[int, ...]


@_without_cyclic_gc
def peak_profile(
    sim: Simulation, gpu: CudaDevice | None = None, calibration: Calibration | None = None
) -> PeakProfile:
    """:func:`peak_bytes` and the memory curve of ``sim`` (see :class:`PeakProfile`), in one walk."""
    memory = _Memory.of(sim, gpu, calibration)
    walk(sim.events, *memory.observers)
    curve = tuple(s.live_bytes for s in memory.live.samples if s.event.phase is not Phase.SETUP)
    return PeakProfile(memory.peak(), curve)


@_without_cyclic_gc
def _kernel_sources(sim: Simulation, kernels: KernelFn) -> tuple[KernelSource, ...] | None:
    """Where each op event's kernel memory came from, for a calibrated estimate (else ``None``)."""
    if not isinstance(kernels, CalibratedKernels):
        return None
    return kernels.sources(e.call for e in sim.events if type(e) is OpEvent and e.call is not None)


def account(
    sim: Simulation,
    gpu: CudaDevice | None = None,
    calibration: Calibration | None = None,
    loop: str = "train",
) -> StepEstimate:
    """The report of a simulation: peaks with their breakdowns, per-module figures, the timeline, FLOPs
    (of the ops the engine captured: simulate with ``capture_filter(flops=True)``), the tensor values
    read, and on CUDA the allocator's and the device's figures (``gpu`` as in ``estimate_step``).
    With a ``calibration`` of the simulation's device (``accounting.kernels.calibrate``), measured
    kernel memory takes the place of the hand models wherever it has the signature. ``loop`` names
    what the simulated steps ran (``"train"``; a forward-only ``"validate"``, ``"test"``, ``"predict"``)."""
    with full_collections_paused():  # engine/collector.py: the walk makes an object per op
        return _account(sim, gpu, calibration, loop)


def _account(
    sim: Simulation, gpu: CudaDevice | None, calibration: Calibration | None, loop: str
) -> StepEstimate:
    roles = final_roles(sim.events)
    memory = _Memory.of(sim, gpu, calibration, roles)
    flops = FlopObserver()
    modules = ModuleFigures(roles)
    reads = DataDependentReads()
    marks = PhaseMarks(memory.live, memory.device)
    walk(sim.events, marks, *memory.observers, flops, modules, reads)
    live = memory.live
    peaks = tuple(_peak(p) for p in live.peaks)
    reserved: tuple[int, ...] | None = None
    context: int | None = None
    assumed: bool | None = None
    smallest: tuple[int, ...] | None = None
    workspace_assumed: bool | None = None
    out_of_memory: str | None = None
    if memory.device is not None and memory.gpu is not None:
        out_of_memory = _out_of_memory(memory.device, memory.gpu)
        # What torch.cuda.max_memory_allocated/reserved count; the breakdown stays in exact bytes.
        device_peaks = memory.device.peaks
        peaks = tuple(
            dataclasses.replace(p, bytes=b) for p, b in zip(peaks, device_peaks.allocated, strict=False)
        )
        reserved = device_peaks.reserved
        context = memory.gpu.context_bytes
        assumed = memory.gpu.context_assumed
        convs = convolutions(sim.events)
        if has_elastic_workspace(convs, memory.kernels):
            smallest = _smallest_workspace_peaks(sim, memory.gpu, memory.kernels)
        if convs:
            workspace_assumed = workspaces_assumed(convs, memory.kernels)
    return StepEstimate(
        device="cuda" if sim.what_if == "cuda" else str(sim.device),
        precision=sim.precision,
        peaks=peaks,
        modules=module_tree(sim.modules, modules, live.samples, flops.count),
        timeline=tuple(
            TimelinePoint(
                s.event.index, s.event.step + 1, s.event.phase, s.event.module, s.event.op, s.live_bytes
            )
            for s in live.samples
        ),
        data_dependent=reads.reads,
        reserved_bytes=reserved,
        flops=flops.count,
        estimate_seconds=sim.seconds + (calibration.seconds if calibration is not None else 0.0),
        approximate=sim.what_if is not None,
        cuda_context_bytes=context,
        cuda_context_assumed=assumed,
        smallest_workspace_peaks=smallest,
        cudnn_workspace_assumed=workspace_assumed,
        calibration=calibration.summary() if calibration is not None else None,
        kernel_sources=_kernel_sources(sim, memory.kernels),
        batch_shapes=sim.batch_shapes,
        reads_values=sim.value_reads > 0,
        loop=loop,
        real_ops=dict(sim.real_ops) if sim.real_ops else None,
        phase_marks=tuple(marks.marks),
        replayed_blocks=dict(sim.replayed_blocks) if sim.replayed_blocks else None,
        replay_note=sim.replay_note,
        compiled=sim.compiled,
        compiled_eagerly=sim.compiled_eagerly,
        compiled_graphs=sim.compiled_graphs,
        compile_seconds=sim.compile_seconds,
        eval_modules=sim.eval_modules,
        followed_note=sim.followed_note,
        out_of_memory=out_of_memory,
    )


def _out_of_memory(device: CachingAllocatorReplay, gpu: CudaDevice) -> str | None:
    """Where the replayed allocator first ran out of the device, in PyTorch's words, or ``None``."""
    failed, at = device.allocator.out_of_memory, device.out_of_memory_at
    if failed is None or at is None or gpu.total_bytes is None:
        return None
    op, step = at
    where = f" at {op.op} in {op.module or '(root)'} ({op.phase.value})" if op is not None else ""
    return (
        f"CUDA out of memory in step {step + 1}{where}: tried to allocate {format_bytes(failed.requested)} "
        f"with {format_bytes(failed.allocated)} allocated and {format_bytes(failed.reserved)} reserved, "
        f"its cache released, of the {format_bytes(failed.capacity)} left to the allocator (the GPU's "
        f"{format_bytes(gpu.total_bytes)} less the CUDA context)"
    )


def _smallest_workspace_peaks(sim: Simulation, gpu: CudaDevice, kernels: KernelFn) -> tuple[int, ...]:
    """The allocated peaks with every cuDNN convolution's workspace at its smallest
    (``kernels.cudnn_workspace``): a second walk of the caching allocator."""
    device = _caching_allocator(sim, gpu, smallest_workspaces(kernels))
    walk(sim.events, device)
    return device.peaks.allocated


def _peak(p: StepPeak) -> Peak:
    values = dict(zip([r.value for r in ROLE_ORDER] + ["temporaries", "workspaces"], p.by_role, strict=True))
    return Peak(
        step=p.step + 1,
        bytes=p.live_bytes,
        breakdown=Breakdown(**values),
        op_index=p.event.index,
        op=p.event.op,
        phase=p.event.phase,
        module=p.event.module,
    )
