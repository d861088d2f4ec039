"""One registry type for everything keyed by aten op: kernel memory models, FLOP formulas, "other" FLOPs,
the engine's data-dependent policies. A leaf module (it imports nothing of the package), so that every
layer can use it.

Shaped like ``torch/utils/flop_counter.py``'s ``register_flop_formula``: a decorator registers a small
pure function for ops, refusing what is not an op and refusing a second registration of the same key.
An entry is keyed by an overload (``aten.mm.default``: that overload only) or by a packet (``aten.mm``:
every overload of it); a lookup tries the overload first, then its packet.

Example:
    >>> import torch
    >>> aten = torch.ops.aten
    >>> doubling = OpRegistry("doubling")
    >>> @doubling.register(aten.mm)
    ... def _mm() -> int:
    ...     return 2
    >>> doubling.lookup(aten.mm.default) is _mm, doubling.lookup(aten.add.Tensor)
    (True, None)
    >>> doubling.register(aten.mm)(_mm)
    Traceback (most recent call last):
    ...
    ValueError: doubling: a second registration for aten.mm
    >>> doubling.register("aten::mm")(_mm)
    Traceback (most recent call last):
    ...
    TypeError: doubling: register an op (torch.ops.aten.mm or torch.ops.aten.mm.default); got 'aten::mm' of type str
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from torch._ops import OpOverload, OpOverloadPacket

__all__ = ["Op", "OpRegistry"]

#: A registry key: an overload, or a packet standing for all its overloads.
Op = OpOverload | OpOverloadPacket
_T = TypeVar("_T")
_F = TypeVar("_F")


class OpRegistry(Generic[_T]):
    """Entries of type ``_T`` keyed by aten op; ``name`` says which registry in errors."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._entries: dict[Op, _T] = {}

    def register(self, *ops: Op) -> Callable[[_F], _F]:
        """A decorator registering the function it decorates for each of ``ops``."""
        for op in ops:
            if not isinstance(op, (OpOverload, OpOverloadPacket)):
                raise TypeError(
                    f"{self.name}: register an op (torch.ops.aten.mm or torch.ops.aten.mm.default); got "
                    f"{op!r} of type {type(op).__name__}"
                )

        def register(entry: _F) -> _F:
            for op in ops:
                self.add(op, entry)  # type: ignore[arg-type]
            return entry

        return register

    def add(self, op: Op, entry: _T) -> None:
        """Register ``entry`` for ``op`` (what :meth:`register` does for each op)."""
        if op in self._entries:
            raise ValueError(f"{self.name}: a second registration for {op}")
        self._entries[op] = entry

    def lookup(self, op: OpOverload) -> _T | None:
        """The entry of ``op`` itself, else of its packet, else ``None``."""
        entry = self._entries.get(op)
        if entry is None:
            entry = self._entries.get(op.overloadpacket)
        return entry

    def __contains__(self, op: object) -> bool:
        return op in self._entries

    def __iter__(self) -> Iterator[Op]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
