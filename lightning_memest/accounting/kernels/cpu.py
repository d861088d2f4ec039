"""CPU kernel models: oneDNN's layout arithmetic shared by all of them, and the models of matrix products,
normalization and reductions (convolutions: ``cpu_conv.py``; the LSTM: ``cpu_rnn.py``).

The numbers were measured on CPU (torch 2.14.1, oneDNN on an AVX-512 Xeon without native bf16, 2
threads) with ``benchmarks/find_kernel_workspaces.py``; ``benchmarks/KERNELS.md`` lists the evidence and
how exact each formula is. oneDNN's choices depend on the ISA and on the thread count
(``torch.get_num_threads()`` is read when a formula needs it), so on other CPUs these are close, not exact.

Example:
    >>> import torch
    >>> from lightning_memest.accounting.kernels import OpCall, TensorMeta, kernel_memory
    >>> a = TensorMeta.of(torch.empty(64, 512).expand(64, 512))
    >>> g = TensorMeta.of(torch.empty(1).expand(512, 64))  # a stride-0 gradient, as sum's backward makes
    >>> out = TensorMeta.of(torch.empty(512, 512))
    >>> call = OpCall(torch.ops.aten.mm.default, (g, a), {}, (out,), "cpu")
    >>> kernel_memory(call)
    KernelMemory(workspace_bytes=131072, workspace_after_outputs=True, extra_output_bytes=None)
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_memest.accounting.kernels.model import CPU_KERNELS, KernelMemory
from lightning_memest.engine.events import OpCall, TensorMeta

__all__ = ["MKLDNN_DTYPES", "copy_if_strided", "good_ld", "ints", "rnd", "threads"]

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------- helpers

MKLDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def threads() -> int:
    return max(1, torch.get_num_threads())


def rnd(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def good_ld(dim: int, itemsize: int) -> int:
    # oneDNN rnn_utils::get_good_ld: 64-byte aligned and not a multiple of 256 (4K aliasing).
    ld = rnd(dim, 64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def copy_if_strided(t: Any) -> int:
    """Bytes of the ``.contiguous()`` copy a kernel makes of a non-contiguous tensor argument."""
    return t.bytes if isinstance(t, TensorMeta) and not t.is_contiguous() else 0


def ints(value: Any, n: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    values = tuple(int(v) for v in value)
    return values * n if len(values) == 1 else values


def _blas_ok(t: TensorMeta) -> bool:
    # aten/src/ATen/native/LinearAlgebra.cpp (addmm_impl_cpu_): an operand is used in place when it or
    # its transpose has unit stride in the last dimension and a leading dimension >= max(1, size).
    if len(t.shape) != 2:
        return True
    rows, cols = t.shape
    s0, s1 = t.stride
    if s1 == 1 and (rows == 1 or s0 >= max(1, cols)):
        return True
    return s0 == 1 and (cols == 1 or s1 >= max(1, rows))


# ------------------------------------------------------------------------------------ matrix products


@CPU_KERNELS.register(aten.mm, aten.addmm)
def _mm(call: OpCall) -> KernelMemory | None:
    if call.device_type != "cpu":
        return None
    mats = call.args[1:3] if call.op.overloadpacket is aten.addmm else call.args[:2]
    ws = 0
    # addmm_impl_cpu_ copies an operand BLAS cannot read in place (e.g. a stride-0 expanded gradient).
    for m in mats:
        if isinstance(m, TensorMeta) and not _blas_ok(m):
            ws += m.bytes
    out = call.outputs[0] if call.outputs else None
    if out is not None and out.dtype == torch.bfloat16:
        # oneDNN bf16 matmul without native bf16 support accumulates into a float32 copy of the result
        # (measured: exactly 4 B per output element + 128, gpt/resnet18 bf16-true and bf16-mixed).
        # float16 takes another path that allocates nothing extra (tests/test_cli.py, 16-true MLP).
        ws += out.numel * 4 + 128
    return KernelMemory(ws) if ws else None


# ------------------------------------------------------------------------------------ normalisation


@CPU_KERNELS.register(aten.native_batch_norm, aten._native_batch_norm_legit)
def _batch_norm(call: OpCall) -> KernelMemory | None:
    # aten/src/ATen/native/Normalization.cpp batch_norm_cpu: two float32 per-channel temporaries (mean and
    # invstd before they are copied out) while training; measured 8 B x C (resnet50: 16,384 at C=2048).
    x, training = call.arg("input"), call.arg("training", True)
    if call.device_type != "cpu" or not isinstance(x, TensorMeta) or not training or len(x.shape) < 2:
        return None
    return KernelMemory(2 * x.shape[1] * 4)


@CPU_KERNELS.register(aten.native_batch_norm_backward)
def _batch_norm_backward(call: OpCall) -> KernelMemory | None:
    # batch_norm_backward_cpu: an input-sized temporary besides grad_input (measured: exactly the input's
    # bytes for every training-mode batch norm of resnet18/50, mobilenet_v2, efficientnet_b0, densenet121).
    x, train = call.arg("input"), call.arg("train", True)
    if call.device_type != "cpu" or not isinstance(x, TensorMeta) or not train:
        return None
    return KernelMemory(x.bytes)


@CPU_KERNELS.register(aten.native_layer_norm)
def _layer_norm(call: OpCall) -> KernelMemory | None:
    # layer_norm_cpu calls input.contiguous(): a copy when the input is strided (vit_b_16, convnext_tiny).
    if call.device_type != "cpu":
        return None
    ws = copy_if_strided(call.arg("input"))
    return KernelMemory(ws) if ws else None


@CPU_KERNELS.register(aten.native_layer_norm_backward)
def _layer_norm_backward(call: OpCall) -> KernelMemory | None:
    # layer_norm_backward_cpu: contiguous copies of a strided grad_out and input (vit_b_16: 2,426,880 each
    # at batch 4), plus a few KB of per-thread gamma/beta partial sums (not modelled).
    if call.device_type != "cpu":
        return None
    ws = copy_if_strided(call.arg("grad_out")) + copy_if_strided(call.arg("input"))
    return KernelMemory(ws) if ws else None


# ------------------------------------------------------------------------------------ reductions etc.


@CPU_KERNELS.register(aten.mean)
def _mean(call: OpCall) -> KernelMemory | None:
    # mean on bfloat16/float16 CPU inputs sums in float32: an input-sized float32 copy plus a float32
    # result (resnet18 bf16 avgpool: 401,408 + 8,192 for [4,512,7,7]).
    x = call.arg("self")
    out = call.outputs[0] if call.outputs else None
    if call.device_type != "cpu" or not isinstance(x, TensorMeta) or out is None:
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or call.op is not aten.mean.dim:
        return None
    return KernelMemory(x.numel * 4 + out.numel * 4)


@CPU_KERNELS.register(aten.embedding_dense_backward)
def _embedding_backward(call: OpCall) -> KernelMemory | None:
    # embedding_dense_backward_cpu: grad.contiguous() (the LSTM LM's gradient arrives transposed).
    if call.device_type != "cpu":
        return None
    ws = copy_if_strided(call.arg("grad_output"))
    return KernelMemory(ws) if ws else None
