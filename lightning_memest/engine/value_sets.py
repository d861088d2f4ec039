"""The values an integer tensor of the step can hold, where the simulation cannot know the values
themselves: a superset, carried from op to op, that bounds what data-dependent ops can output.

Values are known where they come from the batch or from constants (``engine.real_path``), but an op
that *picks* elements of a known tensor with unknown indices (``levels[top_k_indices]`` in torchvision's
region proposals) makes a tensor of unknown values -- all drawn from the known ones. ``unique`` of it
has at most as many values as that set, ``bincount`` and ``one_hot`` at most its largest + 1 bins,
where without the set they would be as long as the tensor (``engine.data_dependent``'s policies read
the sets through :func:`values_in`). Code also *computes* small integers from floats: torchvision's FPN
``LevelMapper`` clamps ``floor(4 + log2(sqrt(area) / 224))`` to the pyramid's levels, casts and
subtracts the lowest, and its RoI pooling takes ``torch.where(levels == level)`` for each level. So
``clamp`` gives a floating-point tensor the interval of its limits, ``floor``/``ceil``/``trunc``/``round``
and copies carry it, a cast to integers makes it a set, and ``+``/``-``/``*`` by a number move a set:
where every feature map has one stride (``fasterrcnn_mobilenet_v3_large_fpn``) ``levels`` is ``{0}``,
and ``levels == 1`` selects nothing (``engine.nonzero_bounds`` reads the sets for comparisons).
Code *decides* on small integers too: a generation loop's ``unfinished & ~(full(True) | isin(tokens,
eos))`` is all 0 at the maximum length whatever the tokens are. So elementwise ops give the op of every
combination of their operands' values (an absorbing operand -- ``x & 0``, ``x | True`` -- forces one),
fills give their value, ``any``/``all``/``max`` reduce a set, and a scalar read of a tensor whose set
gives one answer is exact (``engine.data_dependent``). The same rules carry what a tensor holds in the
assumed case (``engine.assumed_values``), where an operand has an assumption. A known tensor's set is
worked out once per write of its storage (views of one mask ask for it op after op).
Facts are filed with their storage's write generation (``engine.tensor_facts``): a write through any
alias voids them.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode() as mode:
    ...     levels = mode.from_tensor(torch.tensor([2, 3, 5, 3]))
    ...     picked = levels[torch.empty(10, dtype=torch.long).random_(4)]  # unknown indices
    >>> known = {levels: torch.tensor([2, 3, 5, 3])}
    >>> carry_value_sets(torch.ops.aten.index.Tensor, (levels, [None]), picked, known.get)
    >>> values_in(picked, known.get).tolist()
    [2, 3, 5]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from lightning_memest.engine.assumed_values import (
    assumed_set,
    file_assumed,
    has_assumption,
    is_source,
    source_assumption,
)
from lightning_memest.engine.nonzero_bounds import (
    argument,
    carried_bounds,
    clamp_limits,
    file_bound,
    known_number,
    nonzero_bound,
    set_holds,
    set_only_zero,
)
from lightning_memest.engine.tensor_facts import fact_of, file_fact, storage_written

__all__ = ["SetLookup", "ValueLookup", "carry_value_sets", "int_values", "remember_written_sets", "values_in"]

aten = torch.ops.aten

#: The real values behind a tensor of the step (a CPU tensor), or ``None`` when they are unknown.
ValueLookup = Callable[[Tensor], Tensor | None]

#: The values a tensor can hold (a sorted 1-d CPU tensor), or ``None``: :func:`values_in`, or what it
#: holds in the assumed case (``engine.assumed_values``).
SetLookup = Callable[[Tensor], Tensor | None]


def int_values(real: Tensor) -> list[int]:
    """The values of a real tensor, as Python ints (outside the fake mode)."""
    with unset_fake_temporarily():
        return [int(v) for v in real.reshape(-1).tolist()]


#: The fact (``engine.tensor_facts``) of a fake integer tensor holding the values it can have (a sorted
#: 1-d CPU tensor).
_VALUES_ATTR = "_memest_values_in"

#: The fact of a fake tensor with known values holding their set, once computed: a set is asked for
#: op after op of one tensor (each view of an attention mask), and ``unique`` is a sort.
_KNOWN_SET_ATTR = "_memest_known_set"
#: ... or that its values are too many to keep as a set.
_TOO_MANY = object()

#: The largest set kept: beyond, a tensor's size bounds ``unique`` as well.
_SET_LIMIT = 1 << 16

#: The most combinations an elementwise op of two sets is worked out for (``len(a) * len(b)``).
_PAIR_LIMIT = 1 << 14

_VIEWS_AND_PICKS = {
    getattr(aten, name)
    for name in [
        *("view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "select", "slice", "narrow"),
        *("unsqueeze", "squeeze", "permute", "transpose", "t", "alias", "clone", "_to_copy", "flip"),
        *("roll", "repeat", "index", "index_select", "gather", "take", "masked_select", "unbind"),
        *("split", "split_with_sizes", "chunk"),  # not as_strided: it may view memory beyond its input
    ]
}
_UNIQUES = {
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
}
_VALUES_AND_POSITIONS = {
    *(aten.sort, aten.topk, aten.max, aten.min, aten.kthvalue, aten.mode, aten.amax, aten.amin),
}
_POSITIONS = {aten.argmax, aten.argmin}
_UNIONS = {aten.cat, aten.stack}
_written_cache: dict[OpOverload, tuple[int, ...]] = {}
_CLAMPS = {aten.clamp, aten.clamp_, aten.clamp_min, aten.clamp_min_, aten.clamp_max, aten.clamp_max_}


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

_ROUNDINGS: dict[OpOverloadPacket, Callable[[float], float]] = {
    aten.floor: math.floor,
    aten.ceil: math.ceil,
    aten.trunc: math.trunc,
    aten.round: round,
}

#: The fact of a floating-point tensor holding the interval ``(low, high)`` its values lie in (ends may
#: be infinite): ``clamp`` makes it, roundings and copies carry it, a cast to integers makes it a set.
_RANGE_ATTR = "_memest_range"


def values_in(t: Tensor, read: ValueLookup) -> Tensor | None:
    """The values integer tensor ``t`` can hold -- a superset, sorted, 1-d, on the CPU -- or ``None``:
    its known values', else the set :func:`carry_value_sets` gave it."""
    if t.is_floating_point() or t.is_complex():
        return None
    carried = fact_of(t, _VALUES_ATTR)
    if carried is not None:
        return carried  # type: ignore[no-any-return]
    # (before the known values: an in-place op's rules read the set its input had before the write,
    # which forgot those values -- ``remember_written_sets``)
    cached = fact_of(t, _KNOWN_SET_ATTR)
    if cached is not None:
        return None if cached is _TOO_MANY else cached
    real = read(t)
    if real is None or real.numel() > _SET_LIMIT * 16:
        return None
    with unset_fake_temporarily():
        found: Tensor = torch.unique(real.cpu())
    kept = found if found.numel() <= _SET_LIMIT else None
    file_fact(t, _KNOWN_SET_ATTR, _TOO_MANY if kept is None else kept)
    return kept


def remember_written_sets(func: OpOverload, args: Sequence[Any], read: ValueLookup) -> None:
    """Before ``func`` runs: work out the sets of the known values it writes into. Writing something
    unknown forgets those values (``engine.real_path``), and the op's rules, after it ran, read the set
    its input had: ``finished |= token == eos`` of a known ``finished``."""
    for i in _written_positions(func):
        for t in _tensors(args[i] if i < len(args) else None):
            if isinstance(t, FakeTensor) and read(t) is not None:
                values_in(t, read)


def _written_positions(func: OpOverload) -> tuple[int, ...]:
    """The positions of the arguments ``func`` writes into (``Tensor(a!)`` in its schema)."""
    written = _written_cache.get(func)
    if written is None:
        written = _written_cache[func] = tuple(
            i for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write
        )
    return written


def carry_value_sets(
    func: OpOverload,
    args: Sequence[Any],
    out: Any,
    read: ValueLookup,
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    """After ``func`` ran: give its integer outputs of unknown value the set of values they can hold
    (the difference, in Faster R-CNN, between five ``nms`` calls per image and thousands), and their
    bounds on how many elements are nonzero (``engine.nonzero_bounds``). Picks, views and copies carry
    their input's set, ``cat``/``stack`` the union, ``sort``/``topk``/``max``... their input's to their
    values and the positions along the dimension to their indices, a boolean ``sum`` ``0..`` its bound;
    ``clamp`` limits them (a floating-point tensor gets an interval, which roundings carry and a cast to
    integers makes a set); elementwise ops (``+``, ``&``, ``~``, ``==``...) give the op of every
    combination of their operands' values -- or the one value an absorbing operand forces (``x & 0``,
    ``x | True``, ``where`` of a known condition); ``any``/``all`` the truths of their input's values;
    ``full``/``fill_``/``zeros``... their value. The same rules carry what a tensor holds in the assumed
    case (``engine.assumed_values``), where an operand has an assumption. ``kwargs``: the op's keyword
    arguments (without them, rules that read one -- ``add``'s ``alpha`` -- give nothing). A write voids
    what was known of every tensor on the written storage (``engine.tensor_facts``); what the op's
    rules say of its outputs is filed after.
    """
    sets: list[tuple[Any, Tensor]] = []
    assumed: list[tuple[Any, Tensor]] = []
    if _has_unknown_integers(out, read):  # else no set is filed: none is worked out
        sets = _carried_sets(func, args, kwargs, out, read, lambda t: values_in(t, read))
        assumed = _assumed_sets(func, args, kwargs, out, read, sets)
    ranges = _carried_ranges(func, args, kwargs, out, read)
    bounds = carried_bounds(func, args, out, read, lambda t: values_in(t, read), kwargs)
    written = _written_positions(func)
    if written:
        for i in written:
            for t in _tensors(args[i] if i < len(args) else None):
                storage_written(t)
        for t in _tensors(out):  # the written ``out=`` arguments (keywords) are the outputs
            storage_written(t)
    for target, values in sets:
        _give(target, values, read)
    for target, values in assumed:
        for t in _tensors(target):
            file_assumed(t, values if values.dtype == t.dtype else _converted(values, t.dtype))
    for t, interval in ranges:
        file_fact(t, _RANGE_ATTR, interval)
    for t, bound in bounds:
        file_bound(t, bound)


def _has_unknown_integers(out: Any, read: ValueLookup) -> bool:
    """Whether an output is a fake integer or boolean tensor of unknown values (the only kind given a
    set)."""
    for t in _tensors(out):
        if isinstance(t, FakeTensor) and not (t.is_floating_point() or t.is_complex()) and read(t) is None:
            return True
    return False


def _assumed_sets(
    func: OpOverload,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    out: Any,
    read: ValueLookup,
    exact: list[tuple[Any, Tensor]],
) -> list[tuple[Any, Tensor]]:
    """What ``func``'s outputs hold in the assumed case (``engine.assumed_values``), where it says more
    than their exact sets: the rules on the operands' assumed sets, or a comparison's assumption."""
    source = is_source(func)
    if not (source or has_assumption(args)):
        return []

    def assumed_or_exact(t: Tensor) -> Tensor | None:
        found = assumed_set(t)
        return found if found is not None else values_in(t, read)

    found = _carried_sets(func, args, kwargs, out, read, assumed_or_exact)
    if source and isinstance(out, Tensor) and not any(t is out and v.numel() == 1 for t, v in found):
        made = source_assumption(func, args, kwargs or {}, read)
        found = [(out, made)] if made is not None else found
    sizes = {id(t): v.numel() for t, v in exact}
    return [(t, v) for t, v in found if v.numel() < sizes.get(id(t), math.inf)]


def _carried_sets(
    func: OpOverload,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    out: Any,
    read: ValueLookup,
    sets_of: SetLookup,
) -> list[tuple[Any, Tensor]]:
    """The sets ``func``'s outputs get (``sets_of``: the operands'), before anything is filed (an
    in-place op reads its input's)."""
    packet = func.overloadpacket
    found: list[tuple[Any, Tensor | None]] = []
    if packet in _VIEWS_AND_PICKS:
        first = args[0] if args else None
        if packet is aten._to_copy and isinstance(first, Tensor) and first.is_floating_point():
            found.append((out, _cast(first, out)))  # the integers an interval of floats casts to
        else:
            found.append((out, _first_set(args, sets_of)))
    elif packet in _UNIQUES and isinstance(out, tuple) and out:
        found.append((out[0], _first_set(args, sets_of)))
    elif packet in _VALUES_AND_POSITIONS and func._overloadname == "other":  # max(a, b): elementwise
        found.append((out, _union(list(args[:2]), sets_of)))
    elif packet in _VALUES_AND_POSITIONS:
        if isinstance(out, tuple) and len(out) == 2:  # values, and indices along the dimension
            found.append((out[0], _first_set(args, sets_of)))
            found.append((out[1], _positions(args, func)))
        else:
            found.append((out, _first_set(args, sets_of)))
    elif packet in _POSITIONS:
        found.append((out, _positions(args, func)))
    elif packet in _UNIONS:
        found.append((out, _union(args[0] if args and isinstance(args[0], (list, tuple)) else [], sets_of)))
    elif packet is aten.sum and isinstance(out, Tensor):
        found.append((out, _counts(args[0], out, read, sets_of)))
    elif packet in _CLAMPS and isinstance(out, Tensor) and not out.is_floating_point():
        found.append((out, _clamped(func, args, kwargs or {}, read, sets_of)))
    elif packet in _FILLS and isinstance(out, Tensor):
        found.append((out, _filled(func, args, kwargs or {}, read)))
    elif packet in _TRUTHS and isinstance(out, Tensor):
        found.append((out, _truths(args[0], sets_of)))
    elif packet is aten.where and len(args) == 3 and isinstance(out, Tensor):
        found.append((out, _where(args, sets_of)))
    elif packet is aten.isin and isinstance(out, Tensor):
        found.append((out, _isin(func, args, kwargs or {}, read, sets_of)))
    elif packet in _ELEMENTWISE and isinstance(out, Tensor) and kwargs is not None:
        found.append((out, _elementwise(func, args, kwargs, out, sets_of)))
    return [(target, values) for target, values in found if values is not None]


def _counts(t: Any, out: Tensor, read: ValueLookup, sets_of: SetLookup) -> Tensor | None:
    """The values a sum of 0s and 1s can have: ``0..`` the most nonzero elements a sum can add up."""
    if not isinstance(t, Tensor) or out.numel() == 0:
        return None
    if t.dtype != torch.bool:
        possible = sets_of(t)
        if possible is None or not _within(possible, 0, 1):
            return None
    most = min(nonzero_bound(t, read, sets_of), t.numel() // out.numel())
    if most >= _SET_LIMIT:
        return None
    with unset_fake_temporarily():
        return torch.arange(most + 1)


def _union(tensors: Sequence[Any], sets_of: SetLookup) -> Tensor | None:
    """The values any of ``tensors`` can hold, if each one's are known."""
    sets = [sets_of(t) if isinstance(t, Tensor) else None for t in tensors]
    if not sets or any(v is None for v in sets):
        return None
    with unset_fake_temporarily():
        found: Tensor = torch.unique(torch.cat([v for v in sets if v is not None]))
    return found


def _clamped(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], read: ValueLookup, sets_of: SetLookup
) -> Tensor | None:
    """The values of an integer tensor clamped: its set clamped, else every integer between the limits."""
    limits = clamp_limits(func, args, kwargs, read)
    if limits is None:
        return None
    low, high = limits
    possible = sets_of(args[0])
    with unset_fake_temporarily():
        if possible is not None:
            clamped: Tensor = possible.clamp(
                None if math.isinf(low) else low, None if math.isinf(high) else high
            )
            found: Tensor = torch.unique(clamped)
            return found
        if high - low < _SET_LIMIT:
            return torch.arange(math.ceil(low), math.floor(high) + 1)
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


def _carried_ranges(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any] | None, out: Any, read: ValueLookup
) -> list[tuple[Tensor, tuple[float, float]]]:
    """The intervals of ``func``'s floating-point outputs: ``clamp``'s limits (of its input's interval),
    a rounding's of its input's, a copy's or view's its input's."""
    if not (isinstance(out, FakeTensor) and out.is_floating_point()):
        return []
    packet = func.overloadpacket
    first = args[0] if args and isinstance(args[0], Tensor) else None
    if first is None:
        return []
    interval = fact_of(first, _RANGE_ATTR) if first.is_floating_point() else None
    if packet in _CLAMPS:
        limits = clamp_limits(func, args, kwargs or {}, read)
        if limits is None:
            return []
        with unset_fake_temporarily():  # the limits as the op rounds them to the tensor's type
            low_limit, high_limit = (float(torch.tensor(v, dtype=out.dtype)) for v in limits)
        low, high = interval if interval is not None else (-math.inf, math.inf)
        return [(out, (min(max(low, low_limit), high_limit), min(max(high, low_limit), high_limit)))]
    if interval is None:
        return []
    rounding = _ROUNDINGS.get(packet)
    if rounding is not None and func._overloadname == "default":
        return [(out, (_rounded(rounding, interval[0]), _rounded(rounding, interval[1])))]
    if packet in _VIEWS_AND_PICKS and out.dtype in (first.dtype, torch.float64):  # (no rounding)
        return [(out, interval)]
    return []


def _rounded(rounding: Callable[[float], float], x: float) -> float:
    return x if math.isinf(x) else float(rounding(x))


def _cast(t: Tensor, out: Any) -> Tensor | None:
    """The integers a floating-point tensor's interval casts to (truncated toward zero; not to ``bool``,
    which tests for nonzero, nor negative ones to unsigned types)."""
    interval = fact_of(t, _RANGE_ATTR)
    if interval is None or not isinstance(out, Tensor) or out.is_floating_point() or out.dtype == torch.bool:
        return None
    if math.isinf(interval[0]) or math.isinf(interval[1]) or (interval[0] < 0 and not out.is_signed()):
        return None
    low, high = math.trunc(interval[0]), math.trunc(interval[1])
    if high - low >= _SET_LIMIT:
        return None
    with unset_fake_temporarily():
        return torch.arange(low, high + 1)


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, Tensor)]
    return []


def _first_set(args: Sequence[Any], sets_of: SetLookup) -> Tensor | None:
    first = args[0] if args else None
    return sets_of(first) if isinstance(first, Tensor) else None


def _positions(args: Sequence[Any], func: OpOverload) -> Tensor | None:
    """The indices an op along a dimension (``dim``; none: all elements) can return."""
    t = args[0] if args else None
    if not isinstance(t, Tensor):
        return None
    dim = None
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dim":
            dim = args[i] if i < len(args) and not arg.kwarg_only else arg.default_value
    size = t.numel() if dim is None or t.dim() == 0 else t.shape[dim]
    return _range(size) if size <= _SET_LIMIT else None


@functools.lru_cache(maxsize=64)
def _range(size: int) -> Tensor:
    """``0 .. size - 1``, made once per size: argmax over a vocabulary, every generated token (sets are
    never written in place)."""
    with unset_fake_temporarily():
        return torch.arange(size)


def _within(values: Tensor, low: int, high: int) -> bool:
    """Whether every value of the sorted set ``values`` lies in ``low .. high``."""
    if values.numel() == 0:
        return True
    with unset_fake_temporarily():
        return bool(low <= values[0].item() and values[-1].item() <= high)


def _give(out: Any, values: Tensor | None, read: ValueLookup) -> None:
    if values is None:
        return
    for t in [out] if isinstance(out, Tensor) else out if isinstance(out, (list, tuple)) else ():
        if (
            isinstance(t, FakeTensor)
            and not (t.is_floating_point() or t.is_complex())
            and t.constant is None
            and read(t) is None
        ):
            file_fact(t, _VALUES_ATTR, values if values.dtype == t.dtype else _converted(values, t.dtype))


def _converted(values: Tensor, dtype: torch.dtype) -> Tensor:
    with unset_fake_temporarily():
        converted: Tensor = torch.unique(values.to(dtype))
    return converted
