"""Facts the simulation learns about a fake tensor's values (the set of values it can hold, how many of
its elements can be nonzero), kept on the tensor only as long as they stay true.

A fact is about the *memory* a tensor views, so any write into that memory may break it -- also a write
through another tensor: ``mask.view(-1)[i] = 1`` changes what ``mask`` holds, and ``x.data``, ``detach()``
or a view all write into the same storage. So a fact is filed with its tensor's storage and that
storage's write generation (counted per fake mode); :func:`storage_written` starts a new generation,
and every fact filed under an older one -- through whichever tensor -- is no longer returned. A tensor
given new storage (``set_``, ``resize_``) loses its facts the same way.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     mask = torch.zeros(4, dtype=torch.bool)
    ...     flat = mask.view(-1)
    >>> file_fact(mask, "count", 0)
    >>> fact_of(mask, "count")
    0
    >>> storage_written(flat)  # a write through the view: what was known of ``mask`` may be wrong now
    >>> fact_of(mask, "count") is None
    True
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["BATCH_FLOATS", "fact_of", "file_fact", "storage_written"]

#: The fact of a small floating-point batch tensor holding a CPU copy of its values, read by equality
#: checks only (``engine.real_path`` files it; ``engine.values.data_dependent`` reads it).
BATCH_FLOATS = "_memest_batch_floats"

#: The fake mode's attribute holding each storage's write generation (by storage address).
_GENERATIONS = "_memest_write_generations"


def _has_storage(t: Tensor) -> TypeGuard[FakeTensor]:
    """A fake tensor with a storage of its own (not sparse: those have none to file facts under)."""
    return isinstance(t, FakeTensor) and t.layout == torch.strided


def _generations(t: FakeTensor) -> dict[int, int]:
    mode = t.fake_mode
    found: dict[int, int] | None = mode.__dict__.get(_GENERATIONS)
    if found is None:
        found = mode.__dict__[_GENERATIONS] = {}
    return found


def file_fact(t: Tensor, name: str, value: Any) -> None:
    """File ``value`` as fact ``name`` of fake tensor ``t``, true for what its storage holds now
    (anything but a strided fake tensor is ignored: real tensors have their values)."""
    if not _has_storage(t):
        return
    key = t.untyped_storage()._cdata
    t.__dict__[name] = (value, key, _generations(t).setdefault(key, 0))


def fact_of(t: Tensor, name: str) -> Any:
    """Fact ``name`` of ``t``, or ``None`` when it has none or its storage was written since."""
    if not _has_storage(t):
        return None
    entry = t.__dict__.get(name)
    if entry is None:
        return None
    value, key, generation = entry
    if key != t.untyped_storage()._cdata or _generations(t).get(key) != generation:
        del t.__dict__[name]
        return None
    return value


def storage_written(t: Tensor) -> None:
    """``t``'s storage was written: the facts of every tensor on it are void (those filed after this
    call hold)."""
    if not _has_storage(t):
        return
    generations = t.fake_mode.__dict__.get(_GENERATIONS)
    if generations:
        key = t.untyped_storage()._cdata
        if key in generations:
            generations[key] += 1
