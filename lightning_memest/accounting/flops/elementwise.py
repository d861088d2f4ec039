""" "Other" FLOP formulas: normalization, softmax, pooling, losses, and the optimizers' arithmetic (the
conventions are in the package docstring)."""

from __future__ import annotations

import math

import torch

from lightning_memest.accounting.flops.formulas import (
    OTHER_FLOP_FORMULAS,
    first_output_numel,
    list_numel,
    numel_of,
    shape_of,
)
from lightning_memest.engine.events import OpCall

__all__ = ["SOFTMAX_BACKWARD", "SOFTMAX_FORWARD"]

aten = torch.ops.aten

_NORM_FORWARD = 5  # mean (1), variance (2), normalize (1), affine (1) per element
_NORM_BACKWARD = 8  # two reductions over grad_out and grad_out * x_hat (4), grad_input (3), affine (1)
SOFTMAX_FORWARD = 5  # max, subtract, exp, sum, divide (log-softmax: log, subtract)
SOFTMAX_BACKWARD = 4  # product, sum, subtract, product


@OTHER_FLOP_FORMULAS.register(
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten._batch_norm_with_update,
    aten._batch_norm_no_update,
    aten.cudnn_batch_norm,
    aten.miopen_batch_norm,
    aten.native_layer_norm,
    aten.native_group_norm,
    aten._fused_rms_norm,
)
def _norm(call: OpCall) -> int:
    return _NORM_FORWARD * numel_of(call.args[0])


@OTHER_FLOP_FORMULAS.register(
    aten.native_batch_norm_backward,
    aten.batch_norm_backward,
    aten.miopen_batch_norm_backward,
    aten.native_layer_norm_backward,
    aten.native_group_norm_backward,
    aten._fused_rms_norm_backward,
)
def _norm_backward(call: OpCall) -> int:
    return _NORM_BACKWARD * numel_of(call.arg("input"))


@OTHER_FLOP_FORMULAS.register(aten.cudnn_batch_norm_backward)
def _cudnn_norm_backward(call: OpCall) -> int:
    return _NORM_BACKWARD * numel_of(call.arg("input"))


@OTHER_FLOP_FORMULAS.register(aten._softmax, aten._log_softmax, aten._safe_softmax)
def _softmax(call: OpCall) -> int:
    return SOFTMAX_FORWARD * numel_of(call.args[0])


@OTHER_FLOP_FORMULAS.register(aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward(call: OpCall) -> int:
    return SOFTMAX_BACKWARD * numel_of(call.arg("grad_output"))


def _kernel_volume(call: OpCall) -> int:
    size = call.arg("kernel_size")
    return math.prod(size) if len(size) > 1 else int(size[0]) ** (len(shape_of(call.args[0])) - 2)


@OTHER_FLOP_FORMULAS.register(
    aten.max_pool2d_with_indices,
    aten.max_pool3d_with_indices,
    aten.avg_pool2d,
    aten.avg_pool3d,
    aten.max_pool2d,
    aten.max_pool1d,
    aten.avg_pool1d,
)
def _pool(call: OpCall) -> int:
    # A comparison or an addition per window element, per output element.
    return _kernel_volume(call) * first_output_numel(call)


@OTHER_FLOP_FORMULAS.register(aten.avg_pool2d_backward, aten.avg_pool3d_backward)
def _avg_pool_backward(call: OpCall) -> int:
    return _kernel_volume(call) * numel_of(call.arg("grad_output"))


@OTHER_FLOP_FORMULAS.register(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward)
def _max_pool_backward(call: OpCall) -> int:
    # Each output gradient is added to the input element it came from.
    return numel_of(call.arg("grad_output"))


@OTHER_FLOP_FORMULAS.register(
    aten._adaptive_avg_pool2d,
    aten._adaptive_avg_pool3d,
    aten.adaptive_max_pool2d,
    aten.adaptive_max_pool3d,
)
def _adaptive_pool(call: OpCall) -> int:
    return numel_of(call.args[0])  # a reduction: one per input element


@OTHER_FLOP_FORMULAS.register(
    aten._adaptive_avg_pool2d_backward,
    aten._adaptive_avg_pool3d_backward,
    aten.adaptive_max_pool2d_backward,
    aten.adaptive_max_pool3d_backward,
)
def _adaptive_pool_backward(call: OpCall) -> int:
    return numel_of(call.arg("self"))  # one per input-gradient element


@OTHER_FLOP_FORMULAS.register(aten.nll_loss_forward, aten.nll_loss_backward, aten.nll_loss2d_forward)
def _nll_loss(call: OpCall) -> int:
    return numel_of(call.arg("target"))  # a gather (and a sum) per target element


@OTHER_FLOP_FORMULAS.register(aten.nll_loss2d_backward)
def _nll_loss2d_backward(call: OpCall) -> int:
    return numel_of(call.arg("target"))


@OTHER_FLOP_FORMULAS.register(aten.embedding_dense_backward)
def _embedding_backward(call: OpCall) -> int:
    return numel_of(call.arg("grad_output"))  # each row is added into its token's gradient row


@OTHER_FLOP_FORMULAS.register(aten._amp_foreach_non_finite_check_and_unscale_)
def _unscale(call: OpCall) -> int:
    return 2 * list_numel(call.arg("self"))  # a multiplication and a finiteness check per element


# Pointwise ops per parameter element of torch.optim's single-tensor (for-loop) implementations
# (torch 2.14.1, defaults): Adam lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_ = 7; AdamW adds the
# decoupled weight decay (mul_) = 8; SGD with momentum mul_, add_ (buffer), add_ (step) = 3.
_ADAM_ELEMENT_OPS = 7
_SGD_ELEMENT_OPS = 3


@OTHER_FLOP_FORMULAS.register(aten._fused_adam_, aten._fused_adamw_)
def _fused_adam(call: OpCall) -> int:
    decoupled = call.op.overloadpacket is aten._fused_adamw_ and bool(call.arg("weight_decay", 0.0))
    return (_ADAM_ELEMENT_OPS + int(decoupled)) * list_numel(call.arg("self"))


@OTHER_FLOP_FORMULAS.register(aten._fused_sgd_)
def _fused_sgd(call: OpCall) -> int:
    return _SGD_ELEMENT_OPS * list_numel(call.arg("self"))
