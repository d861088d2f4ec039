"""Everything mutable reachable from a module, recorded before a simulation and put back after it.

A ``training_step`` that runs on fake tensors changes what it changes in a real step: it appends to a
list the module owns (``self.history.append(loss.item())``), counts in a dict, pushes onto a deque,
sets an attribute of a helper object. All of that must be as it was when the simulation ends, the
same objects with the same contents -- the user's code, and Lightning, hold references to them.

:class:`Reachable` walks, from the modules, the attributes of every object it meets (modules, and
plain objects of the user's classes) and the contents of every list, dict, set, deque, tuple and
frozenset, and remembers each mutable one's contents; :meth:`Reachable.restore` puts the contents
back in place. Objects of the frameworks (torch, Lightning, loggers, threads) are not walked: the
trainer, the dataloaders and the process groups are reachable from a LightningModule, are not the
module's state, and other threads may change them meanwhile.

Example:
    >>> m = torch.nn.Linear(2, 2)
    >>> m.history = [1.0]
    >>> saved = Reachable([m])
    >>> m.history.append(0.0); m.note = "new"
    >>> saved.restore()
    >>> m.history, hasattr(m, "note")
    ([1.0], False)
"""

from __future__ import annotations

import enum
import operator
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Reachable"]

#: Top-level packages whose objects are not walked (their state is not the module's).
_FRAMEWORKS = frozenset(
    {
        "builtins",  # functions, methods, types, modules: code, not state
        "torch",
        "lightning",
        "lightning_fabric",
        "lightning_utilities",
        "pytorch_lightning",
        "lightning_memest",
        "numpy",
        "pandas",
        "tensorboard",
        "tensorboardX",
        "wandb",
        "mlflow",
        "logging",
        "threading",
        "queue",
        "multiprocessing",
        "concurrent",
        "asyncio",
        "socket",
        "subprocess",
        "io",
        "_io",
        "weakref",
        "abc",
    }
)

#: Values with nothing inside to walk: skipped without a look at their type's package.
_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None), torch.Tensor, nn.Parameter})

#: How many objects one snapshot walks at most: a module holding a huge structure (a dataset as a
#: list of records) is not walked to its end (its top containers are still restored).
_LIMIT = 1_000_000


class Reachable:
    """The contents of every mutable container and the attributes of every object reachable from
    ``roots`` (see the module docstring), as they are now."""

    def __init__(self, roots: Iterable[object]) -> None:
        # Keys and values apart: compared by identity at C speed (map(operator.is_, ...)).
        self._attributes: list[tuple[object, list[str], list[Any]]] = []
        self._lists: list[tuple[list[Any], list[Any]]] = []
        self._dicts: list[tuple[dict[Any, Any], list[Any], list[Any]]] = []
        self._sets: list[tuple[set[Any], list[Any]]] = []
        self._deques: list[tuple[deque[Any], list[Any]]] = []
        self._walk(list(roots))

    def _walk(self, stack: list[object]) -> None:
        seen: set[int] = set()
        kinds: dict[type, int] = dict(_KINDS)  # a class's kind found once a walk (a model has few)
        lists, dicts, sets, deques = self._lists, self._dicts, self._sets, self._deques
        attributes = self._attributes
        while stack and len(seen) < _LIMIT:
            obj: Any = stack.pop()
            cls = type(obj)
            if cls in _ATOMS or id(obj) in seen:
                continue
            seen.add(id(obj))
            kind = kinds.get(cls)
            if kind is None:
                kind = kinds[cls] = _kind(cls)
            if kind == _DICT:
                if not obj:  # most are a module's empty hook dicts
                    dicts.append((obj, [], []))
                    continue
                keys, values = list(obj), list(obj.values())
                dicts.append((obj, keys, values))
                inside: list[Any] = keys + values
            elif kind == _OBJECT:
                state = getattr(obj, "__dict__", None)
                if type(state) is not dict:
                    continue
                names, inside = list(state), list(state.values())
                attributes.append((obj, names, inside))
            elif kind == _LIST:
                inside = list(obj)
                lists.append((obj, inside))
            elif kind == _SET:
                inside = list(obj)
                sets.append((obj, inside))
            elif kind == _DEQUE:
                inside = list(obj)
                deques.append((obj, inside))
            elif kind == _FROZEN:
                inside = list(obj)
            else:
                continue
            stack.extend([v for v in inside if type(v) not in _ATOMS])

    def restore(self) -> None:
        """Put every recorded attribute dict and container back as it was (the same objects). Only what
        changed is touched: an immutable mapping type that refuses ``clear`` is left alone, unchanged."""
        # Most containers are a module's empty hook dicts, unchanged: the length first, then identity.
        for obj, names, values in self._attributes:
            state = vars(obj)
            if not _same_pairs(state, names, values):
                state.clear()
                state.update(zip(names, values, strict=True))
        for items_list, items in self._lists:
            if not _same_items(items_list, items):
                items_list[:] = items
        for mapping, keys, values in self._dicts:
            if len(mapping) != len(keys) or (keys and not _same_pairs(mapping, keys, values)):
                mapping.clear()  # the type's own methods: an OrderedDict keeps its order structure
                mapping.update(zip(keys, values, strict=True))
        for members_set, members in self._sets:
            # Membership tries identity first: the same objects are found without __eq__.
            if len(members_set) != len(members) or not all(m in members_set for m in members):
                members_set.clear()
                members_set.update(members)
        for queue, queued in self._deques:
            if not _same_items(queue, queued):
                queue.clear()
                queue.extend(queued)


_LIST, _DICT, _SET, _DEQUE, _FROZEN, _OBJECT, _SKIP = range(7)

#: The kinds of the common exact types; any other class's is found by :func:`_kind`.
_KINDS: dict[type, int] = {list: _LIST, dict: _DICT, set: _SET, deque: _DEQUE, tuple: _FROZEN}


def _kind(cls: type) -> int:
    """How objects of ``cls`` are walked: as the container they are (subclasses too: ``issubclass``,
    not isinstance, which asks ``__class__``, which a proxy object may answer lazily), by their
    attributes (:func:`_walked`), or not at all."""
    if issubclass(cls, list):
        return _LIST
    if issubclass(cls, dict):
        return _DICT
    if issubclass(cls, set):
        return _SET
    if issubclass(cls, deque):
        return _DEQUE
    if issubclass(cls, (tuple, frozenset)):
        return _FROZEN
    return _OBJECT if _walked(cls) else _SKIP


def _same_items(now: list[Any] | deque[Any], saved: list[Any]) -> bool:
    """The same objects in the same order (identity: ``==`` on tensors is elementwise)."""
    return len(now) == len(saved) and all(map(operator.is_, now, saved))


def _same_pairs(now: dict[Any, Any], keys: list[Any], values: list[Any]) -> bool:
    """The same keys and values, in the same order, by identity."""
    return (
        len(now) == len(keys)
        and all(map(operator.is_, now, keys))
        and all(map(operator.is_, now.values(), values))
    )


def _walked(cls: type) -> bool:
    """Whether objects of ``cls`` are walked: modules (any package) and plain objects of the user's."""
    if issubclass(cls, nn.Module):
        return True
    if issubclass(cls, (torch.Tensor, enum.Enum, type)):
        return False
    return cls.__module__.partition(".")[0] not in _FRAMEWORKS
