"""The values an integer tensor of the step can hold, where the simulation cannot know the values
themselves: a superset, carried from op to op, that bounds what data-dependent ops can output.

Values are known where they come from the batch or from constants (``engine.real_path``), but an op
that *picks* elements of a known tensor with unknown indices (``levels[top_k_indices]`` in torchvision's
region proposals) makes a tensor of unknown values -- all drawn from the known ones. ``unique`` of it
has at most as many values as that set, ``bincount`` and ``one_hot`` at most its largest + 1 bins,
where without the set they would be as long as the tensor (``engine.values.data_dependent``'s policies read
the sets through :func:`values_in`). Code also *computes* small integers from floats: torchvision's FPN
``LevelMapper`` clamps ``floor(4 + log2(sqrt(area) / 224))`` to the pyramid's levels, casts and
subtracts the lowest, and its RoI pooling takes ``torch.where(levels == level)`` for each level. So
``clamp`` gives a floating-point tensor the interval of its limits, ``floor``/``ceil``/``trunc``/``round``
and copies carry it, a cast to integers makes it a set, and ``+``/``-``/``*`` by a number move a set:
where every feature map has one stride (``fasterrcnn_mobilenet_v3_large_fpn``) ``levels`` is ``{0}``,
and ``levels == 1`` selects nothing (``engine.values.nonzero_bounds`` reads the sets for comparisons).
Code *decides* on small integers too: a generation loop's ``unfinished & ~(full(True) | isin(tokens,
eos))`` is all 0 at the maximum length whatever the tokens are. So elementwise ops give the op of every
combination of their operands' values (an absorbing operand -- ``x & 0``, ``x | True`` -- forces one),
fills give their value, ``any``/``all``/``max`` reduce a set, and a scalar read of a tensor whose set
gives one answer is exact (``engine.values.data_dependent``). The same rules carry what a tensor holds in the
assumed case (``engine.values.assumed_values``), where an operand has an assumption. A known tensor's set is
worked out once per write of its storage (views of one mask ask for it op after op).
Facts are filed with their storage's write generation (``engine.values.tensor_facts``): a write through any
alias voids them. This module's job is the lookups and the filing: :func:`values_in`, and
:func:`carry_value_sets` after each op; the rules of each op are ``engine.values.value_set_rules``' (and
``engine.values.elementwise_sets``' for elementwise ops, fills, ``where``, ``isin`` and ``any``/``all``).

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
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from lightning_memest.engine.values.assumed_values import (
    assumed_set,
    file_assumed,
    has_assumption,
    is_source,
    source_assumption,
    source_reason,
)
from lightning_memest.engine.values.nonzero_bounds import carried_bounds, file_bound
from lightning_memest.engine.values.tensor_facts import fact_of, file_fact, storage_written
from lightning_memest.engine.values.value_set_rules import SET_LIMIT, carried_ranges, carried_sets, file_range

__all__ = ["SetLookup", "ValueLookup", "carry_value_sets", "int_values", "remember_written_sets", "values_in"]

#: The real values behind a tensor of the step (a CPU tensor), or ``None`` when they are unknown.
ValueLookup = Callable[[Tensor], Tensor | None]

#: The values a tensor can hold (a sorted 1-d CPU tensor), or ``None``: :func:`values_in`, or what it
#: holds in the assumed case (``engine.values.assumed_values``).
SetLookup = Callable[[Tensor], Tensor | None]


def int_values(real: Tensor) -> list[int]:
    """The values of a real tensor, as Python ints (outside the fake mode)."""
    with unset_fake_temporarily():
        return [int(v) for v in real.reshape(-1).tolist()]


#: The fact (``engine.values.tensor_facts``) of a fake integer tensor holding the values it can have (a sorted
#: 1-d CPU tensor).
_VALUES_ATTR = "_memest_values_in"

#: The fact of a fake tensor with known values holding their set, once computed: a set is asked for
#: op after op of one tensor (each view of an attention mask), and ``unique`` is a sort.
_KNOWN_SET_ATTR = "_memest_known_set"
#: ... or that its values are too many to keep as a set.
_TOO_MANY = object()

#: The positions of the arguments each op writes into (:func:`_written_positions`).
_written_cache: dict[OpOverload, tuple[int, ...]] = {}


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
    if real is None or real.numel() > SET_LIMIT * 16:
        return None
    with unset_fake_temporarily():
        found: Tensor = torch.unique(real.cpu())
    kept = found if found.numel() <= SET_LIMIT else None
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
    bounds on how many elements are nonzero (``engine.values.nonzero_bounds``). Picks, views and copies carry
    their input's set, ``cat``/``stack`` the union, ``sort``/``topk``/``max``... their input's to their
    values and the positions along the dimension to their indices, a boolean ``sum`` ``0..`` its bound;
    ``clamp`` limits them (a floating-point tensor gets an interval, which roundings carry and a cast to
    integers makes a set); elementwise ops (``+``, ``&``, ``~``, ``==``...) give the op of every
    combination of their operands' values -- or the one value an absorbing operand forces (``x & 0``,
    ``x | True``, ``where`` of a known condition); ``any``/``all`` the truths of their input's values;
    ``full``/``fill_``/``zeros``... their value. The same rules carry what a tensor holds in the assumed
    case (``engine.values.assumed_values``), where an operand has an assumption. ``kwargs``: the op's keyword
    arguments (without them, rules that read one -- ``add``'s ``alpha`` -- give nothing). A write voids
    what was known of every tensor on the written storage (``engine.values.tensor_facts``); what the op's
    rules say of its outputs is filed after.
    """
    sets: list[tuple[Any, Tensor]] = []
    assumed: list[tuple[Any, Tensor]] = []
    if _has_unknown_integers(out, read):  # else no set is filed: none is worked out
        sets = carried_sets(func, args, kwargs, out, read, lambda t: values_in(t, read))
        assumed = _assumed_sets(func, args, kwargs, out, read, sets)
    ranges = carried_ranges(func, args, kwargs, out, read)
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
    why = source_reason(func, args) if assumed else ""
    for target, values in assumed:
        for t in _tensors(target):
            file_assumed(t, values if values.dtype == t.dtype else _converted(values, t.dtype), why)
    for t, interval in ranges:
        file_range(t, interval)
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
    """What ``func``'s outputs hold in the assumed case (``engine.values.assumed_values``), where it says more
    than their exact sets: the rules on the operands' assumed sets, or a comparison's assumption."""
    source = is_source(func)
    if not (source or has_assumption(args)):
        return []

    def assumed_or_exact(t: Tensor) -> Tensor | None:
        found = assumed_set(t)
        return found if found is not None else values_in(t, read)

    found = carried_sets(func, args, kwargs, out, read, assumed_or_exact)
    if source and isinstance(out, Tensor) and not any(t is out and v.numel() == 1 for t, v in found):
        made = source_assumption(func, args, kwargs or {}, read)
        found = [(out, made)] if made is not None else found
    sizes = {id(t): v.numel() for t, v in exact}
    return [(t, v) for t, v in found if v.numel() < sizes.get(id(t), math.inf)]


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, Tensor)]
    return []


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
