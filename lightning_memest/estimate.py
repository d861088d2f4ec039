"""``estimate_step``: a training step simulated on fake tensors, turned into a ``StepEstimate``."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_memest.accounting import attention, flops, kernels
from lightning_memest.accounting.allocator import (
    ROLE_ORDER,
    DevicePeaks,
    Replay,
    replay,
    replay_caching_allocator,
)
from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.accounting.cuda_device import DEFAULT_CONTEXT_BYTES, CudaDevice, library_workspace
from lightning_memest.accounting.kernels import KernelMemory
from lightning_memest.engine.distributed import Strategy
from lightning_memest.engine.events import Alloc, DataDependent, Event, OpCall, OpEvent, Role, Tag
from lightning_memest.engine.simulate import Simulation, simulate
from lightning_memest.engine.step import (
    LossFn,
    OptimizerFactory,
    Phase,
    StepConfig,
    check_precision,
    sum_loss,
)
from lightning_memest.lightning_step import lightning_precision, lightning_runner_factory, lightning_strategy
from lightning_memest.report import (
    Breakdown,
    DataDependentRead,
    ModuleStats,
    Peak,
    StepEstimate,
    TimelinePoint,
)


def estimate_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn = sum_loss,
    optimizer: OptimizerFactory | None = None,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    steps: int = 2,
    strategy: Strategy | None = None,
    gpu: CudaDevice | None = None,
) -> StepEstimate:
    """Estimate the peak memory of training steps of ``model`` on ``batch``, without running them.

    The real step code runs ``steps`` times (forward and ``loss_fn``, backward, ``optimizer.step()``,
    ``zero_grad(set_to_none=True)``) on fake tensors of ``device``; every storage's life is followed.
    Nothing real is allocated for the model or the batch, and ``model`` is left exactly as it was.

    Args:
        model: real, meta-device or fake weights.
        batch: a tensor or nested tuples/lists/dicts of tensors (real or meta); ``loss_fn`` gets it.
        loss_fn: ``loss_fn(model, batch) -> loss``; the default sums the model's output.
        optimizer: an optimizer class or factory called with the trainable parameters
            (``torch.optim.AdamW`` or ``lambda ps: torch.optim.SGD(ps, lr=0.1)``); ``None``: no step.
        precision: Lightning's precision names: ``32-true``, ``16-mixed``, ``bf16-mixed``,
            ``16-true``, ``bf16-true``.
        device: where the step would run; defaults to the model's device (``cpu`` for meta models).
            ``cuda`` on a machine without a GPU is a what-if: the step runs on fake CPU tensors with
            CUDA's optimizer defaults and is accounted through the CUDA caching allocator model
            (``StepEstimate.approximate`` is then true).
        steps: steps to simulate (2: the first step and the steady state).
        strategy: data parallelism, ``DDP(world_size)`` or ``FSDP(world_size)`` from
            ``lightning_memest``: the step runs as rank 0 of it, with PyTorch's own DDP / FSDP2 code on
            a fake process group, and every figure is one rank's. ``loss_fn`` then gets the DDP wrapper
            (under FSDP the model itself, sharded).
        gpu: for ``device="cuda"``, the GPU (``CudaDevice``: its compute capability picks cuBLAS's
            workspace size, its context is reported apart); default: this machine's GPU, else an
            unknown one (PyTorch's pre-Hopper defaults, an assumed context).

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        >>> est = estimate_step(model, torch.randn(32, 1024), optimizer=torch.optim.Adam)
        >>> est.steady_state.breakdown.parameters  # (1024 * 1024 + 1024 + 1024 * 10 + 10) * 4 bytes
        4239400
        >>> est.steady_state.breakdown.optimizer_state  # exp_avg, exp_avg_sq, and four step counters
        8478816
    """
    checked = check_precision(precision)
    sim = simulate_step(
        model,
        batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        precision=checked,
        device=device,
        steps=steps,
        strategy=strategy,
    )
    return estimate_from(model, sim, checked, gpu)


def simulate_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn = sum_loss,
    optimizer: OptimizerFactory | None = None,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    steps: int = 2,
    flops: bool = True,
    strategy: Strategy | None = None,
) -> Simulation:
    """The simulation ``estimate_step`` reports on; ``flops=False`` records only what memory needs
    (for callers that want :func:`peak_bytes` alone, such as the batch-size search)."""
    config = StepConfig(loss_fn, optimizer, check_precision(precision), strategy)
    return simulate(
        model, batch, config, device=device, steps=steps, capture=_captured if flops else _for_memory
    )


def estimate_lightning_step(
    trainer: pl.Trainer, module: pl.LightningModule, batch: Any, *, steps: int = 2
) -> StepEstimate:
    """Estimate training batches of a LightningModule as ``trainer`` would run them.

    Runs the module's own ``training_step`` (automatic or manual optimization),
    ``configure_optimizers``, the trainer's precision, gradient accumulation and clipping, on fake
    tensors of the device the trainer trains on (see ``lightning_memest.lightning_step``). The
    module must be attached to ``trainer`` (as it is from ``setup`` on). ``batch`` is a batch as the
    train dataloader yields it.
    """
    sim = simulate_lightning_step(trainer, module, batch, steps=steps)
    return estimate_from(module, sim, lightning_precision(trainer))


def simulate_lightning_step(
    trainer: pl.Trainer, module: pl.LightningModule, batch: Any, *, steps: int = 2, flops: bool = True
) -> Simulation:
    """The simulation ``estimate_lightning_step`` reports on (``flops`` as in :func:`simulate_step`)."""
    strategy = lightning_strategy(trainer)
    return simulate(
        module,
        batch,
        lightning_runner_factory(trainer, strategy),
        device=trainer.strategy.root_device,
        steps=steps,
        capture=_captured if flops else _for_memory,
        precision=lightning_precision(trainer),
        strategy=strategy,
    )


def peak_bytes(sim: Simulation, gpu: CudaDevice | None = None) -> int:
    """The largest peak over a simulation's steps, exactly as ``StepEstimate.peak_bytes`` would say,
    without building the report."""
    if _is_cuda(sim):
        return max(_device_peaks(sim, _gpu(sim, gpu)).allocated)
    return max(p.live_bytes for p in replay(sim.events, sim.steps, kernels.kernel_memory).peaks)


@dataclass(frozen=True)
class PeakProfile:
    """A simulation's peak (as :func:`peak_bytes`) and its memory curve: the exact live bytes at each
    op's high point after setup, in op order. Two profiles of one model at different batch sizes run
    the same ops, so each point of the curve is (nearly) affine in the batch size: the batch-size
    search predicts the peak at any size as the highest of those lines, where the peak moves from
    the optimizer step to the backward pass as the batch grows."""

    peak: int
    curve: tuple[int, ...]


def peak_profile(sim: Simulation, gpu: CudaDevice | None = None) -> PeakProfile:
    """:func:`peak_bytes` and the memory curve of ``sim`` (see :class:`PeakProfile`)."""
    result = replay(sim.events, sim.steps, kernels.kernel_memory)
    curve = tuple(s.live_bytes for s in result.samples if s.event.phase is not Phase.SETUP)
    # On CPU the peak is this replay's (no second one); on CUDA the allocator model's.
    peak = peak_bytes(sim, gpu) if _is_cuda(sim) else max(p.live_bytes for p in result.peaks)
    return PeakProfile(peak, curve)


def estimate_from(
    model: nn.Module, sim: Simulation, precision: str, gpu: CudaDevice | None = None
) -> StepEstimate:
    """Account for a simulation's events and build the report (``gpu`` as in :func:`estimate_step`)."""
    steps = sim.steps
    result = replay(sim.events, steps, kernels.kernel_memory)
    flop_count = flops.count_flops(sim.events)
    peaks = _peaks(result)
    reserved: tuple[int, ...] | None = None
    context: int | None = None
    if _is_cuda(sim):
        # What torch.cuda.max_memory_allocated/reserved count; the breakdown stays in exact bytes.
        device = _gpu(sim, gpu)
        device_peaks = _device_peaks(sim, device)
        context = device.context_bytes
        peaks = tuple(
            dataclasses.replace(p, bytes=b) for p, b in zip(peaks, device_peaks.allocated, strict=False)
        )
        reserved = device_peaks.reserved
    return StepEstimate(
        device="cuda" if sim.what_if == "cuda" else str(sim.device),
        precision=precision,
        peaks=peaks,
        modules=_module_tree(model, sim.events, result, flop_count),
        timeline=tuple(
            TimelinePoint(
                s.event.index, s.event.step + 1, s.event.phase, s.event.module, s.event.op, s.live_bytes
            )
            for s in result.samples
        ),
        data_dependent=_data_dependent_reads(sim.events),
        reserved_bytes=reserved,
        flops=flop_count,
        estimate_seconds=sim.seconds,
        approximate=sim.what_if is not None,
        cuda_context_bytes=context,
    )


def _is_cuda(sim: Simulation) -> bool:
    return sim.device.type == "cuda" or sim.what_if == "cuda"


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


def _device_peaks(sim: Simulation, gpu: CudaDevice) -> DevicePeaks:
    """Whole blocks of the caching allocator and its segments, with the libraries' workspaces. A
    what-if ran CPU kernels: their (oneDNN) kernel models do not apply to CUDA."""
    what_if = sim.what_if is not None

    def cuda_kernel(call: OpCall) -> KernelMemory | None:
        # A what-if ran CPU kernels: the oneDNN models do not apply; SDPA's CUDA backend does.
        return attention.cuda_what_if_memory(call, gpu.capability) if what_if else kernels.kernel_memory(call)

    return replay_caching_allocator(
        sim.events,
        sim.steps,
        _cuda_allocator_model(),
        cuda_kernel,
        lambda op: library_workspace(op, gpu.capability),
    )


def _cuda_allocator_model() -> CudaCachingAllocator:
    """The caching allocator configured as this process's would be (PYTORCH_CUDA_ALLOC_CONF)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    return CudaCachingAllocator.from_alloc_conf(conf)


def _for_memory(op: torch._ops.OpOverload) -> bool:
    """Ops whose full call the memory accounting needs: those with a kernel memory model (and CPU
    attention, whose CUDA backend a what-if models)."""
    return kernels.kernel_model_for(op) is not None or op is attention.CPU_ATTENTION


def _captured(op: torch._ops.OpOverload) -> bool:
    """Ops whose full call the accounting needs: kernel memory models and FLOP formulas."""
    return _for_memory(op) or flops.captures_flops(op)


def _peaks(result: Replay) -> tuple[Peak, ...]:
    peaks = []
    for p in result.peaks:
        values = dict(zip([r.value for r in ROLE_ORDER] + ["temporaries"], p.by_role, strict=True))
        peaks.append(
            Peak(
                step=p.step + 1,
                bytes=p.live_bytes,
                breakdown=Breakdown(**values),
                op_index=p.event.index,
                op=p.event.op,
                phase=p.event.phase,
                module=p.event.module,
            )
        )
    return tuple(peaks)


def _data_dependent_reads(events: Sequence[Event]) -> tuple[DataDependentRead, ...] | None:
    counts = Counter((e.op, e.module, e.assumed) for e in events if isinstance(e, DataDependent))
    if not counts:
        return None
    return tuple(DataDependentRead(op, module, assumed, n) for (op, module, assumed), n in counts.items())


def _within(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def _module_tree(
    model: nn.Module, events: Sequence[Event], result: Replay, flop_count: flops.FlopCount
) -> ModuleStats:
    """Per-module figures of the first step; each module's figures include its children's."""
    saved: Counter[str] = Counter()
    sizes: dict[int, int] = {}
    seen: set[int] = set()
    parameters: dict[str, int] = {}  # parameter path -> storage handle
    for e in events:
        if type(e) is OpEvent and e.step > 0:
            break  # the first step's figures
        if type(e) is Alloc:
            sizes[e.storage] = e.nbytes
        elif type(e) is Tag:
            if e.role is Role.PARAMETER:
                parameters.setdefault(e.module, e.storage)
            elif (
                e.role is Role.ACTIVATION
                and e.storage not in seen
                and result.roles.get(e.storage) is Role.ACTIVATION
            ):
                seen.add(e.storage)
                saved[e.module] += sizes.get(e.storage, 0)
    forward_high: dict[str, int] = {}
    backward_high: dict[str, int] = {}
    for s in result.samples:
        if s.event.step != 0:
            continue
        table = (
            forward_high
            if s.event.phase is Phase.FORWARD
            else backward_high
            if s.event.phase is Phase.BACKWARD
            else None
        )
        if table is None:
            continue
        path = s.event.module
        # The op counts for its module and every ancestor.
        while True:
            if s.live_bytes > table.get(path, -1):
                table[path] = s.live_bytes
            if not path:
                break
            path = path.rpartition(".")[0]

    module_flops = {m.path: m for m in flop_count.modules}

    def build(path: str, module: nn.Module) -> ModuleStats:
        counted = module_flops.get(path)
        children = tuple(
            build(f"{path}.{name}" if path else name, child) for name, child in module.named_children()
        )
        return ModuleStats(
            path=path,
            type_name=type(module).__name__,
            parameter_bytes=sum(sizes[h] for h in {h for p, h in parameters.items() if _within(p, path)}),
            saved_bytes=sum(n for p, n in saved.items() if _within(p, path)),
            forward_peak_bytes=forward_high.get(path),
            backward_peak_bytes=backward_high.get(path),
            forward_flops=None if counted is None else counted.forward,
            backward_flops=None if counted is None or path not in backward_high else counted.backward,
            children=children or None,
        )

    return build("", model)
