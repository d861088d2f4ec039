"""The per-op rules of value sets: which values an op's integer outputs can hold, given its operands'
(``engine.values.value_sets`` asks and files the answers), and which interval a floating-point output's values
lie in.

Picks, views and copies carry their input's set (``levels[top_k_indices]`` in torchvision's region
proposals draws every value from ``levels``), ``unique`` its input's, ``cat``/``stack`` the union,
``sort``/``topk``/``max``... their input's to their values and the positions along the dimension to
their indices, a boolean ``sum`` ``0..`` its bound (``engine.values.nonzero_bounds``), ``clamp`` its limits;
elementwise ops, fills, ``where``, ``isin`` and ``any``/``all`` are ``engine.values.elementwise_sets``'. Code
also *computes* small integers from floats: torchvision's FPN ``LevelMapper`` clamps ``floor(4 +
log2(sqrt(area) / 224))`` to the pyramid's levels and casts it. So ``clamp`` gives a floating-point
tensor the interval of its limits, ``floor``/``ceil``/``trunc``/``round`` and copies carry it, and a
cast to integers makes it a set.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> aten = torch.ops.aten
    >>> with FakeTensorMode():
    ...     area = torch.empty(8)
    ...     clamped = area.clamp(2, 5)
    ...     levels = clamped.long()
    >>> for t, interval in carried_ranges(aten.clamp.default, (area, 2, 5), {}, clamped, {}.get):
    ...     file_range(t, interval)
    >>> cast = aten._to_copy.default
    >>> [v.tolist() for _, v in carried_sets(cast, (clamped,), {}, levels, {}.get, {}.get)]
    [[2, 3, 4, 5]]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from lightning_memest.engine.values.elementwise_sets import elementwise_set
from lightning_memest.engine.values.nonzero_bounds import clamp_limits, nonzero_bound
from lightning_memest.engine.values.tensor_facts import fact_of, file_fact

if TYPE_CHECKING:
    from lightning_memest.engine.values.value_sets import SetLookup, ValueLookup

__all__ = ["SET_LIMIT", "carried_ranges", "carried_sets", "file_range"]

aten = torch.ops.aten

#: The largest set kept: beyond, a tensor's size bounds ``unique`` as well.
SET_LIMIT = 1 << 16

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
_CLAMPS = {aten.clamp, aten.clamp_, aten.clamp_min, aten.clamp_min_, aten.clamp_max, aten.clamp_max_}

_ROUNDINGS: dict[OpOverloadPacket, Callable[[float], float]] = {
    aten.floor: math.floor,
    aten.ceil: math.ceil,
    aten.trunc: math.trunc,
    aten.round: round,
}

#: The fact of a floating-point tensor holding the interval ``(low, high)`` its values lie in (ends may
#: be infinite): ``clamp`` makes it, roundings and copies carry it, a cast to integers makes it a set.
_RANGE_ATTR = "_memest_range"


def carried_sets(
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
    else:  # fills, any/all, where, isin, elementwise ops
        found.append((out, elementwise_set(func, args, kwargs, out, read, sets_of)))
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
    if most >= SET_LIMIT:
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
        if high - low < SET_LIMIT:
            return torch.arange(math.ceil(low), math.floor(high) + 1)
    return None


def carried_ranges(
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


def file_range(t: Tensor, interval: tuple[float, float]) -> None:
    """File the interval floating-point tensor ``t``'s values lie in (``engine.values.tensor_facts``)."""
    file_fact(t, _RANGE_ATTR, interval)


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
    if high - low >= SET_LIMIT:
        return None
    with unset_fake_temporarily():
        return torch.arange(low, high + 1)


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
    return _range(size) if size <= SET_LIMIT else None


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
