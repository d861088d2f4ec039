"""CPU convolutions off oneDNN's blocked kernels: ATen's own im2col kernels for float16 (oneDNN has no
fp16 without AVX512-FP16 or AMX), and oneDNN's im2col GEMM, which it takes pass by pass for dilated
kernels that outgrow the map or its padding, kernels of 15 and more (ViT patch embeddings) and 3-d
inputs shallower than the kernel. The column buffers and weight-sized scratch they hold; ``cpu_conv.py``
decides when they apply. Measured as ``cpu.py`` says; evidence in ``benchmarks/KERNELS.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memest.accounting.kernels.cpu import AMX, OTHER, SSE41, ints, isa, rnd, threads
from lightning_memest.accounting.kernels.model import KernelMemory
from lightning_memest.engine.events import TensorMeta

__all__ = [
    "GemmPasses",
    "gemm_data_scratch",
    "gemm_forward_scratch",
    "gemm_passes",
    "gemm_weights_scratch",
    "gemm_weights_scratch_for",
    "slow_convolution",
    "slow_fp16",
]


# ------------------------------------------------------------------------- float16: ATen's own kernels


def slow_fp16(x: TensorMeta) -> bool:
    # torch's mkldnn_fp16_device_check: oneDNN convolves float16 only with AVX512-FP16 or AMX-FP16 (the
    # AMX CPUs); elsewhere ATen's slow_conv2d / slow_conv_dilated2d run (the sweep on the AMD EPYC).
    return x.dtype == torch.float16 and isa() != AMX


def slow_convolution(
    x: TensorMeta,
    w: TensorMeta,
    out_hw: tuple[int, int],
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    go: TensorMeta | None,
    mask: Sequence[bool] | None,
) -> KernelMemory | None:
    """ATen's im2col convolution (aten/src/ATen/native/ConvolutionMM2d.cpp, NaiveDilatedConvolution.cpp),
    forward (``go`` None) and backward: an im2col column buffer -- for the whole batch, or one image when
    dilated -- and for groups a loop over them, each on a contiguous copy of its input slice, whose
    outputs are concatenated at the end. Exact on the sweep's 26 float16 2-d shapes (kernels 1-7, strides
    1-2, dilation 2-12, groups 1/4/32/depthwise, NCHW and channels-last)."""
    if len(x.shape) != 4:
        return None
    n, _, h, wd = x.shape
    oc, icg, kh, kw = w.shape
    oh, ow = out_hw
    s = x.itemsize
    dilated = any(v > 1 for v in ints(dilation, 2))
    unit = kh == kw == 1 and all(v == 1 for v in ints(stride, 2)) and all(v == 0 for v in ints(padding, 2))
    cols = 0 if unit and not dilated else (1 if dilated else n) * icg * kh * kw * oh * ow * s
    if groups == 1:
        return KernelMemory(cols) if cols else None
    x_g = n * icg * h * wd * s
    if go is None or mask is None:
        return KernelMemory(max(x_g + cols, n * oc * oh * ow * s))
    go_g = n * (oc // groups) * oh * ow * s
    grads = (x.bytes if mask[0] else 0) + (w.bytes if mask[1] else 0)
    return KernelMemory(max(go_g + x_g + cols, grads))


# ---------------------------------------------------------------------- dilation: blocked or GEMM


@dataclass(frozen=True)
class GemmPasses:
    """Which passes of a convolution leave oneDNN's blocked jit kernels for its im2col GEMM."""

    forward: bool = False
    data: bool = False
    weights: bool = False


def gemm_passes(
    x: TensorMeta,
    w: TensorMeta,
    out_hw: tuple[int, int],
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
) -> GemmPasses:
    """oneDNN's dispatch of a dilated 2-d convolution (src/cpu/x64/jit_avx512_common_conv_kernel.cpp, the
    avx512_core kernels; the bf16 ones measured to follow it): each pass whose jit kernel refuses the shape
    runs ``gemm_convolution`` instead. Forward refuses a kernel entirely inside the padding and a padding
    wider than the width unroll ``ur_w``; backward-data the same on its overflow, and any stride with
    dilation; backward-weights any stride with dilation and a dilated kernel taller than the map. Only
    dilated, ungrouped convolutions are checked (the blocked models were fitted on the others). Below
    AVX2 (:data:`SSE41`) every dense 2-d convolution's backward passes are GEMM."""
    dil = ints(dilation, 2)
    depthwise = groups > 1 and w.shape[1] == 1 and w.shape[0] == groups
    if len(x.shape) == 4 and isa() == SSE41 and not depthwise:
        # Below AVX2 oneDNN has no blocked backward kernels for dense convolutions (depthwise ones keep
        # theirs): both backward passes run as GEMM (ONEDNN_VERBOSE: jit:sse41 forward, gemm:jit backward).
        return GemmPasses(forward=False, data=True, weights=True)
    # AVX2's blocked backward-weights kernel (jit_avx2_conv_bwd_weights_kernel_f32::init_conf) takes
    # no dilation and no kernel taller than the map (``kh <= ih``; a wider one it takes). Measured on
    # an AVX2 EPYC (ONEDNN_VERBOSE): 3x3 on 2x2 maps, 5x5 on 4x4, 7x7 on 6x6, any dilation: gemm:jit;
    # 3x3 on 3x3 and on 4x2 (H x W): jit:avx2. ResNet-18's 512 -> 512 layer on 2x2 maps (64 px
    # images) holds two weight-sized working sets per thread: 75,645,184 B, the step's peak.
    avx2 = len(x.shape) == 4 and isa() == OTHER and not depthwise and x.itemsize == 4
    if avx2 and (groups != 1 or max(dil) <= 1):
        # (grouped ones measured only as the AVX-512 kernels)
        return GemmPasses(weights=groups == 1 and w.shape[2] > x.shape[2])
    if groups != 1 or max(dil) <= 1 or len(x.shape) != 4:
        return GemmPasses()
    ih, iw = x.shape[2:]
    oc, _, kh, kw = w.shape
    oh, ow = out_hw
    (sh, sw), (ph, pw), (dh, dw) = ints(stride, 2), ints(padding, 2), dil
    ext_kh, ext_kw = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    r_pad = (ow - 1) * sw + ext_kw - (iw + pw)
    b_pad = (oh - 1) * sh + ext_kh - (ih + ph)
    outside = ext_kw <= pw or ext_kw <= r_pad or ext_kh <= ph or ext_kh <= b_pad
    # Forward's width unroll: 28 registers for "embedded broadcast" kernels (kw > 3, or 3x3 stride 1 on
    # maps up to 28 wide), else 31 // (nb_oc_blocking + 1) with the largest blocking of 5 that divides
    # the output-channel blocks (the thread-efficiency search is not reproduced).
    if kw > 3 or (sh == sw == 1 and kw == 3 and ow <= 28):
        ur_w = min(ow, 28)
    else:
        nb_oc = -(-oc // 16)
        ur_w = min(ow, 31 // (max(d for d in range(1, 6) if nb_oc % d == 0) + 1))
    forward = outside or pw > ur_w or r_pad > ur_w
    strided = sh > 1 or sw > 1
    l_overflow = max(0, (kw - 1) * dw - pw) // sw
    r_overflow = max(0, (kw - 1) * dw - max(0, r_pad)) // sw
    data = strided or outside or max(l_overflow, r_overflow) > min(iw, 28)
    weights = strided or ext_kh > ih or avx2
    return GemmPasses(forward, data, weights)


def gemm_forward_scratch(c: int, ks: int, positions: int, oc: int, s: int) -> int:
    # gemm_convolution_utils.cpp init_conf (forward, NCHW): per thread an im2col block of ic_block x ks x
    # os_block elements (bf16: bf16 columns and a float32 accumulator), + 128 / 256 B. The blocks come from
    # an L2-cache search not reproduced here: the whole column buffer up to ~600 KB, else about 360 KB of
    # columns per thread (measured here, 2 threads: 184 KB at 960 ch on 8x8 maps, 360 KB at 16x16,
    # 452 KB at 28x28, 339 KB at 32x32; so up to 2x over or 20 % under for big inputs).
    col = c * ks * positions
    if col * s > 600_000:
        col = 360_000 // s
    if s == 4:
        return threads() * col * 4 + 128
    return threads() * (col * 2 + min(oc * positions, 100_000) * 4) + 256


def gemm_data_scratch(n: int, c: int, col_elems: int, spatial: int, s: int) -> int:
    # gemm_convolution_utils.cpp (backward-data, NCHW): float32 columns (``col_elems``: one group's ic x
    # ks x os) per thread -- the threads split the minibatch when there is more than one image -- and for
    # bf16 a float32 diff_src accumulator of rnd16(ic x ih x iw) per thread; + 128 / 256 B (exact:
    # 4,423,808 and 4,915,456 for DeepLab's 960 -> 256 ASPP convolution at batch 2, float32 and bfloat16).
    nthr = threads() if n > 1 else 1
    acc = rnd(c * spatial, 16) * 4 if s == 2 else 0
    return nthr * (col_elems * 4 + acc) + (128 if s == 4 else 256)


def gemm_weights_scratch_for(n: int, w: TensorMeta, col_elems: int, positions: int) -> int:
    """The GEMM backward-weights scratch of a 2-d convolution in its dtype."""
    if w.itemsize == 4:
        return gemm_weights_scratch(n, w.bytes, col_elems * 4, positions, None)
    # bfloat16: per working set three float32 weight-sized buffers and bf16 columns, + 64; + 256 (exact:
    # 55,296,384 for the ASPP's 960 -> 256 at dilation 12-36 and 14,745,984 for 256 -> 256 at dilation
    # 6 on 8x8 maps, batch 2, 2 threads, on both instruction sets).
    sets = threads() if n >= 2 and positions / threads() < 256 else 1
    return sets * (3 * w.numel * 4 + col_elems * 2 + 64) + 256


def gemm_weights_scratch(n: int, w_bytes: int, col: int, positions: int, out_depth: int | None) -> int:
    """Scratch of oneDNN's im2col GEMM convolution backward-weights (float32), for ``positions`` output
    positions (D x H x W) and a column buffer of ``col`` bytes; ``out_depth`` for 3-d convolutions.

    A working set is 4 weight-sized float buffers and one column buffer, + 256 B. Each thread gets a set
    ("outer" threading over the minibatch) when the batch is above 1 and the output positions per thread
    are under 256; otherwise the threads share one (measured: 242 positions per thread -> a set each,
    264 -> one set). At batch 1, 3-d convolutions hold column buffers only (one per thread, up to the
    output depth) and 2-d ones one set. Fitted on 30 shapes (2-d kernels 15-32, 3-d inputs shallower
    than the kernel; 1-3 threads; batch 1-4), each exact.
    """
    nthr = threads()
    if n >= 2:
        sets = nthr if positions / nthr < 256 else 1
        return sets * (4 * w_bytes + col) + 256
    if out_depth is not None:
        return min(nthr, out_depth) * col
    return 4 * w_bytes + col + 256
