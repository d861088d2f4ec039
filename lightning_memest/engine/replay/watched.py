"""What a template block's forward did with itself: the decisions it took on attributes that differ from
block to block, and the attributes it wrote -- what decides whether another block may stand in for it.

A stand-in does not run its block's forward; it repeats the events of a template block. That is only
right where the stand-in's block would have run the same events, and what steers a forward besides
its inputs is its own state: its structure and its attributes (``engine.replay.blocks`` compares
those, and blocks of another kind never stand in for one another) and the attributes no two blocks
share -- a layer's index, a stochastic-depth rate, a dict of settings that names the layer. Those
cannot be compared (every block differs); what can be known is what the forward *did* with them.

While a template block (blocks 1, 2 and ``N-2``) runs, each such attribute on it and its submodules is
swapped for a :func:`watched` equal that notes the uses Python makes of it (:class:`Uses`):

* a number's comparisons and truth (``self.idx == 4``, ``drop_prob == 0.0``, ``layer_idx >=
  len(cache)``), also of numbers computed from it (``1 - drop_prob > 0``), are *decisions*, each kept
  as a function of the attribute and its outcome: a block stands in only where every decision comes
  out the same for its own value (block 4 of ``if self.idx == 4`` does not, and the step is simulated
  again without replay);
* any other use -- a number made an index, a hash, a string; a string, tuple, list or dict used at
  all -- is a *doubt*: the group is simulated in full.

A value handed to an op without Python looking at it (``torch.zeros(n)``, a dropout rate) reaches the
op, whose shapes the signatures of blocks 1 and 2 compare.

A forward that writes its own attributes (a tensor cached on the block, a counter, a flag) leaves state
that a stand-in would not leave: :class:`Attributes` snapshots what the block's modules hold before
its forward (each attribute's object, their parameters' and buffers'), and any change fails the
template.

Example:
    >>> import torch
    >>> block = torch.nn.Linear(2, 2)
    >>> block.idx = 1
    >>> with watching(block, [("", "idx")]) as uses:
    ...     _ = block.idx == 4  # a branch on the layer's index
    >>> uses.doubt, uses.hold([3]), uses.hold([4])
    (None, True, False)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["WATCHABLE", "Attributes", "Uses", "values_of", "watched", "watching"]


class Uses:
    """What one run of a block's forward did with its watched attributes (indexed as the keys given to
    :func:`watching`): its decisions, each a function of the attribute's value and the outcome it had;
    and the first use that cannot be decided again for another value (``doubt``; ``None``: none)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.decisions: list[tuple[int, Callable[[Any], Any], Any]] = []
        self.doubt: str | None = None

    def doubted(self, key: int, what: str) -> None:
        if self.doubt is None:
            self.doubt = f"its forward uses {self.names[key]} ({what}), which differs from block to block"

    def hold(self, values: Sequence[Any]) -> bool:
        """Whether every decision comes out as it did, for a block whose watched attributes hold
        ``values`` (in the keys' order): that block's forward takes the same path."""
        if self.doubt is not None:
            return False
        try:
            return all(fn(values[key]) == outcome for key, fn, outcome in self.decisions)
        except Exception:
            return False


_COMPARISONS = {
    "__eq__": operator.eq,
    "__ne__": operator.ne,
    "__lt__": operator.lt,
    "__le__": operator.le,
    "__gt__": operator.gt,
    "__ge__": operator.ge,
}
# Arithmetic whose result is a number again, decided on later: the operand order of each method.
_ARITHMETIC = {
    **{f"__{n}__": getattr(operator, n) for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")},
    **{
        f"__r{n}__": (lambda op: lambda a, b: op(b, a))(getattr(operator, n))
        for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")
    },
    "__neg__": operator.neg,
    "__pos__": operator.pos,
    "__abs__": operator.abs,
}
_PLAIN_ARGS = (bool, int, float, type(None))

# What a watched value keeps as its own, never a use of it; and what Python asks of any object (its
# type, its size) without looking at its value.
_OWN = frozenset({"_memest_key", "_memest_uses", "_memest_of"})
_NOT_USES = frozenset(
    {
        "__new__", "__init__", "__getattribute__", "__getattr__", "__setattr__", "__delattr__", "__class__",
        "__init_subclass__", "__subclasshook__", "__reduce__", "__reduce_ex__", "__getnewargs__",
        "__getnewargs_ex__", "__getstate__", "__sizeof__", "__dir__", "__doc__", "__class_getitem__",
        "__dict__", "__weakref__",
    }
)  # fmt: skip


def _watching_type(base: type) -> type:
    """A subclass of ``base`` whose every special method (comparisons, truth, hashing, indexing,
    iteration, arithmetic, formatting) and every other attribute asked of it (``.get``, ``.items``,
    ``.startswith``) notes its use, then does what ``base``'s does, on the same object."""
    number = base in (int, float)

    def special(name: str) -> Any:
        method = getattr(base, name)
        compare = _COMPARISONS.get(name) if number else None
        arithmetic = _ARITHMETIC.get(name) if number else None

        def use(self: Any, *args: Any) -> Any:
            uses: Uses = self._memest_uses
            key, of = self._memest_key, self._memest_of
            result = method(self, *args)
            plain = all(type(a) in _PLAIN_ARGS for a in args)
            if name == "__bool__" and number:
                uses.decisions.append((key, lambda v: bool(of(v)), result))
            elif compare is not None and plain and type(result) is bool:
                uses.decisions.append((key, lambda v: compare(of(v), *args), result))
            elif arithmetic is not None and plain and type(result) in (int, float):
                derived = _TYPES[type(result)](result)
                _bind(derived, key, uses, lambda v: arithmetic(of(v), *args))
                return derived
            else:
                uses.doubted(key, name)
            return result

        use.__name__ = name
        return use

    def attribute(self: Any, name: str) -> Any:
        if name not in _OWN and not (name.startswith("__") and name.endswith("__")):
            get = object.__getattribute__
            get(self, "_memest_uses").doubted(get(self, "_memest_key"), f".{name}")
        return object.__getattribute__(self, name)

    namespace: dict[str, Any] = {
        name: special(name)
        for name in dir(base)
        if name.startswith("__")
        and name.endswith("__")
        and name not in _NOT_USES
        and callable(getattr(base, name))
    }
    namespace["__getattribute__"] = attribute
    # A copy of it (pickle, deepcopy) is a plain value, as the block's own was.
    namespace["__reduce_ex__"] = lambda self, protocol: (base, (_PLAIN_OF[base](self),))
    return type(f"Watched{base.__name__.capitalize()}", (base,), namespace)


#: The value itself, through no method of a watching subclass (``int(self)`` would call its ``__int__``).
_PLAIN_OF: dict[type, Any] = {
    int: int.__int__,
    float: float.__float__,
    str: str.__str__,
    tuple: lambda t: tuple.__getitem__(t, slice(None)),
    list: list.copy,
    dict: dict.copy,
}
_TYPES = {base: _watching_type(base) for base in _PLAIN_OF}
_WATCHED = frozenset(_TYPES.values())
WATCHABLE = frozenset(_PLAIN_OF)
"""The types of attributes a block's forward can be watched using: numbers, strings, and the
containers that hold them (a per-layer ``dict`` of settings)."""


def _identity(value: Any) -> Any:
    return value


def _bind(made: Any, key: int, uses: Uses, of: Callable[[Any], Any]) -> None:
    object.__setattr__(made, "_memest_key", key)
    object.__setattr__(made, "_memest_uses", uses)
    object.__setattr__(made, "_memest_of", of)


def watched(value: Any, key: int, uses: Uses) -> Any:
    """``value`` as an equal value of a :data:`WATCHABLE` type whose uses are noted in ``uses`` (as the
    watched attribute ``key``)."""
    made = _TYPES[type(value)](value)
    _bind(made, key, uses, _identity)
    return made


def values_of(block: nn.Module, keys: Sequence[tuple[str, str]]) -> tuple[Any, ...]:
    """What the attributes ``keys`` names hold on ``block`` (``None`` where absent)."""
    found = []
    for path, name in keys:
        value = vars(block.get_submodule(path) if path else block).get(name)
        found.append(_PLAIN_OF[type(value).__mro__[1]](value) if type(value) in _WATCHED else value)
    return tuple(found)


@contextmanager
def watching(block: nn.Module, keys: Sequence[tuple[str, str]]) -> Iterator[Uses]:
    """Inside, the attributes ``keys`` names -- ``(module path within block, attribute)`` -- are
    :func:`watched`; the :class:`Uses` yielded has what the block's code did with them. Put back on the
    way out where no doubt arose; a value the forward used beyond decisions (a list it appended to)
    stays watched, keeping what was done to it for the rest of the simulation (which puts the module
    back as it was at its end), its uses from then on noted for the next block that watches it."""
    uses = Uses([f"{path}.{name}" if path else name for path, name in keys])
    swapped: list[tuple[nn.Module, str, Any, Any]] = []
    try:
        for key, (path, name) in enumerate(keys):
            module = block.get_submodule(path) if path else block
            value = vars(module).get(name)
            if type(value) in _WATCHED:
                _bind(value, key, uses, _identity)
            elif type(value) in _TYPES:
                proxy = watched(value, key, uses)
                object.__setattr__(module, name, proxy)
                swapped.append((module, name, value, proxy))
        yield uses
    finally:
        for module, name, value, proxy in swapped:
            if vars(module).get(name) is proxy and uses.doubt is None:
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
