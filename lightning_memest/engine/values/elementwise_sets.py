"""The values the output of an elementwise op, a fill or ``any``/``all`` can hold, from its operands'
value sets (``engine.values.value_sets``): the op of every combination of the operands' values, or the one
value an absorbing operand forces whatever the other holds (``x & 0``, ``x | True``).

Code *decides* on small integers: a generation loop's ``unfinished & ~(full(True) | isin(tokens,
eos))`` is all 0 at the maximum length whatever the tokens are -- ``full`` gives ``{True}``, ``|`` with
it ``{True}``, ``~`` ``{False}``, ``&`` with that ``{0}``. ``where`` of a condition that is always true
(false) gives its first (second) operand's values, ``isin`` each possible element's answer, ``any``/
``all`` the truths of their input's values. ``engine.values.value_set_rules`` asks here for an op that none of
its own rules takes.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> aten = torch.ops.aten
    >>> with FakeTensorMode():
    ...     a, b = torch.empty(3, dtype=torch.long), torch.empty(3, dtype=torch.long)
    ...     total, masked = a + b, a & 0
    >>> sets = {a: torch.tensor([0, 1]), b: torch.tensor([10, 20])}
    >>> elementwise_set(aten.add.Tensor, (a, b), {}, total, {}.get, sets.get).tolist()
    [10, 11, 20, 21]
    >>> elementwise_set(aten.bitwise_and.Scalar, (a, 0), {}, masked, {}.get, {}.get).tolist()
    [0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memest.engine.values.nonzero_bounds import argument, known_number, set_holds, set_only_zero

if TYPE_CHECKING:
    from lightning_memest.engine.values.value_sets import SetLookup, ValueLookup

__all__ = ["elementwise_set"]

aten = torch.ops.aten

#: The most combinations an elementwise op of two sets is worked out for (``len(a) * len(b)``).
_PAIR_LIMIT = 1 << 14


def _packets(*names: str) -> list[OpOverloadPacket]:
    """The op packets ``names`` and their in-place forms (``add`` and ``add_``), those aten has."""
    found = (getattr(aten, n, None) for name in names for n in (name, name + "_"))
    return [p for p in found if isinstance(p, OpOverloadPacket)]


#: Elementwise ops: each output element is the function of the operands' elements at its place, so the
#: output's values are among the function of every combination of the operands' possible values.
_ELEMENTWISE: dict[OpOverloadPacket, Callable[..., Tensor]] = {
    **dict.fromkeys(_packets("bitwise_and", "__and__", "__iand__"), torch.bitwise_and),
    **dict.fromkeys(_packets("bitwise_or", "__or__", "__ior__"), torch.bitwise_or),
    **dict.fromkeys(_packets("bitwise_xor", "__xor__", "__ixor__"), torch.bitwise_xor),
    **dict.fromkeys(_packets("bitwise_not"), torch.bitwise_not),
    **dict.fromkeys(_packets("logical_and"), torch.logical_and),
    **dict.fromkeys(_packets("logical_or"), torch.logical_or),
    **dict.fromkeys(_packets("logical_xor"), torch.logical_xor),
    **dict.fromkeys(_packets("logical_not"), torch.logical_not),
    **{p: getattr(torch, p.__name__.rstrip("_")) for p in _packets("eq", "ne", "gt", "ge", "lt", "le")},
    **{p: getattr(torch, p.__name__.rstrip("_")) for p in _packets("maximum", "minimum", "neg", "abs")},
    **{p: getattr(torch, p.__name__.rstrip("_")) for p in _packets("sign", "remainder", "floor_divide")},
    **dict.fromkeys(_packets("add"), torch.add),
    **dict.fromkeys(_packets("sub"), torch.sub),
    **dict.fromkeys(_packets("rsub"), torch.rsub),
    **dict.fromkeys(_packets("mul"), torch.mul),
}
#: Those of one operand.
_UNARY = {*_packets("bitwise_not", "logical_not", "neg", "abs", "sign")}
#: Those with an ``alpha`` argument (``a + alpha * b``).
_SCALED = {*_packets("add"), *_packets("sub"), *_packets("rsub")}
#: Ops whose result is 0 where an operand is 0 (``x & 0``, ``x * 0``: integers only carry sets).
_ZERO_ABSORBS = {*_packets("bitwise_and", "__and__", "__iand__", "logical_and", "mul")}
#: Ops whose result is true where an operand is (``x | True`` of booleans, ``logical_or``).
_TRUE_ABSORBS = {*_packets("bitwise_or", "__or__", "__ior__", "logical_or")}
#: Reductions to whether any / all elements are nonzero: the truths of the values there can be.
_TRUTHS = {*_packets("any", "all")}
#: Factories and fills, and the argument holding their value (``None``: 0 or 1 by name).
_FILLS: dict[OpOverloadPacket, str | None] = {
    **dict.fromkeys(_packets("zeros", "zeros_like", "new_zeros", "zero", "ones", "ones_like", "new_ones")),
    **dict.fromkeys(_packets("full", "full_like", "new_full"), "fill_value"),
    **dict.fromkeys(_packets("fill"), "value"),
    aten.scalar_tensor: "s",
}


def elementwise_set(
    func: OpOverload,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    out: Any,
    read: ValueLookup,
    sets_of: SetLookup,
) -> Tensor | None:
    """The values ``func``'s output can hold (``sets_of``: the operands'), if it is a fill, ``any``/
    ``all``, ``where``, ``isin`` or an elementwise op and they say: else ``None``. ``kwargs``: the op's
    keyword arguments (without them, an elementwise op gives nothing: ``add`` reads its ``alpha``)."""
    packet = func.overloadpacket
    if packet in _FILLS and isinstance(out, Tensor):
        return _filled(func, args, kwargs or {}, read)
    if packet in _TRUTHS and isinstance(out, Tensor):
        return _truths(args[0], sets_of)
    if packet is aten.where and len(args) == 3 and isinstance(out, Tensor):
        return _where(args, sets_of)
    if packet is aten.isin and isinstance(out, Tensor):
        return _isin(func, args, kwargs or {}, read, sets_of)
    if packet in _ELEMENTWISE and isinstance(out, Tensor) and kwargs is not None:
        return _elementwise(func, args, kwargs, out, sets_of)
    return None


def _operand_set(a: Any, sets_of: SetLookup) -> Tensor | None:
    """An operand's possible values: a tensor's set, a number as a set of one."""
    if isinstance(a, Tensor):
        return sets_of(a)
    if isinstance(a, (bool, int, float)):
        with unset_fake_temporarily():
            return torch.tensor([a])
    return None


def _elementwise(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], out: Tensor, sets_of: SetLookup
) -> Tensor | None:
    """The values of an elementwise op's output: the op of every combination of its operands' values
    (operands that are numbers are themselves), or the value an absorbing operand forces."""
    packet = func.overloadpacket
    operands = list(args[: 1 if packet in _UNARY else 2])
    absorbed = _absorbed(packet, operands, out, sets_of)
    if absorbed is not None:
        return absorbed
    sets = [_operand_set(a, sets_of) for a in operands]
    if not sets or any(s is None for s in sets):
        return None
    if math.prod(s.numel() for s in sets if s is not None) > _PAIR_LIMIT:
        return None
    extra = {"alpha": argument(func, args, kwargs, "alpha")} if packet in _SCALED else {}
    with unset_fake_temporarily():
        # each tensor operand along a dimension of its own: the result holds every combination (numbers
        # stay numbers: they take part in type promotion as in the op)
        grid = [
            a if not isinstance(a, Tensor) else s.reshape([-1 if i == j else 1 for j in range(len(sets))])
            for i, (a, s) in enumerate(zip(operands, sets, strict=True))
            if s is not None
        ]
        try:
            combined = _ELEMENTWISE[packet](*grid, **extra)
        except (RuntimeError, TypeError, ZeroDivisionError):
            return None  # (integer division by a possible 0)
        found: Tensor = torch.unique(combined)
    return found


def _absorbed(
    packet: OpOverloadPacket, operands: Sequence[Any], out: Tensor, sets_of: SetLookup
) -> Tensor | None:
    """The one value an operand forces whatever the other holds: ``x & 0``, ``x * 0`` (integers),
    ``logical_and(x, 0)`` are 0; ``x | True`` (booleans), ``logical_or(x, 1)`` are true."""
    zero, true = packet in _ZERO_ABSORBS, packet in _TRUE_ABSORBS and out.dtype == torch.bool
    if not (zero or true) or len(operands) != 2:
        return None
    for a in operands:
        possible = _operand_set(a, sets_of)
        if possible is None or possible.numel() == 0:
            continue
        with unset_fake_temporarily():
            if zero and set_only_zero(possible):
                return torch.tensor([0])
            if true and not set_holds(possible, 0):
                return torch.tensor([True])
    return None


def _truths(t: Any, sets_of: SetLookup) -> Tensor | None:
    """``any``/``all`` of a tensor of possible values ``S``: ``S != 0`` (all nonzero: true; all zero:
    false; both: either). Not of an empty tensor, whose answer is no element's."""
    if not isinstance(t, Tensor) or t.numel() == 0:
        return None
    possible = sets_of(t)
    if possible is None or possible.numel() == 0:
        return None
    zero, nonzero = set_holds(possible, 0), not set_only_zero(possible)
    with unset_fake_temporarily():
        return torch.tensor([False, True][not zero : 1 + nonzero])


def _where(args: Sequence[Any], sets_of: SetLookup) -> Tensor | None:
    """``where(c, a, b)``: ``a``'s values where ``c`` is always true, ``b``'s where always false, else
    either's."""
    condition = _operand_set(args[0], sets_of)
    a, b = _operand_set(args[1], sets_of), _operand_set(args[2], sets_of)
    with unset_fake_temporarily():
        if condition is not None and condition.numel():
            if not set_holds(condition, 0):
                return a
            if set_only_zero(condition):
                return b
        if a is None or b is None:
            return None
        found: Tensor = torch.unique(torch.cat([a, b.to(a.dtype)]))
    return found


def _isin(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], read: ValueLookup, sets_of: SetLookup
) -> Tensor | None:
    """``isin(elements, test)``: each possible element's answer against the known test values; without
    those, ``False`` (``True`` inverted) where no possible element is a possible test value."""
    elements, test = _operand_set(args[0], sets_of), args[1]
    invert = bool(argument(func, args, kwargs, "invert"))
    if elements is None:
        return None
    known = read(test) if isinstance(test, Tensor) else None
    with unset_fake_temporarily():
        if known is not None or not isinstance(test, Tensor):
            tested = known if known is not None else torch.tensor([test])
            found: Tensor = torch.unique(torch.isin(elements, tested.cpu(), invert=invert))
            return found
        possible = sets_of(test)
        if possible is not None and not bool(torch.isin(elements, possible).any()):
            return torch.tensor([invert])
    return None


def _filled(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], read: ValueLookup
) -> Tensor | None:
    """The one value of a factory's or a fill's output (``zeros``, ``ones``, ``full``, ``fill_``...)."""
    name = _FILLS[func.overloadpacket]
    if name is None:
        value: Any = 1 if "ones" in func.overloadpacket.__name__ else 0
    else:
        value = known_number(argument(func, args, kwargs, name), read)
    if not isinstance(value, (bool, int, float)):
        return None
    with unset_fake_temporarily():
        return torch.tensor([value])
