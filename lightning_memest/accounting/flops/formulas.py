"""The FLOP formula registries, their lookups, and the default rules for ops without an entry.

``formula(call) -> FLOPs`` of one op call, from its argument metadata (:class:`TensorMeta`). Headline
formulas (2 x MACs of matrix products, convolutions, attention) go in :data:`FLOP_FORMULAS`; "other"
work (elementwise, norms, softmax, pooling, reductions) in :data:`OTHER_FLOP_FORMULAS`, and pointwise,
``_foreach_*`` and reduction ops without an entry get the default rules of
:func:`other_flop_formula_for`. Also the shape helpers the formulas share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket

from lightning_memest.engine.events import OpCall, TensorMeta
from lightning_memest.registry import OpRegistry

__all__ = [
    "FLOP_FORMULAS",
    "OTHER_FLOP_FORMULAS",
    "FlopFormula",
    "as_size",
    "captures_flops",
    "first_output_numel",
    "flop_formula_for",
    "list_numel",
    "numel_of",
    "other_flop_formula_for",
    "per_output_element",
    "shape_of",
]

aten = torch.ops.aten

#: ``formula(call) -> FLOPs`` of one op call (argument shapes in ``call.args``, as :class:`TensorMeta`).
FlopFormula = Callable[[OpCall], int]

#: Headline formulas (2 x MACs of matmul, convolution, attention), keyed by packet or overload.
FLOP_FORMULAS: OpRegistry[FlopFormula] = OpRegistry("headline FLOP formulas")
#: "Other" formulas (elementwise, norms, softmax, pooling, reductions) registered explicitly; pointwise
#: and reduction ops without an entry get the default rules of :func:`other_flop_formula_for`.
OTHER_FLOP_FORMULAS: OpRegistry[FlopFormula] = OpRegistry("other FLOP formulas")


def flop_formula_for(op: OpOverload) -> FlopFormula | None:
    """The headline formula of ``op``: registered for the overload itself, else for its packet.

    Example:
        >>> flop_formula_for(torch.ops.aten.mm.default) is not None
        True
        >>> flop_formula_for(torch.ops.aten.add.Tensor) is None  # elementwise: "other" FLOPs
        True
    """
    return FLOP_FORMULAS.lookup(op)


def other_flop_formula_for(op: OpOverload) -> FlopFormula | None:
    """The "other" formula of ``op``: registered (overload, then packet), else the default rule of its
    kind (pointwise, the backward of a pointwise op, ``_foreach_*``, reduction), else ``None``.

    Example:
        >>> other_flop_formula_for(torch.ops.aten.add.Tensor) is not None
        True
        >>> other_flop_formula_for(torch.ops.aten.clone.default) is None  # a copy: no arithmetic
        True
    """
    formula = OTHER_FLOP_FORMULAS.lookup(op)
    if formula is not None:
        return formula
    if op.overloadpacket in _NO_FLOPS:
        return None
    if op.overloadpacket.__name__.startswith("_foreach_"):
        return per_list_element
    if is_elementwise(op):
        return per_output_element
    if torch.Tag.reduction in op.tags:
        return per_input_element
    return None


def captures_flops(op: OpOverload) -> bool:
    """Whether FLOPs need ``op``'s full call: the capture filter for ``simulate``.

    Elementwise ops (the most frequent by far) are not captured: their one FLOP per output element is
    read from ``OpEvent.numel``, which the engine records for every op, so FLOPs cost the fake run little.

    Example:
        >>> aten = torch.ops.aten
        >>> captures_flops(aten.convolution.default), captures_flops(aten.native_layer_norm.default)
        (True, True)
        >>> captures_flops(aten.view.default), captures_flops(aten.add.Tensor)  # no FLOPs; elementwise
        (False, False)
    """
    if flop_formula_for(op) is not None:
        return True
    formula = other_flop_formula_for(op)
    return formula is not None and formula is not per_output_element


# ------------------------------------------------------------------------------------------ helpers


def as_size(value: Any) -> Any:
    """A ``TensorMeta`` as the ``torch.Size`` torch's formulas expect (lists of them too)."""
    if isinstance(value, TensorMeta):
        return torch.Size(value.shape)
    if isinstance(value, (list, tuple)) and any(isinstance(v, TensorMeta) for v in value):
        return type(value)(as_size(v) for v in value)
    return value


def shape_of(value: Any) -> tuple[int, ...]:
    if not isinstance(value, TensorMeta):
        raise TypeError(f"expected a tensor argument, got {type(value).__name__}")
    return value.shape


def numel_of(value: Any) -> int:
    return value.numel if isinstance(value, TensorMeta) else 0


def first_output_numel(call: OpCall) -> int:
    for out in call.outputs:
        if out is not None:
            return out.numel
    return 0


def per_output_element(call: OpCall) -> int:
    # Pointwise: one FLOP per output element (in-place ops: their ``self``).
    n = first_output_numel(call)
    return n if n else numel_of(call.args[0] if call.args else None)


def per_input_element(call: OpCall) -> int:
    # Reduction: one FLOP per input element.
    return numel_of(call.args[0] if call.args else None)


def list_numel(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(numel_of(v) for v in value)
    return numel_of(value)


def per_list_element(call: OpCall) -> int:
    # ``_foreach_*``: one FLOP per element of the first tensor list (in-place variants return nothing).
    return list_numel(call.args[0]) if call.args else 0


def is_elementwise(op: OpOverload) -> bool:
    """Pointwise-tagged, the backward of a pointwise op, or a random draw per element."""
    if op.overloadpacket in _NO_FLOPS:
        return False
    return (
        torch.Tag.pointwise in op.tags
        or op.overloadpacket in _RANDOM
        or _is_pointwise_backward(op.overloadpacket.__name__)
    )


def _is_pointwise_backward(name: str) -> bool:
    # ``hardtanh_backward``, ``elu_backward``, ... (the forward has the pointwise tag, the backward not).
    if not name.endswith("_backward"):
        return False
    forward = getattr(aten, name[: -len("_backward")], None)
    if not isinstance(forward, OpOverloadPacket):
        return False
    return any(torch.Tag.pointwise in getattr(forward, o).tags for o in forward.overloads())  # type: ignore[no-untyped-call]


# One random draw per output element (dropout masks): counted as elementwise.
_RANDOM = frozenset({aten.bernoulli_, aten.bernoulli, aten.native_dropout, aten.rand_like, aten.randn_like})

# Copies and data movement: pointwise-tagged in part, but no arithmetic.
_NO_FLOPS = frozenset(
    {
        aten.clone,
        aten.copy_,
        aten._to_copy,
        aten.lift_fresh,
        aten.lift_fresh_copy,
        aten.zeros_like,
        aten.ones_like,
        aten.empty_like,
        aten.full_like,
        aten.fill_,
        aten.zero_,
        aten.masked_fill,
        aten.masked_fill_,
        aten._foreach_copy_,
        aten._foreach_zero_,
        aten.contiguous,
        aten.detach,
        aten.alias,
        aten.to,
    }
)
