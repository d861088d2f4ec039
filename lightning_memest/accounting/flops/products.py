"""FLOP formulas of matrix products and convolutions: torch's where they are right, fixes where not."""

from __future__ import annotations

import torch
from torch._ops import OpOverloadPacket
from torch.utils import flop_counter as _torch_fc

from lightning_memest.accounting.flops.formulas import FLOP_FORMULAS, FlopFormula, as_size, numel_of, shape_of
from lightning_memest.engine.events import OpCall

__all__: list[str] = []

aten = torch.ops.aten

# ------------------------------------------------------------------------------- matrix products


def _from_torch(packet: OpOverloadPacket) -> FlopFormula:
    """Torch's shape formula for ``packet``, called with the call's shapes (``out_val``: its outputs')."""
    torch_formula = _torch_fc.flop_registry[packet]

    def formula(call: OpCall) -> int:
        outs = tuple(as_size(o) for o in call.outputs)
        return int(
            torch_formula(
                *(as_size(a) for a in call.args),
                out_val=outs[0] if len(outs) == 1 else outs,
                **{k: as_size(v) for k, v in call.kwargs.items()},
            )
        )

    formula.__name__ = f"torch_{packet.__name__}_flop"
    formula.__doc__ = f"torch.utils.flop_counter's formula for aten.{packet.__name__}."
    return formula


# torch's formulas are right for these (2 x MACs of the product; bias adds are not counted).
for _packet in (
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten._scaled_mm,
    aten.convolution,
    aten._convolution,
    aten.cudnn_convolution,
    aten.convolution_overrideable,
    aten._slow_conv2d_forward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
):
    FLOP_FORMULAS.add(_packet, _from_torch(_packet))


@FLOP_FORMULAS.register(aten.mv, aten.addmv)
def _mv(call: OpCall) -> int:
    # (m, n) @ (n,): 2*m*n.
    mat = call.arg("mat") if call.op.overloadpacket is aten.addmv else call.arg("self")
    m, n = shape_of(mat)
    return 2 * m * n


@FLOP_FORMULAS.register(aten.dot, aten.vdot)
def _dot(call: OpCall) -> int:
    return 2 * numel_of(call.arg("self"))


@FLOP_FORMULAS.register(aten.addbmm)
def _addbmm(call: OpCall) -> int:
    # sum over the batch of (b, m, k) @ (b, k, n): as bmm (the batch sum is an addition, not counted).
    b, m, k = shape_of(call.arg("batch1"))
    n = shape_of(call.arg("batch2"))[2]
    return 2 * b * m * n * k


@FLOP_FORMULAS.register(aten._addmm_activation)
def _addmm_activation(call: OpCall) -> int:
    m, k = shape_of(call.arg("mat1"))
    n = shape_of(call.arg("mat2"))[1]
    return 2 * m * n * k


@FLOP_FORMULAS.register(aten.mkldnn_convolution)
def _mkldnn_convolution(call: OpCall) -> int:
    out = call.outputs[0]
    if out is None:
        return 0
    x, w = shape_of(call.arg("self")), shape_of(call.arg("weight"))
    return int(_torch_fc.conv_flop_count(list(x), list(w), list(out.shape), transposed=False))


# ------------------------------------------------------------------------------------ convolution


@FLOP_FORMULAS.register(aten.convolution_backward)
def _convolution_backward(call: OpCall) -> int:
    # Each gradient, of the input (a transposed convolution of grad_output with the weight) and of the
    # weight (a convolution of the input with grad_output, per group), takes as many MACs as the forward
    # convolution. Torch's conv_backward_flop (2.14.1) gets the grad-input term right but computes the
    # grad-weight term as one convolution over all C_in x C_out channel pairs, ignoring ``groups``: a
    # ``groups``-fold overcount (mobilenet_v2's depthwise layers: 32-960x). It also reads the gradients'
    # shapes from the outputs by position, which shifts when ``output_mask[0]`` is false.
    go, x, w = shape_of(call.arg("grad_output")), shape_of(call.arg("input")), shape_of(call.arg("weight"))
    transposed = bool(call.arg("transposed"))
    mask = call.arg("output_mask")
    out = list(go)  # the forward output's shape is grad_output's
    forward = int(_torch_fc.conv_flop_count(list(x), list(w), out, transposed=transposed))
    return forward * (int(bool(mask[0])) + int(bool(mask[1])))
