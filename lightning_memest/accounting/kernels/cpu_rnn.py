"""CPU LSTM kernel models (oneDNN's ``mkldnn_rnn_layer`` and its backward): the workspace output the
meta kernel reports as 0 bytes, and the transients (reordered weights, scratchpad, summed bias).
Measured as ``cpu.py`` says; evidence in ``benchmarks/KERNELS.md``. float32 is the same on every
instruction set; bfloat16 differs with native bf16 (:func:`~lightning_memest.accounting.kernels.cpu.isa`),
where oneDNN runs brgemm cells on plain bf16 weights with a small, T-independent scratchpad.

Example (a bf16 layer, T=32, N=4, 128 -> 512, modelled for each instruction set):
    >>> import torch
    >>> from unittest import mock
    >>> from lightning_memest.accounting.kernels import OpCall, TensorMeta, kernel_memory
    >>> m = lambda *s: TensorMeta.of(torch.empty(s, dtype=torch.bfloat16, device="meta"))
    >>> x, w0, w1, b, h = m(32, 4, 128), m(2048, 128), m(2048, 512), m(2048), m(4, 512)
    >>> outs = (m(32, 4, 512), h, h, TensorMeta.of(torch.empty(0, dtype=torch.uint8)))
    >>> call = OpCall(torch.ops.aten.mkldnn_rnn_layer.default, (x, w0, w1, b, b, h, h, False, [], 2, 512, 1,
    ...               True, False, False, True), {}, outs, "cpu")
    >>> native = mock.patch.dict("os.environ", {"MEMEST_CPU_ISA": "avx512_bf16"})
    >>> with native, mock.patch("torch.get_num_threads", return_value=2):
    ...     kernel_memory(call).workspace_bytes  # bias + plain bf16 weights + scratch (measured 2,687,816)
    2687816
"""

from __future__ import annotations

import torch

from lightning_memest.accounting.kernels.cpu import copy_if_strided, good_ld, native_bf16, rnd
from lightning_memest.accounting.kernels.model import CPU_KERNELS, KernelMemory
from lightning_memest.engine.events import OpCall, TensorMeta

__all__: list[str] = []

aten = torch.ops.aten


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
            rows_t * good_ld(4 * h, 4) * 4,
            rows_t * good_ld(h, 4) * 4,
            rows_t1 * good_ld(m, 4) * 4,
            rows_t1 * good_ld(m, 4) * 4,
            rows_t1 * h * 4,
            rows_t1 * good_ld(m, 4) * 4,
            rows_t1 * h * 4,
        ]
    else:  # bfloat16: fitted layout (gates, ht and diff states in bf16; states and c states in float32)
        parts = [
            rows_t * good_ld(4 * h, s) * s,
            rows_t * good_ld(h, s) * s,
            rows_t1 * good_ld(m, 4) * 4,
            rows_t1 * good_ld(m, 4) * 4,
            rows_t1 * h * 4,
            rows_t1 * good_ld(m, s) * s,
            rows_t1 * h * s,
        ]
    return sum(rnd(p, 4096) for p in parts)


def _lstm_scratch_bytes(t: int, n: int, h: int) -> int:
    # oneDNN scratchpad: scratch gates (T x N rows of good_ld(4H) floats), scratch ht and diff ht (N rows
    # of good_ld(H)), each page-rounded, plus 4,664 B measured on every case (float32).
    return rnd(t * n * good_ld(4 * h, 4) * 4, 4096) + 2 * rnd(n * good_ld(h, 4) * 4, 4096) + 4664


@CPU_KERNELS.register(aten.mkldnn_rnn_layer)
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
    # The workspace layout is the same with native bf16 (the sweep: every bf16 shape exact on the EPYC).
    ws = _lstm_workspace_bytes(t, n, i, h, x.dtype)
    fake_ws = call.outputs[3].nbytes if len(call.outputs) > 3 and call.outputs[3] is not None else 0
    extra = (0, 0, 0, max(0, ws - fake_ws))
    if x.dtype == torch.bfloat16 and native_bf16():
        # Native bf16 (measured on the AMD EPYC, 2 threads): the weights are reordered as two plain bf16
        # buffers (I x 4H and H x 4H, no good_ld padding) and the scratchpad no longer holds T x N gates.
        transient = 4 * h * s + (i + h) * 4 * h * s + _native_bf16_scratch(n, h, 0)
    else:
        transient = 4 * h * s + (i + h) * good_ld(4 * h, s) * s + _lstm_scratch_bytes(t, n, h)
    return KernelMemory(transient, True, extra)


def _native_bf16_scratch(n: int, h: int, i: int, backward: bool = False) -> int:
    # oneDNN's brgemm RNN scratchpad with native bf16: independent of T; linear in N x H (the per-step
    # gates and states of a minibatch). Fitted on 10 (T, N, I, H) points at 2 threads (N 2-16, H 64-1024,
    # I 32-512): exact for N x H >= 2048, up to 5 KB over below (N = 1 takes another path: 279 KB at H=512).
    if backward:
        return 16824 + 67 * n * h // 4 + 8 * i
    return 17224 + 22 * n * h


@CPU_KERNELS.register(aten.mkldnn_rnn_layer_backward)
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
    ws += copy_if_strided(grad_out)
    if s == 2 and native_bf16():
        # Native bf16 (measured on the AMD EPYC, 2 threads: 8,248,248 for T32 N4 128 -> 512 and 10,616,760
        # for the LM's first layer exact, the sweep's other shapes within 2.3 KB): a float32 copy
        # of the output gradient (T x N x H) and of the two state gradients, the weights as plain bf16
        # (I x 4H, H x 4H), float32 diff weights in ldigo (I + H rows of good_ld(4H)), the diff bias and
        # a T-independent scratchpad.
        ws += t * n * h * 4 + 2 * n * h * 4 + (i + h) * 4 * h * s + (i + h) * good_ld(4 * h, 4) * 4
        ws += 4 * h * 4 + _native_bf16_scratch(n, h, i, backward=True)
    else:
        if s == 4:
            ws += (i + h) * good_ld(4 * h, 4) * 4  # weights, ldigo
            # Diff weights in ldgoi (4H rows of good_ld(I) and good_ld(H)) are reordered only where
            # good_ld pads the dimension; otherwise oneDNN writes into the gradient itself (seen in the
            # allocator's events). This is exactly the "over at H <= 256" of the first fit: 327,680 at
            # (I 32, H 128), 524,288 at (128, 128), 262,144 at (256, 128) and (64, 256).
            ws += sum(4 * h * good_ld(d, 4) * 4 for d in (i, h) if good_ld(d, 4) != d)
        else:
            # bfloat16 without native bf16: the ldigo weights stay bfloat16 (exact: the saving over
            # float32 is (I+H) x 4,096 B at H=512 for both LM layers), and something T x N x H
            # float32-sized is not allocated; the 12,272 B remainder is fitted on the LSTM LM's two
            # layers (T=128, N=4, H=512), not derived.
            ws += (i + h) * good_ld(4 * h, s) * s - t * n * h * 4 + 12272
            ws += 4 * h * (good_ld(i, 4) + good_ld(h, 4)) * 4  # diff weights, ldgoi
        ws += 4 * h * 4  # diff bias
        ws += _lstm_scratch_bytes(t, n, h)
    ws -= 4 * h * 4  # the bias-gradient clone is allocated after the workspace is freed
    extra = [0] * len(call.outputs)
    if len(extra) > 4:
        extra[4] = 4 * h * 4  # float32 even for bfloat16 (measured 8,192 B at H=512 in both)
    return KernelMemory(ws, True, tuple(extra))
