"""Memory that real kernels allocate beyond what their fake (meta) kernels report, per kind of run.

Where each concept lives: ``model.py`` (what a model answers, the registries), ``calibrate.py`` (the
machine's own kernels measured, per op signature, cached), and the hand models: ``cpu.py`` (oneDNN
arithmetic; matrix products, normalization, reductions), ``cpu_conv.py`` (convolutions),
``cpu_rnn.py`` (the LSTM), ``cpu_collectives.py`` (gloo's collectives), ``cuda_attention.py`` (SDPA's
CUDA backends, for what-ifs). A new hand model is a small function registered in the file of its
device and op family.

This module holds the policy: :func:`kernel_fn` says who speaks for a simulation -- a calibration of
its device where it has the signature, else the hand models: CPU models for a run on the CPU, CUDA
models for a run on a GPU, and for a CUDA what-if (CPU kernels ran, CUDA is accounted) the what-if
models: the oneDNN models do not apply to CUDA.

Example:
    >>> import torch
    >>> fn = kernel_fn("cpu", what_if=False)
    >>> g = TensorMeta.of(torch.empty(1).expand(512, 64))  # a stride-0 gradient, as sum's backward makes
    >>> a, out = TensorMeta.of(torch.empty(64, 512)), TensorMeta.of(torch.empty(512, 512))
    >>> fn(OpCall(torch.ops.aten.mm.default, (g, a), {}, (out,), "cpu")).workspace_bytes  # BLAS's copy
    131072
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch._ops import OpOverload

# Imported for their registrations.
from lightning_memest.accounting.kernels import (  # noqa: F401
    cpu,
    cpu_collectives,
    cpu_conv,
    cpu_rnn,
    cuda_attention,
)
from lightning_memest.accounting.kernels.calibrate import Calibration, calibratable, outputs_only
from lightning_memest.accounting.kernels.measured_ops import MEASURED_CPU_OPS, MeasuredOps
from lightning_memest.accounting.kernels.model import (
    CPU_KERNELS,
    CUDA_KERNELS,
    CUDA_WHAT_IF_KERNELS,
    Capability,
    CudaKernelModel,
    KernelMemory,
    KernelModel,
)
from lightning_memest.engine.events import OpCall, TensorMeta
from lightning_memest.registry import OpRegistry
from lightning_memest.report import KernelSource

__all__ = [
    "CPU_KERNELS",
    "CUDA_KERNELS",
    "CUDA_WHAT_IF_KERNELS",
    "CalibratedKernels",
    "Calibration",
    "KernelFn",
    "KernelMemory",
    "KernelModel",
    "OpCall",
    "TensorMeta",
    "captures_for_calibration",
    "captures_kernel",
    "kernel_fn",
    "kernel_memory",
]

#: What the accounting calls per captured op: the kernel memory of the call, ``None`` for nothing.
KernelFn = Callable[[OpCall], "KernelMemory | None"]


def _significant(result: KernelMemory | None) -> KernelMemory | None:
    if result is None or (result.workspace_bytes <= 0 and result.extra_output_bytes is None):
        return None
    return result


def kernel_memory(call: OpCall) -> KernelMemory | None:
    """What the real CPU kernel of ``call`` allocates beyond its fake outputs; ``None`` when nothing."""
    model = CPU_KERNELS.lookup(call.op)
    return None if model is None else _significant(model(call))


def _cuda(registry: OpRegistry[CudaKernelModel], capability: Capability) -> KernelFn:
    def fn(call: OpCall) -> KernelMemory | None:
        model = registry.lookup(call.op)
        return None if model is None else _significant(model(call, capability))

    return fn


def _hand(device_type: str, what_if: bool, capability: Capability) -> tuple[KernelFn, OpRegistry[Any]]:
    if what_if:
        return _cuda(CUDA_WHAT_IF_KERNELS, capability), CUDA_WHAT_IF_KERNELS
    if device_type == "cuda":
        return _cuda(CUDA_KERNELS, capability), CUDA_KERNELS
    return kernel_memory, CPU_KERNELS


def kernel_fn(
    device_type: str,
    *,
    what_if: bool,
    capability: Capability = None,
    calibration: Calibration | None = None,
) -> KernelFn:
    """The kernel memory of a simulation on ``device_type`` (``what_if``: a CUDA what-if, which ran on
    the CPU; ``capability`` is the GPU's, for CUDA models): the hand models, or with a ``calibration``
    of that device the measured figure of each calibrated signature and the hand model elsewhere
    (:class:`CalibratedKernels`)."""
    hand, registry = _hand(device_type, what_if, capability)
    if calibration is None or what_if or calibration.device != device_type:
        # A CPU run measures the few ops no hand model can speak for (measured_ops.py).
        return MeasuredOps(hand) if device_type == "cpu" and not what_if else hand
    return CalibratedKernels(calibration, hand, registry)


class CalibratedKernels:
    """Measured kernel memory where the calibration has the call's signature, the hand model elsewhere;
    it says, per op, where its answers came from (:meth:`sources`). Answers are remembered per call
    object, so the two replays of a CUDA simulation look each signature up once (and a replayed
    block's events, which share their template's call objects, too)."""

    def __init__(self, calibration: Calibration, hand: KernelFn, registry: OpRegistry[Any]) -> None:
        self.calibration = calibration
        self.hand = hand
        self.registry = registry
        self._memo: dict[int, tuple[KernelMemory | None, int | None]] = {}  # id -> (answer, source)

    def __call__(self, call: OpCall) -> KernelMemory | None:
        key = id(call)
        known = self._memo.get(key)
        if known is not None:
            return known[0]
        found, result = self.calibration.lookup(call)
        if found:
            slot: int | None = 0
        else:
            result = self.hand(call)
            # Modelled: a hand model, or the rule that such a call allocates only its outputs.
            slot = 1 if self.registry.lookup(call.op) is not None or outputs_only(call) else 2
        if not (found or slot == 1 or calibratable(call.op)):
            slot = None  # an op calibration has nothing to say about: not counted
        self._memo[key] = (result, slot)
        return result

    def measured(self, call: OpCall) -> bool:
        """Whether the calibration measured ``call``'s signature (else the hand model answers it)."""
        known = self._memo.get(id(call))  # answered already: its source says
        return known[1] == 0 if known is not None else self.calibration.lookup(call)[0]

    def sources(self, calls: Iterable[OpCall]) -> tuple[KernelSource, ...]:
        """Per op (overload name, sorted): how many of ``calls`` (the step's, one per op event) this
        answered by calibration, by a hand model, or by neither (nothing assumed beyond the outputs: a
        call calibration could not run)."""
        counts: dict[str, list[int]] = {}  # op -> [calibrated, modelled, uncovered]
        memo = self._memo
        for call in calls:
            known = memo.get(id(call))
            if known is not None and known[1] is not None:
                counts.setdefault(str(call.op), [0, 0, 0])[known[1]] += 1
        return tuple(KernelSource(op, *c) for op, c in sorted(counts.items()))


def captures_kernel(op: OpOverload) -> bool:
    """Whether any kernel model needs ``op``'s full call: part of the engine's capture filter."""
    if op in MEASURED_CPU_OPS:
        return True
    return any(r.lookup(op) is not None for r in (CPU_KERNELS, CUDA_KERNELS, CUDA_WHAT_IF_KERNELS))


def captures_for_calibration(op: OpOverload) -> bool:
    """Whether calibration needs ``op``'s full call: a hand model's op, or one it can measure."""
    return captures_kernel(op) or calibratable(op)
