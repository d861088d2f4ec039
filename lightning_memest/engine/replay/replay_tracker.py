"""The tracker of a simulation with replayed blocks (``engine.replay.block_replay``): stand-ins name, bind and
forget storages through it, and the storages a stand-in copied from a template's die when the
template's do.

Example:
    >>> tracker = ReplayTracker()
    >>> tracker.new_handle(), tracker.new_handle()
    (0, 1)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_memest.engine.events import Free
from lightning_memest.engine.tracker import Tracker, plain_fake
from lightning_memest.errors import EstimationError

__all__ = ["ReplayMismatch", "ReplayTracker"]


class ReplayMismatch(EstimationError):
    """A replayed step turned out not to repeat (a check after a stand-in ran failed): simulate it again
    without replay."""


class ReplayTracker(Tracker):
    """A :class:`Tracker` that lets stand-ins name, bind and forget storages, and frees the storages a
    stand-in copied from a template's when the template's die."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.links: dict[int, list[int]] = {}  # a template's real handle -> stand-ins' copies
        self.linked: set[int] = set()  # copies still waiting for their template's storage to die
        self.freed: set[int] = set()  # real handles that died (for links made after)
        self.on_step_end: Callable[[], None] | None = None
        # id(tensor) -> (the tensor, weakly; its handle, shape and requires_grad; its handle_and_layout)
        self._vouched: dict[int, tuple[weakref.ref[Tensor], int, Any, bool, tuple[Any, ...]]] = {}
        self._vouched_at = self.layout_writes
        self._on_free = self._on_free  # type: ignore[method-assign]  # one bound method for every storage

    def _free_callback(self, key: int, handle: int) -> Callable[[object], None]:
        # One object the cyclic collector follows per storage where a closure makes five (function,
        # cells): its full collections walk every one of them while the step runs.
        return functools.partial(self._on_free, key, handle)

    def _on_free(self, key: int, handle: int, _: object) -> None:
        if self._handles.get(key) == handle:
            del self._handles[key], self._sizes[key], self._refs[key]
            self.events.append(Free(handle))
            self.freed.add(handle)
            for copy in self.links.pop(handle, ()):
                if copy in self.linked:
                    self.linked.discard(copy)
                    self.events.append(Free(copy))

    def new_handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def bind(self, t: Tensor, handle: int) -> int:
        """``t``'s storage (made by a stand-in, untracked) is the one ``handle`` names; its key."""
        storage = t.untyped_storage()
        key: int = storage._cdata
        self._handles[key] = handle
        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, self._free_callback(key, handle))
        return key

    def forget(self, key: int, handle: int) -> None:
        """The storage's free was replayed: its real death records nothing more."""
        if self._handles.get(key) == handle:
            del self._handles[key], self._sizes[key], self._refs[key]
            self.freed.add(handle)

    def rehandle(self, key: int, handle: int) -> None:
        """The live storage ``key`` is named ``handle`` from here on: its death frees that (a replayed
        optimizer update freed its old name where the real one will free the new one's)."""
        storage = self._refs[key]()
        assert storage is not None
        self._handles[key] = handle
        self._refs[key] = weakref.ref(storage, self._free_callback(key, handle))

    def vouch(self, t: Tensor, handle: int, layout: tuple[Any, ...]) -> None:
        """``layout`` (``engine.tracker.plain_layout``) is :meth:`handle_and_layout`'s for ``t``, a plain fake
        tensor of storage ``handle`` (one a stand-in made to a template's layout, or one read in full)."""
        _, shape, *_, requires_grad = layout  # (plain_layout's order)
        self._vouched[id(t)] = (weakref.ref(t), handle, shape, requires_grad, layout)

    def handle_and_layout(self, t: Tensor) -> tuple[int | None, tuple[Any, ...]]:
        """:meth:`Tracker.handle_and_layout`, from what was vouched for ``t`` while that holds: the same
        live tensor, on the same storage, of the same shape and ``requires_grad``, and no op since
        that could change a layout in place (``layout_writes``). The optimizer's replay reads every
        entry of a stand-in parameter's lists (120 a replayed layer): the same parameters and state
        every step, and gradients a stand-in made (3 us a read in full, 0.6 from here)."""
        if self.layout_writes != self._vouched_at:
            self._vouched.clear()
            self._vouched_at = self.layout_writes
        known = self._vouched.get(id(t))
        if known is not None and known[0]() is t:
            handle = self._handles.get(t.untyped_storage()._cdata)
            if handle == known[1] and t.shape == known[2] and t.requires_grad is known[3]:
                return handle, known[4]
        handle, layout = super().handle_and_layout(t)
        if handle is not None and plain_fake(t):
            self.vouch(t, handle, layout)
        return handle, layout

    def link(self, template: int, copy: int) -> bool:
        """``copy`` dies with the template's storage ``template``; ``False`` if that died already."""
        if template in self.freed:
            return False
        self.links.setdefault(template, []).append(copy)
        self.linked.add(copy)
        return True

    def end_step(self) -> None:
        super().end_step()
        if self.on_step_end is not None:
            self.on_step_end()
