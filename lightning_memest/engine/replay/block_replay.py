"""Replay of repeated blocks: simulate a few instances of a block for real, and let the others stand
in with the events of those.

In each step, of a group of ``N`` alike blocks (``engine.replay.blocks``) blocks ``0, 1, 2, N-2, N-1`` run
for real on fake tensors, and ``1``, ``2`` and ``N-2`` are recorded. When the forwards of ``1`` and
``2`` ran the same events, blocks ``3 .. N-3`` do not run: each *stand-in* appends block ``1``'s
forward events with fresh storage handles, and returns fake outputs of the right layout made by one
autograd node; its backward appends block ``N-2``'s backward events (recorded just before: backward
runs in reverse) and hands autograd the gradient of its input and its parameters' gradients. Storages
that cross the block's boundary are real tensors bound to their handles, so the rest of the step --
user code, the loss, the optimizer over every parameter, ``zero_grad`` -- runs for real and sees an
ordinary step (torch.optim's own loops replay the stand-ins' parameters: ``engine.replay.optimizer_replay``),
and the stream is an ordinary stream: accounting never knows.

What the block's autograd nodes saved is what keeps its inputs alive into backward: a stand-in holds
the inputs (and outputs) its template saved until its backward. A storage the template allocated that
outlives both of its spans without being returned (a cache's keys) dies with the template's own.

A group of several kinds in turn (a period, ``engine.replay.blocks``) is replayed kind by kind: the blocks
of each kind are a group of their own, with their own templates.

Checks make replay safe or absent: a stand-in runs only where the inputs match the template's
(structure, layouts, other arguments) and block ``1``'s and ``2``'s forwards agree; at the end of each
step the full signatures of ``1``, ``2`` and ``N-2`` (forward and backward) must agree and every
stand-in must have run its backward. Where a check fails after a stand-in ran, :class:`ReplayMismatch`
is raised and the caller simulates again without replay.

Example:
    >>> import torch
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(8)))
    >>> sim = simulate(model, torch.randn(4, 8), StepConfig(), replay_blocks=True)
    >>> sim.replayed_blocks
    (('', 3),)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_memest.engine.events import ModuleEnter, ModuleExit, Phase
from lightning_memest.engine.fake import device_of, quick_device_queries
from lightning_memest.engine.replay.block_templates import (
    Template,
    backward_into,
    dense,
    forward_template,
)
from lightning_memest.engine.replay.blocks import (
    BlockGroup,
    BlockRecord,
    layout_of,
    relative_path,
)
from lightning_memest.engine.replay.replay_tracker import ReplayMismatch, ReplayTracker
from lightning_memest.engine.replay.stand_in_events import Call, CallEvents
from lightning_memest.engine.replay.watched import Attributes, Uses, values_of, watching
from lightning_memest.engine.tracker import Tracker, plain_layout

__all__ = ["ReplayMismatch", "ReplayTracker", "block_replay"]

_SIMPLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _input_key(leaves: list[Any], spec: Any) -> Any:
    parts: list[Any] = []
    for v in leaves:
        if isinstance(v, Tensor):
            parts.append((layout_of(v), device_of(v)))
        elif isinstance(v, _SIMPLE):
            parts.append(("v", v))
        else:
            parts.append(("obj", id(v)))  # the same object for every instance, or no match
    return (str(spec), tuple(parts), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))


@dataclass(frozen=True)
class _Member:
    """A member of a group as its stand-ins need it."""

    path: str
    params: tuple[nn.Parameter, ...]
    buffers: tuple[Tensor, ...]
    devices: tuple[torch.device, ...]  # the parameters'


class _Group:
    """The replay state of one group, reset every step."""

    def __init__(self, group: BlockGroup) -> None:
        self.group = group
        self.n = len(group.members)
        self.step = -1
        self.members: dict[int, _Member] = {}
        """By module id: a member's path, parameters and buffers (the fake ones, which the simulation
        does not replace), looked up once, not at every stand-in of every step."""
        self.index = {id(m): k for k, m in enumerate(group.modules)}  # (not a search of the members each)
        self.reset(-1)

    def member(self, module: nn.Module) -> _Member:
        found = self.members.get(id(module))
        if found is None:
            path = self.group.members[self.index[id(module)]]
            params = tuple(module.parameters())
            devices = tuple(device_of(p) for p in params)
            found = self.members[id(module)] = _Member(path, params, tuple(module.buffers()), devices)
        return found

    def reset(self, step: int) -> None:
        self.step = step
        self.next = 0
        self.records: dict[int, BlockRecord] = {}
        self.template: Template | None = None
        self.decided: Uses | None = None  # what block 1's forward did with its watched attributes
        self.off: str | None = None
        self.replayed = 0
        self.backward_ready = False

    def same_path(self, module: nn.Module) -> bool:
        """Whether a block's forward decides as the template's did on the attributes no two blocks share
        (``engine.replay.watched``): each decision of block 1's, made again with this block's values."""
        watched = self.group.watched
        if not watched:
            return True
        return self.decided is not None and self.decided.hold(values_of(module, watched))

    def recorded(self, k: int) -> bool:
        return k in (1, 2, self.n - 2)

    def stand_in(self, k: int) -> bool:
        return 3 <= k <= self.n - 3 and self.off is None


class BlockReplay:
    """Stand-ins for the repeated blocks of one simulation (see the module's docstring)."""

    def __init__(self, tracker: ReplayTracker, groups: list[BlockGroup]) -> None:
        self.tracker = tracker
        # A group of several kinds in turn replays each kind on its own, from its own templates.
        self.groups = [_Group(phase) for g in groups for phase in g.phases()]
        self.calls: dict[int, tuple[_Group, Call]] = {}
        self.out = CallEvents(tracker)
        self._next_call = 0
        self.replayed: dict[str, int] = {}
        """Stand-ins per group in the last step that had any."""
        self.off: dict[str, str] = {}
        """Per container whose blocks a check kept from standing in (the first such step's), why."""
        tracker.on_step_end = self.finish_step

    # --- the forward of a member -------------------------------------------------------------------
    def forward(
        self,
        state: _Group,
        k: int,
        module: nn.Module,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        tracker = self.tracker
        if tracker.step != state.step:
            state.reset(tracker.step)
        if tracker.phase is not Phase.FORWARD or k != state.next:
            # Called out of order, twice, or outside the step's forward: no replay for this step.
            if state.replayed:
                raise ReplayMismatch(f"block {state.group.members[k]} ran out of order after a replay")
            state.off = state.off or "out of order"
            return original(*args, **kwargs)
        state.next = k + 1
        if state.stand_in(k):
            template = self._template(state)
            why = "inputs differ"
            if template is not None and not state.same_path(module):
                why = "its forward decides otherwise on what differs by block"
            elif template is not None:
                leaves, spec = tree_flatten((args, kwargs))
                if _input_key(leaves, spec) == template.record.input_key:
                    state.replayed += 1
                    return self._stand_in(state, template, module, leaves)
            if state.replayed:
                raise ReplayMismatch(f"block {state.group.members[k]} does not match its template: {why}")
            state.off = state.off or why
            return original(*args, **kwargs)
        if state.recorded(k):
            return self._recorded(state, k, module, original, args, kwargs)
        return original(*args, **kwargs)

    def _template(self, state: _Group) -> Template | None:
        if state.template is not None:
            return state.template
        first, second = state.records.get(1), state.records.get(2)
        if first is None or second is None:
            state.off = "no template"
            return None
        a, b = first.signature(), second.signature()
        if first.failure or second.failure or a[:5] != b[:5]:
            state.off = first.failure or second.failure or "the forwards differ"
            return None
        template = forward_template(first, a)
        if template is None:
            state.off = "outputs or storages a stand-in cannot make"
        state.template = template
        return template

    def _recorded(
        self,
        state: _Group,
        k: int,
        module: nn.Module,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        tracker = self.tracker
        leaves, spec = tree_flatten((args, kwargs))
        record = BlockRecord(
            state.group.members[k],
            tuple(tracker.handle_of(v) if isinstance(v, Tensor) else None for v in leaves),
            _input_key(leaves, spec),
            tuple(tracker.handle_of(p) for p in module.parameters()),
            tuple(tracker.handle_of(b) for b in module.buffers()),
            [],
        )
        state.records[k] = record
        start, real = len(tracker.events), Counter(tracker.real_ops)
        # What the forward does with the block's own state decides whether another block would run the
        # same events (engine/replay/watched.py): its decisions on what no two blocks share (block 1's
        # are made again for each stand-in), another use of it, an attribute it sets.
        with watching(module, state.group.watched) as uses:
            held = Attributes(module)
            out = original(*args, **kwargs)
            written = held.written()
        if k == 1:
            state.decided = uses
        if uses.doubt is not None:
            record.fail(uses.doubt)
        if written is not None:
            record.fail(f"its forward sets its own {written}")
        record.forward = tracker.events[start:]
        record.forward_real = tracker.real_ops - real
        out_leaves, out_spec = tree_flatten(out)
        tensors = [(i, t) for i, t in enumerate(out_leaves) if isinstance(t, Tensor)]
        values = tuple(None if isinstance(v, Tensor) else v for v in out_leaves)
        if not all(isinstance(v, _SIMPLE) for v in values):
            record.fail("an output a stand-in cannot make")
        record.outputs = tuple(tracker.handle_of(t) or -1 for _, t in tensors)
        record.output_layouts = tuple(layout_of(t) for _, t in tensors)
        record.output_spec = (str(out_spec), values)
        record.output_treespec = out_spec
        record.output_slots = tuple(i for i, _ in tensors)
        graded_in = [v for v in leaves if isinstance(v, Tensor) and v.requires_grad]
        graded_out = [t for _, t in tensors if t.requires_grad]
        if len(graded_in) != 1 or len(graded_out) != 1 or graded_in[0].grad_fn is None:
            record.fail("not one input and one output with gradients")
            return out
        x, y = graded_in[0], graded_out[0]
        assert x.grad_fn is not None and y.grad_fn is not None
        params = list(module.parameters())
        y.grad_fn.register_prehook(self._backward_start(record, y.output_nr, params))
        x.grad_fn.register_prehook(self._backward_end(record, x.output_nr, params))
        return out

    def _backward_start(
        self, record: BlockRecord, nr: int, params: list[nn.Parameter]
    ) -> Callable[[Any], None]:
        events = self.tracker.events
        tracker = self.tracker

        def start(grads: Any) -> None:
            if record.backward is not None or record.backward_start is not None:
                return
            at = len(events)
            # The block's children whose output is the block's enter just before (their hooks fire first).
            while at:
                e = events[at - 1]
                if type(e) is not ModuleEnter or relative_path(e.path, record.path) in (None, "@"):
                    break
                at -= 1
            record.backward_start = at
            record.real_before = Counter(tracker.real_ops)
            record.grads_before = _grad_handles(tracker, params)
            g = grads[nr]
            record.grad_output = None if g is None else tracker.handle_of(g)

        return start

    def _backward_end(
        self, record: BlockRecord, nr: int, params: list[nn.Parameter]
    ) -> Callable[[Any], None]:
        tracker = self.tracker

        def end(grads: Any) -> None:
            start = record.backward_start
            if record.backward is not None or start is None:
                return
            kept = []
            for e in tracker.events[start:]:
                if type(e) is ModuleEnter or type(e) is ModuleExit:
                    rel = relative_path(e.path, record.path)
                    if rel is None or rel == "@":
                        continue  # the block's own scope and the outside's: their hooks fire for real
                kept.append(e)
            record.backward = kept
            record.backward_real = tracker.real_ops - record.real_before
            g = grads[nr]
            if g is None:
                record.fail("no gradient for the input")
            else:
                record.grad_input, record.grad_input_layout = tracker.handle_of(g), layout_of(g)
            record.param_grads = tuple(
                (None, None) if p.grad is None else (tracker.handle_of(p.grad), layout_of(p.grad))
                for p in params
            )

        return end

    # --- a stand-in ----------------------------------------------------------------------------------
    def _stand_in(self, state: _Group, template: Template, module: nn.Module, leaves: list[Any]) -> Any:
        tracker = self.tracker
        handles = tuple(tracker.handle_of(v) if isinstance(v, Tensor) else None for v in leaves)
        member = state.member(module)
        call = Call(
            member.path,
            handles,
            tuple(tracker.handle_of(p) for p in member.params),
            tuple(tracker.handle_of(b) for b in member.buffers),
            member.params,
            member.devices,
        )
        for v, h in zip(leaves, handles, strict=True):
            if h is not None:
                call.real[h] = v.untyped_storage()._cdata
        x = leaves[template.grad_leaf]
        call.device = device_of(x)
        self.out.emit(template.forward, call, Phase.FORWARD)
        tracker.real_ops.update(template.record.forward_real)
        for n in template.linked:
            if not tracker.link(template.record.internal_handle(n), call.internal[n]):
                raise ReplayMismatch(f"a storage of {template.record.path} died before its copy was made")
        call_id = self._next_call
        self._next_call += 1
        self.calls[call_id] = (state, call)
        outs: list[Tensor] = []
        for i, (canon, lay) in enumerate(zip(template.outputs, template.output_layouts, strict=True)):
            if i == template.grad_output:
                # Below the modes: the node's checks of its input's device (3) need no op of the step.
                with torch._C._DisableTorchDispatch():
                    t = _StandIn.apply(self, call_id, i, x)
            else:
                t = self.out.make(lay, call.device)
                self.out.bind(call, t, canon)
            outs.append(t)
        call.keep = [leaves[k] for k in template.hold_inputs] + [outs[i] for i in template.hold_outputs]
        flat = list(template.output_spec[1])
        for slot, t in zip(template.record.output_slots, outs, strict=True):
            flat[slot] = t
        return tree_unflatten(flat, template.record.output_treespec)

    def make_output(self, call_id: int, i: int) -> Tensor:
        state, call = self.calls[call_id]
        template = state.template
        assert template is not None
        assert call.device is not None
        t = self.out.make(template.output_layouts[i], call.device)
        self.out.bind(call, t, template.outputs[i])
        return t

    def backward(self, call_id: int, grad: Tensor | None) -> Tensor:
        state, call = self.calls.pop(call_id)
        template = self._backward_template(state)
        tracker = self.tracker
        if grad is None or tracker.phase is not Phase.BACKWARD:
            raise ReplayMismatch(f"block {call.block}'s backward did not run as its template's")
        h = tracker.handle_of(grad)
        if h is None:
            raise ReplayMismatch(f"the gradient of block {call.block}'s output is not tracked")
        call.grad_output = h
        call.real.setdefault(h, grad.untyped_storage()._cdata)
        assert template.backward is not None and template.grad_input is not None
        # Gradients accumulated into (a second micro-batch): the template's add_ names them.
        call.grads_before = _grad_handles(tracker, call.param_objects)
        self.out.emit(template.backward, call, Phase.BACKWARD)
        tracker.real_ops.update(template.backward_real)
        assert template.grad_input_layout is not None and dense(template.grad_input_layout)
        # Below the modes from here: the tensors made (each of which would enter and leave them) and the
        # gradients' setter (whose checks ask both tensors for their devices: 6 ops) run no op of the step.
        with torch._C._DisableTorchDispatch(), quick_device_queries():
            grad_in = self._grads(template, call, h)
        call.keep = []
        return grad_in

    def _grads(self, template: Template, call: Call, h: int) -> Tensor:
        """The gradient of a stand-in's input, and its parameters' (set on them), made to the template's
        layouts (``h``: the handle of its output's gradient)."""
        tracker = self.tracker
        assert template.grad_input is not None and template.grad_input_layout is not None
        assert call.device is not None
        grad_in = self.out.make(template.grad_input_layout, call.device)
        if template.grad_input == ("go", 0):  # the output's gradient's storage, taken over
            key = call.real.pop(h, None)
            if key is None:
                raise ReplayMismatch(f"the gradient of block {call.block}'s output is gone")
            tracker.forget(key, h)
        self.out.bind(call, grad_in, template.grad_input)
        for p, device, (canon, lay) in zip(
            call.param_objects, call.param_devices, template.param_grads, strict=True
        ):
            if canon is None or lay is None:
                continue
            if canon[0] == "pg":  # accumulated in place by the template's events: it stays
                if p.grad is None or layout_of(p.grad) != lay:
                    raise ReplayMismatch(f"a parameter of block {call.block} has no gradient to add to")
                continue
            if p.grad is not None:
                raise ReplayMismatch(f"a parameter of block {call.block} already had a gradient")
            g = self.out.make(lay, device)
            # Made to the layout: the optimizer's replay reads it as that (ReplayTracker.vouch).
            shape, stride, offset, dtype, nbytes, _ = lay  # (make refused another offset or size)
            made = plain_layout(device, shape, stride, offset, dtype, nbytes, False)
            tracker.vouch(g, self.out.bind(call, g, canon), made)
            p.grad = g
        return grad_in

    def _backward_template(self, state: _Group) -> Template:
        template = state.template
        if template is None:
            raise ReplayMismatch("a stand-in without a template")
        if state.backward_ready:
            return template
        record = state.records.get(state.n - 2)
        if record is None or record.backward is None:
            raise ReplayMismatch(f"block {state.group.members[-2]} gave no backward to replay")
        sig = record.signature()
        if record.failure or sig[:5] != template.record.signature()[:5]:
            raise ReplayMismatch(record.failure or f"block {record.path} does not match its template")
        sig = record.signature()
        if not backward_into(template, record, sig):
            raise ReplayMismatch(f"block {record.path}'s backward leaves storages a stand-in cannot make")
        state.backward_ready = True
        return template

    def note(self) -> str | None:
        """Why the groups of alike blocks that were never replayed were not: the first failed check."""
        off = {path: why for path, why in self.off.items() if path not in self.replayed}
        if not off:
            return None
        return "; ".join(f"{path or 'the model'}: {why}" for path, why in sorted(off.items()))

    def stood_in(self) -> bool:
        """Whether any stand-in ran in this simulation (this step, or an earlier one)."""
        return bool(self.replayed) or any(state.replayed for state in self.groups)

    # --- the step's end ------------------------------------------------------------------------------
    def finish_step(self) -> None:
        """Every replayed group's real instances agree in full, and every stand-in ran its backward."""
        step: Counter[str] = Counter()  # a container's groups together (runs of two kinds in one list)
        for state in self.groups:
            if not state.replayed:
                if state.off is not None:  # a check failed before any stand-in: the reason, for the report
                    self.off.setdefault(state.group.path, state.off)
                continue
            if any(s is state for s, _ in self.calls.values()):
                raise ReplayMismatch(f"a stand-in in {state.group.path!r} never ran its backward")
            records = [state.records.get(k) for k in (1, 2, state.n - 2)]
            sigs = []
            for r in records:
                if r is None or r.backward is None or r.failure:
                    raise ReplayMismatch("a template block did not complete its step")
                sigs.append(r.signature())
            if not sigs[0] == sigs[1] == sigs[2]:
                raise ReplayMismatch(f"the blocks of {state.group.path!r} differ in backward")
            step[state.group.path] += state.replayed
            state.replayed = 0
            state.step = -1
        self.replayed.update(step)


def _grad_handles(tracker: Tracker, params: Sequence[nn.Parameter]) -> tuple[int | None, ...]:
    """The storage handle of each parameter's gradient now (``None``: it has none)."""
    return tuple(None if p.grad is None else tracker.handle_of(p.grad) for p in params)


class _StandIn(torch.autograd.Function):
    """The autograd node of a stand-in: its output's gradient goes to the stand-in's backward."""

    @staticmethod
    def forward(ctx: Any, replay: BlockReplay, call_id: int, i: int, x: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)  # no zeros made for an unused output: a mismatch instead
        ctx.replay, ctx.call_id = replay, call_id
        return replay.make_output(call_id, i)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[None, None, None, Tensor]:
        return None, None, None, ctx.replay.backward(ctx.call_id, grad)


@contextmanager
def block_replay(groups: list[BlockGroup], tracker: Tracker) -> Iterator[BlockReplay | None]:
    """Inside, the blocks of ``groups`` (``engine.replay.blocks.repeated_blocks``, found before the
    simulation's own hooks are on the model) are replayed where they repeat; ``None`` where there are
    none or ``tracker`` is not a :class:`ReplayTracker`. Each member's ``forward`` is wrapped on the
    instance, and unwrapped on the way out."""
    if not groups or not isinstance(tracker, ReplayTracker):
        yield None
        return
    replay = BlockReplay(tracker, groups)
    patched: list[tuple[nn.Module, bool, Any]] = []
    for state in replay.groups:
        for k, m in enumerate(state.group.modules):
            original = m.forward
            had = "forward" in vars(m)

            def forward(
                *args: Any,
                _s: _Group = state,
                _k: int = k,
                _m: nn.Module = m,
                _o: Any = original,
                **kwargs: Any,
            ) -> Any:
                return replay.forward(_s, _k, _m, _o, args, kwargs)

            object.__setattr__(m, "forward", forward)
            patched.append((m, had, original))
    try:
        yield replay
    finally:
        for m, had, original in patched:
            if had:
                object.__setattr__(m, "forward", original)
            else:
                object.__delattr__(m, "forward")
        replay.calls.clear()  # stand-ins whose backward never ran hold their tensors: let them go
        tracker.links.clear()
        tracker.linked.clear()
        tracker.on_step_end = None
