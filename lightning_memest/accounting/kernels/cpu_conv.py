"""CPU convolution kernel models (oneDNN): forward and backward, 2-d and 3-d, NCHW and channels-last,
float32 and bfloat16 -- the reorders into blocked layouts, the result buffers and the scratchpads that
oneDNN holds beyond the op's outputs -- and float16, which ATen computes with its own im2col kernels where
oneDNN has no fp16 (every CPU without AVX512-FP16). Dilated convolutions whose dilated kernel outgrows
the map or its padding leave oneDNN's blocked (jit) kernels for its im2col GEMM ones, pass by pass, as
oneDNN's dispatch conditions say. Measured as ``cpu.py`` says; evidence in ``benchmarks/KERNELS.md``.

Example:
    >>> import torch
    >>> from lightning_memest.accounting.kernels import OpCall, TensorMeta, kernel_memory
    >>> x, w = TensorMeta.of(torch.empty(2, 3, 32, 32)), TensorMeta.of(torch.empty(16, 3, 3, 3))
    >>> out = TensorMeta.of(torch.empty(2, 16, 32, 32))
    >>> call = OpCall(torch.ops.aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False,
    ...               [0, 0], 1), {}, (out,), "cpu")
    >>> kernel_memory(call).workspace_bytes  # the blocked result, reordered into the output
    131072
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_memest.accounting.kernels.cpu import (
    MKLDNN_DTYPES,
    OTHER,
    channel_block,
    ints,
    isa,
    native_bf16,
    rnd,
    threads,
)
from lightning_memest.accounting.kernels.cpu_conv_gemm import (
    gemm_data_scratch,
    gemm_forward_scratch,
    gemm_passes,
    gemm_weights_scratch,
    gemm_weights_scratch_for,
    slow_convolution,
    slow_fp16,
)
from lightning_memest.accounting.kernels.model import CPU_KERNELS, KernelMemory
from lightning_memest.engine.events import OpCall, TensorMeta

__all__: list[str] = []

aten = torch.ops.aten


def _conv_shapes(x: TensorMeta, w: TensorMeta, stride: Any, padding: Any, dilation: Any) -> tuple[int, int]:
    kh, kw = w.shape[2], w.shape[3]
    sh, sw = ints(stride, 2)
    ph, pw = ints(padding, 2)
    dh, dw = ints(dilation, 2)
    oh = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return oh, ow


def _blocked_weight_bytes(w: TensorMeta, groups: int, blocked_src: bool, s: int) -> int:
    # oneDNN blocked weights (OIhw16i16o, Goihw16g, Ohwi16o; OIdhw16i16o): channel dims padded to 16 on
    # AVX-512.
    oc, icg = w.shape[:2]
    k = math.prod(w.shape[2:])
    if groups > 1 and icg == 1 and oc == groups:  # depthwise
        return rnd(oc, 16) * k * s
    if groups > 1:
        return groups * rnd(oc // groups, 16) * rnd(icg, 16) * k * s
    return rnd(oc, 16) * (rnd(icg, 16) if blocked_src else icg) * k * s


def _is_mkldnn_conv(call: OpCall, x: Any, w: Any, transposed: Any, ndim: int = 4) -> bool:
    return (
        call.device_type == "cpu"
        and isinstance(x, TensorMeta)
        and isinstance(w, TensorMeta)
        and len(x.shape) == ndim
        and len(w.shape) == ndim
        and not transposed
        and x.dtype in MKLDNN_DTYPES
    )


@CPU_KERNELS.register(aten.convolution)
def _convolution(call: OpCall) -> KernelMemory | None:
    # aten/src/ATen/native/mkldnn/Conv.cpp _mkldnn_convolution: for NCHW input oneDNN computes into a
    # blocked (nChw16c) tensor y, then mkldnn_to_dense reorders y into the output; src and weights are
    # reordered to blocked layouts first. Channels-last input: the output is written in place, the weight
    # is made channels-last (a copy) and reordered.
    x, w = call.arg("input"), call.arg("weight")
    stride, padding, dilation = call.arg("stride"), call.arg("padding"), call.arg("dilation")
    transposed, groups = call.arg("transposed", False), int(call.arg("groups", 1))
    if _is_mkldnn_conv3d(call, x, w, transposed, groups):
        return _convolution_3d(x, w, call.outputs[0])
    if not _is_mkldnn_conv(call, x, w, transposed):
        return None
    n, c, h, wd = x.shape
    oc, icg, kh, kw = w.shape
    s = x.itemsize
    oh, ow = _conv_shapes(x, w, stride, padding, dilation)
    out = n * oc * oh * ow * s
    if slow_fp16(x):
        return slow_convolution(x, w, (oh, ow), stride, padding, dilation, groups, None, None)
    depthwise = groups > 1 and icg == 1 and oc == groups
    gemm = gemm_passes(x, w, (oh, ow), stride, padding, dilation, groups)
    if gemm.forward and not (x.is_channels_last() or w.is_channels_last()):
        # oneDNN's im2col GEMM forward (gemm_convolution): plain layouts, a plain result copied into the
        # output, and the column scratchpad (measured: DeepLab's ASPP 960 -> 256 on 8x8 maps, 368,768).
        return KernelMemory(max(gemm_forward_scratch(c, kh * kw, oh * ow, oc, s), out))
    if x.is_channels_last() or w.is_channels_last():
        w_copy = 0 if w.is_channels_last() or (w.is_contiguous() and (icg == 1 or kh * kw == 1)) else w.bytes
        w_r = _blocked_weight_bytes(w, groups, True, s)
        # 12,336 B of oneDNN scratchpad measured on every non-depthwise channels-last conv (convnext_tiny).
        return KernelMemory(w_copy + w_r + (0 if depthwise else 12336))
    blocked = c >= 16 or groups > 1
    src_r = n * rnd(c, 16) * h * wd * s if blocked else 0
    w_r = _blocked_weight_bytes(w, groups, blocked, s)
    y = n * rnd(oc, 16) * oh * ow * s
    # 1x1 convolutions with stride > 1 gather the strided input per thread ("rtus" scratchpad).
    rtus = 0
    unit = kh == kw == 1 and blocked and groups == 1
    if unit and any(v > 1 for v in ints(stride, 2)) and (s == 4 or native_bf16()):
        rtus = threads() * c * oh * ow * s + 128
    store = _bf16_1x1_store(oh * ow, oc) if unit and s == 2 and native_bf16() else 0
    return KernelMemory(max(store + src_r + w_r + y + rtus - out, y))


def _bf16_1x1_store(bcast: int, load: int) -> int:
    # jit_avx512_core_bf16_1x1_conv_kernel.cpp init_scratchpad: forward and backward-data keep a float32
    # store buffer of nthr x bcast_dim (output positions of one image) x load_dim (output channels, or
    # input channels for backward-data, rounded to 16), + 128 (measured on the AMD EPYC: 1,605,760 for
    # 64 -> 256 on 28x28, 100,480 for 256 -> 64 on 14x14, 401,536 for backward-data of both).
    return threads() * bcast * rnd(load, 16) * 4 + 128


@CPU_KERNELS.register(aten.convolution_backward)
def _convolution_backward(call: OpCall) -> KernelMemory | None:
    # Conv.cpp mkldnn_convolution_backward_input / _weights: grad_output, weights and input are reordered
    # to blocked layouts, oneDNN writes blocked diff_src / diff_weights that are reordered into the outputs.
    go, x, w = call.arg("grad_output"), call.arg("input"), call.arg("weight")
    transposed, groups = call.arg("transposed", False), int(call.arg("groups", 1))
    mask, stride = call.arg("output_mask", (True, True, True)), call.arg("stride")
    if _is_mkldnn_conv3d(call, x, w, transposed, groups) and isinstance(go, TensorMeta):
        return _convolution_backward_3d(go, x, w, mask, ints(stride, 3))
    if not _is_mkldnn_conv(call, x, w, transposed) or not isinstance(go, TensorMeta):
        return None
    n, c, h, wd = x.shape
    oc, icg, kh, kw = w.shape
    oh, ow = go.shape[2], go.shape[3]
    s = x.itemsize
    padding, dilation = call.arg("padding"), call.arg("dilation")
    if slow_fp16(x):
        return slow_convolution(x, w, (oh, ow), stride, padding, dilation, groups, go, mask)
    depthwise = groups > 1 and icg == 1 and oc == groups
    gemm = gemm_passes(x, w, (oh, ow), stride, padding, dilation, groups)
    # oneDNN's GEMM convolution (gemm_convolution_utils.cpp init_conf): im2col columns of one group's
    # input channels x kernel x output positions, none for a 1x1 stride-1 kernel over the same map.
    positions = oh * ow
    same_map = kh * kw == 1 and (oh, ow) == (h, wd) and all(v == 1 for v in ints(stride, 2))
    col_elems = 0 if same_map else c // groups * kh * kw * positions
    if x.is_channels_last() or w.is_channels_last():
        found = _convolution_backward_channels_last(go, x, w, mask, depthwise, stride, dilation)
        if gemm.weights and mask[1] and found is not None:
            # The GEMM backward-weights runs on a plain copy of the input (measured: the NCHW scratch +
            # the input's bytes + 128, float32 and bfloat16, 8x8 maps at dilation 6 and 12).
            scratch = gemm_weights_scratch_for(n, w, col_elems, positions) + x.bytes + 128
            return KernelMemory(max(found.workspace_bytes, scratch))
        return found
    # NCHW backend: a channels-last grad_output (a channels-last layer after this one) is made contiguous.
    go_copy = 0 if go.is_contiguous() else go.bytes
    if gemm.data or gemm.weights:
        blocked = c >= 16
        bf16_scratch = (
            _bf16_weights_scratch(x, w, go, ints(stride, 2), dilation=max(ints(dilation, 2)))
            if mask[1] and s == 2 and not gemm.weights and blocked and kh * kw > 1
            else None
        )
        w_b = _blocked_weight_bytes(w, groups, blocked, s)
        excess = _blocked_backward_excess(
            go,
            x,
            w,
            w_b,
            mask,
            blocked,
            False,
            bf16_scratch,
            gemm_data=gemm_data_scratch(n, c, col_elems, h * wd, s) if gemm.data else None,
            gemm_weights=gemm_weights_scratch_for(n, w, col_elems, positions) if gemm.weights else None,
        )
        return KernelMemory(go_copy + excess)
    wide = kw >= 14 if isa() == OTHER else kh >= 15 and kw >= 15
    if wide and groups == 1 and s == 4 and mask[1]:
        # Kernels of 15 and more (ViT patch embeddings: 16x16, 32x32) run backward-weights as an im2col
        # GEMM (measured: 14 -> blocked, 15 -> GEMM). vit_b_32 at batch 2: 77,003,008 (-3.9 % before).
        # AVX2's kernel takes widths under 14 (``kw < 14``): a ViT-H/14 patch embedding is GEMM there
        # (measured on an AVX2 EPYC: 384 x 3 x 14 x 14 on 224 px read -48 % as blocked; now exact).
        col = c * kh * kw * oh * ow * s
        return KernelMemory(go_copy + gemm_weights_scratch(n, w.bytes, col, oh * ow, None))
    if depthwise:
        if native_bf16() and kh * kw <= 9 and mask[1] and max(ints(dilation, 2)) == 1:
            # With native bf16 (the AMD EPYC, float32 and bfloat16 alike; mobilenet_v2's every 3x3
            # depthwise layer): backward-weights holds the blocked grad_output and input together, and
            # bfloat16 a float32 diff-weights buffer (+ 128). Exact in the sweep and in mobilenet_v2's
            # real step (bf16-mixed, batch 4). Dilated ones read one input, as below (dilation 4).
            go_r = n * rnd(oc, 16) * oh * ow * s
            src_r = n * rnd(c, 16) * h * wd * s
            if s == 2 and any(v > 1 for v in ints(stride, 2)):
                # bf16 stride 2: two input-sized buffers less the weight's bytes (exact on mobilenet_v2's
                # four stride-2 depthwise layers and the sweep's).
                return KernelMemory(go_copy + 2 * src_r - w.bytes)
            diff_w = w.numel * 4 + 128 if s == 2 else 0
            return KernelMemory(go_copy + go_r + src_r + diff_w)
        # Measured: one input-sized blocked buffer (mobilenet_v2, efficientnet_b0; exact at stride 1).
        return KernelMemory(go_copy + n * rnd(c, 16) * h * wd * s)
    blocked = c >= 16 or groups > 1
    strided = s == 4 and groups == 1 and any(v > 1 for v in ints(stride, 2))
    bf16_scratch = (
        _bf16_weights_scratch(x, w, go, ints(stride, 2), dilation=max(ints(dilation, 2)))
        if mask[1] and s == 2 and groups == 1 and blocked and kh * kw > 1
        else None
    )
    data_scratch = 0
    if s == 2 and kh == kw == 1 and groups == 1 and blocked and native_bf16():
        # bf16 1x1 with native bf16: backward-data's float32 store buffer (as forward's, over the input
        # channels), and backward-weights' float32 diff-weights buffer (n_wei_buffers = nthr_mb, which
        # oneDNN's balance() leaves at 1 here) + 128 -- exact for 64 -> 256 on 28x28; the transposition
        # buffers beside it (0-150 KB: 41 KB for 64 -> 128 stride 2, 67 KB for mobilenet_v2's 320 ->
        # 1280 on 7x7, 150 KB for 256 -> 64 on 14x14) are not modelled.
        data_scratch = _bf16_1x1_store(h * wd, c)
        bf16_scratch = w.numel * 4 + 128 if mask[1] else None
    w_b = _blocked_weight_bytes(w, groups, blocked, s)
    excess = _blocked_backward_excess(
        go, x, w, w_b, mask, blocked, strided, bf16_scratch, data_scratch=data_scratch
    )
    return KernelMemory(go_copy + excess)


def _blocked_backward_excess(
    go: TensorMeta,
    x: TensorMeta,
    w: TensorMeta,
    w_b: int,
    mask: Sequence[bool],
    blocked: bool,
    strided: bool,
    weights_scratch: int | None = None,
    *,
    gemm_data: int | None = None,
    gemm_weights: int | None = None,
    data_scratch: int = 0,
) -> int:
    """The most oneDNN's blocked (nC[d]hw16c) convolution backward holds beyond its outputs, 2-d and
    3-d alike: grad_output, the weights (``w_b`` bytes blocked) and, when ``blocked``, the source are
    reordered; backward-data writes a blocked diff_src reordered into grad_input, backward-weights a
    blocked diff_weights reordered into grad_weight (with ``weights_scratch`` beside grad_weight when
    given: the bfloat16 scratchpad). A pass that runs as oneDNN's im2col GEMM instead (``gemm_data`` /
    ``gemm_weights``: its scratchpad) works on plain layouts: its scratchpad, then a plain result copied
    into the gradient (seen in the allocator's events of dilated 3x3 convolutions)."""
    n, c = x.shape[:2]
    oc = w.shape[0]
    s = x.itemsize
    spatial = math.prod(x.shape[2:])
    go_r = n * rnd(oc, 16) * math.prod(go.shape[2:]) * s
    src_r = n * rnd(c, 16) * spatial * s if blocked else 0
    gi = n * c * spatial * s if mask[0] else 0
    gw = w.bytes if mask[1] else 0
    gb = oc * s if mask[2] else 0
    held = [0]
    if mask[0] and gemm_data is not None:
        held += [gi + gemm_data, 2 * gi]  # GEMM backward-data, then its plain diff_src copied
    elif mask[0]:
        dsrc = n * rnd(c, 16) * spatial * s
        held += [go_r + w_b + dsrc + data_scratch, dsrc + gi]  # backward-data, then into grad_input
    if mask[1] and gemm_weights is not None:
        # GEMM backward-weights (the bias gradient written beside it), then its plain copy
        held += [gi + gw + gb + gemm_weights, gi + 2 * gw + gb]
    elif mask[1]:
        held += [gi + go_r + src_r + w_b, gi + w_b + gw]  # backward-weights, then into grad_weight
        if strided and blocked and mask[0]:
            # Downsampling float32 convolutions computing grad_input hold input-minus-grad_output bytes
            # more in the backward-weights phase (fitted: exact on resnet18's and resnet50's five
            # stride-2 shapes where it dominates -- it was up to 3.2 MB under -- and r3d_18's four).
            held.append(gi + go_r + src_r + x.bytes - go.bytes)
        if weights_scratch is not None:
            held.append(gi + go_r + src_r + gw + weights_scratch)
    return max(0, max(held) - (gi + gw + gb))


def _bf16_weights_scratch(
    x: TensorMeta,
    w: TensorMeta,
    go: TensorMeta,
    stride: tuple[int, ...],
    split_mb: bool | None = None,
    dilation: int = 1,
) -> int:
    # oneDNN bfloat16 backward-weights (emulated on AVX-512 without native bf16) writes diff weights
    # directly into grad_weight but holds a scratchpad of: a float32 diff-weights accumulator, the source
    # transposed per image with tr_iw = rnd_up(ceil(iw / stride) + kw - 1, 2) * stride columns, and the
    # output gradient transposed (rows rounded to 2). Threads split the minibatch (each thread its own
    # copies) for narrow inputs and the channel blocks otherwise (then 8 KiB per thread).
    # Fitted on 11 resnet-like shapes at 1 and 2 threads (3x3 stride 1 and 2): exact when the split rule
    # below guesses oneDNN's thread balance right.
    # 3-d: the same with the rows of every depth slice (exact on a 32 -> 32 3x3x3 at 4x14x14).
    n, c, *rows, wd = x.shape
    oc, kw = w.shape[0], w.shape[-1]
    *out_rows, ow = go.shape[2:]
    sw = stride[-1]
    # Dilated kernels widen the transposed source by dilation - 1 columns (fitted: 3x3 at dilation 2, 6
    # and 12 on 28x28 maps, exact on both instruction sets).
    tr_iw = rnd(-(-wd // sw) + kw - 1 + (dilation - 1 if dilation > 1 else 0), 2) * sw
    per_copy = w.numel * 4 + c * math.prod(rows) * tr_iw * 2 + oc * math.prod(out_rows) * rnd(ow, 2) * 2
    nthr = threads()
    if split_mb is None:
        split_mb = c <= 128 and n >= nthr  # right on 8 of 9 measured shapes (64->128 3x3 s2 at 56x56 is not)
    if split_mb and nthr > 1:
        return nthr * per_copy + 8580
    return per_copy + nthr * 8192 + 388


# 3-d convolutions (video models: torchvision's r3d_18, mc3_18, r2plus1d_18), float32 NCDHW, measured on
# r3d_18 (batch 2, 3x8x112x112, every conv shape) and micro cases (batch 1-4, 1-3 threads, maps 1x7x7 to
# 8x56x56) with benchmarks/find_kernel_workspaces.py. oneDNN runs them as it runs 2-d ones (blocked
# nCdhw16c reorders), except where the input is shallower than the kernel (r3d_18's last stages: depth
# 1-2 under a 3-deep kernel), where it falls back to an im2col GEMM whose backward-weights scratch is
# the step's peak (232 MB for one 512->512 layer at batch 2).


def _is_mkldnn_conv3d(call: OpCall, x: Any, w: Any, transposed: Any, groups: int) -> bool:
    # Measured: float32, contiguous NCDHW, ungrouped; bfloat16 too with native bf16 (the sweep's 3-d
    # shapes on the AMD EPYC; unmeasured on the Xeon, so left to no model there).
    return (
        _is_mkldnn_conv(call, x, w, transposed, ndim=5)
        and groups == 1
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and native_bf16()))
        and x.is_contiguous()
    )


def _convolution_3d(x: TensorMeta, w: TensorMeta, out: TensorMeta | None) -> KernelMemory | None:
    # The 2-d NCHW scheme with a depth: blocked source (C >= 16), blocked weights, a blocked result y
    # reordered into the output. Exact on all 11 conv shapes of r3d_18 (no rtus scratch at stride 2).
    if out is None:
        return None
    n, c = x.shape[:2]
    oc = w.shape[0]
    s = x.itemsize
    blocked = c >= 16
    src_r = n * rnd(c, 16) * math.prod(x.shape[2:]) * s if blocked else 0
    w_r = _blocked_weight_bytes(w, 1, blocked, s)
    y = n * rnd(oc, 16) * math.prod(out.shape[2:]) * s
    return KernelMemory(max(src_r + w_r + y - out.bytes, y))


def _convolution_backward_3d(
    go: TensorMeta, x: TensorMeta, w: TensorMeta, mask: Sequence[bool], stride: tuple[int, ...]
) -> KernelMemory | None:
    n, c, depth = x.shape[:3]
    ic, kd, kh, kw = w.shape[1:]
    oh, ow = go.shape[3], go.shape[4]
    s = x.itemsize
    if depth < kd:
        # im2col GEMM backward-weights (see gemm_weights_scratch); the column buffer holds one output
        # depth slice. The backward-data phase stays below it on every measured shape.
        if not mask[1] or s != 4:
            return None  # bfloat16's GEMM here is unmeasured beyond one shape
        col = ic * kd * kh * kw * oh * ow * s
        return KernelMemory(gemm_weights_scratch(n, w.bytes, col, math.prod(go.shape[2:]), go.shape[2]))
    blocked = c >= 16
    w_b = _blocked_weight_bytes(w, 1, blocked, s)
    # Exact on 2 of r3d_18's 4 other shapes; the stride-1 64->64 layer and the stem are w + 8.6 KB
    # under (the per-thread diff-weights reduction, as in 2-d). bfloat16 (native): the 2-d bf16
    # backward-weights scratchpad with a depth.
    scratch = _bf16_weights_scratch(x, w, go, stride) if s == 2 and mask[1] and blocked else None
    strided = min(stride) > 1 and s == 4
    return KernelMemory(_blocked_backward_excess(go, x, w, w_b, mask, blocked, strided, scratch))


def _cl_contiguous(t: TensorMeta) -> bool:
    """Whether ``t.contiguous(memory_format=torch.channels_last)`` would not copy (size-1 dims ignored)."""
    _, c, h, w = t.shape
    expected = (c * h * w, 1, w * c, c)
    return all(size == 1 or st == e for size, st, e in zip(t.shape, t.stride, expected, strict=True))


def _convolution_backward_channels_last(
    go: TensorMeta,
    x: TensorMeta,
    w: TensorMeta,
    mask: Sequence[bool],
    depthwise: bool,
    stride: Any,
    dilation: Any = 1,
) -> KernelMemory | None:
    # Convolution.cpp convolution_backward with the mkldnn backend in channels-last (input or weight
    # channels-last): grad_output, input and weight are made channels-last-contiguous (copies when they are
    # not -- the weight of a plain nn.Conv2d always is copied, except depthwise and 1x1), oneDNN reorders the
    # weight to a blocked layout and computes a blocked diff-weights. Measured (float32, convnext_tiny and
    # micro cases, N 1-8, maps 7-56, 1 and 2 threads):
    #   dense: grad-input phase w_copy + w + 12,464; grad-weight phase w_copy + 2 w (+ bias bytes)
    #   depthwise kh*kw >= 16 (convnext's 7x7): oneDNN's depthwise kernel refuses the grad-weight pass and
    #   its generic one runs it as a grouped convolution, whose diff weights (``aBCde16c16b``) pad each
    #   group's single input and output channel to a block: block^2 w, + w -- 257 w with AVX-512, 65 w
    #   with AVX2 (ONEDNN_VERBOSE names the layouts), whatever the batch, map size, stride or thread
    #   count (+ bias bytes); kh*kw < 16 (3x3, oneDNN's depthwise kernel): 2 w (+ bias bytes).
    # Open: dense 2x2 stride-2 convs on 56x56 maps add a thread-dependent 35 KB (1 thread) to 650 KB
    # (2 threads). bfloat16 is different (below).
    oc = w.shape[0]
    kh, kw = w.shape[2], w.shape[3]
    kk = kh * kw
    copies = (0 if _cl_contiguous(go) else go.bytes) + (0 if _cl_contiguous(x) else x.bytes)
    if x.dtype == torch.bfloat16 and depthwise and kh == kw >= 4 and mask[1]:
        # bfloat16 depthwise (convnext under bf16-mixed), measured on kernels 5/7/9, maps 1-56, C 16-768,
        # N 2-4, 1 and 2 threads: C x (1590 k^2 - 672 k + 2024 + 64 H (rnd2(W) + 2)) + 8,584 -- again
        # independent of the batch and the thread count (61.2 MB at C=768 on 7x7 maps). Fitted, not derived:
        # exact at k=5 and 7, 14 KB (0.3 %) off at k=9 on 14x14 maps.
        h, wd = x.shape[2], x.shape[3]
        per_c = 1590 * kh * kh - 672 * kh + 2024 + 64 * h * (rnd(wd, 2) + 2)
        return KernelMemory(copies + oc * per_c + 8584)
    if x.dtype == torch.bfloat16 and not depthwise and mask[1]:
        # bfloat16 dense (convnext's 2x2 stride-2 downsampling under bf16-mixed): the weight copy, then the
        # same kind of scratchpad as NCHW (float32 diff weights + transposed source and grad_output),
        # counted once (oneDNN splitting the channel blocks): exact to 46 KB for 384->768 at 14x14, but
        # 1.7 MB under for 192->384 at 28x28, where oneDNN splits the minibatch instead (a lower bound).
        w_copy = 0 if _cl_contiguous(w) else w.bytes
        unit_stride = all(v == 1 for v in ints(stride, 2))
        if native_bf16() and x.shape[1] >= 16 and w.shape[1] == x.shape[1] and (kk > 1 or unit_stride):
            # With native bf16 the threads split the minibatch as in NCHW (the default split rule): the
            # sweep's dense channels-last 3x3 and 7x7 shapes (dilation 1-12) exact to 7 KB, 1x1 74 KB over.
            # Strided 1x1, grouped and stem (C < 16) convolutions keep the channel-split fit (within
            # 250 KB in the sweep).
            scratch = _bf16_weights_scratch(x, w, go, ints(stride, 2), dilation=max(ints(dilation, 2)))
            return KernelMemory(copies + w_copy + scratch)
        return KernelMemory(
            copies + w_copy + _bf16_weights_scratch(x, w, go, ints(stride, 2), split_mb=False)
        )
    if x.dtype != torch.float32:
        return None
    wb, bias = w.bytes, oc * x.itemsize if mask[2] else 0
    held = [0]
    if depthwise:
        if mask[0]:
            held.append(2 * wb)
        if mask[1]:
            held.append((channel_block() ** 2 + 1 if kk >= 16 else 2) * wb + bias)
    else:
        w_copy = 0 if _cl_contiguous(w) else wb
        if mask[0]:
            held.append(w_copy + wb + 12464)
        if mask[1]:
            held.append(w_copy + 2 * wb + bias)
    return KernelMemory(copies + max(held))
