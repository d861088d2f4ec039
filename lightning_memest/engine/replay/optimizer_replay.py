"""Replay of the optimizer's per-parameter work for the parameters of stand-in blocks (blocks
``3 .. N-3`` of a group of ``engine.replay.blocks``): their updates are not run, their events are block 1's.

torch.optim's for-loop optimizers work parameter by parameter in one Python loop, and what one
iteration does depends only on its parameter's tensors (parameter, gradient, state: their layouts, the
step counter's value) and on the hyperparameters. So for the loops of torch's own code only -- the
state's lazy creation in ``Adam._init_group`` (Adam and AdamW) and the updates of
``_single_tensor_adam`` and ``_single_tensor_sgd`` -- the loop is handed its lists through a view
(``engine.replay.optimizer_loops.Slots``) that marks where each iteration's events begin. Where the loop
reaches the first stand-in's parameters, the iterations of block 1's parameters (checked equal to
block 2's) are appended once per stand-in parameter with its own handles and fresh ones for what the iteration
allocates; the loop then goes on with block ``N-2``'s, whose events must equal block 1's again, or
:class:`ReplayMismatch` (the caller simulates again without replay).

One iteration's temporaries live into the next (Adam's ``denom`` dies when the next one is
assigned): the first stand-in frees those of the last real iteration before it, and those real
storages are renamed to the last stand-in's, whose frees the next real iteration makes. A
stand-in's state is made as fake tensors of the template's layout bound to the handles of their
replayed allocations; its step counter's value follows the template's. Anything else runs as it
always did: another optimizer (the user's own, a subclass: user code is never skipped), the updates of
the foreach and fused kernels (CUDA's default; their state's creation is still replayed), tensor
hyperparameters, ``capturable`` or ``differentiable``, a step whose first iterations make what
outlives the next one (SGD's momentum buffers in its first step), and ``Adam._init_group`` once the
state is made (it then appends the state to the lists: cheaper run than checked).

Example:
    >>> import torch
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(8)))
    >>> config = StepConfig(optimizer=torch.optim.AdamW)
    >>> simulate(model, torch.randn(4, 8), config, replay_blocks=True).replayed_updates > 0
    True

(The same once ``torch.compile`` has run in the process, which wraps each optimizer class's
``_init_group`` in one of its own: each is replayed.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_memest.engine.events import Phase
from lightning_memest.engine.fake import below, fake_tensor
from lightning_memest.engine.replay.block_templates import dense
from lightning_memest.engine.replay.blocks import BlockGroup, Layout, layout_of
from lightning_memest.engine.replay.optimizer_loops import (
    OFF_FLAGS,
    Canon,
    Iteration,
    Loop,
    Program,
    Run,
    Slots,
    allocation_sizes,
    constants,
    equal,
)
from lightning_memest.engine.replay.replay_tracker import ReplayMismatch, ReplayTracker
from lightning_memest.engine.replay.stand_in_events import ALLOC, FREE, OP, TAG, append_program
from lightning_memest.engine.tracker import Tracker, plain_layout

__all__ = ["OptimizerReplay", "optimizer_replay"]


class OptimizerReplay:
    """Stand-ins for the stand-in blocks' parameters in torch.optim's loops (the module's docstring)."""

    def __init__(self, tracker: ReplayTracker, groups: list[BlockGroup]) -> None:
        self.tracker = tracker
        self.groups = groups
        self.count = 0
        """Parameter iterations replayed (state creations and updates, every step)."""
        self._owner: dict[int, tuple[int, int, int]] | None = None  # id(parameter) -> group, block, index
        # By id(program): the program (held, so that its id names no other while cached) and _compile's.
        self._compiled: dict[int, tuple[Any, ...]] = {}

    def runs(self, params: Sequence[Any]) -> dict[int, Run]:
        """Where each group's blocks 1 .. N-2 lie in ``params``, block after block, in the same order
        (a group of several kinds in turn: its periods, each one block here)."""
        found: dict[tuple[int, int], list[tuple[int, int]]] = {}
        owner = self._owner
        if owner is None:  # the simulation's fake parameters, the same in every loop of every step
            owner = self._owner = {}
            for g, group in enumerate(self.groups):
                j = 0
                for k, module in enumerate(group.modules):
                    j = 0 if k % group.period == 0 else j
                    for p in module.parameters():
                        owner[id(p)] = (g, k // group.period, j)
                        j += 1
        for i, p in enumerate(params):
            o = owner.get(id(p))
            if o is not None:
                found.setdefault(o[:2], []).append((i, o[2]))
        runs: dict[int, Run] = {}
        for g, group in enumerate(self.groups):
            n, first = len(group.modules) // group.period, found.get((g, 1))
            if not first:
                continue
            q, base = len(first), first[0][0]
            if all(
                found.get((g, k)) == [(base + (k - 1) * q + m, first[m][1]) for m in range(q)]
                for k in range(1, n - 1)
            ):
                runs[base + 2 * q] = Run(base + 2 * q, base + (n - 3) * q, q, base, base + q)
        return runs

    # --- emitting ------------------------------------------------------------------------------
    def emit(
        self, prog: tuple[tuple[Any, ...], ...], own: Sequence[int | None], prev: Sequence[tuple[int, int]]
    ) -> list[int]:
        """Append one iteration's events with ``own``'s handles and fresh ones; those, by allocation."""
        tracker = self.tracker
        compiled = self._compiled.get(id(prog))
        if compiled is None:
            compiled = self._compiled[id(prog)] = (prog, *_compile(prog))
        _, code, canons, paths, internal = compiled
        # Each name resolved once, in the order of first use (fresh handles as the instructions'
        # own order would give them), then read by index.
        hs: list[int] = []
        for c in canons:
            kind = c[0]
            if kind == "i":
                hs.append(tracker.new_handle())
            elif kind == "o":
                h = own[c[1]]
                assert h is not None
                hs.append(h)
            elif kind == "prev":
                hs.append(prev[c[1]][0])
            else:
                hs.append(int(c[1]))
        append_program(tracker, code, hs, paths, Phase.OPTIMIZER, {})  # (it binds no storage)
        return [hs[k] for k in internal]

    def carry_over(self, loop: Loop, run: Run, progs: list[Program]) -> dict[int, int] | None:
        """The storage keys of what the last real iteration left for the first stand-in to free."""
        left = loop.internals(loop.at[run.start - 1])
        wanted = {left[n][0]: n for n in progs[-1][1]} if all(n < len(left) for n in progs[-1][1]) else None
        if wanted is None:
            return None
        keys = {h: key for key, h in self.tracker._handles.items() if h in wanted}
        return keys if len(keys) == len(wanted) else None

    def hand_over(
        self, loop: Loop, run: Run, progs: list[Program], keys: dict[int, int], last: list[tuple[int, int]]
    ) -> None:
        """The real storages the first stand-in freed die where the last stand-in's would: as those."""
        left = loop.internals(loop.at[run.start - 1])
        for n in progs[-1][1]:
            self.tracker.rehandle(keys[left[n][0]], last[n][0])

    # --- the updates: _single_tensor_adam, _single_tensor_sgd ----------------------------------
    def updates(self, original: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        params = args[0] if args else None
        if (
            type(params) is not list
            or self.tracker.phase is not Phase.OPTIMIZER
            or any(kwargs.get(flag) for flag in OFF_FLAGS)
            or not all(v is None or type(v) in (bool, int, float) for v in kwargs.values())
        ):
            return original(*args, **kwargs)
        n = len(params)
        slots = [k for k, a in enumerate(args) if type(a) is list and len(a) == n]
        if any(not (type(a) is list and (len(a) in (0, n))) and a is not None for a in args):
            return original(*args, **kwargs)  # a tensor beside the lists (grad_scale): not ours
        runs = self.runs(params)
        if not runs:
            return original(*args, **kwargs)
        order: list[int] = []
        lists = [args[k] for k in slots]
        loop = Loop(self.tracker, lists, runs, order)
        events = self.tracker.events

        def drive() -> Iterator[Any]:
            i = 0
            while i < n:
                run = runs.get(i)
                if run is not None and self.splice_updates(loop, run):
                    i = run.stop
                    continue
                order.append(i)
                before = constants([lst[i] for lst in lists]) if i in loop.watch else ()
                prev, loop.pending = loop.pending, None
                loop.begin(Iteration(i, len(events), prev, before))
                yield params[i]
                i += 1
            loop.end = len(events)

        view = list(args)
        for k in slots:
            view[k] = Slots(args[k], order, drive if k == 0 else None)
        original(*view, **kwargs)
        if loop.end is None:
            raise ReplayMismatch("an optimizer loop stopped before its end")
        loop.check()

    def splice_updates(self, loop: Loop, run: Run) -> bool:
        progs = loop.templates(run)
        if progs is None:
            return False
        for m in range(run.q):  # what each leaves, the next frees: nothing outlives two iterations
            frees = {
                ins[1][1] for ins in progs[(m + 1) % run.q][0] if ins[0] == "free" and ins[1][0] == "prev"
            }
            if frees != set(progs[m][1]):
                return False
        keys = self.carry_over(loop, run, progs)
        if keys is None:
            return False
        shapes = {t: loop.facts(t)[0] for t in range(run.t1, run.t2)}
        stand = []
        # Below the modes (the reads run no op): the step counters' compares and copies need no block each.
        with torch._C._DisableTorchDispatch():
            for i in range(run.start, run.stop):
                t = run.t1 + (i - run.start) % run.q
                facts = loop.facts(i)
                if not loop.alike(t, shapes[t], facts):
                    return False
                stand.append((i, t, facts[1], facts[2]))
            sizes = [allocation_sizes(p[0]) for p in progs]
            loop.begin(Iteration(-1, len(self.tracker.events)))
            prev = loop.internals(loop.at[run.start - 1])
            for i, t, own, consts in stand:
                m = (i - run.start) % run.q
                made = self.emit(progs[m][0], own, prev)
                prev = list(zip(made, sizes[m], strict=True))
                loop.followconstants(t, consts)
        self.hand_over(loop, run, progs, keys, prev)
        loop.pending = prev
        loop.done.append(run)
        self.count += len(stand)
        return True

    # --- the state's creation: Adam._init_group ------------------------------------------------
    def init_group(self, original: Callable[..., Any], opt: Any, group: Any, lists: tuple[Any, ...]) -> Any:
        params = group.get("params") if isinstance(group, dict) else None
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or type(params) is not list:
            return original(opt, group, *lists)
        if self.tracker.phase is not Phase.OPTIMIZER or not all(type(lst) is list for lst in lists):
            return original(opt, group, *lists)
        runs = self.runs(params)
        if not runs:
            return original(opt, group, *lists)
        order: list[int] = []
        grads = [p.grad for p in params]
        loop = Loop(self.tracker, [params, grads], runs, order)
        events = self.tracker.events
        state = opt.state

        def drive() -> Iterator[Any]:
            i = 0
            while i < len(params):
                run = runs.get(i)
                if run is not None and self.splice_init(loop, run, state, lists, params):
                    i = run.stop
                    continue
                order.append(i)
                had = bool(state.get(params[i]))
                loop.begin(Iteration(i, len(events), [], (), tuple(len(lst) for lst in lists), had))
                yield params[i]
                i += 1
            loop.end = len(events)

        view = dict(group)
        view["params"] = Slots(params, order, drive)
        out = original(opt, view, *lists)
        if loop.end is None:
            raise ReplayMismatch("an optimizer loop stopped before its end")
        loop.lengths_end = tuple(len(lst) for lst in lists)
        loop.check(lambda i: self.init_shape(loop, i, state, lists, params))
        return out

    def init_shape(self, loop: Loop, i: int, state: Any, lists: tuple[Any, ...], params: list[Any]) -> Any:
        """What an init iteration appended (by what: the parameter, its gradient, a state entry), whether
        it made the state, and which of its storages the state holds; ``False`` where it cannot be said."""
        r = loop.at[i]
        lengths = loop.iters[r].lengths
        after = (
            loop.iters[r + 1].lengths
            if r + 1 < len(loop.iters) and loop.iters[r + 1].lengths
            else loop.lengths_end
        )
        p = params[i]
        st = state.get(p, {})
        by_id: dict[int, tuple[Any, ...]] = {id(p): ("p",)}
        if p.grad is not None:
            by_id[id(p.grad)] = ("grad",)
        by_id |= {id(v): ("state", key) for key, v in st.items() if isinstance(v, Tensor)}
        appended = []
        for lst, a, b in zip(lists, lengths, after, strict=True):
            entries = tuple(by_id.get(id(x)) for x in lst[a:b])
            if None in entries:
                return False
            appended.append(entries)
        made = not loop.iters[r].had_state and bool(st)
        holds: list[tuple[Any, int]] = []
        if made:
            allocated = [h for h, _ in loop.internals(r)]
            for key, v in st.items():
                if isinstance(v, Tensor):
                    h = self.tracker.handle_of(v)
                    if h not in allocated or not dense(layout_of(v)):
                        return False
                    holds.append((key, allocated.index(h)))
        return tuple(appended), made, tuple(st) if made else (), tuple(holds)

    def splice_init(
        self, loop: Loop, run: Run, state: Any, lists: tuple[Any, ...], params: list[Any]
    ) -> bool:
        if all(loop.iters[loop.at[run.t1 + m]].had_state for m in range(run.q)):
            # The state is made: an iteration only appends it to the lists, which costs less than the
            # checks a replay of it needs (a 32-layer 7B decoder's second step: 0.5 ms a layer).
            return False
        loop.lengths_end = tuple(len(lst) for lst in lists)  # the template's ends here, at the latest
        progs = loop.templates(run, lambda i: self.init_shape(loop, i, state, lists, params))
        if progs is None:
            return False
        shapes = [self.init_shape(loop, run.t1 + m, state, lists, params) for m in range(run.q)]
        if any(s is False for s in shapes):
            return False
        for m, (prog, left) in enumerate(progs):
            _, made, _, holds = shapes[m]
            if left != frozenset(n for _, n in holds) or any(
                ins[1][0] == "prev" for ins in prog if ins[0] == "free"
            ):
                return False
        stand = [(i, run.t1 + (i - run.start) % run.q) for i in range(run.start, run.stop)]
        # The template's layouts once, not once per stand-in.
        layouts = {
            t: (layout_of(params[t]), None if params[t].grad is None else layout_of(params[t].grad))
            for t in range(run.t1, run.t1 + run.q)
        }
        template_layouts: dict[int, Layout] = {}  # the templates' state tensors, by id
        for i, t in stand:
            p = params[i]
            if layout_of(p) != layouts[t][0]:
                return False
            if (None if p.grad is None else layout_of(p.grad)) != layouts[t][1]:
                return False
            if shapes[(i - run.start) % run.q][1]:
                if state.get(p):
                    return False
            elif not self.same_state(state.get(p, {}), state.get(params[t], {}), template_layouts):
                return False
        loop.begin(Iteration(-1, len(self.tracker.events), [], (), tuple(len(lst) for lst in lists)))
        mode = self.tracker.mode
        specs: dict[int, tuple[Any, ...]] = {}
        for i, t in stand:
            m = (i - run.start) % run.q
            p, tp = params[i], params[t]
            made_handles = self.emit(
                progs[m][0],
                (self.tracker.handle_of(p), None if p.grad is None else self.tracker.handle_of(p.grad)),
                [],
            )
            appended, made, _, holds = shapes[m]
            if made:
                with torch._C._DisableTorchDispatch():  # its tensors made below the modes at once
                    state[p] = self.state_like(mode, state[tp], made_handles, dict(holds), specs)
            st = state[p]
            for lst, entries in zip(lists, appended, strict=True):
                for e in entries:
                    lst.append(p if e[0] == "p" else p.grad if e[0] == "grad" else st[e[1]])
        loop.done.append(run)
        self.count += len(stand)
        return True

    def state_like(
        self,
        mode: Any,
        template: dict[Any, Any],
        handles: list[int],
        held: dict[Any, int],
        specs: dict[int, Any],
    ) -> dict[Any, Any]:
        """A stand-in's state: the template's, its tensors made to their layouts and bound to the handles
        of their replayed allocations (``held``: each key's index among ``handles``; ``specs``: the
        templates' layouts found so far, by id)."""
        new: dict[Any, Any] = {}
        for key, v in template.items():
            if isinstance(v, Tensor):
                spec = specs.get(id(v))
                if spec is None:  # the template's layout once, not once per stand-in
                    spec = specs[id(v)] = (tuple(v.shape), tuple(v.stride()), v.dtype, v.device)
                t = _fake_like(mode, v, spec)
                handle = handles[held[key]]
                self.tracker.bind(t, handle)
                # Made to the layout: the updates' replay reads it as that (ReplayTracker.vouch).
                shape, stride, dtype, device = spec
                layout = plain_layout(device, shape, stride, 0, dtype, t.untyped_storage().nbytes(), False)
                self.tracker.vouch(t, handle, layout)
                new[key] = t
            else:
                new[key] = copy.deepcopy(v)
        return new

    @staticmethod
    def same_state(a: dict[Any, Any], b: dict[Any, Any], layouts: dict[int, Layout]) -> bool:
        """Whether state ``a`` is template state ``b`` in all its iteration depends on (``layouts``:
        those of the templates' tensors found so far, which every stand-in of the template shares)."""
        if list(a) != list(b):
            return False
        for key, v in b.items():
            w = a[key]
            if isinstance(v, Tensor):
                lay = layouts.get(id(v))
                if lay is None:
                    lay = layouts[id(v)] = layout_of(v)
                if not isinstance(w, Tensor) or layout_of(w) != lay:
                    return False
                cv, cw = getattr(v, "constant", None), getattr(w, "constant", None)
                if (cv is None) != (cw is None) or (cv is not None and cw is not None and not equal(cv, cw)):
                    return False
            elif w != v:
                return False
        return True


def _compile(prog: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], list[Canon], list[str], list[int]]:
    """An iteration's program as ``engine.replay.stand_in_events.append_program`` appends it: its names
    and module paths replaced by their indexes in the two lists returned (each at its first use), and
    the indexes of its own storages (``("i", n)``) by ``n``."""
    names: dict[Canon, int] = {}
    paths: dict[str, int] = {}

    def name(c: Canon) -> int:
        return names.setdefault(c, len(names))

    def path(module: str) -> int:
        return paths.setdefault(module, len(paths))

    code: list[tuple[Any, ...]] = []
    for ins in prog:
        kind = ins[0]
        if kind == "op":
            outs = None if ins[4] is None else tuple(name(c) for c in ins[4])
            code.append((OP, path(ins[2]), ins[1], ins[3], outs, ins[5]))
        elif kind == "tag":
            code.append((TAG, name(ins[1]), ins[2], path(ins[3]), None, None))
        elif kind == "alloc":
            code.append((ALLOC, name(ins[1]), ins[2], None, None, None))
        else:
            code.append((FREE, name(ins[1]), None, None, None, None))
    made = sorted((c[1], k) for c, k in names.items() if c[0] == "i")
    return tuple(code), list(names), list(paths), [k for _, k in made]


def _fake_like(mode: Any, v: Tensor, spec: tuple[Any, ...]) -> Tensor:
    """A fake tensor of ``v``'s layout (``spec``: its shape, stride, dtype and device) and constant (a
    stand-in's state: its allocation is replayed)."""
    constant = getattr(v, "constant", None)
    if constant is not None:
        with below():  # the real tensor's own clone
            constant = constant.clone()
    shape, stride, dtype, device = spec
    return fake_tensor(mode, shape, stride, dtype, device, constant)


@contextmanager
def optimizer_replay(groups: list[BlockGroup], tracker: Tracker) -> Iterator[OptimizerReplay | None]:
    """Inside, torch.optim's for-loop optimizers replay the stand-in blocks' parameters (see the module's
    docstring); ``None`` without groups or a :class:`ReplayTracker`. The loops are wrapped where torch
    looks them up at each call (module globals, ``Adam._init_group``), and put back on the way out."""
    if not groups or not isinstance(tracker, ReplayTracker):
        yield None
        return
    import torch.optim.adam as adam_module
    import torch.optim.sgd as sgd_module

    replay = OptimizerReplay(tracker, groups)
    patched: list[tuple[Any, str, Any]] = []

    def wrap_updates(module: Any, name: str) -> None:
        original = getattr(module, name, None)
        if original is None:
            return

        def updates(*args: Any, **kwargs: Any) -> None:
            replay.updates(original, args, kwargs)

        patched.append((module, name, original))
        setattr(module, name, updates)

    wrap_updates(adam_module, "_single_tensor_adam")
    wrap_updates(sgd_module, "_single_tensor_sgd")
    # Once dynamo has run in the process it wraps each optimizer class's _init_group in one of the
    # class's own (AdamW's then no longer inherits Adam's): each class that has one gets the wrapper.
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        init = cls.__dict__.get("_init_group")
        if init is None:
            continue

        def init_group(opt: Any, group: Any, *lists: Any, _init: Any = init) -> Any:
            return replay.init_group(_init, opt, group, lists)

        patched.append((cls, "_init_group", init))
        cls._init_group = init_group  # type: ignore[method-assign]
    try:
        yield replay
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
