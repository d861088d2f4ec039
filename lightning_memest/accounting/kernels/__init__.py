"""Memory that real kernels allocate beyond what their fake (meta) kernels report, per kind of run.

Where each concept lives: ``model.py`` (what a model answers, the registries), ``cpu.py`` (oneDNN
arithmetic; matrix products, normalization, reductions), ``cpu_conv.py`` (convolutions),
``cpu_rnn.py`` (the LSTM), ``cuda_attention.py`` (SDPA's CUDA backends, for what-ifs). A new kernel
model is a small function registered in the file of its device and op family.

This module holds the policy: :func:`kernel_fn` says which registry speaks for a simulation -- CPU
models for a run on the CPU, CUDA models for a run on a GPU, and for a CUDA what-if (CPU kernels ran,
CUDA is accounted) the what-if models: the oneDNN models do not apply to CUDA.

Example:
    >>> import torch
    >>> fn = kernel_fn("cpu", what_if=False)
    >>> out = TensorMeta.of(torch.empty(4, 8, dtype=torch.bfloat16))
    >>> x, w = TensorMeta.of(torch.empty(4, 16, dtype=torch.bfloat16)), TensorMeta.of(torch.empty(16, 8))
    >>> fn(OpCall(torch.ops.aten.mm.default, (x, w), {}, (out,), "cpu")).workspace_bytes  # fp32 result
    256
"""

from __future__ import annotations

from collections.abc import Callable

from torch._ops import OpOverload

# Imported for their registrations.
from lightning_memest.accounting.kernels import cpu, cpu_conv, cpu_rnn, cuda_attention  # noqa: F401
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

__all__ = [
    "CPU_KERNELS",
    "CUDA_KERNELS",
    "CUDA_WHAT_IF_KERNELS",
    "KernelFn",
    "KernelMemory",
    "KernelModel",
    "OpCall",
    "TensorMeta",
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


def kernel_fn(device_type: str, *, what_if: bool, capability: Capability = None) -> KernelFn:
    """The kernel models of a simulation on ``device_type`` (``what_if``: a CUDA what-if, which ran on
    the CPU); ``capability`` is the GPU's, for CUDA models."""
    if what_if:
        return _cuda(CUDA_WHAT_IF_KERNELS, capability)
    if device_type == "cuda":
        return _cuda(CUDA_KERNELS, capability)
    return kernel_memory


def captures_kernel(op: OpOverload) -> bool:
    """Whether any kernel model needs ``op``'s full call: part of the engine's capture filter."""
    return any(r.lookup(op) is not None for r in (CPU_KERNELS, CUDA_KERNELS, CUDA_WHAT_IF_KERNELS))
