"""Kernel memory models (lightning_memest.accounting.kernels): hand-computed cases of each formula."""

from __future__ import annotations

import pytest
import torch

from lightning_memest.accounting.kernels import CPU_KERNELS, KernelMemory, OpCall, TensorMeta, kernel_memory
from lightning_memest.registry import OpRegistry

aten = torch.ops.aten


def meta(
    *shape: int, dtype: torch.dtype = torch.float32, stride: tuple[int, ...] | None = None
) -> TensorMeta:
    if stride is None:
        t = torch.empty(shape, dtype=dtype, device="meta")
        stride = t.stride()
    n = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return TensorMeta(tuple(shape), tuple(stride), dtype, "cpu", n * dtype.itemsize)


def cl(n: int, c: int, h: int, w: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return meta(n, c, h, w, dtype=dtype, stride=(c * h * w, 1, w * c, c))


def call(
    op: torch._ops.OpOverload, *args: object, outputs: tuple[TensorMeta | None, ...] = (), device: str = "cpu"
) -> OpCall:
    return OpCall(op, tuple(args), {}, outputs, device)


def ws(c: OpCall) -> int:
    km = kernel_memory(c)
    return 0 if km is None else km.workspace_bytes


def test_tensor_meta_of_and_layouts() -> None:
    t = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    m = TensorMeta.of(t)
    assert m.shape == (2, 3, 4, 5) and m.nbytes == 2 * 3 * 4 * 5 * 4 and m.bytes == m.nbytes
    assert m.is_channels_last() and not m.is_contiguous()
    assert TensorMeta.of(torch.empty(3, 4)).is_contiguous()
    assert not TensorMeta.of(torch.empty(3, 4).t()).is_contiguous()


def test_lookup_by_overload_then_packet(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CPU_KERNELS.lookup(aten.mm.default) is CPU_KERNELS.lookup(aten.mm.out) is not None
    assert CPU_KERNELS.lookup(aten.relu.default) is None
    assert kernel_memory(call(aten.relu.default, meta(4))) is None

    registry: OpRegistry[object] = OpRegistry("test kernels")
    monkeypatch.setattr("lightning_memest.accounting.kernels.CPU_KERNELS", registry)

    @registry.register(aten.relu.default)
    def fixed(c: OpCall) -> KernelMemory:
        return KernelMemory(7)

    assert kernel_memory(call(aten.relu.default, meta(4))) == KernelMemory(7)
    with pytest.raises(ValueError, match=r"a second registration for aten\.relu\.default"):
        registry.register(aten.relu.default)(fixed)
    with pytest.raises(TypeError, match="register an op"):
        registry.register("aten::relu")  # type: ignore[arg-type]


def test_mm_copies_a_stride0_operand() -> None:
    grad = meta(512, 64, stride=(0, 0))  # sum's backward expands a scalar
    x = meta(64, 256)
    assert ws(call(aten.mm.default, grad, x, outputs=(meta(512, 256),))) == 512 * 64 * 4
    assert ws(call(aten.mm.default, meta(512, 64), x, outputs=(meta(512, 256),))) == 0
    assert ws(call(aten.mm.default, meta(512, 64, stride=(1, 512)), x)) == 0  # a transpose: BLAS reads it
    assert ws(call(aten.mm.default, grad, x, device="cuda")) == 0


def test_bf16_addmm_float32_accumulator() -> None:
    out = meta(512, 1024, dtype=torch.bfloat16)
    c = call(
        aten.addmm.default,
        meta(1024, dtype=torch.bfloat16),
        meta(512, 256, dtype=torch.bfloat16),
        meta(256, 1024, dtype=torch.bfloat16, stride=(1, 256)),
        outputs=(out,),
    )
    assert ws(c) == 512 * 1024 * 4 + 128  # measured 2,097,280 (gpt bf16-true)


def conv(
    x: TensorMeta,
    w: TensorMeta,
    stride: int = 1,
    pad: int = 0,
    groups: int = 1,
    out: TensorMeta | None = None,
) -> OpCall:
    """A 2-d or 3-d convolution call (its rank from the input's); ``out``: its output, when given."""
    d = len(x.shape) - 2
    args = (x, w, None, [stride] * d, [pad] * d, [1] * d, False, [0] * d, groups)
    return call(aten.convolution.default, *args, outputs=(out,) if out is not None else ())


def test_convolution_forward_oneDNN_reorders(monkeypatch: pytest.MonkeyPatch) -> None:
    # resnet18 stem, batch 4: no src reorder (3 channels), y = output size -> excess = y = 12,845,056.
    assert ws(conv(meta(4, 3, 224, 224), meta(64, 3, 7, 7), 2, 3)) == 4 * 64 * 112 * 112 * 4
    # 3x3 64->64 at 56x56: src reorder + weight reorder (measured excess 3,358,720).
    assert ws(conv(meta(4, 64, 56, 56), meta(64, 64, 3, 3), 1, 1)) == 4 * 64 * 56 * 56 * 4 + 64 * 64 * 9 * 4
    # 1x1 stride 2 gathers strided input per thread: + threads x C x OH x OW x 4 + 128 (measured 3,645,568).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    expected = 4 * 64 * 56 * 56 * 4 + 128 * 64 * 4 + 2 * 64 * 28 * 28 * 4 + 128
    assert ws(conv(meta(4, 64, 56, 56), meta(128, 64, 1, 1), 2)) == expected
    # channels-last depthwise (convnext): only the padded weight reorder (measured 18,816).
    assert ws(conv(cl(4, 96, 56, 56), meta(96, 1, 7, 7), 1, 3, groups=96)) == 96 * 49 * 4
    # channels-last 2x2 stride 2: weight made channels-last + reorder + 12,336 (measured 602,160).
    assert ws(conv(cl(4, 96, 56, 56), meta(192, 96, 2, 2), 2)) == 2 * 192 * 96 * 4 * 4 + 12336
    # channel padding to 16: 24 channels count as 32 in the blocked buffers.
    assert (
        ws(conv(meta(1, 24, 8, 8), meta(24, 24, 1, 1)))
        == 32 * 64 * 4 + 32 * 32 * 4 + 32 * 64 * 4 - 24 * 64 * 4
    )


def test_convolution_backward() -> None:
    # resnet18 3x3 512->512 at 7x7, batch 4: the blocked diff-weights buffer outlives grad_weight's reorder.
    c = call(
        aten.convolution_backward.default,
        meta(4, 512, 7, 7),
        meta(4, 512, 7, 7),
        meta(512, 512, 3, 3),
        None,
        [1, 1],
        [1, 1],
        [1, 1],
        False,
        [0, 0],
        1,
        [True, True, False],
    )
    assert ws(c) == 512 * 512 * 9 * 4  # measured 9,437,184
    # The stem (no grad_input): grad_output reorder + weights (measured 12,891,264 with 46,208 of scratch).
    c = call(
        aten.convolution_backward.default,
        meta(4, 64, 112, 112),
        meta(4, 3, 224, 224),
        meta(64, 3, 7, 7),
        None,
        [2, 2],
        [3, 3],
        [1, 1],
        False,
        [0, 0],
        1,
        [False, True, False],
    )
    assert ws(c) == 4 * 64 * 112 * 112 * 4


# r3d_18's and resnet's convolutions have no bias.
NO_BIAS = (True, True, False)


def convb(
    go: TensorMeta,
    x: TensorMeta,
    w: TensorMeta,
    stride: int,
    padding: int,
    groups: int = 1,
    mask: tuple[bool, bool, bool] = (True, True, True),
) -> OpCall:
    """A 2-d or 3-d convolution backward call (its rank from the input's)."""
    dims = len(x.shape) - 2
    return call(
        aten.convolution_backward.default,
        go,
        x,
        w,
        [w.shape[0]],
        [stride] * dims,
        [padding] * dims,
        [1] * dims,
        False,
        [0] * dims,
        groups,
        list(mask),
    )


def test_convolution_backward_channels_last() -> None:
    # convnext_tiny, batch 4, float32 (all measured exactly).
    # Depthwise 7x7: 257 x the weight + the bias, whatever the batch and map size (38,688,768 at C=768).
    w = meta(768, 1, 7, 7)
    assert ws(convb(cl(4, 768, 7, 7), cl(4, 768, 7, 7), w, 1, 3, 768)) == 257 * 768 * 49 * 4 + 768 * 4
    assert ws(convb(cl(8, 96, 56, 56), cl(8, 96, 56, 56), meta(96, 1, 7, 7), 1, 3, 96)) == 4836096
    # Depthwise 3x3: 2 x the weight + the bias (58,368 at C=768); grad_input only: 2 x the weight.
    assert ws(convb(cl(4, 768, 7, 7), cl(4, 768, 7, 7), meta(768, 1, 3, 3), 1, 1, 768)) == 58368
    c = convb(cl(4, 8, 14, 14), cl(4, 8, 14, 14), meta(8, 1, 7, 7), 1, 3, 8, (True, False, False))
    assert ws(c) == 2 * 8 * 49 * 4  # measured 3,136
    # Dense 2x2 stride 2: weight made channels-last + blocked weight + blocked diff weights + bias
    # (3,540,480); a plain-contiguous grad_output is made channels-last first (+602,112: 14,760,960).
    w = meta(384, 192, 2, 2)
    assert ws(convb(cl(4, 384, 14, 14), cl(4, 192, 28, 28), w, 2, 0)) == 3 * w.bytes + 384 * 4
    w = meta(768, 384, 2, 2)
    assert ws(convb(meta(4, 768, 7, 7), cl(4, 384, 14, 14), w, 2, 0)) == 14760960
    # grad_input only: weight copy + blocked weight + 12,464 of scratch (measured 307,376).
    w = meta(64, 64, 3, 3)
    assert ws(convb(cl(4, 64, 28, 28), cl(4, 64, 28, 28), w, 1, 1, mask=(True, False, False))) == 307376
    # Stem of convnext: NCHW input, so the NCHW backend; the channels-last grad_output is copied
    # (+4,816,896) on top of the NCHW formula (measured 9,660,928 at 2 threads: 27.5 KB of scratch open).
    c = convb(cl(4, 96, 56, 56), meta(4, 3, 224, 224), meta(96, 3, 4, 4), 4, 0, mask=(False, True, True))
    plain = convb(
        meta(4, 96, 56, 56), meta(4, 3, 224, 224), meta(96, 3, 4, 4), 4, 0, mask=(False, True, True)
    )
    assert ws(c) == ws(plain) + 4 * 96 * 56 * 56 * 4


def test_convolution_backward_bf16_weights_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    bf = torch.bfloat16
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    # resnet18 layer4 3x3 512->512 at 7x7, batch 4 (the bf16-true step peak): blocked grad_output and input
    # (200,704 each) + scratch = float32 diff weights 9,437,184 + transposed source 512*7*10*2 + transposed
    # grad_output 512*7*8*2 + 2 threads x 8,192 + 388 = 9,582,980 (measured 9,984,388 in all).
    c = convb(
        meta(4, 512, 7, 7, dtype=bf),
        meta(4, 512, 7, 7, dtype=bf),
        meta(512, 512, 3, 3, dtype=bf),
        1,
        1,
        mask=(True, True, False),
    )
    assert ws(c) == 2 * 200704 + 512 * 512 * 9 * 4 + 512 * 7 * 10 * 2 + 512 * 7 * 8 * 2 + 2 * 8192 + 388
    # 3x3 64->64 at 56x56: threads split the minibatch, each with its own copies (measured 5,149,060).
    c = convb(
        meta(4, 64, 56, 56, dtype=bf),
        meta(4, 64, 56, 56, dtype=bf),
        meta(64, 64, 3, 3, dtype=bf),
        1,
        1,
        mask=(True, True, False),
    )
    per_thread = 64 * 64 * 9 * 4 + 64 * 56 * 58 * 2 + 64 * 56 * 56 * 2
    assert ws(c) == 2 * 1605632 + 2 * per_thread + 8580
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert ws(c) == 2 * 1605632 + per_thread + 8580  # measured 1-thread scratch 973,188


def test_convolution_backward_bf16_channels_last_depthwise() -> None:
    # convnext_tiny under bf16-mixed: independent of batch and threads, measured exactly at
    # C=768 on 7x7 maps (61,225,864) and C=96 on 56x56 maps (27,186,376).
    bf = torch.bfloat16

    def dw(n: int, c: int, h: int, k: int) -> int:
        x = cl(n, c, h, h, dtype=bf)
        return ws(convb(x, x, meta(c, 1, k, k, dtype=bf), 1, k // 2, c))

    per_c_7x7 = 1590 * 49 - 672 * 7 + 2024  # 75,230
    assert dw(4, 768, 7, 7) == 768 * (per_c_7x7 + 64 * 7 * (8 + 2)) + 8584 == 61_225_864
    assert dw(4, 96, 56, 7) == 27_186_376
    assert dw(2, 96, 56, 7) == 27_186_376
    assert dw(4, 16, 7, 5) == 694_888  # kernel 5, measured


def test_batch_norm() -> None:
    x = meta(4, 64, 112, 112)
    c64 = meta(64)
    fwd = call(aten.native_batch_norm.default, x, c64, c64, c64, c64, True, 0.1, 1e-5)
    assert ws(fwd) == 2 * 64 * 4
    assert ws(call(aten.native_batch_norm.default, x, c64, c64, c64, c64, False, 0.1, 1e-5)) == 0
    bwd = call(aten.native_batch_norm_backward.default, x, x, c64, c64, c64, c64, c64, True, 1e-5, [True] * 3)
    assert ws(bwd) == 4 * 64 * 112 * 112 * 4  # measured 12,845,056 (resnet18 batch 4)


def test_layer_norm_and_embedding_copy_strided_inputs() -> None:
    strided = meta(4, 197, 768, stride=(768, 3072, 1))  # vit_b_16: a transposed (seq, batch) view
    assert (
        ws(call(aten.native_layer_norm.default, strided, [768], meta(768), meta(768), 1e-6))
        == 4 * 197 * 768 * 4
    )
    assert ws(call(aten.native_layer_norm.default, meta(4, 197, 768), [768], None, None, 1e-6)) == 0
    stats = meta(4, 197, 1)
    bwd = call(
        aten.native_layer_norm_backward.default,
        strided,
        strided,
        [768],
        stats,
        stats,
        meta(768),
        meta(768),
        [True] * 3,
    )
    assert ws(bwd) == 2 * 4 * 197 * 768 * 4  # measured 4,853,760
    grad = meta(4, 128, 256, stride=(256, 1024, 1))
    assert (
        ws(
            call(
                aten.embedding_dense_backward.default, grad, meta(4, 128, dtype=torch.int64), 1000, -1, False
            )
        )
        == 4 * 128 * 256 * 4
    )


def test_bf16_mean_accumulates_in_float32() -> None:
    x = meta(4, 512, 7, 7, dtype=torch.bfloat16)
    out = meta(4, 512, 1, 1, dtype=torch.bfloat16)
    assert ws(call(aten.mean.dim, x, [-1, -2], True, outputs=(out,))) == 401408 + 8192
    assert ws(call(aten.mean.dim, meta(4, 512, 7, 7), [-1, -2], True, outputs=(meta(4, 512, 1, 1),))) == 0


def lstm_fwd(t: int, n: int, i: int, h: int) -> OpCall:
    hx = meta(n, h)
    outs = (meta(t, n, h), hx, hx, meta(0, dtype=torch.uint8))
    return call(
        aten.mkldnn_rnn_layer.default,
        meta(t, n, i),
        meta(4 * h, i),
        meta(4 * h, h),
        meta(4 * h),
        meta(4 * h),
        hx,
        hx,
        False,
        [],
        2,
        h,
        1,
        True,
        False,
        True,
        True,
        outputs=outs,
    )


@pytest.mark.parametrize(
    ("t", "n", "i", "h", "workspace", "transient"),
    [
        (128, 4, 256, 512, 16_084_992, 10_605_112),  # measured (tests/models.py LSTM LM, batch 4)
        (128, 16, 512, 512, 64_303_104, None),  # the NOTES' 512->512 layer at batch 16
        (32, 3, 100, 200, 1_212_416, 1_283_256),
        (10, 1, 16, 32, 32_768, 46_136),
    ],
)
def test_lstm_workspace_output_and_transients(
    t: int, n: int, i: int, h: int, workspace: int, transient: int | None
) -> None:
    km = kernel_memory(lstm_fwd(t, n, i, h))
    assert km is not None and km.extra_output_bytes == (0, 0, 0, workspace)
    if transient is not None:
        assert km.workspace_bytes == transient


def test_lstm_backward() -> None:
    t, n, h = 128, 4, 512
    x, hx, y = meta(t, n, 512), meta(n, h), meta(t, n, h)
    grad = meta(t, n, h, stride=(h, t * h, 1))  # the LM's gradient arrives batch-first
    w, b = meta(4 * h, 512), meta(4 * h)
    c = call(
        aten.mkldnn_rnn_layer_backward.default,
        x,
        w,
        meta(4 * h, h),
        b,
        b,
        hx,
        hx,
        y,
        hx,
        hx,
        grad,
        None,
        None,
        False,
        2,
        h,
        1,
        True,
        True,
        False,
        [],
        True,
        meta(16084992, dtype=torch.uint8),
        outputs=(x, w, meta(4 * h, h), b, b, hx, hx),
    )
    km = kernel_memory(c)
    assert km is not None
    assert km.workspace_bytes == 22_434_360  # measured excess, layer 2 of the LSTM LM at batch 4
    assert km.extra_output_bytes == (0, 0, 0, 0, 4 * h * 4, 0, 0)


def test_lstm_backward_bf16() -> None:
    # The LSTM LM in bf16-true, batch 4 (measured excess 16,667,176 / 12,980,776 for layers 2 / 1): the
    # float32 parts minus (I+H) x (good_ld(4H, f32) x 4 - good_ld(4H, bf16) x 2) = (I+H) x 4,096 for the
    # bfloat16 ldigo weights, minus T x N x H x 4 - 12,272 (fitted).
    bf = torch.bfloat16
    t, n, h = 128, 4, 512
    for i, measured in ((512, 16_667_176), (256, 12_980_776)):
        hx, y = meta(n, h, dtype=bf), meta(t, n, h, dtype=bf)
        w1, w2, b = meta(4 * h, i, dtype=bf), meta(4 * h, h, dtype=bf), meta(4 * h, dtype=bf)
        c = call(
            aten.mkldnn_rnn_layer_backward.default,
            meta(t, n, i, dtype=bf),
            w1,
            w2,
            b,
            b,
            hx,
            hx,
            y,
            hx,
            hx,
            meta(t, n, h, dtype=bf, stride=(h, t * h, 1)) if i == 512 else y,  # layer 1's is contiguous
            None,
            None,
            False,
            2,
            h,
            1,
            True,
            True,
            False,
            [],
            True,
            meta(11350016, dtype=torch.uint8),
            outputs=(meta(t, n, i, dtype=bf), w1, w2, b, b, hx, hx),
        )
        assert ws(c) == measured


def test_cuda_calls_get_no_cpu_model() -> None:
    c = lstm_fwd(8, 2, 16, 16)
    assert kernel_memory(OpCall(c.op, c.args, c.kwargs, c.outputs, "cuda")) is None


def test_convolution_backward_bf16_channels_last_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    # convnext_tiny's last downsampling (2x2 stride 2, 384->768 from 14x14) in bf16, 2 threads: weight copy
    # + float32 diff weights + transposed source 384*14*16*2 + transposed grad_output 768*7*8*2 + 2 x 8,192 +
    # 388 = 7,352,708 (measured 7,398,788: 46 KB of the transposes not understood).
    bf = torch.bfloat16
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    w = meta(768, 384, 2, 2, dtype=bf)
    c = convb(cl(4, 768, 7, 7, dtype=bf), cl(4, 384, 14, 14, dtype=bf), w, 2, 0)
    assert ws(c) == w.bytes + 2 * w.bytes + 384 * 14 * 16 * 2 + 768 * 7 * 8 * 2 + 2 * 8192 + 388


def test_convolution_3d_forward_follows_the_2d_scheme() -> None:
    # r3d_18, batch 2, 3x8x112x112 (measured with find_kernel_workspaces.py): blocked source + blocked
    # weights + a blocked result reordered into the output. 64->64 3x3x3 at 8x56x56: 13,287,424.
    x, out = meta(2, 64, 8, 56, 56), meta(2, 64, 8, 56, 56)
    assert ws(conv(x, meta(64, 64, 3, 3, 3), 1, 1, out=out)) == 2 * 64 * 8 * 56 * 56 * 4 + 64 * 64 * 27 * 4
    # 1x1x1 stride 2 (no per-thread gather, unlike 2-d): 12,877,824.
    assert ws(conv(x, meta(128, 64, 1, 1, 1), 2, 0, out=meta(2, 128, 4, 28, 28))) == 12_877_824
    # the stem (3 channels: no source reorder): the blocked result alone, 12,845,056.
    stem = call(
        aten.convolution.default,
        meta(2, 3, 8, 112, 112),
        meta(64, 3, 3, 7, 7),
        None,
        [1, 2, 2],
        [1, 3, 3],
        [1] * 3,
        False,
        [0] * 3,
        1,
        outputs=(meta(2, 64, 8, 56, 56),),
    )
    assert ws(stem) == 12_845_056


def test_convolution_3d_backward_gemm_when_the_input_is_shallower_than_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # r3d_18's layer4 512->512 3x3x3 on 1x7x7 maps, batch 2, 2 threads: oneDNN's im2col GEMM holds per
    # thread 4 weight-sized buffers and one column buffer (512*27 x 7*7 floats), + 256: measured
    # 231,911,680 -- the step's peak, which the fake run alone missed by 30 %.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    w = meta(512, 512, 3, 3, 3)
    x = go = meta(2, 512, 1, 7, 7)
    col = 512 * 27 * 49 * 4
    assert ws(convb(go, x, w, 1, 1, mask=NO_BIAS)) == 2 * (4 * w.bytes + col) + 256 == 231_911_680
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert ws(convb(go, x, w, 1, 1, mask=NO_BIAS)) == 115_955_968  # measured at 1 thread
    # batch 1: the column buffers only, one per thread up to the output depth (measured 2,709,504).
    assert ws(convb(meta(1, 512, 1, 7, 7), meta(1, 512, 1, 7, 7), w, 1, 1, mask=NO_BIAS)) == col
    # deep enough for the kernel: the blocked (jit) scheme, as in 2-d -- 128->128 at 4x28x28, measured
    # 6,422,528: the backward-data phase, blocked grad_output + weights + diff_src, less the outputs.
    x = go = meta(2, 128, 4, 28, 28)
    assert ws(convb(go, x, meta(128, 128, 3, 3, 3), 1, 1, mask=NO_BIAS)) == 6_422_528


def test_convolution_3d_backward_strided_holds_three_grad_outputs_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # r3d_18's 64->128 downsampling from 8x56x56, batch 2 (measured 25,657,344 for 1x1x1 and 24,805,376
    # for 3x3x3): input + blocked grad_output + blocked source + 3 grad_outputs, less the outputs.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x, go = meta(2, 64, 8, 56, 56), meta(2, 128, 4, 28, 28)
    assert ws(convb(go, x, meta(128, 64, 1, 1, 1), 2, 0, mask=NO_BIAS)) == 25_657_344
    assert ws(convb(go, x, meta(128, 64, 3, 3, 3), 2, 1, mask=NO_BIAS)) == 24_805_376
    # bfloat16 and grouped 3-d convolutions are not modelled (unmeasured).
    xb = meta(2, 64, 8, 56, 56, dtype=torch.bfloat16)
    assert (
        kernel_memory(
            convb(
                meta(2, 128, 4, 28, 28, dtype=torch.bfloat16),
                xb,
                meta(128, 64, 1, 1, 1, dtype=torch.bfloat16),
                2,
                0,
            )
        )
        is None
    )


def test_convolution_backward_large_kernels_run_as_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    # ViT patch embeddings (3 -> 768, kernel = stride): oneDNN's im2col GEMM backward-weights, per thread
    # 4 weight-sized buffers + a column buffer (3*32*32 x 7*7 floats), + 256 -- and the grad_output the
    # permute after the conv leaves non-contiguous is copied. vit_b_32 at batch 2, 2 threads: measured
    # 77,003,008 (its step-2 peak; -3.9 % before this model).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    w = meta(768, 3, 32, 32)
    go = meta(2, 768, 7, 7, stride=(768 * 49, 1, 7 * 768, 768))  # the transpose of a contiguous (2, 49, 768)
    col = 3 * 32 * 32 * 49 * 4
    vit = (False, True, True)  # the input is the batch: no grad_input; the patch conv has a bias
    assert ws(convb(go, meta(2, 3, 224, 224), w, 32, 0, mask=vit)) == go.bytes + 2 * (4 * w.bytes + col) + 256
    assert ws(convb(go, meta(2, 3, 224, 224), w, 32, 0, mask=vit)) == 77_003_008
    # Above 256 output positions per thread the threads share one set (16x16 stride 8: 22x22 -> a set
    # each, measured 21,848,320; 23x23 -> one, measured 11,062,528).
    w16 = meta(768, 3, 16, 16)
    assert ws(convb(meta(2, 768, 22, 22), meta(2, 3, 184, 184), w16, 8, 0, mask=vit)) == 21_848_320
    assert ws(convb(meta(2, 768, 23, 23), meta(2, 3, 192, 192), w16, 8, 0, mask=vit)) == 11_062_528
    # kernel 14 still runs the blocked kernels: not this formula (measured 1,806,336 = the weights).
    w14 = meta(768, 3, 14, 14)
    assert (
        ws(convb(meta(2, 768, 16, 16), meta(2, 3, 224, 224), w14, 14, 0, mask=vit))
        != 2 * (4 * w14.bytes + 3 * 14 * 14 * 256 * 4) + 256
    )


def test_convolution_backward_downsampling_holds_input_minus_grad_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stride-2 float32 convolutions computing grad_input: the backward-weights phase holds grad_input, the
    # blocked grad_output and source, and (input - grad_output) bytes more. Measured (2 threads):
    # resnet50's 128->128 3x3 at 56x56, batch 4: 12,255,232 (3.2 MB under before); resnet18's 64->128
    # 1x1 at 56x56, batch 2: 3,178,496.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    mask = (True, True, False)
    go, x, w = meta(4, 128, 28, 28), meta(4, 128, 56, 56), meta(128, 128, 3, 3)
    assert ws(convb(go, x, w, 2, 0, mask=mask)) == 12_255_232
    assert (
        ws(convb(meta(2, 128, 28, 28), meta(2, 64, 56, 56), meta(128, 64, 1, 1), 2, 0, mask=mask))
        == 3_178_496
    )
    # where the weights outweigh it, the blocked-weights phase stays the peak (resnet18's 128->256 3x3,
    # measured 1,204,224)
    assert (
        ws(convb(meta(2, 256, 14, 14), meta(2, 128, 28, 28), meta(256, 128, 3, 3), 2, 0, mask=mask))
        == 1_204_224
    )
