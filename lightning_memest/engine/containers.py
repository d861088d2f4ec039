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
        self._attributes: list[tuple[object, list[tuple[str, Any]]]] = []
        self._lists: list[tuple[list[Any], list[Any]]] = []
        self._dicts: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
        self._sets: list[tuple[set[Any], list[Any]]] = []
        self._deques: list[tuple[deque[Any], list[Any]]] = []
        self._walk(list(roots))

    def _walk(self, stack: list[object]) -> None:
        seen: set[int] = set()
        while stack and len(seen) < _LIMIT:
            obj = stack.pop()
            if type(obj) in _ATOMS or id(obj) in seen:
                continue
            seen.add(id(obj))
            inside = self._record(obj)
            if inside is not None:
                stack.extend(v for v in inside if type(v) not in _ATOMS)

    def _record(self, obj: Any) -> list[Any] | None:
        """Remember ``obj``'s contents where it is mutable; what it holds, where it is walked."""
        cls = type(obj)
        # type(), not isinstance: isinstance asks __class__, which a proxy object may answer lazily.
        if issubclass(cls, list):
            items = list(obj)
            self._lists.append((obj, items))
            return items
        if issubclass(cls, dict):
            pairs = list(obj.items())
            self._dicts.append((obj, pairs))
            return [v for pair in pairs for v in pair]
        if issubclass(cls, set):
            members = list(obj)
            self._sets.append((obj, members))
            return members
        if issubclass(cls, deque):
            queued = list(obj)
            self._deques.append((obj, queued))
            return queued
        if issubclass(cls, (tuple, frozenset)):
            return list(obj)
        if not _walked(cls):
            return None
        state = getattr(obj, "__dict__", None)
        if type(state) is not dict:
            return None
        pairs = list(state.items())
        self._attributes.append((obj, pairs))
        return [v for _, v in pairs]

    def restore(self) -> None:
        """Put every recorded attribute dict and container back as it was (the same objects). Only what
        changed is touched: an immutable mapping type that refuses ``clear`` is left alone, unchanged."""
        # Most containers are a module's empty hook dicts, unchanged: the length first, then identity.
        for obj, attributes in self._attributes:
            state = vars(obj)
            if not _same_pairs(state, attributes):
                state.clear()
                state.update(attributes)
        for items_list, items in self._lists:
            if not _same_items(items_list, items):
                items_list[:] = items
        for mapping, pairs in self._dicts:
            if not _same_pairs(mapping, pairs):
                mapping.clear()  # the type's own methods: an OrderedDict keeps its order structure
                mapping.update(pairs)
        for members_set, members in self._sets:
            # Membership tries identity first: the same objects are found without __eq__.
            if len(members_set) != len(members) or not all(m in members_set for m in members):
                members_set.clear()
                members_set.update(members)
        for queue, queued in self._deques:
            if not _same_items(queue, queued):
                queue.clear()
                queue.extend(queued)


def _same_items(now: list[Any] | deque[Any], saved: list[Any]) -> bool:
    """The same objects in the same order (identity: ``==`` on tensors is elementwise)."""
    if len(now) != len(saved):
        return False
    return not saved or all(a is b for a, b in zip(list(now), saved, strict=True))


def _same_pairs(now: dict[Any, Any], saved: list[tuple[Any, Any]]) -> bool:
    """The same keys and values, in the same order, by identity."""
    if len(now) != len(saved):
        return False
    return not saved or all(
        k is k0 and v is v0 for (k, v), (k0, v0) in zip(list(now.items()), saved, strict=True)
    )


def _walked(cls: type) -> bool:
    """Whether objects of ``cls`` are walked: modules (any package) and plain objects of the user's."""
    if issubclass(cls, nn.Module):
        return True
    if issubclass(cls, (torch.Tensor, enum.Enum, type)):
        return False
    return cls.__module__.partition(".")[0] not in _FRAMEWORKS
