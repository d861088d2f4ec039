"""Memory that real kernels allocate beyond what their fake (meta) kernels report.

A fake-tensor run sees each op's outputs and nothing else. Real kernels also allocate *workspaces*
(held only while the op runs: oneDNN reorders of inputs and weights into blocked layouts, scratchpads,
contiguous copies of strided arguments, float32 accumulators of bfloat16 GEMMs) and some return outputs
bigger than their meta kernels say (the oneDNN LSTM workspace). Each formula here models one aten op,
registered per op the way ``torch/utils/flop_counter.py`` registers FLOP formulas, and computes from the
op's argument metadata alone.

The numbers were measured on CPU (torch 2.14.1, oneDNN on an AVX-512 Xeon without native bf16, 2
threads) with ``benchmarks/find_kernel_workspaces.py``; ``benchmarks/KERNELS.md`` lists the evidence and
how exact each formula is. oneDNN's choices depend on the ISA and on the thread count
(``torch.get_num_threads()`` is read when a formula needs it), so on other CPUs these are close, not exact.

Semantics of :class:`KernelMemory`: while the op runs, the allocator holds what it held before the op,
plus the op's outputs, plus ``workspace_bytes`` (when ``workspace_after_outputs``); when
``workspace_after_outputs`` is false the workspace is held and released *before* the outputs exist
(peak ``before + max(workspace, outputs)``). The models here report the op's *excess*: the most it holds
at once beyond what existed before plus its outputs, so they use ``workspace_after_outputs=True``
even where the kernel frees part of it before allocating an output -- the peak is the same.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._ops import OpOverload, OpOverloadPacket

from lightning_memest.engine.events import OpCall, TensorMeta

__all__ = [
    "KERNEL_MODELS",
    "KernelMemory",
    "KernelModel",
    "OpCall",
    "TensorMeta",
    "kernel_memory",
    "kernel_model_for",
    "register_kernel_model",
    "registered_ops",
]

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class KernelMemory:
    """What a real kernel allocates that its fake kernel does not show."""

    workspace_bytes: int = 0  # held only inside the op (allocated and freed by the kernel)
    workspace_after_outputs: bool = True  # whether the op's outputs are already allocated meanwhile
    # Per flattened output (torch.utils._pytree.tree_leaves order): bytes the real kernel's storage has
    # beyond the fake one's; None when no output is under-reported.
    extra_output_bytes: tuple[int, ...] | None = None


KernelModel = Callable[[OpCall], "KernelMemory | None"]
_F = TypeVar("_F", bound=KernelModel)

KERNEL_MODELS: dict[OpOverloadPacket | OpOverload, KernelModel] = {}


def register_kernel_model(*ops: OpOverloadPacket | OpOverload) -> Callable[[_F], _F]:
    """Register a kernel model for ops (an overload, or a packet for all its overloads)."""

    def register(fn: _F) -> _F:
        for op in ops:
            KERNEL_MODELS[op] = fn
        return fn

    return register


def kernel_model_for(op: OpOverload) -> KernelModel | None:
    """The model registered for ``op``: for the overload itself, else for its packet."""
    model = KERNEL_MODELS.get(op)
    if model is None:
        model = KERNEL_MODELS.get(op.overloadpacket)
    return model


def kernel_memory(call: OpCall) -> KernelMemory | None:
    """What the real kernel of ``call`` allocates beyond its fake outputs; ``None`` when nothing."""
    model = kernel_model_for(call.op)
    if model is None:
        return None
    result = model(call)
    if result is None or (result.workspace_bytes <= 0 and result.extra_output_bytes is None):
        return None
    return result


# ---------------------------------------------------------------------------------------------- helpers

_MKLDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _rnd(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _good_ld(dim: int, itemsize: int) -> int:
    # oneDNN rnn_utils::get_good_ld: 64-byte aligned and not a multiple of 256 (4K aliasing).
    ld = _rnd(dim, 64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def _copy_if_strided(t: Any) -> int:
    """Bytes of the ``.contiguous()`` copy a kernel makes of a non-contiguous tensor argument."""
    return t.bytes if isinstance(t, TensorMeta) and not t.is_contiguous() else 0


def _ints(value: Any, n: int) -> tuple[int, ...]:
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


@register_kernel_model(aten.mm, aten.addmm)
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


# ------------------------------------------------------------------------------------ convolution


def _conv_shapes(x: TensorMeta, w: TensorMeta, stride: Any, padding: Any, dilation: Any) -> tuple[int, int]:
    kh, kw = w.shape[2], w.shape[3]
    sh, sw = _ints(stride, 2)
    ph, pw = _ints(padding, 2)
    dh, dw = _ints(dilation, 2)
    oh = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return oh, ow


def _blocked_weight_bytes(w: TensorMeta, groups: int, blocked_src: bool, s: int) -> int:
    # oneDNN blocked weights (OIhw16i16o, Goihw16g, Ohwi16o; OIdhw16i16o): channel dims padded to 16 on
    # AVX-512.
    oc, icg = w.shape[:2]
    k = math.prod(w.shape[2:])
    if groups > 1 and icg == 1 and oc == groups:  # depthwise
        return _rnd(oc, 16) * k * s
    if groups > 1:
        return groups * _rnd(oc // groups, 16) * _rnd(icg, 16) * k * s
    return _rnd(oc, 16) * (_rnd(icg, 16) if blocked_src else icg) * k * s


def _is_mkldnn_conv(call: OpCall, x: Any, w: Any, transposed: Any, ndim: int = 4) -> bool:
    return (
        call.device_type == "cpu"
        and isinstance(x, TensorMeta)
        and isinstance(w, TensorMeta)
        and len(x.shape) == ndim
        and len(w.shape) == ndim
        and not transposed
        and x.dtype in _MKLDNN_DTYPES
    )


@register_kernel_model(aten.convolution)
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
    depthwise = groups > 1 and icg == 1 and oc == groups
    if x.is_channels_last() or w.is_channels_last():
        w_copy = 0 if w.is_channels_last() or (w.is_contiguous() and (icg == 1 or kh * kw == 1)) else w.bytes
        w_r = _blocked_weight_bytes(w, groups, True, s)
        # 12,336 B of oneDNN scratchpad measured on every non-depthwise channels-last conv (convnext_tiny).
        return KernelMemory(w_copy + w_r + (0 if depthwise else 12336))
    blocked = c >= 16 or groups > 1
    src_r = n * _rnd(c, 16) * h * wd * s if blocked else 0
    w_r = _blocked_weight_bytes(w, groups, blocked, s)
    y = n * _rnd(oc, 16) * oh * ow * s
    # 1x1 convolutions with stride > 1 gather the strided input per thread ("rtus" scratchpad).
    rtus = 0
    if blocked and kh == kw == 1 and any(v > 1 for v in _ints(stride, 2)) and s == 4:
        rtus = _threads() * c * oh * ow * s + 128
    return KernelMemory(max(src_r + w_r + y + rtus - out, y))


@register_kernel_model(aten.convolution_backward)
def _convolution_backward(call: OpCall) -> KernelMemory | None:
    # Conv.cpp mkldnn_convolution_backward_input / _weights: grad_output, weights and input are reordered
    # to blocked layouts, oneDNN writes blocked diff_src / diff_weights that are reordered into the outputs.
    go, x, w = call.arg("grad_output"), call.arg("input"), call.arg("weight")
    transposed, groups = call.arg("transposed", False), int(call.arg("groups", 1))
    mask, stride = call.arg("output_mask", (True, True, True)), call.arg("stride")
    if _is_mkldnn_conv3d(call, x, w, transposed, groups) and isinstance(go, TensorMeta):
        return _convolution_backward_3d(go, x, w, mask, _ints(stride, 3))
    if not _is_mkldnn_conv(call, x, w, transposed) or not isinstance(go, TensorMeta):
        return None
    n, c, h, wd = x.shape
    oc, icg, kh, kw = w.shape
    oh, ow = go.shape[2], go.shape[3]
    s = x.itemsize
    depthwise = groups > 1 and icg == 1 and oc == groups
    if x.is_channels_last() or w.is_channels_last():
        return _convolution_backward_channels_last(go, x, w, mask, depthwise, stride)
    # NCHW backend: a channels-last grad_output (a channels-last layer after this one) is made contiguous.
    go_copy = 0 if go.is_contiguous() else go.bytes
    if kh >= 15 and kw >= 15 and groups == 1 and s == 4 and mask[1]:
        # Kernels of 15 and more (ViT patch embeddings: 16x16, 32x32) run backward-weights as an im2col
        # GEMM (measured: 14 -> blocked, 15 -> GEMM). vit_b_32 at batch 2: 77,003,008 (-3.9 % before).
        col = c * kh * kw * oh * ow * s
        return KernelMemory(go_copy + _gemm_weights_scratch(n, w.bytes, col, oh * ow, None))
    if depthwise:
        # Measured: one input-sized blocked buffer (mobilenet_v2, efficientnet_b0; exact at stride 1).
        return KernelMemory(go_copy + n * _rnd(c, 16) * h * wd * s)
    blocked = c >= 16 or groups > 1
    strided = s == 4 and groups == 1 and any(v > 1 for v in _ints(stride, 2))
    bf16_scratch = (
        _bf16_weights_scratch(x, w, go, _ints(stride, 2))
        if mask[1] and s == 2 and groups == 1 and blocked and kh * kw > 1
        else None
    )
    w_b = _blocked_weight_bytes(w, groups, blocked, s)
    excess = _blocked_backward_excess(go, x, w, w_b, mask, blocked, strided, bf16_scratch)
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
) -> int:
    """The most oneDNN's blocked (nC[d]hw16c) convolution backward holds beyond its outputs, 2-d and
    3-d alike: grad_output, the weights (``w_b`` bytes blocked) and, when ``blocked``, the source are
    reordered; backward-data writes a blocked diff_src reordered into grad_input, backward-weights a
    blocked diff_weights reordered into grad_weight (with ``weights_scratch`` beside grad_weight when
    given: the bfloat16 scratchpad)."""
    n, c = x.shape[:2]
    oc = w.shape[0]
    s = x.itemsize
    spatial = math.prod(x.shape[2:])
    go_r = n * _rnd(oc, 16) * math.prod(go.shape[2:]) * s
    src_r = n * _rnd(c, 16) * spatial * s if blocked else 0
    gi = n * c * spatial * s if mask[0] else 0
    gw = w.bytes if mask[1] else 0
    gb = oc * s if mask[2] else 0
    held = [0]
    if mask[0]:
        dsrc = n * _rnd(c, 16) * spatial * s
        held += [go_r + w_b + dsrc, dsrc + gi]  # backward-data, then the reorder into grad_input
    if mask[1]:
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
    x: TensorMeta, w: TensorMeta, go: TensorMeta, stride: tuple[int, ...], split_mb: bool | None = None
) -> int:
    # oneDNN bfloat16 backward-weights (emulated on AVX-512 without native bf16) writes diff weights
    # directly into grad_weight but holds a scratchpad of: a float32 diff-weights accumulator, the source
    # transposed per image with tr_iw = rnd_up(ceil(iw / stride) + kw - 1, 2) * stride columns, and the
    # output gradient transposed (rows rounded to 2). Threads split the minibatch (each thread its own
    # copies) for narrow inputs and the channel blocks otherwise (then 8 KiB per thread).
    # Fitted on 11 resnet-like shapes at 1 and 2 threads (3x3 stride 1 and 2): exact when the split rule
    # below guesses oneDNN's thread balance right.
    n, c, h, wd = x.shape
    oc, _, _, kw = w.shape
    oh, ow = go.shape[2], go.shape[3]
    sw = stride[1]
    tr_iw = _rnd(-(-wd // sw) + kw - 1, 2) * sw
    per_copy = w.numel * 4 + c * h * tr_iw * 2 + oc * oh * _rnd(ow, 2) * 2
    nthr = _threads()
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
    # Measured: float32, contiguous NCDHW, ungrouped.
    return (
        _is_mkldnn_conv(call, x, w, transposed, ndim=5)
        and groups == 1
        and x.dtype == torch.float32
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
    src_r = n * _rnd(c, 16) * math.prod(x.shape[2:]) * s if blocked else 0
    w_r = _blocked_weight_bytes(w, 1, blocked, s)
    y = n * _rnd(oc, 16) * math.prod(out.shape[2:]) * s
    return KernelMemory(max(src_r + w_r + y - out.bytes, y))


def _convolution_backward_3d(
    go: TensorMeta, x: TensorMeta, w: TensorMeta, mask: Sequence[bool], stride: tuple[int, ...]
) -> KernelMemory | None:
    n, c, depth = x.shape[:3]
    ic, kd, kh, kw = w.shape[1:]
    oh, ow = go.shape[3], go.shape[4]
    s = x.itemsize
    if depth < kd:
        # im2col GEMM backward-weights (see _gemm_weights_scratch); the column buffer holds one output
        # depth slice. The backward-data phase stays below it on every measured shape.
        if not mask[1]:
            return None
        col = ic * kd * kh * kw * oh * ow * s
        return KernelMemory(_gemm_weights_scratch(n, w.bytes, col, math.prod(go.shape[2:]), go.shape[2]))
    blocked = c >= 16
    w_b = _blocked_weight_bytes(w, 1, blocked, s)
    # Exact on 2 of r3d_18's 4 other shapes; the stride-1 64->64 layer and the stem are w + 8.6 KB
    # under (the per-thread diff-weights reduction, as in 2-d).
    return KernelMemory(_blocked_backward_excess(go, x, w, w_b, mask, blocked, min(stride) > 1))


def _gemm_weights_scratch(n: int, w_bytes: int, col: int, positions: int, out_depth: int | None) -> int:
    """Scratch of oneDNN's im2col GEMM convolution backward-weights (float32), for ``positions`` output
    positions (D x H x W) and a column buffer of ``col`` bytes; ``out_depth`` for 3-d convolutions.

    A working set is 4 weight-sized float buffers and one column buffer, + 256 B. Each thread gets a set
    ("outer" threading over the minibatch) when the batch is above 1 and the output positions per thread
    are under 256; otherwise the threads share one (measured: 242 positions per thread -> a set each,
    264 -> one set). At batch 1, 3-d convolutions hold column buffers only (one per thread, up to the
    output depth) and 2-d ones one set. Fitted on 30 shapes (2-d kernels 15-32, 3-d inputs shallower
    than the kernel; 1-3 threads; batch 1-4), each exact.
    """
    nthr = _threads()
    if n >= 2:
        sets = nthr if positions / nthr < 256 else 1
        return sets * (4 * w_bytes + col) + 256
    if out_depth is not None:
        return min(nthr, out_depth) * col
    return 4 * w_bytes + col + 256


def _cl_contiguous(t: TensorMeta) -> bool:
    """Whether ``t.contiguous(memory_format=torch.channels_last)`` would not copy (size-1 dims ignored)."""
    _, c, h, w = t.shape
    expected = (c * h * w, 1, w * c, c)
    return all(size == 1 or st == e for size, st, e in zip(t.shape, t.stride, expected, strict=True))


def _convolution_backward_channels_last(
    go: TensorMeta, x: TensorMeta, w: TensorMeta, mask: Sequence[bool], depthwise: bool, stride: Any
) -> KernelMemory | None:
    # Convolution.cpp convolution_backward with the mkldnn backend in channels-last (input or weight
    # channels-last): grad_output, input and weight are made channels-last-contiguous (copies when they are
    # not -- the weight of a plain nn.Conv2d always is copied, except depthwise and 1x1), oneDNN reorders the
    # weight to a blocked layout and computes a blocked diff-weights. Measured (float32, convnext_tiny and
    # micro cases, N 1-8, maps 7-56, 1 and 2 threads):
    #   dense: grad-input phase w_copy + w + 12,464; grad-weight phase w_copy + 2 w (+ bias bytes)
    #   depthwise kh*kw >= 16 (convnext's 7x7): the grad-weight phase holds 257 w (+ bias bytes) whatever
    #   the batch, map size, stride or thread count; kh*kw < 16 (3x3): 2 w (+ bias bytes).
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
        per_c = 1590 * kh * kh - 672 * kh + 2024 + 64 * h * (_rnd(wd, 2) + 2)
        return KernelMemory(copies + oc * per_c + 8584)
    if x.dtype == torch.bfloat16 and not depthwise and mask[1]:
        # bfloat16 dense (convnext's 2x2 stride-2 downsampling under bf16-mixed): the weight copy, then the
        # same kind of scratchpad as NCHW (float32 diff weights + transposed source and grad_output),
        # counted once (oneDNN splitting the channel blocks): exact to 46 KB for 384->768 at 14x14, but
        # 1.7 MB under for 192->384 at 28x28, where oneDNN splits the minibatch instead (a lower bound).
        w_copy = 0 if _cl_contiguous(w) else w.bytes
        return KernelMemory(
            copies + w_copy + _bf16_weights_scratch(x, w, go, _ints(stride, 2), split_mb=False)
        )
    if x.dtype != torch.float32:
        return None
    wb, bias = w.bytes, oc * x.itemsize if mask[2] else 0
    held = [0]
    if depthwise:
        if mask[0]:
            held.append(2 * wb)
        if mask[1]:
            held.append((257 if kk >= 16 else 2) * wb + bias)
    else:
        w_copy = 0 if _cl_contiguous(w) else wb
        if mask[0]:
            held.append(w_copy + wb + 12464)
        if mask[1]:
            held.append(w_copy + 2 * wb + bias)
    return KernelMemory(copies + max(held))


# ------------------------------------------------------------------------------------ normalisation


@register_kernel_model(aten.native_batch_norm, aten._native_batch_norm_legit)
def _batch_norm(call: OpCall) -> KernelMemory | None:
    # aten/src/ATen/native/Normalization.cpp batch_norm_cpu: two float32 per-channel temporaries (mean and
    # invstd before they are copied out) while training; measured 8 B x C (resnet50: 16,384 at C=2048).
    x, training = call.arg("input"), call.arg("training", True)
    if call.device_type != "cpu" or not isinstance(x, TensorMeta) or not training or len(x.shape) < 2:
        return None
    return KernelMemory(2 * x.shape[1] * 4)


@register_kernel_model(aten.native_batch_norm_backward)
def _batch_norm_backward(call: OpCall) -> KernelMemory | None:
    # batch_norm_backward_cpu: an input-sized temporary besides grad_input (measured: exactly the input's
    # bytes for every training-mode batch norm of resnet18/50, mobilenet_v2, efficientnet_b0, densenet121).
    x, train = call.arg("input"), call.arg("train", True)
    if call.device_type != "cpu" or not isinstance(x, TensorMeta) or not train:
        return None
    return KernelMemory(x.bytes)


@register_kernel_model(aten.native_layer_norm)
def _layer_norm(call: OpCall) -> KernelMemory | None:
    # layer_norm_cpu calls input.contiguous(): a copy when the input is strided (vit_b_16, convnext_tiny).
    if call.device_type != "cpu":
        return None
    ws = _copy_if_strided(call.arg("input"))
    return KernelMemory(ws) if ws else None


@register_kernel_model(aten.native_layer_norm_backward)
def _layer_norm_backward(call: OpCall) -> KernelMemory | None:
    # layer_norm_backward_cpu: contiguous copies of a strided grad_out and input (vit_b_16: 2,426,880 each
    # at batch 4), plus a few KB of per-thread gamma/beta partial sums (not modelled).
    if call.device_type != "cpu":
        return None
    ws = _copy_if_strided(call.arg("grad_out")) + _copy_if_strided(call.arg("input"))
    return KernelMemory(ws) if ws else None


# ------------------------------------------------------------------------------------ reductions etc.


@register_kernel_model(aten.mean)
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


@register_kernel_model(aten.embedding_dense_backward)
def _embedding_backward(call: OpCall) -> KernelMemory | None:
    # embedding_dense_backward_cpu: grad.contiguous() (the LSTM LM's gradient arrives transposed).
    if call.device_type != "cpu":
        return None
    ws = _copy_if_strided(call.arg("grad_output"))
    return KernelMemory(ws) if ws else None


# ------------------------------------------------------------------------------------ oneDNN LSTM


def _rnn_dims(call: OpCall) -> tuple[TensorMeta, int, int, int, int, int] | None:
    # Both ops take the input as (T, N, I) -- for batch_first LSTMs a transposed view -- and
    # weights (4H, I) and (4H, H); the backward names them weight1/weight2.
    forward = call.op.overloadpacket is aten.mkldnn_rnn_layer
    x = call.arg("input")
    w_ih, w_hh = (
        (call.arg("weight0"), call.arg("weight1")) if forward else (call.arg("weight1"), call.arg("weight2"))
    )
    if call.device_type != "cpu" or not all(isinstance(t, TensorMeta) for t in (x, w_ih, w_hh)):
        return None
    if len(x.shape) != 3 or len(w_ih.shape) != 2 or len(w_hh.shape) != 2:
        return None
    t, n = x.shape[0], x.shape[1]
    gates, i = w_ih.shape
    h = w_hh.shape[1]
    return x, t, n, i, h, gates


def _lstm_workspace_bytes(t: int, n: int, i: int, h: int, dtype: torch.dtype) -> int:
    # oneDNN src/cpu/rnn/rnn_utils (set_offsets / set_workspace_sizes) for one layer and direction, each
    # part rounded up to a 4 KiB page: gates, ht, states_layer, states_iter (registered twice), c states,
    # diff states, diff c states. Matches all 21 measured (T, N, I, H) float32 and bfloat16 cases exactly.
    s = dtype.itemsize
    m = max(i, h)
    rows_t, rows_t1 = t * n, 2 * (t + 1) * n
    if dtype == torch.float32:
        parts = [
            rows_t * _good_ld(4 * h, 4) * 4,
            rows_t * _good_ld(h, 4) * 4,
            rows_t1 * _good_ld(m, 4) * 4,
            rows_t1 * _good_ld(m, 4) * 4,
            rows_t1 * h * 4,
            rows_t1 * _good_ld(m, 4) * 4,
            rows_t1 * h * 4,
        ]
    else:  # bfloat16: fitted layout (gates, ht and diff states in bf16; states and c states in float32)
        parts = [
            rows_t * _good_ld(4 * h, s) * s,
            rows_t * _good_ld(h, s) * s,
            rows_t1 * _good_ld(m, 4) * 4,
            rows_t1 * _good_ld(m, 4) * 4,
            rows_t1 * h * 4,
            rows_t1 * _good_ld(m, s) * s,
            rows_t1 * h * s,
        ]
    return sum(_rnd(p, 4096) for p in parts)


def _lstm_scratch_bytes(t: int, n: int, h: int) -> int:
    # oneDNN scratchpad: scratch gates (T x N rows of good_ld(4H) floats), scratch ht and diff ht (N rows
    # of good_ld(H)), each page-rounded, plus 4,664 B measured on every case (float32).
    return _rnd(t * n * _good_ld(4 * h, 4) * 4, 4096) + 2 * _rnd(n * _good_ld(h, 4) * 4, 4096) + 4664


@register_kernel_model(aten.mkldnn_rnn_layer)
def _mkldnn_rnn_layer(call: OpCall) -> KernelMemory | None:
    # aten/src/ATen/native/mkldnn/RNN.cpp mkldnn_rnn_layer: the meta kernel returns a 0-byte workspace;
    # the real one is oneDNN's workspace_desc size. While it runs: the summed bias (4H), the weights
    # reordered to ldigo with a good leading dimension, and the scratchpad.
    dims = _rnn_dims(call)
    if dims is None or not call.arg("train", True):
        return None
    x, t, n, i, h, gates = dims
    if gates != 4 * h:
        return None  # only LSTM is lowered to mkldnn_rnn_layer
    s = x.itemsize
    ws = _lstm_workspace_bytes(t, n, i, h, x.dtype)
    fake_ws = call.outputs[3].nbytes if len(call.outputs) > 3 and call.outputs[3] is not None else 0
    extra = (0, 0, 0, max(0, ws - fake_ws))
    transient = 4 * h * s + (i + h) * _good_ld(4 * h, s) * s + _lstm_scratch_bytes(t, n, h)
    return KernelMemory(transient, True, extra)


@register_kernel_model(aten.mkldnn_rnn_layer_backward)
def _mkldnn_rnn_layer_backward(call: OpCall) -> KernelMemory | None:
    # RNN.cpp mkldnn_rnn_layer_backward: zeros for undefined grad_hy / grad_cy, the summed bias, a
    # contiguous grad_output, weights in ldigo and diff weights in ldgoi (good leading dimensions), a
    # float diff-bias, the scratchpad; the second bias gradient is a clone the meta kernel aliases.
    dims = _rnn_dims(call)
    if dims is None:
        return None
    x, t, n, i, h, gates = dims
    if gates != 4 * h:
        return None
    s = x.itemsize
    grad_out, grad_hy, grad_cy = call.arg("grad_output"), call.arg("grad_hy"), call.arg("grad_cy")
    ws = 4 * h * s  # summed bias
    ws += (n * h * s if grad_hy is None else 0) + (n * h * s if grad_cy is None else 0)
    ws += _copy_if_strided(grad_out)
    if s == 4:
        ws += (i + h) * _good_ld(4 * h, 4) * 4  # weights, ldigo
    else:
        # bfloat16: the ldigo weights stay bfloat16 (exact: the saving over float32 is (I+H) x 4,096 B at
        # H=512 for both LM layers), and something T x N x H float32-sized is not allocated; the 12,272
        # B remainder is fitted on the LSTM LM's two layers (T=128, N=4, H=512), not derived.
        ws += (i + h) * _good_ld(4 * h, s) * s - t * n * h * 4 + 12272
    ws += 4 * h * (_good_ld(i, 4) + _good_ld(h, 4)) * 4  # diff weights, ldgoi
    ws += 4 * h * 4  # diff bias
    ws += _lstm_scratch_bytes(t, n, h)
    ws -= 4 * h * 4  # the bias-gradient clone is allocated after the workspace is freed
    extra = [0] * len(call.outputs)
    if len(extra) > 4:
        extra[4] = 4 * h * 4  # float32 even for bfloat16 (measured 8,192 B at H=512 in both)
    return KernelMemory(ws, True, tuple(extra))


def registered_ops() -> Sequence[str]:
    """The names of the ops that have a kernel model."""
    return sorted(str(op) for op in KERNEL_MODELS)
