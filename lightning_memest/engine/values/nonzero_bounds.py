"""How many elements of an integer or boolean fake tensor can be nonzero: an upper bound, carried op to
op beside the value sets (``engine.values.value_sets``), so that ``nonzero``, ``torch.where(cond)``,
``masked_select`` and ``x[mask]`` output as many elements as the code path allows -- not, as their
inputs' sizes alone would say, every element.

Why: code that *samples* builds masks of a bounded number of set elements from values it cannot know.
torchvision's ``BalancedPositiveNegativeSampler`` (Faster R-CNN's RPN and RoI heads) sets
``batch_size_per_image`` positions of two zero masks, then takes ``torch.where(pos | neg)``: without a
bound the simulation pools every proposal (about 10x the real 128 per image), and everything after it is
as much too large. Each tensor's bound ``B`` (of ``N`` elements) follows from the op that made it (a
tensor broadcast to an output of ``n`` elements counts ``B * n / N``; every bound is capped at the
output's size):

* **sources**: a known value (the batch, constants: ``engine.real_path``) its exact count, recorded when
  the op makes it, so that an unknown write later starts from it; ``zeros``/``zeros_like``/
  ``new_zeros``/``zero_`` 0; ``full``/``fill_``/``new_full``/``full_like`` 0 or ``N`` by the fill value;
  a value set of only 0 (``values_in``) 0; anything else ``N``;
* **writes of ``k`` elements** add at most ``k`` to the written tensor's bound (fewer when the written
  values are known to be mostly zero; none when they are all zero): ``index_put_``/``x[idx] = v`` (``k``:
  the indexed elements; for a mask index, its own bound), ``index_fill_``, ``index_copy_``,
  ``index_add_``, ``masked_fill_`` (``k``: the mask's bound), ``masked_scatter_``, ``scatter*``;
  ``copy_`` takes its source's;
* **views, copies, moves** (``view``, ``reshape``, ``permute``, ``clone``, ``_to_copy``, ``flip``, ``roll``,
  ``abs``, ``neg``, ``sign``, ``relu``, ``triu``, ``clamp`` keeping 0, ...) keep ``B``; **picks without
  repetition** (``select``, ``slice``, ``split``, ``unbind``, ``diagonal``, boolean indexing,
  ``masked_select``) keep ``B`` per output; ``expand``/``repeat``/``repeat_interleave`` multiply it by the
  repetition; picks that may repeat (integer indexing, ``gather``, ``index_select``) give 0 of a tensor
  with 0 and otherwise nothing;
* **unions** (``|``, ``logical_or``, ``^``, ``+``, ``-``, ``maximum``, ``minimum``, ``!=``/``>``/``<``
  of two tensors): ``a + b``; **intersections** (``&``, ``logical_and``, ``*``): ``min(a, b)``;
  ``where(c, a, b)``: ``min(c, a) + b``; ``//``, ``%``, shifts: the first operand's;
  ``cat``/``stack``: the sum;
* **comparisons with a scalar** (``==``, ``!=``, ``>``, ``>=``, ``<``, ``<=``): 0 when no value of the
  tensor's value set passes (how many can *equal* ``v``: none if ``v`` is not a possible value, at most
  ``B`` if ``v != 0``); ``B`` when 0 itself fails the comparison (``x >= 1``, ``x == 2``, ``x != 0``);
  else ``N``;
* **reductions** whose result is 0 where all reduced elements are 0 (``sum``, ``any``, ``all``,
  ``prod``, ``amax``, ``max``, ``count_nonzero``, ``sort``/``topk`` values): ``B`` (and the values of a
  boolean ``sum`` lie in ``0..B``: ``engine.values.value_sets``).

Only integer and boolean tensors carry bounds: floating point ``0 * inf`` is not 0. A bound is filed
with its storage's write generation (``engine.values.tensor_facts``): a write through any alias that no rule
accounts for voids it.

**A router's selections share its picks** (``engine.values.router_shares``): ``ids == e`` for each value
``e`` of positions ``ids`` that ``topk``/``argmax``/``sort`` picked take an even share of the picks,
adding up to every pick; selections of other unknown values keep their own bounds.

Example:
    >>> import torch
    >>> from lightning_memest.engine.tracker import Tracker, real_value
    >>> from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode
    >>> with TrackingFakeTensorMode(Tracker()):  # as the simulation runs a sampler
    ...     pos = torch.zeros(1000, dtype=torch.uint8)
    ...     neg = torch.zeros(1000, dtype=torch.uint8)
    ...     pos[torch.randperm(1000)[:32]] = 1
    ...     neg[torch.randperm(1000)[:96]] = 1
    ...     sampled = torch.where(pos | neg)[0]
    >>> nonzero_bound(pos, real_value), sampled.shape
    (32, torch.Size([128]))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from lightning_memest.engine.values.router_shares import file_share, is_picked, mark_picks, shared_selection
from lightning_memest.engine.values.tensor_facts import fact_of, file_fact

if TYPE_CHECKING:
    from lightning_memest.engine.values.value_sets import ValueLookup

__all__ = [
    "ValuesOf",
    "argument",
    "carried_bounds",
    "clamp_limits",
    "file_bound",
    "known_number",
    "nonzero_bound",
    "set_holds",
    "set_only_zero",
    "spread_bound",
]

aten = torch.ops.aten

#: The values a tensor can hold (``value_sets.values_in`` with the simulation's lookup), or ``None``.
ValuesOf = Callable[[Tensor], Tensor | None]

#: The fact name of a tensor's bound (see ``engine.values.tensor_facts``).
_BOUND = "_memest_nonzero"


def nonzero_bound(t: Tensor, read: ValueLookup, values: ValuesOf | None = None) -> int:
    """At most how many elements of ``t`` are nonzero: its carried bound, else its known value's count,
    else 0 for a value set of only 0, else its element count."""
    n = t.numel()
    if t.is_floating_point() or t.is_complex():
        return n
    carried = fact_of(t, _BOUND)
    if carried is not None:
        return min(int(carried), n)
    real = read(t)
    if real is not None:
        return _count(real)
    possible = values(t) if values is not None else None
    if possible is not None and set_only_zero(possible):
        return 0
    return n


def set_holds(values: Tensor, v: Any) -> bool:
    """Whether the sorted set ``values`` (a value set, ``engine.values.value_sets``) holds the number ``v``: a
    binary search, not a pass over the set (sets of positions run to a vocabulary's size, and a
    reduction over them wakes the CPU's worker threads at every op)."""
    n = values.numel()
    if n == 0:
        return False
    with unset_fake_temporarily():
        if values.dtype == torch.bool:
            return (not bool(values[0])) if v == 0 else (bool(values[-1]) and v == 1)
        if values.is_floating_point() or values.is_complex():
            return bool((values == v).any())
        if isinstance(v, float) and not v.is_integer():
            return False
        low, high = int(values[0]), int(values[-1])
        if not low <= v <= high:
            return False
        at = int(torch.searchsorted(values, torch.tensor([int(v)], dtype=values.dtype)))
        return at < n and int(values[at]) == v


def set_only_zero(values: Tensor) -> bool:
    """Whether every value of the sorted set ``values`` is 0 (also when it has none)."""
    return values.numel() == 0 or (values.numel() == 1 and set_holds(values, 0))


def spread_bound(t: Any, n: int, read: ValueLookup, values: ValuesOf | None = None) -> int:
    """The bound of ``t`` broadcast to ``n`` elements (``t`` may be a Python number: 0 or all)."""
    if not isinstance(t, Tensor):
        return 0 if not t else n
    size = t.numel()
    if size == 0 or n == 0:
        return 0
    return min(n, nonzero_bound(t, read, values) * -(-n // size))


def file_bound(t: Tensor, bound: int) -> None:
    """File ``bound`` as ``t``'s (a fake integer or boolean tensor's; others are ignored)."""
    if isinstance(t, FakeTensor) and not (t.is_floating_point() or t.is_complex()):
        file_fact(t, _BOUND, min(bound, t.numel()))


def _count(real: Tensor) -> int:
    with unset_fake_temporarily():
        return int(torch.count_nonzero(real))


def carried_bounds(
    func: OpOverload,
    args: Sequence[Any],
    out: Any,
    read: ValueLookup,
    values: ValuesOf,
    kwargs: Mapping[str, Any] | None = None,
) -> list[tuple[Tensor, int]]:
    """The bounds ``func``'s integer and boolean outputs get, from its arguments' (see the module
    docstring); computed before anything is filed, so an in-place op reads its input's old bound."""
    mark_picks(func, args, out)
    outs = _outputs(out)
    if not outs:
        return []
    found: list[tuple[Tensor, int]] = []
    unknown: list[Tensor] = []
    for o in outs:
        real = read(o)
        if real is not None:
            found.append((o, _count(real)))
        else:
            unknown.append(o)
    rule = _RULES.get(func.overloadpacket)
    if rule is None or not unknown:
        return found
    fn, first_only = rule
    call = _Op(func, args, kwargs or {}, read, values)
    for o in unknown[:1] if first_only else unknown:
        try:
            bound = fn(call, o.numel())
        except Exception:  # a rule that cannot read its arguments gives no bound: the size stands
            bound = None
        if bound is not None:
            found.append((o, min(bound, o.numel())))
            file_share(o, bound)
    return found


def _outputs(out: Any) -> list[Tensor]:
    if isinstance(out, FakeTensor):
        return [] if out.is_floating_point() or out.is_complex() else [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, FakeTensor) and not (o.is_floating_point() or o.is_complex())]
    return []


@dataclass(frozen=True)
class _Op:
    """One op's call, for its rule."""

    func: OpOverload
    args: Sequence[Any]
    kwargs: Mapping[str, Any]
    read: ValueLookup
    values: ValuesOf

    def bound(self, t: Any) -> int:
        """A tensor argument's bound; a number's: 0 if it is 0, else 1 (per element)."""
        if isinstance(t, Tensor):
            return nonzero_bound(t, self.read, self.values)
        return 0 if not t else 1

    def spread(self, t: Any, n: int) -> int:
        return spread_bound(t, n, self.read, self.values)

    def arg(self, name: str) -> Any:
        return argument(self.func, self.args, self.kwargs, name)

    def scalar(self, t: Any) -> Any:
        return known_number(t, self.read)


def argument(func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> Any:
    """The argument of ``func`` called ``name`` in its schema (its default when not given)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            if name in kwargs:
                return kwargs[name]
            return a.default_value if a.has_default_value() else None
    raise KeyError(name)


def known_number(t: Any, read: ValueLookup) -> Any:
    """A number argument, or a one-element tensor's known value; ``None`` when unknown."""
    if not isinstance(t, Tensor):
        return t
    if t.numel() != 1:
        return None
    real = read(t)
    if real is None:
        return None
    with unset_fake_temporarily():
        return real.reshape(()).item()


def clamp_limits(
    func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], read: ValueLookup
) -> tuple[float, float] | None:
    """The ``(min, max)`` of a ``clamp``/``clamp_min``/``clamp_max`` call (infinite where not given), or
    ``None`` when a limit is a tensor of unknown value."""
    name = func.overloadpacket.__name__.rstrip("_")
    if name == "clamp":
        low, high = argument(func, args, kwargs, "min"), argument(func, args, kwargs, "max")
    else:
        low, high = (args[1], None) if name == "clamp_min" else (None, args[1])
    limits = []
    for limit, unbounded in ((low, -math.inf), (high, math.inf)):
        value = unbounded if limit is None else known_number(limit, read)
        if value is None:
            return None
        limits.append(value)
    return limits[0], limits[1]


#: A rule gives an output of ``n`` elements its bound (``None``: no bound).
_Rule = Callable[[_Op, int], int | None]
_RULES: dict[OpOverloadPacket, tuple[_Rule, bool]] = {}


def _rule(*names: str, first_only: bool = False) -> Callable[[_Rule], _Rule]:
    """Register a rule for the ops ``names`` and their in-place forms; ``first_only``: it bounds only the
    first output (the values of ``max.dim``, not the indices)."""

    def register(fn: _Rule) -> _Rule:
        for name in names:
            for variant in (name, name + "_"):
                packet = getattr(aten, variant, None)
                if isinstance(packet, OpOverloadPacket):
                    _RULES[packet] = (fn, first_only)
        return fn

    return register


# --- sources ----------------------------------------------------------------------------------------------
@_rule("zeros", "zeros_like", "new_zeros", "zero")
def _zeros(op: _Op, n: int) -> int:
    return 0


@_rule("full", "full_like", "new_full", "fill")
def _full(op: _Op, n: int) -> int | None:
    name = "value" if op.func.overloadpacket in (aten.fill, aten.fill_) else "fill_value"
    value = op.scalar(op.arg(name))
    return 0 if value is not None and not value else None


# --- writes -----------------------------------------------------------------------------------------------
@_rule("index_put")
def _index_put(op: _Op, n: int) -> int | None:
    t, indices, written_values = op.args[0], op.args[1], op.args[2]
    written = _indexed_count(op, t, list(indices))
    if written is None:
        return None
    return op.bound(t) + min(written, op.spread(written_values, written))


def _indexed_count(op: _Op, t: Tensor, indices: list[Tensor | None]) -> int | None:
    """How many elements of ``t`` ``t[indices]`` names at most (``None``: not worked out)."""
    dim, factor = 0, 1
    int_shapes: list[tuple[int, ...]] = []
    masks: list[Tensor] = []
    for index in indices:
        if index is None:
            factor *= t.shape[dim]
            dim += 1
        elif index.dtype in (torch.bool, torch.uint8):
            masks.append(index)
            dim += index.dim()
        else:
            int_shapes.append(tuple(index.shape))
            dim += 1
    factor *= math.prod(t.shape[dim:])
    if masks and int_shapes:
        return None
    if masks:  # each mask indexes like the columns of its nonzero(): as many as it has set
        return factor * min(op.bound(m) for m in masks)
    return factor * math.prod(torch.broadcast_shapes(*int_shapes))  # type: ignore[no-untyped-call]


@_rule("index_fill")
def _index_fill(op: _Op, n: int) -> int:
    t, dim, index, value = op.args[:4]
    written = int(index.numel()) * (t.numel() // max(t.shape[dim], 1) if t.dim() else 1)
    return op.bound(t) + min(written, op.spread(value, written))


@_rule("index_copy", "index_add")
def _index_copy(op: _Op, n: int) -> int:
    return op.bound(op.args[0]) + op.bound(op.arg("source"))


@_rule("masked_fill")
def _masked_fill(op: _Op, n: int) -> int:
    t, mask, value = op.args[:3]
    return op.spread(t, n) + min(op.spread(mask, n), op.spread(value, n))


@_rule("masked_scatter")
def _masked_scatter(op: _Op, n: int) -> int:
    t, mask, source = op.args[:3]
    return op.spread(t, n) + min(op.spread(mask, n), op.bound(source))


@_rule("scatter", "scatter_add", "scatter_reduce")
def _scatter(op: _Op, n: int) -> int:
    # each element of ``index`` writes one position, from ``src`` (or the value) at the same place
    t, index, source = op.args[0], op.args[2], op.args[3]
    written = int(index.numel())
    nonzero = op.bound(source) if isinstance(source, Tensor) else op.spread(source, written)
    return op.bound(t) + min(written, nonzero)


@_rule("copy")
def _copy(op: _Op, n: int) -> int:
    return op.spread(op.args[1], n)


# --- views, copies, picks -----------------------------------------------------------------------------------
@_rule(
    *("view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "permute", "transpose"),
    *("t", "alias", "clone", "_to_copy", "flip", "roll", "abs", "neg", "sign", "sgn", "relu", "triu"),
    *("tril", "select", "slice", "narrow", "diagonal", "unbind", "split", "split_with_sizes", "movedim"),
    *("unsafe_split", "unsafe_split_with_sizes", "tensor_split", "lift_fresh_copy", "lift_fresh"),
)
def _same(op: _Op, n: int) -> int:
    return op.bound(op.args[0])


@_rule("expand", "repeat", "repeat_interleave")
def _repeated(op: _Op, n: int) -> int | None:
    t = op.args[0]
    if op.func.overloadpacket is aten.repeat_interleave and op.func._overloadname != "self_int":
        return 0 if op.bound(t) == 0 else None
    return op.spread(t, n)


@_rule("index", "index_select", "gather", "take")  # (not as_strided: it may reach beyond its input)
def _picked(op: _Op, n: int) -> int | None:
    t = op.args[0]
    bound = op.bound(t)
    if bound == 0:
        return 0
    if op.func.overloadpacket is aten.index and all(
        i is None or i.dtype in (torch.bool, torch.uint8) for i in op.args[1]
    ):
        return bound  # a mask picks distinct elements
    return None


@_rule("masked_select")
def _masked_select(op: _Op, n: int) -> int:
    t, mask = op.args[:2]
    return op.spread(t, math.prod(torch.broadcast_shapes(t.shape, mask.shape)))  # type: ignore[no-untyped-call]


@_rule("clamp", "clamp_min", "clamp_max")
def _clamp(op: _Op, n: int) -> int | None:
    limits = clamp_limits(op.func, op.args, op.kwargs, op.read)
    if limits is not None and limits[0] <= 0 <= limits[1]:
        return op.bound(op.args[0])  # 0 stays 0
    return None


# --- elementwise ----------------------------------------------------------------------------------------
@_rule(
    *("bitwise_or", "__or__", "__ior__", "logical_or", "bitwise_xor", "__xor__", "__ixor__", "logical_xor"),
    *("add", "sub", "maximum", "minimum"),
)
def _union(op: _Op, n: int) -> int:
    return op.spread(op.args[0], n) + op.spread(op.args[1], n)


@_rule("bitwise_and", "__and__", "__iand__", "logical_and", "mul")
def _intersection(op: _Op, n: int) -> int:
    return min(op.spread(op.args[0], n), op.spread(op.args[1], n))


@_rule("where")
def _where(op: _Op, n: int) -> int | None:
    if len(op.args) < 3:
        return None
    condition, a, b = op.args[:3]
    return min(op.spread(condition, n), op.spread(a, n)) + op.spread(b, n)


@_rule("floor_divide", "div", "remainder", "fmod", "bitwise_left_shift", "bitwise_right_shift")
def _first_operand(op: _Op, n: int) -> int:
    return op.spread(op.args[0], n)  # 0 // b, 0 % b, 0 << b are 0


@_rule("cat", "stack")
def _cat(op: _Op, n: int) -> int:
    return sum(op.bound(t) for t in op.args[0])


_COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": torch.eq,
    "ne": torch.ne,
    "gt": torch.gt,
    "ge": torch.ge,
    "lt": torch.lt,
    "le": torch.le,
}


@_rule(*_COMPARISONS)
def _compare(op: _Op, n: int) -> int | None:
    a, b = op.args[:2]
    name = op.func.overloadpacket.__name__.rstrip("_")
    compare = _COMPARISONS[name]
    if not isinstance(a, Tensor):
        return None
    other = op.scalar(b) if not isinstance(b, Tensor) or b.dim() == 0 else None
    if other is None:
        if isinstance(b, Tensor) and name in ("ne", "gt", "lt"):
            return op.spread(a, n) + op.spread(b, n)  # a != b, a > b, a < b: one of them is nonzero
        return None
    possible = op.values(a)
    if possible is not None and not _some_pass(name, possible, other):
        return 0  # no value it can hold passes
    with unset_fake_temporarily():
        zero_passes = bool(compare(torch.zeros((), dtype=a.dtype), other))
    cap = n if zero_passes else op.spread(a, n)
    picked = is_picked(a)
    if name == "eq" and picked and possible is not None and possible.numel() > 1 and n == a.numel():
        return shared_selection(a, other, possible.numel(), cap)
    return None if zero_passes else cap


def _some_pass(name: str, values: Tensor, other: Any) -> bool:
    """Whether a value of the sorted set ``values`` passes the comparison ``name`` with the number
    ``other``: from its ends and a search (not a pass over the set)."""
    if values.numel() == 0:
        return False
    if name == "eq":
        return set_holds(values, other)
    if name == "ne":
        return not (values.numel() == 1 and set_holds(values, other))
    with unset_fake_temporarily():
        low, high = values[0].item(), values[-1].item()
    return bool(_COMPARISONS[name](torch.tensor(high if name in ("gt", "ge") else low), other))


# --- reductions --------------------------------------------------------------------------------------------
@_rule(
    *("sum", "nansum", "any", "all", "prod", "amax", "amin", "max", "min", "count_nonzero"),
    *("sort", "topk", "kthvalue", "mode", "msort"),
    first_only=True,
)
def _reduced(op: _Op, n: int) -> int:
    if op.func._overloadname == "other":  # max(a, b), min(a, b): elementwise
        return op.spread(op.args[0], n) + op.spread(op.args[1], n)
    return op.bound(op.args[0])
