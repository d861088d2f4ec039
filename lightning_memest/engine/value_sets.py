"""The values an integer tensor of the step can hold, where the simulation cannot know the values
themselves: a superset, carried from op to op, that bounds what data-dependent ops can output.

Values are known where they come from the batch or from constants (``engine.real_path``), but an op
that *picks* elements of a known tensor with unknown indices (``levels[top_k_indices]`` in torchvision's
region proposals) makes a tensor of unknown values -- all drawn from the known ones. ``unique`` of it
has at most as many values as that set, ``bincount`` and ``one_hot`` at most its largest + 1 bins,
where without the set they would be as long as the tensor (``engine.data_dependent``'s policies read
the sets through :func:`values_in`).

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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

__all__ = ["ValueLookup", "carry_value_sets", "int_values", "values_in"]

aten = torch.ops.aten

#: The real values behind a tensor of the step (a CPU tensor), or ``None`` when they are unknown.
ValueLookup = Callable[[Tensor], Tensor | None]


def int_values(real: Tensor) -> list[int]:
    """The values of a real tensor, as Python ints (outside the fake mode)."""
    with unset_fake_temporarily():
        return [int(v) for v in real.reshape(-1).tolist()]


#: The attribute of a fake integer tensor holding the values it can have (a sorted 1-d CPU tensor).
_VALUES_ATTR = "_memest_values_in"

#: The largest set kept: beyond, a tensor's size bounds ``unique`` as well.
_SET_LIMIT = 1 << 16

_VIEWS_AND_PICKS = {
    getattr(aten, name)
    for name in [
        *("view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "select", "slice", "narrow"),
        *("unsqueeze", "squeeze", "permute", "transpose", "t", "alias", "clone", "_to_copy", "flip"),
        *("roll", "repeat", "index", "index_select", "gather", "take", "masked_select", "unbind"),
        *("split", "split_with_sizes", "chunk", "as_strided"),
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


def values_in(t: Tensor, read: ValueLookup) -> Tensor | None:
    """The values integer tensor ``t`` can hold -- a superset, sorted, 1-d, on the CPU -- or ``None``:
    its known values', else the set :func:`carry_value_sets` gave it."""
    if t.is_floating_point() or t.is_complex():
        return None
    carried = t.__dict__.get(_VALUES_ATTR) if isinstance(t, FakeTensor) else None
    if carried is not None:
        return carried  # type: ignore[no-any-return]
    real = read(t)
    if real is None or real.numel() > _SET_LIMIT * 16:
        return None
    with unset_fake_temporarily():
        found: Tensor = torch.unique(real.cpu())
    return found if found.numel() <= _SET_LIMIT else None


def carry_value_sets(func: OpOverload, args: Sequence[Any], out: Any, read: ValueLookup) -> None:
    """After ``func`` ran: give its integer outputs of unknown value the set of values they can hold
    (the difference, in Faster R-CNN, between five ``nms`` calls per image and thousands). Picks, views
    and copies carry their input's set,
    ``cat``/``stack`` the union, ``sort``/``topk``/``max``... their input's to their values and the
    positions along the dimension to their indices; an in-place write drops the written tensor's set.
    """
    packet = func.overloadpacket
    if packet in _VIEWS_AND_PICKS:
        _give(out, _first_set(args, read), read)
    elif packet in _UNIQUES and isinstance(out, tuple) and out:
        _give(out[0], _first_set(args, read), read)
    elif packet in _VALUES_AND_POSITIONS:
        if isinstance(out, tuple) and len(out) == 2:  # values, and indices along the dimension
            _give(out[0], _first_set(args, read), read)
            _give(out[1], _positions(args, func), read)
        else:
            _give(out, _first_set(args, read), read)
    elif packet in _POSITIONS:
        _give(out, _positions(args, func), read)
    elif packet in _UNIONS:
        tensors = args[0] if args and isinstance(args[0], (list, tuple)) else ()
        sets = [values_in(t, read) if isinstance(t, Tensor) else None for t in tensors]
        if sets and all(v is not None for v in sets):
            with unset_fake_temporarily():
                _give(out, torch.unique(torch.cat([v for v in sets if v is not None])), read)
    else:
        written = _written_cache.get(func)
        if written is None:
            written = _written_cache[func] = tuple(
                i for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write
            )
        for i in written:
            if i < len(args) and isinstance(args[i], FakeTensor):
                args[i].__dict__.pop(_VALUES_ATTR, None)


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
            t.__dict__[_VALUES_ATTR] = values if values.dtype == t.dtype else _converted(values, t.dtype)


def _converted(values: Tensor, dtype: torch.dtype) -> Tensor:
    with unset_fake_temporarily():
        converted: Tensor = torch.unique(values.to(dtype))
    return converted
