"""A model that arrives on the meta device and is sharded is initialised as large jobs initialise it:
only what survives the sharding ever exists on the device.

Why: a job too large to lay out whole builds its model on ``torch.device("meta")``, applies
``fully_shard`` (checkpointing, parallelisation), then materialises the shards (``to_empty`` and its
init): the unsharded parameters never exist on any device. The simulation has to build the fake model
whole (it is the user's module, faked) and shards it on the fake process group, so its events begin with
the full parameters allocated, ``fully_shard``'s chunking ops, and the full parameters freed. Replayed
as they are, the caching allocator of a CUDA what-if would keep those freed blocks reserved (at 128
ranks the reserved peak stayed near the 8-rank one while the allocated peak fell).

:func:`initialised_sharded` rewrites the events of that setup window into what the meta-init job does:
each storage alive at the window's end (the shards, their padded buffers, the batch) allocated once,
at its size then, in the order it was first allocated, resident; everything allocated and freed inside
the window, and the window's ops, dropped (the init kernels on the shards are not simulated).

Example:
    >>> from lightning_memest.engine.events import Alloc, Free, Resize
    >>> events = [Alloc(1, 400, True), Alloc(2, 100), Resize(2, 50), Free(1)]
    >>> initialised_sharded(events, 0)
    >>> events
    [Alloc(storage=2, nbytes=50, resident=True)]
"""

from __future__ import annotations

from lightning_memest.engine.events import Alloc, Event, Free, OpEvent, Resize, Tag

__all__ = ["initialised_sharded"]


def initialised_sharded(events: list[Event], start: int) -> None:
    """Rewrite ``events[start:]``, the setup window of a meta-device model sharded before its first
    step, in place: the window's survivors allocated once (their final size, resident, in birth
    order), with their tags; what was born and died inside it, its resizes and its ops, gone."""
    window = events[start:]
    born = [e.storage for e in window if isinstance(e, Alloc)]
    died = {e.storage for e in window if isinstance(e, Free)}
    size: dict[int, int] = {}
    for e in window:
        if isinstance(e, (Alloc, Resize)):
            size[e.storage] = e.nbytes
    survivors = [h for h in dict.fromkeys(born) if h not in died]
    kept: list[Event] = [Alloc(h, size[h], True) for h in survivors]
    alive, newborn = set(survivors), set(born)
    for e in window:
        if isinstance(e, (Alloc, Resize, OpEvent)):
            continue
        if isinstance(e, Tag) and e.storage not in alive:
            continue
        if isinstance(e, Free) and e.storage in newborn:
            continue  # born and freed in the window: never on the device
        kept.append(e)
    del events[start:]
    events.extend(kept)
