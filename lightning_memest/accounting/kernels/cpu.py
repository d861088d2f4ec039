"""CPU kernel models: the machine's instruction set (:func:`isa`), oneDNN's layout arithmetic shared by all
models, and the models of matrix products, normalization and reductions (convolutions: ``cpu_conv.py``;
the LSTM: ``cpu_rnn.py``).

oneDNN picks its kernels -- and their scratch buffers -- by the instruction set: with native bf16
(``avx512_bf16``) it runs brgemm bf16 matmuls and bf16 RNN cells that allocate differently from the
emulated bf16 of an AVX-512 CPU without it. So each model that differs reads :func:`isa` and keeps one
formula per instruction set. The numbers were measured with torch 2.14.1 (oneDNN 3.12) at 2 threads:
:data:`AVX512` on an AVX-512 Xeon without native bf16 (``benchmarks/find_kernel_workspaces.py``), and
:data:`AVX512_BF16` on an AMD EPYC with ``avx512_bf16`` (``benchmarks/kernel_sweep.py``);
``benchmarks/KERNELS.md`` lists the evidence and how exact each formula is. The thread count
(``torch.get_num_threads()``) is read where a formula needs it; cache sizes also steer some oneDNN
heuristics, so on other CPUs of the same instruction set these are close, not always exact.

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

import functools
import math
import os
from typing import Any

import torch

from lightning_memest.accounting.kernels.model import CPU_KERNELS, KernelMemory
from lightning_memest.engine.events import OpCall, TensorMeta
from lightning_memest.machine import cpu_flags

__all__ = [
    "AMX",
    "AVX512",
    "AVX512_BF16",
    "ISAS",
    "ISA_ENV",
    "MKLDNN_DTYPES",
    "OTHER",
    "brgemm_bf16_scratch",
    "copy_if_strided",
    "good_ld",
    "ints",
    "isa",
    "native_bf16",
    "rnd",
    "threads",
]

aten = torch.ops.aten

# ------------------------------------------------------------------------------------ instruction set

#: AVX-512 without native bf16 (bf16 emulated in fp32): the Xeon the first models were fitted on.
AVX512 = "avx512"
#: AVX-512 with native bf16 (``avx512_bf16``: AMD Zen 4/5, Cooper Lake): measured on an AMD EPYC.
AVX512_BF16 = "avx512_bf16"
#: AMX tiles (Sapphire Rapids and later): not measured; its bf16 kernels are closest to AVX512_BF16's.
AMX = "amx"
#: AVX2 without AVX-512: the AVX512 models as the nearest, with oneDNN's 8-channel blocks where they
#: matter (:func:`channel_block`); checked with AVX2 forced on the EPYC (``ATEN_CPU_CAPABILITY=avx2
#: ONEDNN_MAX_CPU_ISA=AVX2``), not on an AVX2 CPU.
OTHER = "other"
#: Below AVX2 (SSE4.1, AVX): as :data:`OTHER`, but oneDNN has no blocked backward kernels for dense
#: convolutions there and runs both passes as im2col GEMM (``gemm:jit`` in ``ONEDNN_VERBOSE``); checked
#: with ``ONEDNN_MAX_CPU_ISA=SSE41`` forced on the EPYC.
SSE41 = "sse41"
ISAS = (AVX512, AVX512_BF16, AMX, OTHER, SSE41)
#: Overrides the detected instruction set (one of :data:`ISAS`): to estimate for another CPU, and in tests.
ISA_ENV = "MEMEST_CPU_ISA"
# oneDNN's ONEDNN_MAX_CPU_ISA values (src/cpu/x64/cpu_isa_traits.hpp) in increasing order, by what they
# allow: a cap below AVX512_CORE_BF16 makes oneDNN emulate bf16 on any CPU.
_BELOW_AVX2 = ("SSE41", "AVX")
_BELOW_AVX512 = ("AVX2", "AVX2_VNNI", "AVX2_VNNI_2")
_NO_BF16 = ("AVX512_CORE", "AVX512_CORE_VNNI")


def isa() -> str:
    """The instruction set oneDNN runs here, as the kernel models key it: :data:`AVX512`,
    :data:`AVX512_BF16`, :data:`AMX`, :data:`OTHER` (AVX2) or :data:`SSE41` (below AVX2).
    ``$MEMEST_CPU_ISA`` overrides it; otherwise it
    comes from the CPU's flags (torch's CPU capability where ``/proc/cpuinfo`` has none), capped as
    ``ONEDNN_MAX_CPU_ISA`` caps oneDNN (read once per process)."""
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)}; got {forced!r}")
        return forced
    return _machine_isa()


#: What oneDNN's ``avx512_core`` needs of the CPU.
_AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@functools.cache
def _machine_isa() -> str:
    # oneDNN picks its kernels from the CPU's own flags and its own cap, whatever ATen's capability
    # (ATEN_CPU_CAPABILITY lowers ATen's alone); torch's detection stands in where there are no flags.
    flags = set(cpu_flags())
    capability = torch.backends.cpu.get_cpu_capability()
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    avx2 = "avx2" in flags if flags else capability != "DEFAULT"
    if not avx2 or cap in _BELOW_AVX2:
        return SSE41
    avx512 = flags >= _AVX512_CORE if flags else capability.startswith("AVX512")
    if not avx512 or cap in _BELOW_AVX512:
        return OTHER
    if cap in _NO_BF16 or ("avx512_bf16" not in flags and "amx_bf16" not in flags):
        return AVX512
    if "amx_bf16" in flags and (not cap or "AMX" in cap or cap in ("ALL", "DEFAULT")):
        return AMX
    return AVX512_BF16


def native_bf16() -> bool:
    """Whether oneDNN runs bf16 natively here (:data:`AVX512_BF16` or :data:`AMX`)."""
    return isa() in (AVX512_BF16, AMX)


# ---------------------------------------------------------------------------------------------- helpers

MKLDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def channel_block() -> int:
    """The float32 channel block of oneDNN's blocked layouts here: 16 with AVX-512 (``nChw16c``,
    ``aBCde16c16b``), 8 below it (AVX2, AVX and SSE4.1: ``nChw8c``, ``aBCde8c8b``)."""
    return 8 if isa() in (OTHER, SSE41) else 16


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
        if native_bf16():
            a, b = mats
            if isinstance(a, TensorMeta) and isinstance(b, TensorMeta) and len(a.shape) == len(b.shape) == 2:
                ws += brgemm_bf16_scratch(a.shape[0], a.shape[1], b.shape[1], _transposed(a))
        else:
            # oneDNN bf16 matmul without native bf16 support accumulates into a float32 copy of the
            # result (measured: exactly 4 B per output element + 128, gpt/resnet18 bf16-true and
            # bf16-mixed).
            ws += out.numel * 4 + 128
    # float16 takes another path that allocates nothing extra (tests/test_cli.py, 16-true MLP; the
    # sweep's f16 linear and bmm on both instruction sets).
    return KernelMemory(ws) if ws else None


@CPU_KERNELS.register(aten.bmm)
def _bmm(call: OpCall) -> KernelMemory | None:
    # bf16 bmm runs the same brgemm matmul with a batch dimension: one scratchpad for all the batch
    # (the sweep's bmm, forward and both backward products: exact but the transposed-A one, 16 KB under).
    a, b = call.arg("self"), call.arg("mat2")
    if call.device_type != "cpu" or not isinstance(a, TensorMeta) or not isinstance(b, TensorMeta):
        return None
    if a.dtype != torch.bfloat16 or not native_bf16() or len(a.shape) != 3 or len(b.shape) != 3:
        return None  # without native bf16: measured nothing beyond the output (f32 and f16 alike)
    inner = TensorMeta(a.shape[1:], a.stride[1:], a.dtype, a.device_type, a.nbytes)
    return KernelMemory(brgemm_bf16_scratch(a.shape[1], a.shape[2], b.shape[2], _transposed(inner)))


def _transposed(t: TensorMeta) -> bool:
    """A 2-d operand stored column-major (a transposed view): oneDNN's ``ba`` source layout."""
    return len(t.shape) == 2 and t.stride[0] == 1 and t.shape[0] > 1 and t.stride[1] >= t.shape[0]


def brgemm_bf16_scratch(m: int, k: int, n: int, a_transposed: bool) -> int:
    """Scratchpad of oneDNN's brgemm bf16 matmul (``brg_matmul:avx512_core_bf16``) for ``(m x k) @ (k x
    n)``, after src/cpu/x64/matmul/brgemm_matmul_utils.cpp (``init_scratchpad``): per thread a float32
    accumulator block C (``M_blk x 64``), B copied to the VNNI layout (``K_blk x 64``, K_blk = min(K, 512),
    1024 above K = 1024), and for a transposed A (weight gradients) A copied (``M_blk x lda``); 1,664 B of
    brgemm batch descriptors. M_blk = M split into blocks of at most 256; with a copied A and K above one
    block the C buffer spans up to 16 N blocks. Fitted against 400 measured (M, K, N, layout) points on
    the AMD EPYC (2 threads): 297 exact, median error 0 / 512 B (plain / transposed A); K >= 2048 with
    M >= 1024 splits K across threads and reads up to 2 MB higher (not modelled)."""
    nthr = threads()
    m_chunks = -(-m // 256)
    m_blk = -(-m // m_chunks)
    k_blk = min(k, 1024 if k > 1024 and not a_transposed else 512)
    n_blk = min(n, 64)
    if not a_transposed:
        return nthr * (m_blk * n_blk * 4 + rnd(k_blk, 32) * n_blk * 2) + 1664
    lda = rnd(k_blk, 32)
    if lda >= 512 and lda & (lda - 1) == 0:
        lda += 32  # get_actual_lda: a big power of two is padded by a cache line
    n_chunks = -(-n // 64)
    if m_chunks < nthr:
        n_chunks = -(-n_chunks // nthr)
    c_blocks = min(16, n_chunks) if k > 512 else 1
    a_copy = min(nthr, m_chunks) * m_blk * lda * 2
    return a_copy + nthr * (m_blk * 64 * 4 * c_blocks + rnd(k_blk, 32) * 64 * 2) + 128 + 1664


# ------------------------------------------------------------------------------------ normalisation


@CPU_KERNELS.register(aten.native_batch_norm, aten._native_batch_norm_legit)
def _batch_norm(call: OpCall) -> KernelMemory | None:
    # aten/src/ATen/native/Normalization.cpp batch_norm_cpu: two float32 per-channel temporaries (mean and
    # invstd before they are copied out) while training; measured 8 B x C (resnet50: 16,384 at C=2048).
    x, training = call.arg("input"), call.arg("training", True)
    if call.device_type != "cpu" or not isinstance(x, TensorMeta) or not training or len(x.shape) < 2:
        return None
    c, weight = x.shape[1], call.arg("weight")
    if isinstance(weight, TensorMeta) and weight.dtype == torch.float32 and x.itemsize == 2:
        # Mixed dtypes (a bf16 input with float32 parameters, as autocast runs it): the real kernel saves
        # mean and invstd in float32, the meta kernel says the input's dtype (measured: 128 B more each
        # at C=64, both instruction sets).
        return KernelMemory(2 * c * 4, True, (0, c * 2, c * 2))
    return KernelMemory(2 * c * 4)


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
    # at batch 4), plus a few KB of per-thread gamma/beta partial sums (modelled with native bf16 only).
    if call.device_type != "cpu":
        return None
    ws = copy_if_strided(call.arg("grad_out")) + copy_if_strided(call.arg("input"))
    x, mask = call.arg("input"), call.arg("output_mask", (True, True, True))
    if native_bf16() and isinstance(x, TensorMeta) and (mask[1] or mask[2]):
        # aten/src/ATen/native/cpu/layer_norm_kernel.cpp: per-thread gamma and beta partial sums,
        # {2, num_threads, N} in the input's dtype (measured on the AMD EPYC: 4,096 B for N=256 float32,
        # 2,048 for bfloat16 -- and the Xeon's unmodelled 2-12 KB remainder fits it too, 12,288 B for
        # vit_b_16's N=768; kept out of the AVX512 model, whose tests pin the copies alone).
        ws += 2 * threads() * math.prod(call.arg("normalized_shape", x.shape[-1:])) * x.itemsize
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


# ------------------------------------------------------------------------------------ boolean masks


@CPU_KERNELS.register(aten.index.Tensor, aten.index_put, aten.index_put_, aten._index_put_impl_)
def _mask_coordinates(call: OpCall) -> KernelMemory | None:
    # A boolean (or uint8) index becomes the coordinates of its set elements first (ATen's expandTensors
    # calls nonzero): int64, count x mask dims, freed as the op ends. Measured (torch 2.14.1, CPU): x[m]
    # for a (4096, 64) mask of 130,970 set holds 2,095,520 B beyond its output, x.index_put_((m,), v)
    # the same; (1000,) and (64, 32, 8) masks alike. The count is the selection's rows (the output's for
    # index, the values' for index_put); where they do not say (a broadcast value, several indices),
    # every element of the mask: the most.
    indices, target = call.arg("indices"), call.arg("self")
    if (
        call.device_type != "cpu"
        or not isinstance(indices, (list, tuple))
        or not isinstance(target, TensorMeta)
    ):
        return None
    masks = [i for i in indices if isinstance(i, TensorMeta) and i.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return None
    ws = sum(math.prod(m.shape) * len(m.shape) * 8 for m in masks)
    advanced = [i for i in indices if i is not None]
    if len(advanced) == 1:  # one mask, after ``lead`` whole dims: the selection is dim ``lead``
        mask = masks[0]
        lead = indices.index(mask)
        rest = len(target.shape) - lead - len(mask.shape)
        selected = call.outputs[0] if call.op is aten.index.Tensor and call.outputs else call.arg("values")
        if isinstance(selected, TensorMeta) and len(selected.shape) == lead + 1 + rest:
            rows = selected.shape[lead]
            if rows != 1 or call.op is aten.index.Tensor:  # one value row may be broadcast to all
                ws = min(rows, math.prod(mask.shape)) * len(mask.shape) * 8
    return KernelMemory(ws) if ws else None
