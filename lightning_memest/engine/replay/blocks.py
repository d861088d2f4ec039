"""Repeated blocks: which modules of a model may be replayed, and the signature that proves two
simulated instances of a block ran the same events.

A *group* is a run of consecutive children of a ``ModuleList`` / ``Sequential`` that are alike before
anything runs: the same class, the same submodule tree, the same parameter and buffer names, shapes,
dtypes and ``requires_grad``, the same kind (plain attributes such as ``is_sliding``), distinct module
objects, and no hooks of the user's anywhere inside (replay skips running a block's children, so
their hooks would not run). Where kinds take turns (Gemma 2's sliding-window and global layers,
Llama 4's MoE and NoPE layers) a group has a *period*: block ``k`` is alike block ``k + period``.
Whether two instances also *run* alike is decided from their events (:class:`BlockRecord`): the
events of a forward and of its backward, with storage handles renamed by what they are -- the block's
``k``-th input, ``j``-th parameter, the gradient of its output, or the ``n``-th storage the block
allocated -- and module paths relative to the block. Equal signatures mean: the same ops with the
same calls, allocations of the same sizes freed at the same points, the same tags.

Example:
    >>> import torch
    >>> layers = [torch.nn.Linear(4, 4) for _ in range(8)]
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), *layers)  # the first differs
    >>> [(g.path, g.members[0], len(g.members), g.period) for g in repeated_blocks(model)]
    [('', '1', 8, 1)]
"""

from __future__ import annotations

import enum
import functools
import types
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memest.engine.events import (
    Alloc,
    Event,
    Free,
    ModuleEnter,
    ModuleExit,
    OpEvent,
    Phase,
    Tag,
)
from lightning_memest.engine.replay.watched import WATCHABLE

__all__ = [
    "MAX_PERIOD",
    "MIN_BLOCKS",
    "BlockGroup",
    "BlockRecord",
    "Canon",
    "Layout",
    "relative_path",
    "repeated_blocks",
]

#: The fewest blocks of a group worth replaying: the first three (the outside's boundary, the template
#: and its check) and the last two (the backward template and the boundary) run for real.
MIN_BLOCKS = 6

#: The longest period of block kinds replayed: Gemma 3 takes one global-attention layer after five
#: sliding-window ones (6), Jamba one attention layer in eight (8). A group of period ``p`` needs
#: ``p * MIN_BLOCKS`` blocks.
MAX_PERIOD = 8

#: A storage handle renamed: ``("i", n)`` the ``n``-th storage the block allocated, ``("in", k)`` its
#: ``k``-th input tensor's, ``("p", j)`` / ``("b", j)`` its parameters' and buffers', ``("pg", j)`` the
#: gradient its ``j``-th parameter held before the backward, ``("go", 0)`` the gradient of its output,
#: ``("ext", h)`` any other storage (shared by every instance, or the
#: signatures differ).
Canon = tuple[str, int]

#: What a tensor must be for a stand-in to make it: shape, stride, storage offset, dtype, the storage's
#: bytes, ``requires_grad``.
Layout = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype, int, bool]


def layout_of(t: Tensor) -> Layout:
    # torch.Size is a tuple (equal, same hash) and stride() one already: no conversions (stand-ins and
    # the optimizer's replay ask this some 200 times a replayed layer). The offset's type says SymInt.
    offset = int(t.storage_offset())
    return (t.shape, t.stride(), offset, t.dtype, t.untyped_storage().nbytes(), t.requires_grad)


@dataclass(frozen=True, eq=False)
class BlockGroup:
    """Consecutive alike children of one container: ``path`` the container's, ``members`` theirs;
    with a ``period`` above 1, blocks of ``period`` kinds in turn (``members[k]`` is alike
    ``members[k + period]``), a whole number of periods."""

    path: str
    members: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    period: int = 1
    watched: tuple[tuple[str, str], ...] = ()
    """The attributes of the blocks (module path within a block, name) that differ in every block:
    watched while a template block runs (``engine.replay.watched``)."""

    def phases(self) -> list[BlockGroup]:
        """One group of period 1 per kind: the members ``r, r + period, ...`` for each ``r``."""
        if self.period == 1:
            return [self]
        p = self.period
        return [
            BlockGroup(self.path, self.members[r::p], self.modules[r::p], watched=self.watched)
            for r in range(p)
        ]


def repeated_blocks(model: nn.Module, min_blocks: int = MIN_BLOCKS) -> list[BlockGroup]:
    """The groups of alike consecutive blocks in ``model`` (outermost first; none inside another)."""
    if _global_hooks():
        return []  # a global hook is user code that would run on each child of a real block
    groups: list[BlockGroup] = []
    taken: set[str] = set()  # the members found: a container inside one is not looked into
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        if taken and _inside(path, taken):
            continue
        children = list(container.named_children())
        modules = [m for _, m in children]
        structures = [_structure(m) for m in modules]
        for start, stop, _ in _periodic_runs(structures, modules, min_blocks):
            run = children[start:stop]
            # Refined by kind: blocks alike in structure that differ in what they are (see _kinds).
            kinds, watched = _kinds(run)
            keys = [(structures[start + k], kind) for k, kind in enumerate(kinds)]
            for a, b, period in _periodic_runs(keys, modules[start:stop], min_blocks):
                part = run[a:b]
                members = tuple(f"{path}.{n}" if path else n for n, _ in part)
                groups.append(BlockGroup(path, members, tuple(m for _, m in part), period, watched))
                taken.update(members)
    return groups


def _inside(path: str, members: set[str]) -> bool:
    """Whether ``path`` is one of ``members`` or inside one: its prefixes looked up, not the members
    scanned (a model has thousands of modules and, deep, hundreds of members)."""
    at = len(path)
    while at > 0:
        if path[:at] in members:
            return True
        at = path.rfind(".", 0, at)
    return False


def _periodic_runs(
    keys: Sequence[Any], modules: Sequence[nn.Module], min_blocks: int
) -> list[tuple[int, int, int]]:
    """Runs ``(start, stop, period)`` of whole periods (``period <= MAX_PERIOD``) over which ``keys[k]
    == keys[k - period]``, at least ``min_blocks`` periods long, each of distinct modules and no
    ``None`` key (a block that cannot be replayed): from each start the longest, of the smallest
    period; leftmost first, not overlapping."""
    n = len(keys)
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < n:
        best: tuple[int, int, int] | None = None
        for p in range(1, MAX_PERIOD + 1):
            if i + p * min_blocks > n or keys[i + p - 1] is None:
                break
            seen = {id(m) for m in modules[i : i + p]}
            if len(seen) < p:
                break
            j = i + p
            while j < n and keys[j] is not None and id(modules[j]) not in seen and keys[j] == keys[j - p]:
                seen.add(id(modules[j]))
                j += 1
            length = (j - i) // p * p
            if length >= p * min_blocks and (best is None or length > best[1] - best[0]):
                best = (i, i + length, p)
        if best is None:
            i += 1
        else:
            runs.append(best)
            i = best[1]
    return runs


def _global_hooks() -> bool:
    from torch.nn.modules import module as m

    return bool(
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )


#: The plain values among a module's attributes: what can steer its forward without showing in its
#: parameters (a layer's kind, ``use_rope``, ``shift_size``, ``is_sliding``).
_PLAIN = (type(None), bool, int, float, str, torch.dtype, enum.Enum)
_MODULE_STATE = frozenset({"training"})  # (private names, "_parameters" and the like, are skipped too)


_MISSING = object()  # an attribute a block does not have


def _compared(value: Any, depth: int = 0) -> Any:
    """What of an attribute's value two blocks are compared by: a plain value itself (with its type);
    a container of them (a config dict, a list of window sizes) by its contents; a tensor kept as a
    plain attribute by its layout (what an op reading it uses, the signatures compare); a
    ``functools.partial`` and a small object of the user's by what they hold (each layer's own
    ``partial(gelu, approximate="tanh")``, its own copy of a config); anything else -- a function, a
    class, a large object -- by identity: shared by the blocks, or told apart."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if depth >= _DEPTH:
        return ("object", id(value))
    if isinstance(value, (tuple, list, set, frozenset)) and len(value) <= _ITEMS:
        items = [_compared(v, depth + 1) for v in value]
        return (type(value), tuple(sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items))
    if isinstance(value, dict) and len(value) <= _ITEMS:
        return (type(value), tuple(sorted((repr(k), _compared(v, depth + 1)) for k, v in value.items())))
    if isinstance(value, functools.partial):
        return (
            "partial",
            _compared(value.func, depth + 1),
            _compared(value.args, depth + 1),
            _compared(value.keywords, depth + 1),
        )
    held = getattr(value, "__dict__", None)
    if (
        isinstance(held, dict)
        and len(held) <= _ITEMS
        and not isinstance(value, (type, types.FunctionType, types.MethodType, types.ModuleType, nn.Module))
    ):
        return ("object", type(value), _compared(held, depth + 1))
    return ("object", id(value))


_DEPTH, _ITEMS = 4, 64  # past these, an attribute's value is compared by identity


def _attributes(block: nn.Module) -> dict[tuple[str, str], Any]:
    """The attributes of every module in ``block`` but its children (see :func:`_compared`), keyed by
    (module path, name)."""
    found: dict[tuple[str, str], Any] = {}
    for path, m in block.named_modules():
        for name, value in vars(m).items():
            if name not in _MODULE_STATE and not name.startswith("_") and not isinstance(value, nn.Module):
                found[(path, name)] = value
    return found


def _kinds(run: list[tuple[str, nn.Module]]) -> tuple[list[tuple[Any, ...]], tuple[tuple[str, str], ...]]:
    """Each block's *kind* along ``run``: the values of the attributes that vary along it and repeat
    values (``use_rope`` off every fourth layer, a sliding window every other one, alternating window
    shifts, a config dict that marks one layer wide), which steer a forward the structure does not
    show: blocks of one kind never stand in for another's. And the attributes whose every value is
    distinct (a layer's index, a stochastic-depth rate growing with depth, a dict naming the layer):
    they name an instance, not a kind, and are *watched* -- what a template block's forward decides on
    them must come out the same for each stand-in, any other use keeps the group simulated
    (``engine.replay.watched``)."""
    seen = [_attributes(m) for _, m in run]
    kinds: list[tuple[str, str]] = []
    watched: list[tuple[str, str]] = []
    for key in sorted(set().union(*seen)):
        values = [a.get(key, _MISSING) for a in seen]
        compared = [_compared(v) for v in values]
        if all(c == compared[0] for c in compared):
            continue
        if all(type(v) in WATCHABLE for v in values) and len(set(compared)) == len(values):
            watched.append(key)
            continue
        kinds.append(key)
    return [tuple(_compared(attrs.get(k, _MISSING)) for k in kinds) for attrs in seen], tuple(watched)


def _structure(block: nn.Module) -> Any:
    """What makes two blocks alike before running them; ``None`` for a block that cannot be replayed
    (hooks of the user's inside it, on a module or a parameter)."""
    # One walk of the modules where named_parameters and named_buffers would each take another (the
    # same order and the same duplicates skipped: asked of every block of every model).
    modules = list(block.named_modules())
    params: list[tuple[Any, ...]] = []
    buffers: list[tuple[Any, ...]] = []
    seen: set[int] = set()
    seen_buffers: set[int] = set()
    for prefix, m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return None
        for n, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                return None
            seen.add(id(p))
            params.append((f"{prefix}.{n}" if prefix else n, tuple(p.shape), p.dtype, p.requires_grad))
        for n, b in m._buffers.items():
            if b is None or id(b) in seen_buffers:
                continue
            seen_buffers.add(id(b))
            buffers.append((f"{prefix}.{n}" if prefix else n, tuple(b.shape), b.dtype))
    return tuple((name, type(m)) for name, m in modules), tuple(params), tuple(buffers)


def relative_path(path: str, block: str) -> str | None:
    """``path`` relative to the block at ``block`` (``"@"`` the block, ``"@.x"`` a descendant);
    ``None`` for a module outside it."""
    if path == block:
        return "@"
    if path.startswith(block + "."):
        return "@" + path[len(block) :]
    return None


@dataclass
class BlockRecord:
    """One really simulated call of a block: its forward's events and its backward's, with what it took
    and gave; :meth:`signature` renames them (see the module's docstring)."""

    path: str
    inputs: tuple[int | None, ...]
    """The storage handle of each input tensor (``None`` untracked or not a tensor)."""
    input_key: Any
    """The inputs' structure, layouts and non-tensor values: what a stand-in's call must match."""
    params: tuple[int | None, ...]
    buffers: tuple[int | None, ...]
    forward: list[Event]
    outputs: tuple[int, ...] = ()
    output_layouts: tuple[Layout, ...] = ()
    output_spec: Any = None
    """The outputs' structure (as text) and their non-tensor values, compared."""
    output_treespec: Any = None
    output_slots: tuple[int, ...] = ()
    """Where the tensors are among the outputs' leaves."""
    backward: list[Event] | None = None
    backward_start: int | None = None
    """Where in the stream the backward began (set as it begins)."""
    grad_output: int | None = None
    grads_before: tuple[int | None, ...] = ()
    """The storage handle of each parameter's gradient as the backward began (``None``: none yet);
    a gradient accumulated into in place (``accumulate_grad_batches``) is named by its parameter."""
    grad_input: int | None = None
    grad_input_layout: Layout | None = None
    param_grads: tuple[tuple[int | None, Layout | None], ...] = ()
    failure: str | None = None
    """Why this call cannot serve as a template (``None``: it can)."""
    forward_real: Counter[str] = field(default_factory=Counter)
    """Its forward's ops run for real (their fake kernels failed, ``engine.real_ops``), by op: what a
    stand-in of it counts too, as the report lists them per call."""
    backward_real: Counter[str] = field(default_factory=Counter)
    real_before: Counter[str] = field(default_factory=Counter)  # the tracker's count as a span began
    _canon: dict[int, Canon] = field(default_factory=dict)
    _internal: list[int] = field(default_factory=list)

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why

    # --- renaming ----------------------------------------------------------------------------------
    def canon(self, handle: int) -> Canon:
        """The renamed handle (a storage first seen allocated here becomes internal)."""
        c = self._canon.get(handle)
        if c is None:
            c = self._external(handle)
            self._canon[handle] = c
        return c

    def _external(self, handle: int) -> Canon:
        for kind, handles in (("in", self.inputs), ("p", self.params), ("b", self.buffers)):
            for k, h in enumerate(handles):
                if h == handle:
                    return (kind, k)
        for j, h in enumerate(self.grads_before):
            if h == handle:
                return ("pg", j)
        if handle == self.grad_output:
            return ("go", 0)
        return ("ext", handle)

    def internal_handle(self, n: int) -> int:
        """The real handle of the ``n``-th storage this call allocated."""
        return self._internal[n]

    def _events(self, events: Sequence[Event], phase: Phase) -> Iterator[tuple[Any, ...]]:
        for e in events:
            kind = type(e)
            if kind is OpEvent:
                assert isinstance(e, OpEvent)
                if e.phase is not phase or e.workspace:
                    self.fail(f"{e.op} in {e.phase.value} or run for real")
                outs = None if e.outputs is None else tuple(self._out(h) for h in e.outputs)
                yield ("op", e.op, self._rel(e.module), e.call, outs, e.numel)
            elif kind is Alloc:
                assert isinstance(e, Alloc)
                if e.resident:
                    self.fail("a resident allocated inside a block")
                yield ("alloc", self.canon(e.storage), e.nbytes)
            elif kind is Free:
                assert isinstance(e, Free)
                yield ("free", self.canon(e.storage))
            elif kind is Tag:
                assert isinstance(e, Tag)
                yield ("tag", self.canon(e.storage), e.role, self._rel(e.module))
            elif kind is ModuleEnter or kind is ModuleExit:
                assert isinstance(e, (ModuleEnter, ModuleExit))
                outs = tuple(self.canon(h) for h in e.outputs) if isinstance(e, ModuleExit) else ()
                yield ("enter" if kind is ModuleEnter else "exit", self._rel(e.path), e.phase, outs)
            else:  # reads of values, resizes, marks: not replayed
                self.fail(f"a {kind.__name__} event inside a block")
                yield ("other",)

    def _out(self, handle: int) -> Canon | None:
        return None if handle < 0 else self.canon(handle)

    def _rel(self, path: str) -> str:
        rel = relative_path(path, self.path)
        return path if rel is None else rel

    def signature(self) -> tuple[Any, ...]:
        """The renamed events of the forward and the backward (the backward's once recorded), the
        outputs, the gradients made; equal signatures: interchangeable calls."""
        self._canon.clear()
        self._internal.clear()
        # Storages allocated here are named by the order of their allocations (an op's event, which
        # may name its outputs, comes before their allocations).
        for e in [*self.forward, *(self.backward or ())]:
            if type(e) is Alloc:
                assert isinstance(e, Alloc)
                if e.storage in self._canon:  # handles are never reused
                    self.fail("a storage allocated twice")
                self._canon[e.storage] = ("i", len(self._internal))
                self._internal.append(e.storage)
        forward = tuple(self._events(self.forward, Phase.FORWARD))
        outputs = tuple(self.canon(h) for h in self.outputs)
        backward: tuple[Any, ...] | None = None
        grads: tuple[Any, ...] = ()
        if self.backward is not None:
            backward = tuple(self._events(self.backward, Phase.BACKWARD))
            gi = None if self.grad_input is None else self.canon(self.grad_input)
            grads = (
                gi,
                self.grad_input_layout,
                tuple((None if h is None else self.canon(h), lay) for h, lay in self.param_grads),
            )
        return (self.input_key, forward, outputs, self.output_layouts, self.output_spec, backward, grads)
