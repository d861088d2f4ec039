"""Kernel memory models (lightning_memest.accounting.kernels): hand-computed cases of each formula."""

from __future__ import annotations

import pytest
import torch

from lightning_memest.accounting.kernels import (
    CPU_KERNELS,
    KernelMemory,
    OpCall,
    TensorMeta,
    cpu,
    kernel_memory,
)
from lightning_memest.registry import OpRegistry

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _no_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-computed cases below were measured on an AVX-512 Xeon without native bf16: pin that
    instruction set whatever this machine is; tests of another one set it themselves."""
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)


def native(monkeypatch: pytest.MonkeyPatch, threads: int = 2) -> None:
    """Model an AVX-512 CPU with native bf16 (the AMD EPYC the new cases were measured on) at ``threads``."""
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512_BF16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)


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


# ------------------------------------------------------------------------------- instruction sets

AVX512_CORE = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq")


@pytest.mark.parametrize(
    ("capability", "flags", "cap", "expected"),
    [
        ("AVX512", (*AVX512_CORE, "avx512_vnni"), None, cpu.AVX512),  # the Xeon of the first models
        ("AVX512", (*AVX512_CORE, "avx512_bf16", "avx512_vnni"), None, cpu.AVX512_BF16),  # the AMD EPYC
        ("AVX512", (*AVX512_CORE, "avx512_bf16"), "AVX512_CORE_VNNI", cpu.AVX512),  # oneDNN capped
        ("AVX512", (*AVX512_CORE, "avx512_bf16", "amx_bf16", "amx_tile"), None, cpu.AMX),
        ("AVX512", (*AVX512_CORE, "avx512_bf16", "amx_bf16"), "AVX512_CORE_BF16", cpu.AVX512_BF16),
        ("AVX2", ("avx2", "avx_vnni"), None, cpu.OTHER),
        ("AVX512", (*AVX512_CORE, "avx512_bf16"), "AVX2", cpu.OTHER),
        # Below AVX2: oneDNN's dense convolution backward runs as GEMM.
        ("DEFAULT", ("avx_vnni",), None, cpu.SSE41),
        ("AVX512", (*AVX512_CORE, "avx512_bf16"), "SSE41", cpu.SSE41),
        ("AVX512", (*AVX512_CORE,), "AVX", cpu.SSE41),
        # ATEN_CPU_CAPABILITY lowers ATen's kernels only: oneDNN still runs AVX-512 (measured: the
        # depthwise backward below keeps its 16-channel blocks).
        ("AVX2", (*AVX512_CORE, "avx512_bf16"), None, cpu.AVX512_BF16),
        ("AVX512", ("avx2", "avx512f"), None, cpu.OTHER),  # AVX-512 F alone is not oneDNN's avx512_core
        ("AVX512", (), None, cpu.AVX512),  # no /proc/cpuinfo: torch's detection
        ("AVX2", (), None, cpu.OTHER),
        ("DEFAULT", (), None, cpu.SSE41),
    ],
)
def test_isa_from_capability_flags_and_onednn_cap(
    monkeypatch: pytest.MonkeyPatch, capability: str, flags: tuple[str, ...], cap: str | None, expected: str
) -> None:
    monkeypatch.delenv(cpu.ISA_ENV)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    cpu._machine_isa.cache_clear()
    try:
        assert cpu.isa() == expected
        assert cpu.native_bf16() == (expected in (cpu.AVX512_BF16, cpu.AMX))
    finally:
        cpu._machine_isa.cache_clear()


def test_isa_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512_BF16)
    assert cpu.isa() == cpu.AVX512_BF16 and cpu.native_bf16()
    monkeypatch.setenv(cpu.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="MEMEST_CPU_ISA must be one of"):
        cpu.isa()


# ------------------------------------------------------------------- native bf16 (AMD EPYC, 2 threads)

BF = torch.bfloat16


def test_native_bf16_matmul_brgemm_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A linear 256 -> 1024 on 512 rows (TinyGPT's MLP): forward addmm x @ W^T, backward grad @ W and
    # grad^T @ x. Per thread a float32 C block (M_blk x 64), B in VNNI blocks (K_blk x 64), and for the
    # transposed A (the weight gradient) A copied (M_blk x lda); + 1,664 (+ 128). All measured exactly.
    native(monkeypatch)
    x, w, g = meta(512, 256, dtype=BF), meta(1024, 256, dtype=BF), meta(512, 1024, dtype=BF)
    wt = meta(256, 1024, dtype=BF, stride=(1, 256))
    fwd = call(aten.addmm.default, meta(1024, dtype=BF), x, wt, outputs=(g,))
    assert ws(fwd) == 2 * (256 * 64 * 4 + 256 * 64 * 2) + 1664 == 198_272
    assert (
        ws(call(aten.mm.default, g, w, outputs=(x,))) == 2 * (256 * 64 * 4 + 512 * 64 * 2) + 1664 == 263_808
    )
    gt = meta(1024, 512, dtype=BF, stride=(1, 1024))
    lda = 512 + 32  # a power of two >= 512 is padded by a cache line
    expected = 2 * 256 * lda * 2 + 2 * (256 * 64 * 4 + 512 * 64 * 2) + 128 + 1664
    assert ws(call(aten.mm.default, gt, x, outputs=(w,))) == expected == 820_992
    # TinyGPT's head weight gradient, (1000 x 512)^T-stored @ (512 x 256): M = 1000 in four blocks of 250
    # (measured 804,864).
    head_t = meta(1000, 512, dtype=BF, stride=(1, 1000))
    head = call(aten.mm.default, head_t, meta(512, 256, dtype=BF), outputs=(meta(1000, 256, dtype=BF),))
    assert ws(head) == 2 * 250 * 544 * 2 + 2 * (250 * 64 * 4 + 512 * 64 * 2) + 128 + 1664 == 804_864
    # f32 and f16 matmuls hold nothing; bf16 without native bf16 keeps the float32 copy of the result.
    assert ws(call(aten.mm.default, meta(512, 1024), meta(1024, 256), outputs=(meta(512, 256),))) == 0
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)
    assert ws(call(aten.mm.default, g, w, outputs=(x,))) == 512 * 256 * 4 + 128


def test_native_bf16_bmm(monkeypatch: pytest.MonkeyPatch) -> None:
    # (16, 128, 64) @ (16, 64, 128) and its grad-input product: one scratchpad for the batch (measured
    # 83,584 and 99,968); without native bf16 nothing is measured beyond the output.
    native(monkeypatch)
    a, b = meta(16, 128, 64, dtype=BF), meta(16, 64, 128, dtype=BF)
    assert ws(call(aten.bmm.default, a, b, outputs=(meta(16, 128, 128, dtype=BF),))) == 83_584
    g, bt = meta(16, 128, 128, dtype=BF), meta(16, 128, 64, dtype=BF, stride=(8192, 1, 128))
    assert ws(call(aten.bmm.default, g, bt, outputs=(a,))) == 99_968
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)
    assert ws(call(aten.bmm.default, a, b, outputs=(meta(16, 128, 128, dtype=BF),))) == 0


def lstm_bwd(t: int, n: int, i: int, h: int, dtype: torch.dtype) -> OpCall:
    hx, y, x = meta(n, h, dtype=dtype), meta(t, n, h, dtype=dtype), meta(t, n, i, dtype=dtype)
    w1, w2, b = meta(4 * h, i, dtype=dtype), meta(4 * h, h, dtype=dtype), meta(4 * h, dtype=dtype)
    f = torch.float32  # the meta kernel's gradients are float32 for bf16 too
    outs = (meta(t, n, i, dtype=f), meta(4 * h, i, dtype=f), meta(4 * h, h, dtype=f), meta(4 * h, dtype=f))
    outs += (meta(4 * h, dtype=f), meta(n, h, dtype=f), meta(n, h, dtype=f))
    args = (x, w1, w2, b, b, hx, hx, y, hx, hx, y, None, None, False, 2, h, 1, True, True, False, [], False)
    return call(aten.mkldnn_rnn_layer_backward.default, *args, meta(0, dtype=torch.uint8), outputs=outs)


def lstm_fwd_dtype(t: int, n: int, i: int, h: int, dtype: torch.dtype) -> OpCall:
    c = lstm_fwd(t, n, i, h)
    cast = tuple(meta(*a.shape, dtype=dtype) if isinstance(a, TensorMeta) else a for a in c.args)
    outs = tuple(meta(*o.shape, dtype=dtype) if o is not None and o.numel else o for o in c.outputs)
    return OpCall(c.op, cast, {}, outs, "cpu")


def test_native_bf16_lstm(monkeypatch: pytest.MonkeyPatch) -> None:
    native(monkeypatch)
    # Forward, T=32, N=4, 128 -> 512: summed bias + plain bf16 weights (I x 4H, H x 4H) + a scratchpad
    # of 17,224 + 22 N H: measured 2,687,816; the workspace output as without native bf16 (2,895,872).
    km = kernel_memory(lstm_fwd_dtype(32, 4, 128, 512, BF))
    assert km is not None and km.extra_output_bytes == (0, 0, 0, 2_895_872)
    assert km.workspace_bytes == 4096 + (128 + 512) * 2048 * 2 + 17224 + 22 * 4 * 512 == 2_687_816
    # Backward: the state zeros and summed bias (bf16), float32 copies of the output gradient and state
    # gradients, the plain bf16 weights, float32 diff weights in ldigo (good_ld(4H) = 2064), the diff
    # bias and a T-independent scratchpad; the bias-gradient clone comes after (measured 8,248,248).
    expected = 3 * 4096 + 32 * 4 * 512 * 4 + 2 * 4 * 512 * 4 + 640 * 2048 * 2 + 640 * 2064 * 4
    expected += 16824 + 67 * 4 * 512 // 4 + 8 * 128
    assert ws(lstm_bwd(32, 4, 128, 512, BF)) == expected == 8_248_248
    assert ws(lstm_bwd(128, 4, 256, 512, BF)) == 10_616_760  # the LSTM LM's first layer, measured
    # Without native bf16 the Xeon's fit holds (the LM's layer: 12,980,776 measured there).
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)
    assert ws(lstm_bwd(128, 4, 256, 512, BF)) == 12_980_776


@pytest.mark.parametrize("isa", [cpu.AVX512, cpu.AVX512_BF16])
def test_lstm_f32_backward_diff_weights_only_where_padded(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    # float32 is the same on both instruction sets: the ldgoi diff weights get a buffer only where
    # good_ld pads a dimension (I=128 and H=64 are not padded: 128 is no multiple of 256). Measured on
    # the EPYC: 364,088 for (T32, N4, 128 -> 64) and 10,719,800 for 128 -> 512 (the Xeon's fit read
    # +196,608 and +1,048,576 there; its four "over at H <= 256" shapes are exactly this term).
    native(monkeypatch)
    monkeypatch.setenv(cpu.ISA_ENV, isa)
    assert ws(lstm_bwd(32, 4, 128, 64, torch.float32)) == 364_088
    assert ws(lstm_bwd(32, 4, 128, 512, torch.float32)) == 10_719_800


def convd(
    x: TensorMeta,
    w: TensorMeta,
    *,
    stride: int = 1,
    pad: int = 0,
    dil: int = 1,
    groups: int = 1,
    go: TensorMeta | None = None,
    mask: tuple[bool, bool, bool] = NO_BIAS,
) -> OpCall:
    """A 2-d convolution (``go`` None) or its backward, with dilation."""
    geometry = ([stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0], groups)
    if go is None:
        return call(aten.convolution.default, x, w, None, *geometry)
    return call(aten.convolution_backward.default, go, x, w, None, *geometry, list(mask))


@pytest.mark.parametrize("isa", [cpu.AVX512, cpu.AVX512_BF16])
def test_dilated_convolutions_leave_the_blocked_kernels(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    # DeepLab's ASPP: 960 -> 256, 3x3 at dilation 12-36 on 8x8 maps (batch 2, 2 threads). oneDNN's jit
    # kernels refuse a padding wider than the width unroll (forward), the overflow (backward-data) and a
    # dilated kernel taller than the map (backward-weights): all three run as im2col GEMM (measured
    # 75,202,816 in float32 -- the first model said 8,847,360 -- and 55,296,384 in bfloat16; the same
    # on the VNNI-capped oneDNN, so for both instruction sets).
    native(monkeypatch)
    monkeypatch.setenv(cpu.ISA_ENV, isa)
    x, w, go = meta(2, 960, 8, 8), meta(256, 960, 3, 3), meta(2, 256, 8, 8)
    for dil in (12, 24, 36):
        col = 960 * 9 * 64 * 4
        weights = 2 * (4 * w.bytes + col) + 256  # the GEMM working set per thread
        assert ws(convd(x, w, pad=dil, dil=dil, go=go)) == weights == 75_202_816
    xb, wb, gb = meta(2, 960, 8, 8, dtype=BF), meta(256, 960, 3, 3, dtype=BF), meta(2, 256, 8, 8, dtype=BF)
    bf16_weights = 2 * (3 * wb.numel * 4 + 960 * 9 * 64 * 2 + 64) + 256
    assert ws(convd(xb, wb, pad=12, dil=12, go=gb)) == bf16_weights == 55_296_384
    # Dilation 6: forward and backward-data stay blocked, backward-weights is GEMM (20,054,272 measured).
    x6, w6 = meta(2, 256, 8, 8), meta(256, 256, 3, 3)
    assert (
        ws(convd(x6, w6, pad=6, dil=6, go=meta(2, 256, 8, 8))) == 2 * (4 * w6.bytes + 256 * 9 * 64 * 4) + 256
    )
    assert ws(convd(x6, w6, pad=6, dil=6)) == 2 * 256 * 64 * 4 + w6.bytes  # blocked: src + weights
    # GEMM forward: the whole column buffer per thread while small, + 128 (64 channels: 295,040 measured).
    assert ws(convd(meta(2, 64, 8, 8), meta(64, 64, 3, 3), pad=12, dil=12)) == 2 * 64 * 9 * 64 * 4 + 128
    # 28x28 maps at dilation 12 fit every jit kernel: the blocked models hold (802,816 measured).
    x28, w28 = meta(2, 64, 28, 28), meta(64, 64, 3, 3)
    assert ws(convd(x28, w28, pad=12, dil=12, go=meta(2, 64, 28, 28))) == ws(
        convd(x28, w28, pad=1, go=meta(2, 64, 28, 28))
    )


def test_float16_convolutions_use_atens_im2col(monkeypatch: pytest.MonkeyPatch) -> None:
    # No oneDNN fp16 without AVX512-FP16: ATen's slow_conv2d holds the batch's im2col columns forward and
    # backward; a dilated one (slow_conv_dilated2d) one image's; 1x1 stride 1 none. Groups loop: a
    # contiguous copy of the group's input + its columns, and the per-group outputs concatenated.
    h = torch.float16
    x, w = meta(2, 64, 28, 28, dtype=h), meta(64, 64, 3, 3, dtype=h)
    cols = 2 * 64 * 9 * 784 * 2
    assert (
        ws(convd(x, w, pad=1)) == ws(convd(x, w, pad=1, go=meta(2, 64, 28, 28, dtype=h))) == cols == 1_806_336
    )
    assert ws(convd(x, w, pad=2, dil=2)) == cols // 2  # dilated: one image's columns (903,168)
    assert ws(convd(x, meta(256, 64, 1, 1, dtype=h))) == 0
    assert ws(convd(x, meta(64, 16, 3, 3, dtype=h), pad=1, groups=4)) == 501_760  # 451,584 + 50,176
    go = meta(2, 64, 28, 28, dtype=h)
    assert ws(convd(x, meta(64, 16, 3, 3, dtype=h), pad=1, groups=4, go=go)) == 551_936
    xd, wd = meta(2, 96, 28, 28, dtype=h), meta(96, 1, 3, 3, dtype=h)
    assert ws(convd(xd, wd, pad=1, groups=96)) == xd.bytes  # the concatenated group outputs (301,056)
    assert ws(convd(xd, wd, pad=1, groups=96, go=xd)) == xd.bytes + wd.bytes  # 302,784
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AMX)  # AMX CPUs have oneDNN fp16: not this model
    assert ws(convd(x, w, pad=1)) != cols


def test_native_bf16_1x1_convolutions_store_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    # jit_avx512_core_bf16_1x1: a float32 store buffer of threads x output positions x channels, + 128,
    # on top of the reorders; stride 2 gathers the input per thread (rtus) as float32 does.
    native(monkeypatch)
    x, w = meta(2, 64, 28, 28, dtype=BF), meta(256, 64, 1, 1, dtype=BF)
    store = 2 * 784 * 256 * 4 + 128
    assert ws(convd(x, w)) == store + 2 * 64 * 784 * 2 + w.bytes == 1_839_232
    assert ws(convd(meta(2, 256, 14, 14, dtype=BF), meta(64, 256, 1, 1, dtype=BF))) == 333_952
    assert ws(convd(x, meta(128, 64, 1, 1, dtype=BF), stride=2)) == 468_224
    # Backward-data holds grad_output, weights and diff_src blocked + its store buffer (over the input
    # channels): 802,816 + 32,768 + 200,704 + 401,536 less the outputs (measured 1,204,352).
    assert ws(convd(x, w, go=meta(2, 256, 28, 28, dtype=BF))) == 1_204_352
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)
    assert ws(convd(x, w)) == 2 * 256 * 784 * 2  # the Xeon's fit: the blocked result alone


def test_native_depthwise_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    # Measured on the EPYC (batch 2, 96 channels, 28x28): backward-weights holds the blocked grad_output
    # and input together (float32 1,204,224 at stride 1, 752,640 at stride 2), bf16 with a float32 diff
    # weight (605,696); bf16 stride 2: two inputs less the weight (600,384; mobilenet_v2's four too).
    native(monkeypatch)
    x, w = meta(2, 96, 28, 28), meta(96, 1, 3, 3)
    assert ws(convd(x, w, pad=1, groups=96, go=x)) == 1_204_224
    assert ws(convd(x, w, stride=2, pad=1, groups=96, go=meta(2, 96, 14, 14))) == 752_640
    xb, wb = meta(2, 96, 28, 28, dtype=BF), meta(96, 1, 3, 3, dtype=BF)
    assert ws(convd(xb, wb, pad=1, groups=96, go=xb)) == 605_696
    assert ws(convd(xb, wb, stride=2, pad=1, groups=96, go=meta(2, 96, 14, 14, dtype=BF))) == 600_384
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)
    assert ws(convd(x, w, pad=1, groups=96, go=x)) == x.bytes  # the Xeon's: one input-sized buffer


def test_native_bf16_channels_last_and_3d(monkeypatch: pytest.MonkeyPatch) -> None:
    native(monkeypatch)
    # Channels-last dense bf16: the NCHW backward-weights scratchpad, the minibatch split between the
    # threads (2 x (64 x 64 x 9 x 4 + 64 x 28 x 30 x 2 + 64 x 28 x 28 x 2) + 8,580 = 719,236 measured).
    x = cl(2, 64, 28, 28, dtype=BF)
    w = meta(64, 64, 3, 3, dtype=BF, stride=(576, 1, 192, 64))
    assert ws(convd(x, w, pad=1, go=x)) == 719_236
    # 3-d bf16: the 2-d schemes with a depth (measured 155,648 forward, 645,508 backward).
    x3, w3 = meta(2, 32, 4, 14, 14, dtype=BF), meta(32, 32, 3, 3, 3, dtype=BF)
    assert ws(conv(x3, w3, 1, 1, out=x3)) == 155_648
    assert ws(convb(x3, x3, w3, 1, 1, mask=NO_BIAS)) == 645_508
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)
    assert kernel_memory(convb(x3, x3, w3, 1, 1, mask=NO_BIAS)) is None  # unmeasured on the Xeon


def test_native_layer_norm_backward_partial_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    # {2, threads, N} gamma/beta partial sums in the input's dtype (measured 4,096 f32 / 2,048 bf16, N=256).
    native(monkeypatch)
    for dtype, expected in ((torch.float32, 4096), (BF, 2048)):
        x, stats = meta(4, 64, 256, dtype=dtype), meta(4, 64, 1)
        g = meta(256, dtype=dtype)
        c = call(aten.native_layer_norm_backward.default, x, x, [256], stats, stats, g, g, [True] * 3)
        assert ws(c) == expected
    monkeypatch.setenv(cpu.ISA_ENV, cpu.AVX512)
    assert ws(c) == 0


def test_mixed_dtype_batch_norm_saves_float32_stats() -> None:
    # bf16 input, float32 parameters (autocast): the real kernel's mean/invstd are float32, the meta
    # kernel's bf16 (measured 512 B of temporaries + 128 B more per saved statistic at C=64).
    x, p = meta(4, 64, 28, 28, dtype=BF), meta(64)
    km = kernel_memory(call(aten.native_batch_norm.default, x, p, p, p, p, True, 0.1, 1e-5))
    assert km == KernelMemory(512, True, (0, 128, 128))


# Convolution backwards run for real in a fresh process (its oneDNN as the environment caps it) and
# measured by the tests' own probe: each call's transient excess over its outputs, beside the model's.
_CONV_BACKWARDS = r"""
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile
from probe import largest_rise, storage_blocks
from lightning_memest.accounting.kernels import OpCall, TensorMeta, cpu, kernel_memory

op = torch.ops.aten.convolution_backward.default
rows = []
for c, oc, hw, k, stride, groups, cl, mask in json.loads(sys.argv[1]):
    fmt = torch.channels_last if cl else torch.contiguous_format
    out_hw = (hw + 2 * (k // 2) - k) // stride + 1
    x = torch.zeros(2, c, hw, hw).to(memory_format=fmt)
    go = torch.zeros(2, oc, out_hw, out_hw).to(memory_format=fmt)
    w = torch.zeros(oc, c // groups, k, k)
    args = (go, x, w, None, [stride] * 2, [k // 2] * 2, [1, 1], False, [0, 0], groups, mask)
    op(*args)  # oneDNN's first call of a primitive keeps some of it
    resident = storage_blocks([x, go, w])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grads = op(*args)
    left = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
    metas = tuple(TensorMeta.of(a) if isinstance(a, torch.Tensor) else a for a in args)
    outputs = tuple(None if g is None else TensorMeta.of(g) for g in grads)
    model = kernel_memory(OpCall(op, metas, {}, outputs, "cpu"))
    rows.append([largest_rise(prof, resident) - left, model.workspace_bytes if model else None])
print(json.dumps([cpu.isa(), rows]))
"""


def _conv_backwards(caps: dict[str, str], specs: list[tuple[object, ...]]) -> tuple[str, list[list[int]]]:
    """(the kernel models' instruction set, [measured, modelled] per spec) in a fresh process whose
    oneDNN runs as ``caps`` say; nothing of this process's caps or pins is inherited."""
    import json
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the caps are oneDNN's x86 instruction sets; this machine is {platform.machine()}")
    tests = Path(__file__).resolve().parent
    caps_here = (cpu.ISA_ENV, "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
    env = {k: v for k, v in os.environ.items() if k not in caps_here}
    env.update(caps, PYTHONPATH=os.pathsep.join([str(tests), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", _CONV_BACKWARDS, json.dumps(specs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    isa, rows = json.loads(done.stdout.strip().splitlines()[-1])
    return isa, rows


@pytest.mark.parametrize(
    "caps",
    [
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    ],
    ids=["avx512", "avx2"],
)
def test_depthwise_channels_last_backward_pads_each_group_to_a_block(caps: dict[str, str]) -> None:
    # oneDNN's depthwise kernel refuses the 7x7 grad-weight pass; its generic kernel's diff weights pad
    # each group's one input and one output channel to a block: 16x16 with AVX-512 (257 w), 8x8 below
    # it (65 w). Measured on this machine's oneDNN capped to each instruction set (a CPU without
    # AVX-512 runs the AVX2 case only), so no other kernel of an unmeasured CPU kind (AMX) is asserted.
    isa, [[measured, modelled]] = _conv_backwards(caps, [(96, 96, 14, 7, 1, 96, True, [False, True, False])])
    if "AVX512_CORE_VNNI" in caps.values() and isa != cpu.AVX512:
        pytest.skip(f"no AVX-512 here (the kernel models' instruction set: {isa})")
    assert modelled == measured, (isa, measured, modelled)
    block = 8 if isa == cpu.OTHER else 16
    assert measured == (block * block + 1) * 96 * 49 * 4


def _modelled_as_measured(caps: dict[str, str], isa: str, specs: list[tuple[object, ...]]) -> list[list[int]]:
    """[measured, modelled] per spec under ``caps`` (whose kernel models are ``isa``'s), each pair within
    oneDNN's 128 B of scratchpad alignment."""
    found, rows = _conv_backwards(caps, specs)
    assert found == isa
    for spec, (measured, modelled) in zip(specs, rows, strict=True):
        assert abs(modelled - measured) <= 128, (spec, measured, modelled)
    return rows


def test_dense_convolution_backward_below_avx2_runs_as_gemm() -> None:
    # Below AVX2 oneDNN has blocked forward kernels but no blocked backward ones for dense convolutions:
    # both passes run as im2col GEMM (one group's columns; none for 1x1 stride 1). Measured with oneDNN
    # capped to SSE4.1 (any x86-64 has it): 3x3, 3x3 stride 2, 1x1, and 4 groups.
    specs = [
        (64, 64, 28, 3, 1, 1, False, [True, True, True]),
        (64, 128, 28, 3, 2, 1, False, [True, True, True]),
        (256, 64, 14, 1, 1, 1, False, [True, True, True]),
        (64, 64, 28, 3, 1, 4, False, [True, True, True]),
    ]
    _modelled_as_measured({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}, cpu.SSE41, specs)


def test_avx2_backward_weights_of_a_kernel_taller_than_the_map_or_14_wide_runs_as_gemm() -> None:
    # AVX2's blocked backward-weights kernel takes no kernel taller than the map and none 14 or wider:
    # oneDNN runs those as im2col GEMM, with a weight-sized working set per thread (ResNet-18's 512 ->
    # 512 layer on the 2x2 maps of 64 px images: its step read -18.9 % as blocked; a 14x14 patch
    # embedding -48 %). Measured on an AVX2 EPYC and with oneDNN capped to AVX2 elsewhere; a kernel as
    # tall as the map stays blocked.
    specs = [
        (512, 512, 2, 3, 1, 1, False, [True, True, False]),
        (64, 64, 4, 5, 1, 1, False, [True, True, False]),
        (64, 64, 3, 3, 1, 1, False, [True, True, False]),
        (3, 96, 224, 14, 14, 1, False, [False, True, False]),
    ]
    rows = _modelled_as_measured(
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, cpu.OTHER, specs
    )
    assert rows[0][0] > 4 * 512 * 512 * 9 * 4  # (a set of four weight-sized buffers, or more)
