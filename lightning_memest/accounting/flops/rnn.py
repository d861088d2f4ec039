"""FLOP formulas of recurrent layers: oneDNN's LSTM layer and cuDNN's RNN (headline), and the LSTM
cell's elementwise work ("other")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_memest.accounting.flops.formulas import FLOP_FORMULAS, OTHER_FLOP_FORMULAS, shape_of
from lightning_memest.engine.events import OpCall, TensorMeta

__all__: list[str] = []

aten = torch.ops.aten


def _rnn_forward_flops(x: tuple[int, ...], weights: Iterable[Any]) -> int:
    # Each time step of each sequence multiplies its layer input by W_ih and its state by W_hh, for every
    # layer and direction: 2 x (T*N) x (sum of the 2-d weight matrices' elements). x is (T, N, I), or
    # (N, T, I) when batch-first, or (sum of lengths, I) when packed.
    steps = x[0] if len(x) == 2 else x[0] * x[1]
    return 2 * steps * sum(w.numel for w in weights if isinstance(w, TensorMeta) and len(w.shape) == 2)


@FLOP_FORMULAS.register(aten.mkldnn_rnn_layer)
def _mkldnn_rnn_layer(call: OpCall) -> int:
    # oneDNN's LSTM layer (nn.LSTM on CPU): weight0 = W_ih (4H, I), weight1 = W_hh (4H, H).
    return _rnn_forward_flops(shape_of(call.arg("input")), (call.arg("weight0"), call.arg("weight1")))


@FLOP_FORMULAS.register(aten.mkldnn_rnn_layer_backward)
def _mkldnn_rnn_layer_backward(call: OpCall) -> int:
    # grad of the layer input and of the state (through W_ih^T, W_hh^T) and of both weights: 2x forward.
    return 2 * _rnn_forward_flops(shape_of(call.arg("input")), (call.arg("weight1"), call.arg("weight2")))


@FLOP_FORMULAS.register(aten._cudnn_rnn)
def _cudnn_rnn(call: OpCall) -> int:
    # cuDNN's RNN (all layers and directions in one op); ``weight`` lists every layer's matrices.
    # Layers above the first see the previous layer's output, of the same number of steps.
    return _rnn_forward_flops(shape_of(call.arg("input")), call.arg("weight"))


@FLOP_FORMULAS.register(aten._cudnn_rnn_backward)
def _cudnn_rnn_backward(call: OpCall) -> int:
    mask = call.arg("output_mask")
    fwd = _rnn_forward_flops(shape_of(call.arg("input")), call.arg("weight"))
    # grad of inputs and states (mask 0-2, one pass) and of weights (mask 3).
    return fwd * (int(any(mask[:3])) + int(bool(mask[3])))


def _lstm_cell_elements(call: OpCall, w_hh_name: str) -> int:
    # Per time step, sequence and hidden unit of an LSTM cell: bias and activation of 4 gates (8), the
    # cell update c = f*c + i*g (3), h = o * tanh(c) (2): 13.
    x, w_hh = shape_of(call.arg("input")), shape_of(call.arg(w_hh_name))
    steps = x[0] if len(x) == 2 else x[0] * x[1]
    return 13 * steps * w_hh[1] if w_hh[0] == 4 * w_hh[1] else 0


@OTHER_FLOP_FORMULAS.register(aten.mkldnn_rnn_layer)
def _mkldnn_rnn_layer_cell(call: OpCall) -> int:
    return _lstm_cell_elements(call, "weight1")


@OTHER_FLOP_FORMULAS.register(aten.mkldnn_rnn_layer_backward)
def _mkldnn_rnn_layer_cell_backward(call: OpCall) -> int:
    return 2 * _lstm_cell_elements(call, "weight2")  # the chain rule through each elementwise step
