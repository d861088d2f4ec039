"""What a template block's forward did with itself: read an attribute that differs from block to block,
or write one -- either of which keeps its group from being replayed.

A stand-in does not run its block's forward; it repeats the events of a template block. That is only
right where the stand-in's block would have run the same events, and what steers a forward besides
its inputs is its own state: its structure and its plain attributes (``engine.replay.blocks`` compares
those, and blocks of another kind never stand in for one another) and the attributes no two blocks
share -- a layer's index, a stochastic-depth rate. Those cannot be compared (every block differs);
what can be known is whether the forward *uses* them. While a template block (blocks 1, 2 and
``N-2``) runs, each such number on it and its submodules is swapped for a :func:`watched` copy that
notes every use Python makes of it (a comparison, ``bool``, an index, arithmetic, formatting, a hash);
a forward that used one might take another branch in another block (``if self.idx == 4``), and the
group is simulated in full. A number handed to an op without Python looking at it (``torch.zeros(n)``)
reaches the op's call, which the signatures of blocks 1 and 2 compare.

A forward that writes its own attributes (a tensor cached on the block, a counter, a flag) leaves state
that a stand-in would not leave: :class:`Attributes` snapshots what the block's modules hold before
its forward (each attribute's object, their parameters' and buffers'), and any change fails the
template.

Example:
    >>> import torch
    >>> block = torch.nn.Linear(2, 2)
    >>> block.idx = 4
    >>> with watching(block, [("", "idx")]) as used:
    ...     _ = block.idx == 4  # a branch on the layer's index
    >>> used
    ['idx']
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["Attributes", "watched", "watching"]

# Every special method Python calls on a number it uses: comparisons and truth, conversions and
# formatting, hashing (a dict key), arithmetic (whose result may decide a branch later).
_USES = (
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__bool__",
    "__hash__",
    "__index__",
    "__int__",
    "__float__",
    "__complex__",
    "__str__",
    "__repr__",
    "__format__",
    "__round__",
    "__trunc__",
    "__floor__",
    "__ceil__",
    "__neg__",
    "__pos__",
    "__abs__",
    "__invert__",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__divmod__",
    "__rdivmod__",
    "__pow__",
    "__rpow__",
    "__lshift__",
    "__rlshift__",
    "__rshift__",
    "__rrshift__",
    "__and__",
    "__rand__",
    "__or__",
    "__ror__",
    "__xor__",
    "__rxor__",
)


def _watching_type(base: type) -> type:
    # The number itself, through no method of ours (int(self) would call our __int__).
    plain: Any = int.__int__ if base is int else float.__float__

    def method(name: str) -> Any:
        def use(self: Any, *args: Any) -> Any:
            self._memest_used.append(self._memest_name)
            return getattr(base, name)(plain(self), *args)  # on the plain number: no more notes

        use.__name__ = name
        return use

    namespace = {name: method(name) for name in _USES if hasattr(base, name)}
    namespace["__reduce__"] = lambda self: (base, (plain(self),))  # a copy made of it is a plain number
    return type(f"Watched{base.__name__.capitalize()}", (base,), namespace)


_TYPES = {int: _watching_type(int), float: _watching_type(float)}


def watched(value: int | float, name: str, used: list[str]) -> int | float:
    """``value`` as a number that appends ``name`` to ``used`` at each use Python makes of it."""
    made = _TYPES[type(value)](value)
    made._memest_name, made._memest_used = name, used
    return made  # type: ignore[no-any-return]


@contextmanager
def watching(block: nn.Module, keys: Sequence[tuple[str, str]]) -> Iterator[list[str]]:
    """Inside, the numbers ``keys`` names -- ``(module path within block, attribute)`` -- are
    :func:`watched`; the list yielded names each use, in order. Put back on every way out (only where
    the attribute still holds the watched number: the forward may have replaced it)."""
    used: list[str] = []
    swapped: list[tuple[nn.Module, str, Any, Any]] = []
    try:
        for path, name in keys:
            module = block.get_submodule(path) if path else block
            value = vars(module).get(name)
            if isinstance(value, (int, float)) and type(value) in _TYPES:
                proxy = watched(value, f"{path}.{name}" if path else name, used)
                object.__setattr__(module, name, proxy)
                swapped.append((module, name, value, proxy))
        yield used
    finally:
        for module, name, value, proxy in swapped:
            if vars(module).get(name) is proxy:
                object.__setattr__(module, name, value)


class Attributes:
    """What the modules of a block hold, as objects: compared before and after its forward."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.before = self._held()

    def _held(self) -> dict[tuple[str, str], int]:
        held: dict[tuple[str, str], int] = {}
        for path, module in self.block.named_modules():
            for name, value in vars(module).items():
                held[(path, name)] = id(value)
            for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
                for name, t in tensors.items():
                    held[(path, f"{kind}:{name}")] = id(t)
        return held

    def written(self) -> str | None:
        """The first attribute the forward set, added or removed (``None``: none)."""
        after = self._held()
        for key in (*self.before, *after):
            if self.before.get(key) != after.get(key):
                path, name = key
                return f"{path}.{name}" if path else name
        return None
