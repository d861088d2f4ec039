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

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from lightning_memest.engine.nonzero_bounds import (
    carried_bounds,
    clamp_limits,
    file_bound,
    known_number,
    nonzero_bound,
)
from lightning_memest.engine.tensor_facts import fact_of, file_fact, storage_written

__all__ = ["ValueLookup", "carry_value_sets", "int_values", "values_in"]

aten = torch.ops.aten

#: The real values behind a tensor of the step (a CPU tensor), or ``None`` when they are unknown.
ValueLookup = Callable[[Tensor], Tensor | None]


def int_values(real: Tensor) -> list[int]:
    """The values of a real tensor, as Python ints (outside the fake mode)."""
    with unset_fake_temporarily():
        return [int(v) for v in real.reshape(-1).tolist()]


#: The fact (``engine.tensor_facts``) of a fake integer tensor holding the values it can have (a sorted
#: 1-d CPU tensor).
_VALUES_ATTR = "_memest_values_in"

#: The largest set kept: beyond, a tensor's size bounds ``unique`` as well.
_SET_LIMIT = 1 << 16

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
_VALUES_AND_POSITIONS = {aten.sort, aten.topk, aten.max, aten.min, aten.kthvalue, aten.mode}
_POSITIONS = {aten.argmax, aten.argmin}
_UNIONS = {aten.cat, aten.stack}
_written_cache: dict[OpOverload, tuple[int, ...]] = {}
_CLAMPS = {aten.clamp, aten.clamp_, aten.clamp_min, aten.clamp_min_, aten.clamp_max, aten.clamp_max_}
_ARITHMETIC: dict[OpOverloadPacket, Callable[..., Tensor]] = {
    **dict.fromkeys((aten.add, aten.add_), torch.add),
    **dict.fromkeys((aten.sub, aten.sub_), torch.sub),
    **dict.fromkeys((aten.mul, aten.mul_), torch.mul),
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
    real = read(t)
    if real is None or real.numel() > _SET_LIMIT * 16:
        return None
    with unset_fake_temporarily():
        found: Tensor = torch.unique(real.cpu())
    return found if found.numel() <= _SET_LIMIT else None


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
    integers makes a set), ``+``/``-``/``*`` by a number move them. ``kwargs``: the op's keyword
    arguments (without them, rules that read one -- ``add``'s ``alpha`` -- give nothing). A write voids
    what was known of every tensor on the written storage (``engine.tensor_facts``); what the op's
    rules say of its outputs is filed after.
    """
    sets = _carried_sets(func, args, kwargs, out, read)
    ranges = _carried_ranges(func, args, kwargs, out, read)
    bounds = carried_bounds(func, args, out, read, lambda t: values_in(t, read), kwargs)
    written = _written_cache.get(func)
    if written is None:
        written = _written_cache[func] = tuple(
            i for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write
        )
    if written:
        for i in written:
            for t in _tensors(args[i] if i < len(args) else None):
                storage_written(t)
        for t in _tensors(out):  # the written ``out=`` arguments (keywords) are the outputs
            storage_written(t)
    for target, values in sets:
        _give(target, values, read)
    for t, interval in ranges:
        file_fact(t, _RANGE_ATTR, interval)
    for t, bound in bounds:
        file_bound(t, bound)


def _carried_sets(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any] | None, out: Any, read: ValueLookup
) -> list[tuple[Any, Tensor]]:
    """The sets ``func``'s outputs get, before anything is filed (an in-place op reads its input's)."""
    packet = func.overloadpacket
    found: list[tuple[Any, Tensor | None]] = []
    if packet in _VIEWS_AND_PICKS:
        first = args[0] if args else None
        if packet is aten._to_copy and isinstance(first, Tensor) and first.is_floating_point():
            found.append((out, _cast(first, out)))  # the integers an interval of floats casts to
        else:
            found.append((out, _first_set(args, read)))
    elif packet in _UNIQUES and isinstance(out, tuple) and out:
        found.append((out[0], _first_set(args, read)))
    elif packet in _VALUES_AND_POSITIONS and func._overloadname == "other":  # max(a, b): elementwise
        found.append((out, _union(list(args[:2]), read)))
    elif packet in _VALUES_AND_POSITIONS:
        if isinstance(out, tuple) and len(out) == 2:  # values, and indices along the dimension
            found.append((out[0], _first_set(args, read)))
            found.append((out[1], _positions(args, func)))
        else:
            found.append((out, _first_set(args, read)))
    elif packet in _POSITIONS:
        found.append((out, _positions(args, func)))
    elif packet in _UNIONS:
        found.append((out, _union(args[0] if args and isinstance(args[0], (list, tuple)) else [], read)))
    elif packet is aten.sum and isinstance(out, Tensor):
        found.append((out, _counts(args[0], out, read)))
    elif packet in _CLAMPS and isinstance(out, Tensor) and not out.is_floating_point():
        found.append((out, _clamped(func, args, kwargs or {}, read)))
    elif packet in _ARITHMETIC and isinstance(out, Tensor) and kwargs is not None:
        found.append((out, _moved(func, args, kwargs, read)))
    return [(target, values) for target, values in found if values is not None]


def _counts(t: Any, out: Tensor, read: ValueLookup) -> Tensor | None:
    """The values a sum of 0s and 1s can have: ``0..`` the most nonzero elements a sum can add up."""
    if not isinstance(t, Tensor) or out.numel() == 0:
        return None
    if t.dtype != torch.bool:
        possible = values_in(t, read)
        if possible is None or not set(int_values(possible)) <= {0, 1}:
            return None
    most = min(nonzero_bound(t, read, lambda x: values_in(x, read)), t.numel() // out.numel())
    if most >= _SET_LIMIT:
        return None
    with unset_fake_temporarily():
        return torch.arange(most + 1)


def _union(tensors: Sequence[Any], read: ValueLookup) -> Tensor | None:
    """The values any of ``tensors`` can hold, if each one's are known."""
    sets = [values_in(t, read) if isinstance(t, Tensor) else None for t in tensors]
    if not sets or any(v is None for v in sets):
        return None
    with unset_fake_temporarily():
        found: Tensor = torch.unique(torch.cat([v for v in sets if v is not None]))
    return found


def _clamped(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], read: ValueLookup
) -> Tensor | None:
    """The values of an integer tensor clamped: its set clamped, else every integer between the limits."""
    limits = clamp_limits(func, args, kwargs, read)
    if limits is None:
        return None
    low, high = limits
    possible = values_in(args[0], read)
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


def _moved(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], read: ValueLookup
) -> Tensor | None:
    """The values of ``t + s``, ``t - s``, ``t * s`` (``s`` a number or a known one-element tensor)."""
    t, other = args[0], args[1] if len(args) > 1 else None
    possible = values_in(t, read) if isinstance(t, Tensor) else None
    number = known_number(other, read) if other is not None else None
    if possible is None or number is None:
        return None
    extra = {"alpha": kwargs["alpha"]} if "alpha" in kwargs else {}
    with unset_fake_temporarily():
        moved: Tensor = torch.unique(_ARITHMETIC[func.overloadpacket](possible, number, **extra))
    return moved


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


def _first_set(args: Sequence[Any], read: ValueLookup) -> Tensor | None:
    first = args[0] if args else None
    return values_in(first, read) if isinstance(first, Tensor) else None


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
    if size > _SET_LIMIT:
        return None
    with unset_fake_temporarily():
        return torch.arange(size)


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
