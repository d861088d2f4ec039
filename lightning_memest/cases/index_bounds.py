"""Index ops checked against the values their indices can hold, where the values themselves are not at
hand: an input the real step would reject (token ids beyond the vocabulary, a sequence longer than a
position table) is rejected before any run, with the real kernel's reason.

Fake tensors have no values, so an out-of-range index passes a fake forward and only the real step
fails. But whoever makes an input knows the range of values it made (``torch.randint(0, V, ...)``
holds ``0 .. V-1``). :class:`IndexBounds` carries such ranges from op to op as intervals and checks
them where an op indexes a tensor with them, the way the real kernel checks each value:

* an interval starts at a tensor given with its range, at ``torch.arange`` (positions), and at a real
  integer tensor (a model's buffer of positions; its values are read);
* it goes through ops whose output values are among their input's -- views, copies, selections,
  concatenation -- and through adding, subtracting or multiplying by a constant, where it moves
  exactly. Any other op (arithmetic between two tensors, comparisons, ``where``, ``clamp``, ``%``)
  ends it; so does an in-place write into the tensor's storage. An interval therefore always holds
  every value the tensor can have, and a rejection is never a guess: some value of the range is
  out of bounds, as the real kernel would find;
* checked: ``embedding`` and ``embedding_bag`` (rows of the table), ``index_select``, ``gather`` and
  advanced indexing (the indexed dimension's size).

This is general over models rather than a check of ``nn.Embedding`` sizes against a vocabulary: a
position table indexed by ``arange(seq)``, a buffer of position ids sliced to the sequence, a lookup
by ``gather`` -- any index op fed from the input's values or from positions is checked at the op,
and the message names the tensor indexed.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> table = torch.nn.Embedding(50, 4)
    >>> with FakeTensorMode(allow_non_fake_inputs=True):
    ...     ids = torch.empty(2, 8, dtype=torch.long)  # fake: no values
    ...     with IndexBounds({ids: (0, 499, "the token ids")}, names={"embed.weight": table.weight}):
    ...         table(ids)
    Traceback (most recent call last):
    ...
    lightning_memest.cases.index_bounds.OutOfBoundsError: the token ids (0 .. 499) index embed.weight (aten.embedding), which has 50 rows: the real step fails with IndexError: index out of range in self
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["IndexBounds", "OutOfBoundsError"]

aten = torch.ops.aten

#: Real integer tensors up to this many elements have their range read from their values.
VALUE_READ_LIMIT = 1 << 20

#: Ops whose output values are all among their first tensor argument's.
_SELECTIONS: frozenset[OpOverloadPacket] = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten.reshape,
        aten._reshape_alias,
        aten.expand,
        aten.unsqueeze,
        aten.squeeze,
        aten.permute,
        aten.transpose,
        aten.t,
        aten.slice,
        aten.select,
        aten.narrow,
        aten.alias,
        aten.detach,
        aten.clone,
        aten.contiguous,
        aten._to_copy,
        aten.lift_fresh,
        aten.lift_fresh_copy,
        aten.flip,
        aten.roll,
        aten.repeat,
        aten.flatten,
        aten.movedim,
        aten.unbind,
        aten.split,
        aten.split_with_sizes,
        aten.chunk,
        aten.unfold,
        aten.diagonal,
        aten.index,
        aten.index_select,
        aten.gather,
        aten.masked_select,
    }
)
_UNIONS: frozenset[OpOverloadPacket] = frozenset({aten.cat, aten.stack})


class OutOfBoundsError(IndexError):
    """An index op would get a value out of bounds in the real step."""


@dataclass(frozen=True)
class _Range:
    low: int
    high: int
    source: str
    """What the values came from, for the message: ``"the token ids"``, ``"torch.arange"``."""
    storage: int
    """The storage holding them: an in-place write to it ends the range."""

    def moved(self, low: int, high: int, storage: int) -> _Range:
        return _Range(min(low, high), max(low, high), self.source, storage)


class IndexBounds(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Carries the value ranges of integer tensors through a forward and checks every index op against
    them (see the module docstring); raises :class:`OutOfBoundsError` where a value of a range is out
    of bounds.

    Args:
        ranges: tensors given with their values' range and its source: ``{t: (low, high, source)}``.
        names: the model's tensors by name (parameters and buffers), to name what is indexed.

    Entered inside a ``FakeTensorMode`` (or on real tensors), it sees each op's arguments before the
    fake mode converts them.
    """

    def __init__(
        self, ranges: Mapping[Tensor, tuple[int, int, str]], names: Mapping[str, Tensor] | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._ranges: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t, (low, high, source) in ranges.items():
            self._ranges[t] = _Range(low, high, source, _storage(t))
        self._names = {id(t): name for name, t in (names or {}).items()}

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check = _CHECKS.get(func.overloadpacket)
        if check is not None:
            check(self, func, args)
        out = func(*args, **kwargs)
        self._forget_written(func, args, kwargs)
        self._carry(func, args, out)
        return out

    # ----------------------------------------------------------------------------------------- ranges

    def range_of(self, t: object) -> _Range | None:
        """The range of an integer tensor's values, where known."""
        if not isinstance(t, Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            return None
        found: _Range | None = self._ranges.get(t)  # type: ignore[no-untyped-call]
        if found is not None or isinstance(t, FakeTensor) or t.device.type == "meta":
            return found
        if t.numel() == 0 or t.numel() > VALUE_READ_LIMIT:
            return None
        with unset_fake_temporarily():  # a real tensor (a model's buffer): its values are at hand
            low, high = int(t.min()), int(t.max())
        name = self._names.get(id(t))
        return _Range(low, high, f"the values of {name}" if name else "a tensor's values", _storage(t))

    def _carry(self, func: OpOverload, args: Sequence[Any], out: Any) -> None:
        found = self._output_range(func, args, out)
        if found is None:
            return
        for t in _tensors(out):
            if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool) and _holds(t, found):
                self._ranges[t] = found.moved(found.low, found.high, _storage(t))

    def _output_range(self, func: OpOverload, args: Sequence[Any], out: Any) -> _Range | None:
        packet = func.overloadpacket
        first = args[0] if args else None
        if packet in _SELECTIONS:
            return self.range_of(first)
        if packet in _UNIONS:
            parts = [self.range_of(t) for t in first or ()]
            known = [p for p in parts if p is not None]
            if not known or len(known) != len(parts):
                return None
            return known[0].moved(min(p.low for p in known), max(p.high for p in known), 0)
        if packet is aten.arange:
            return _arange_range(args, out)
        move = _MOVES.get(packet)
        found = self.range_of(first)
        if move is None or found is None or len(args) < 2:
            return None
        constant = _constant(args[1])
        if constant is None:
            return None
        alpha = _constant(args[2]) if len(args) > 2 else 1
        if alpha != 1:  # add/sub/rsub scaled by alpha: rare, not followed
            return None
        low, high = move(found.low, constant), move(found.high, constant)
        return found.moved(low, high, 0)

    def _forget_written(self, func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """An in-place write ends the ranges of every tensor on the written storage (views included)."""
        written = {
            _storage(t)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
            for t in _tensors(args[i] if i < len(args) else kwargs.get(a.name))
        }
        if not written:
            return
        for t, r in list(self._ranges.items()):  # type: ignore[no-untyped-call]
            if r.storage in written:
                del self._ranges[t]

    # ----------------------------------------------------------------------------------------- checks

    def check(self, func: OpOverload, table: Tensor, dim: int, index: object, negatives: bool) -> None:
        """Raise where a value of ``index``'s range is out of bounds for ``table``'s dimension ``dim``
        (``negatives``: counted from the end, as advanced indexing allows)."""
        found = self.range_of(index)
        if found is None or table.ndim <= dim:
            return
        size = int(table.shape[dim])
        low_ok = found.low >= (-size if negatives else 0)
        if low_ok and found.high < size:
            return
        bad = found.high if found.high >= size else found.low
        what = self._names.get(id(table), "a tensor")
        extent = f"{size} rows" if dim == 0 else f"size {size} in dimension {dim}"
        raise OutOfBoundsError(
            f"{found.source} ({found.low} .. {found.high}) index {what} ({_op_name(func)}), which has "
            f"{extent}: the real step fails with {_real_message(func, bad, dim, size)}"
        )


def _check_embedding(bounds: IndexBounds, func: OpOverload, args: Sequence[Any]) -> None:
    bounds.check(func, args[0], 0, args[1], negatives=False)


def _check_index_select(bounds: IndexBounds, func: OpOverload, args: Sequence[Any]) -> None:
    bounds.check(func, args[0], _dim(args[1], args[0]), args[2], negatives=False)


def _check_index(bounds: IndexBounds, func: OpOverload, args: Sequence[Any]) -> None:
    for dim, index in enumerate(args[1] or ()):
        if index is not None and index.dtype != torch.bool:
            bounds.check(func, args[0], dim, index, negatives=True)


_CHECKS: dict[OpOverloadPacket, Callable[[IndexBounds, OpOverload, Sequence[Any]], None]] = {
    aten.embedding: _check_embedding,
    aten._embedding_bag: _check_embedding,
    aten._embedding_bag_forward_only: _check_embedding,
    aten.index_select: _check_index_select,
    aten.gather: _check_index_select,
    aten.index: _check_index,
}

_MOVES: dict[OpOverloadPacket, Callable[[int, int], int]] = {
    aten.add: lambda v, c: v + c,
    aten.sub: lambda v, c: v - c,
    aten.rsub: lambda v, c: c - v,
    aten.mul: lambda v, c: v * c,
}


def _real_message(func: OpOverload, bad: int, dim: int, size: int) -> str:
    """What the real CPU kernel raises for that value (torch 2.x)."""
    packet = func.overloadpacket
    if packet in (aten.embedding, aten.index_select):
        return "IndexError: index out of range in self"
    if packet is aten.gather:
        return f"RuntimeError: index {bad} is out of bounds for dimension {dim} with size {size}"
    if packet is aten.index:
        return f"IndexError: index {bad} is out of bounds for dimension {dim} with size {size}"
    return f"RuntimeError: index {bad} is not in the valid range [0, {size})"


def _op_name(func: OpOverload) -> str:
    return f"aten.{func.overloadpacket.__name__}"


def _arange_range(args: Sequence[Any], out: Any) -> _Range | None:
    if not isinstance(out, Tensor) or out.numel() == 0 or out.is_floating_point():
        return None
    numbers = [_constant(a) for a in args]
    if any(n is None for n in numbers):
        return None
    start, step = (0, 1) if len(numbers) == 1 else (numbers[0], numbers[2] if len(numbers) > 2 else 1)
    assert start is not None and step is not None
    last = start + step * (out.numel() - 1)
    return _Range(min(start, last), max(start, last), "torch.arange", 0)


def _constant(value: object) -> int | None:
    """A Python integer, or the value of a real 0-d integer tensor (a wrapped number)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if not isinstance(value, Tensor) or isinstance(value, FakeTensor) or value.device.type == "meta":
        return None
    if value.ndim == 0 and not value.is_floating_point() and not value.is_complex():
        with unset_fake_temporarily():
            return int(value.item())
    return None


def _dim(dim: int, t: Tensor) -> int:
    return dim + t.ndim if dim < 0 else dim


def _holds(t: Tensor, found: _Range) -> bool:
    """Whether ``t``'s dtype holds the range (a narrowing cast wraps values: no range then)."""
    info = torch.iinfo(t.dtype)
    return info.min <= found.low and found.high <= info.max


def _storage(t: Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return id(t)


def _tensors(value: Any) -> Iterator[Tensor]:
    leaves, _ = tree_flatten(value)
    return (leaf for leaf in leaves if isinstance(leaf, Tensor))
