"""FLOP formulas of attention: the CPU kernels torch's counter does not know (2 x MACs of both
``seq x seq`` products, in full even when causal, as torch counts them) and the softmax inside fused
attention kernels (an "other" FLOP per score)."""

from __future__ import annotations

import torch
from torch.utils import flop_counter as _torch_fc

from lightning_memest.accounting.flops.elementwise import SOFTMAX_BACKWARD, SOFTMAX_FORWARD
from lightning_memest.accounting.flops.formulas import FLOP_FORMULAS, OTHER_FLOP_FORMULAS, shape_of
from lightning_memest.engine.events import OpCall

__all__: list[str] = []

aten = torch.ops.aten


@FLOP_FORMULAS.register(aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_cpu(call: OpCall) -> int:
    # torch's sdpa_flop_count: Q K^T and P V in full (also when is_causal; see the module docstring).
    q, k, v = (torch.Size(shape_of(call.arg(n))) for n in ("query", "key", "value"))
    return int(_torch_fc.sdpa_flop_count(q, *_query_heads(q, k, v)))  # type: ignore[no-untyped-call]


@FLOP_FORMULAS.register(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _sdpa_cpu_backward(call: OpCall) -> int:
    # torch's sdpa_backward_flop_count: the scores recomputed, then grads of P V and Q K^T (5 products).
    go, q, k, v = (torch.Size(shape_of(call.arg(n))) for n in ("grad_out", "query", "key", "value"))
    k, v = _query_heads(q, k, v)
    return int(_torch_fc.sdpa_backward_flop_count(go, q, k, v))  # type: ignore[no-untyped-call]


def _query_heads(q: torch.Size, k: torch.Size, v: torch.Size) -> tuple[torch.Size, torch.Size]:
    # Grouped-query attention: each query head attends its group's key/value head, so the products
    # are those of as many key/value heads as query heads (torch < 2.14's formulas refuse the shapes).
    heads = q[-3] if len(q) >= 3 else None
    if heads is None or k[-3] == heads:
        return k, v
    return torch.Size((*k[:-3], heads, *k[-2:])), torch.Size((*v[:-3], heads, *v[-2:]))


@FLOP_FORMULAS.register(
    aten._scaled_dot_product_fused_attention_overrideable,
    aten._scaled_dot_product_fused_attention_overrideable_backward,
)
def _sdpa_overrideable(call: OpCall) -> int:
    # The same signatures as the CPU flash kernel's (query, key, value / grad_out, query, key, value).
    if call.op.overloadpacket is aten._scaled_dot_product_fused_attention_overrideable:
        return _sdpa_cpu(call)
    return _sdpa_cpu_backward(call)


def _scores(call: OpCall) -> int:
    # batch x heads x seq_q x seq_k: the attention matrix a fused kernel computes a softmax over.
    b, h, sq, _ = shape_of(call.arg("query"))
    sk = shape_of(call.arg("key"))[2]
    return b * h * sq * sk


@OTHER_FLOP_FORMULAS.register(
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_fused_attention_overrideable,
)
def _sdpa_softmax(call: OpCall) -> int:
    return SOFTMAX_FORWARD * _scores(call)


@OTHER_FLOP_FORMULAS.register(
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._scaled_dot_product_fused_attention_overrideable_backward,
)
def _sdpa_softmax_backward(call: OpCall) -> int:
    # The probabilities are recomputed from the saved log-sum-exp (2: subtract, exp), then the softmax
    # backward (4).
    return (2 + SOFTMAX_BACKWARD) * _scores(call)
