"""What a stand-in call of ``engine.replay.block_replay`` appends to the event stream, and the tensors it
makes: a template's program (its recorded events, renamed: ``engine.replay.blocks.Canon``) emitted with the
handles and module paths of one call, compiled once per program so that each name is resolved once a
call (a replayed layer emits some 500 events a step).

Example:
    >>> _compile((("alloc", ("i", 0), 64), ("free", ("i", 0))))
    (((1, 0, 64, None, None, None), (2, 0, None, None, None, None)), [('i', 0)], [])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memest.engine.events import Alloc, Free, ModuleExit, OpEvent, Phase, Tag
from lightning_memest.engine.fake import fake_tensor
from lightning_memest.engine.replay.blocks import Canon, Layout
from lightning_memest.engine.replay.replay_tracker import ReplayMismatch, ReplayTracker
from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode

__all__ = ["ALLOC", "ENTER", "EXIT", "FREE", "OP", "TAG", "Call", "CallEvents", "append_program"]


@dataclass
class Call:
    """One stand-in's call: the handles its canonical names stand for, and the real storages."""

    block: str
    inputs: tuple[int | None, ...]
    params: tuple[int | None, ...]
    buffers: tuple[int | None, ...]
    param_objects: tuple[nn.Parameter, ...]
    param_devices: tuple[torch.device, ...]
    internal: dict[int, int] = field(default_factory=dict)
    real: dict[int, int] = field(default_factory=dict)  # handle -> storage key, for bound storages
    keep: list[Tensor] = field(default_factory=list)
    grad_output: int | None = None
    grads_before: tuple[int | None, ...] = ()  # the parameters' gradients as the backward began
    device: torch.device | None = None  # the input's: where the stand-in makes its tensors
    paths: dict[str, str] = field(default_factory=dict)  # a template's module path -> this call's


class CallEvents:
    """Emits templates' programs for stand-in calls into one tracker's stream."""

    def __init__(self, tracker: ReplayTracker) -> None:
        self.tracker = tracker
        # By id(program): the program (held, so that its id names no other while cached) and _compile's.
        self._compiled: dict[int, tuple[Any, ...]] = {}

    def resolve(self, call: Call, c: Canon) -> int:
        kind, n = c
        if kind == "i":  # named by its op's event before its allocation: given its handle then
            h = call.internal.get(n)
            if h is None:
                h = call.internal[n] = self.tracker.new_handle()
            return h
        if kind == "in":
            h = call.inputs[n]
        elif kind == "p":
            h = call.params[n]
        elif kind == "b":
            h = call.buffers[n]
        elif kind == "go":
            h = call.grad_output
        elif kind == "pg":
            h = call.grads_before[n] if n < len(call.grads_before) else None
        else:
            return n
        if h is None:
            raise ReplayMismatch(f"block {call.block} has no storage for {c}")
        return h

    def path(self, call: Call, rel: str) -> str:
        path = call.paths.get(rel)
        if path is None:  # once per module of the call: its events share the string
            path = call.block if rel == "@" else call.block + rel[1:] if rel.startswith("@.") else rel
            call.paths[rel] = path
        return path

    def emit(self, program: tuple[Any, ...], call: Call, phase: Phase) -> None:
        tracker = self.tracker
        compiled = self._compiled.get(id(program))
        if compiled is None:
            compiled = self._compiled[id(program)] = (program, *_compile(program))
        _, code, canons, rels = compiled
        # Each name and path resolved once a call, in the order of first use (the handles the
        # instructions' own order would give), then read by index (a replayed layer emits some 500).
        hs: list[int] = []
        internal, new_handle = call.internal, tracker.new_handle
        for c in canons:
            if c[0] == "i":  # most names: resolve's first case, without its call
                h = internal.get(c[1])
                if h is None:
                    h = internal[c[1]] = new_handle()
                hs.append(h)
            else:
                hs.append(self.resolve(call, c))
        ps = [self.path(call, r) for r in rels]
        append_program(tracker, code, hs, ps, phase, call.real)

    def make(self, lay: Layout, device: torch.device) -> Tensor:
        shape, stride, offset, dtype, nbytes, _ = lay
        mode = self.tracker.mode
        assert isinstance(mode, TrackingFakeTensorMode)
        t = fake_tensor(mode, shape, stride, dtype, device)  # the template's allocation stands for it
        if offset or t.untyped_storage().nbytes() != nbytes:
            raise ReplayMismatch("a stand-in cannot make a tensor of this layout")
        return t

    def bind(self, call: Call, t: Tensor, canon: Canon) -> int:
        """``t`` is the storage ``canon`` names in ``call``; its handle."""
        h = self.resolve(call, canon)
        call.real[h] = self.tracker.bind(t, h)
        return h


def append_program(
    tracker: ReplayTracker,
    code: tuple[tuple[Any, ...], ...],
    hs: Sequence[int],
    ps: Sequence[str],
    phase: Phase,
    real: dict[int, int],
) -> None:
    """Append a compiled program's events (instructions of the kinds :data:`OP` .. :data:`EXIT`) with the
    handles ``hs`` and module paths ``ps`` its instructions index; ``real``: the bound storages (handle
    -> storage key) whose replayed free is their death (the stand-ins'; the optimizer's replay binds
    none)."""
    backward, step = phase is Phase.BACKWARD, tracker.step
    new, ap, i = object.__new__, tracker.events.append, tracker.op_index
    real_pop, forget, discard = real.pop, tracker.forget, tracker.linked.discard
    for kind, a, b, c, d, e in code:
        # Events made as their dataclass makes them, every field set, without its constructor's call
        # (a third of an event's cost): an event class with another field fails the replay tests.
        if kind == OP:
            i += 1
            ev = new(OpEvent)
            ev.index = i
            ev.step = step
            ev.phase = phase
            ev.module = ps[a]
            ev.op = b
            ev.call = c
            ev.outputs = None if d is None else tuple([-1 if k < 0 else hs[k] for k in d])
            ev.numel = e
            ev.workspace = 0  # a template's op ran no kernel for real (blocks refuse those)
            ap(ev)
        elif kind == ALLOC:
            al = new(Alloc)
            al.storage = hs[a]
            al.nbytes = b
            al.resident = False
            ap(al)
        elif kind == FREE:
            h = hs[a]
            key = real_pop(h, None)
            if key is not None:  # a bound storage's real death records nothing more
                forget(key, h)
            discard(h)
            fr = new(Free)
            fr.storage = h
            ap(fr)
        elif kind == TAG:
            tg = new(Tag)
            tg.storage = hs[a]
            tg.role = b
            tg.module = ps[c]
            ap(tg)
        elif kind == ENTER:
            tracker.enter_module(ps[a], backward=backward)
        else:  # exit
            p = ps[a]
            stack = tracker._backward_stack if backward else tracker._forward_stack
            for j in range(len(stack) - 1, -1, -1):
                if stack[j] == p:
                    del stack[j]
                    break
            ap(ModuleExit(p, b, tuple([hs[k] for k in c])))
    tracker.op_index = i
    tracker._step_ran_op = True


#: The kinds of a compiled program's instructions, each a 6-tuple: the kind, then its fields, padded.
OP, ALLOC, FREE, TAG, ENTER, EXIT = range(6)


def _compile(program: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[Canon], list[str]]:
    """A template's program with its names (canonical handles) and module paths replaced by their
    indexes in the two lists returned, each listed at its first use; each instruction a 6-tuple of its
    kind and fields (unpacked in one step by the emitting loop)."""
    canons: dict[Canon, int] = {}
    rels: dict[str, int] = {}

    def name(c: Canon) -> int:
        return canons.setdefault(c, len(canons))

    def path(r: str) -> int:
        return rels.setdefault(r, len(rels))

    code: list[tuple[Any, ...]] = []
    for ins in program:
        kind = ins[0]
        if kind == "op":
            outs = None if ins[4] is None else tuple(-1 if c is None else name(c) for c in ins[4])
            code.append((OP, path(ins[2]), ins[1], ins[3], outs, ins[5]))
        elif kind == "alloc":
            code.append((ALLOC, name(ins[1]), ins[2], None, None, None))
        elif kind == "free":
            code.append((FREE, name(ins[1]), None, None, None, None))
        elif kind == "tag":
            code.append((TAG, name(ins[1]), ins[2], path(ins[3]), None, None))
        elif kind == "enter":
            code.append((ENTER, path(ins[1]), None, None, None, None))
        else:  # exit
            code.append((EXIT, path(ins[1]), ins[2], tuple(name(c) for c in ins[3]), None, None))
    return tuple(code), list(canons), list(rels)
