"""A node-level profile of a training step over a ``torch.fx`` graph: what each node saves for backward,
allocates, and computes.

:func:`profile_graph` traces a module (``torch.fx.symbolic_trace``), or takes a ``GraphModule`` as it
is, and runs **one training step** of it on fake tensors -- forward, ``loss_fn``, backward, the same
step as :func:`~lightning_memest.estimate.estimate_step` -- with the graph executed node by node by a
``torch.fx.Interpreter``. The engine's event stream is then split by node:

* in forward, an event belongs to the node whose ``run_node`` was running when it was recorded;
* in backward, to the node that created the autograd node being run: each autograd node a graph node
  creates in forward (found by walking its outputs' ``grad_fn`` graph back to what earlier nodes made)
  gets a pre-hook that says so. Parameters' ``AccumulateGrad`` nodes go to the first node that used
  the parameter;
* everything else -- the loss, the backward's seed gradient, autograd nodes of tensors made outside the
  graph -- belongs to :attr:`GraphProfile.outside`.

Figures of one node (:class:`NodeProfile`; all bytes are storage bytes, each storage counted once):

``fwd_in``
    bytes of storages the node saved for backward that existed before it ran: its inputs (or storages
    they view). A storage several nodes save is counted once, for the **first node that saved it** (the
    same rule as ``ModuleStats.saved_bytes``): a convolution after a ReLU saves its input, but that
    storage is the ReLU's already, so the convolution's ``fwd_in`` does not count it again.
``fwd_tmp``
    bytes of storages the node saved for backward that it allocated itself: intermediates and, unlike
    ColossalAI's ``MetaInfoProp``, also its **outputs when it saves them** (a ReLU, a sigmoid, a softmax
    save their result). So ``fwd_in + fwd_tmp`` (:attr:`NodeProfile.saved`) is everything the node keeps
    alive for backward, and the nodes' ``saved`` plus ``outside.saved`` is exactly the activation total
    of the step (``estimate_step(...).modules.saved_bytes``). Parameters, buffers and the batch are never
    counted: they are resident anyway.
``fwd_out``
    bytes of the storages of the node's outputs that the node allocated: a view, a ``getitem`` or an
    in-place op outputs 0 new bytes.
``bwd_out``
    bytes its backward allocated that are still alive when its backward ends: the gradients it hands on,
    of its inputs and of the parameters it owns.
``bwd_tmp``
    at the high point of its backward, the bytes it had allocated beyond ``bwd_out`` (temporaries freed
    before its backward ended); ``bwd_tmp + bwd_out`` is its backward's own high-water mark. Kernel
    workspaces (``accounting.kernels``) are not in these figures (they are in the step's peak).
``fwd_flops`` / ``bwd_flops``
    headline FLOPs (2 x MACs of matmuls, convolutions, attention; ``accounting.flops``) of its forward and
    backward ops; ``fwd_other_flops`` / ``bwd_other_flops``: elementwise, norm, softmax ... work. The
    nodes' figures plus ``outside``'s add up to ``count_flops``'s forward and backward totals.

``symbolic_trace`` traces through ``torch.utils.checkpoint``: the graph, and so the profile, is that of
the model without activation checkpointing (what a checkpoint planner starts from); ``estimate_step``
reports the checkpointed step.

A model that ``symbolic_trace`` cannot trace (Python control flow on a tensor's value, ...) raises
:class:`~lightning_memest.errors.TraceError` with fx's reason; ``estimate_step`` still gives its
module-level report (:func:`module_rows` / :func:`module_table` render that one the same way).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    >>> profile = profile_graph(model, torch.randn(8, 64))
    >>> [(n.name, n.fwd_in, n.fwd_tmp, n.fwd_out) for n in profile.nodes]  # doctest: +NORMALIZE_WHITESPACE
    [('input_1', 0, 0, 0), ('_0', 0, 0, 4096), ('_1', 0, 4096, 4096), ('_2', 0, 0, 320),
     ('output', 0, 0, 0)]
    >>> profile.totals.saved_bytes  # the ReLU's output (8 x 128 x 4 B), which the last Linear saves too
    4096
    >>> profile.node("_2").fwd_flops  # 2 x 8 x 128 x 10
    20480
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Final

import torch
import torch.fx
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_memest.accounting.allocator import final_roles
from lightning_memest.accounting.flops import captures_flops, count_flops
from lightning_memest.engine.events import Alloc, Event, Free, OpEvent, Resize, Role, Tag
from lightning_memest.engine.fake import setattr_raw
from lightning_memest.engine.simulate import Runner, simulate
from lightning_memest.engine.step import (
    LossFn,
    Phase,
    StepConfig,
    StepListener,
    StepRunner,
    check_precision,
    sum_loss,
)
from lightning_memest.engine.tracker import Tracker
from lightning_memest.errors import TraceError
from lightning_memest.report import ModuleStats, format_bytes, human_flops

__all__ = [
    "META_KEY",
    "MODULE_ORDERS",
    "NODE_ORDERS",
    "GraphProfile",
    "GraphTotals",
    "NodeProfile",
    "annotate",
    "annotated_graph_module",
    "module_rows",
    "module_table",
    "profile_graph",
    "trace",
]

#: The key of ``node.meta`` that :func:`annotate` sets.
META_KEY: Final = "memest"

_OUTSIDE = -1  # the owner of events that belong to no graph node
_GRAD_FN_KEY = "lightning_memest.fx.node"  # marks an autograd node's owner in its ``metadata``


# ------------------------------------------------------------------------------------------ reports


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """What one graph node does in a training step (see the module docstring for each figure)."""

    name: str
    op: str
    """The fx opcode: ``placeholder``, ``get_attr``, ``call_function``, ``call_method``, ``call_module``,
    ``output`` (``outside`` for :attr:`GraphProfile.outside`)."""
    target: str
    """The module path (``call_module``), method name, attribute path, or qualified function name."""
    fwd_in: int
    fwd_tmp: int
    fwd_out: int
    bwd_tmp: int
    bwd_out: int
    fwd_flops: int
    bwd_flops: int
    fwd_other_flops: int
    bwd_other_flops: int

    @property
    def saved(self) -> int:
        """Bytes this node keeps alive for backward: ``fwd_in + fwd_tmp``."""
        return self.fwd_in + self.fwd_tmp

    @property
    def flops(self) -> int:
        """Headline FLOPs of its forward and backward."""
        return self.fwd_flops + self.bwd_flops


@dataclass(frozen=True, slots=True)
class GraphTotals:
    """Sums over the nodes and :attr:`GraphProfile.outside`."""

    saved_bytes: int
    """Activation bytes of the step: equals ``estimate_step(...).modules.saved_bytes`` (first step)."""
    fwd_flops: int
    bwd_flops: int
    fwd_other_flops: int
    bwd_other_flops: int


#: ``by`` values of :meth:`GraphProfile.table` / :meth:`GraphProfile.rows`: ``graph`` keeps the graph's
#: order; the others sort by that figure, largest first.
NODE_ORDERS: Final = (
    "graph",
    "saved",
    "fwd_in",
    "fwd_tmp",
    "fwd_out",
    "bwd_tmp",
    "bwd_out",
    "flops",
    "fwd_flops",
    "bwd_flops",
)


@dataclass(frozen=True)
class GraphProfile:
    """The node-level profile of one training step (first step; see :func:`profile_graph`)."""

    nodes: tuple[NodeProfile, ...]
    """One per graph node, in graph order."""
    outside: NodeProfile
    """What ran outside the graph: the loss, the seed gradient of backward, and the like."""
    device: str
    precision: str
    seconds: float
    """Wall seconds of the simulation."""
    graph_module: torch.fx.GraphModule = field(repr=False, compare=False)
    """The graph that ran (the one given, or the trace of the module given); see :func:`annotate`."""

    @property
    def totals(self) -> GraphTotals:
        every = (*self.nodes, self.outside)
        return GraphTotals(
            saved_bytes=sum(n.saved for n in every),
            fwd_flops=sum(n.fwd_flops for n in every),
            bwd_flops=sum(n.bwd_flops for n in every),
            fwd_other_flops=sum(n.fwd_other_flops for n in every),
            bwd_other_flops=sum(n.bwd_other_flops for n in every),
        )

    def node(self, name: str) -> NodeProfile:
        """The profile of the node called ``name`` (``KeyError`` if there is none)."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def ordered(self, by: str = "graph", top: int | None = None) -> list[NodeProfile]:
        """The nodes in graph order (``by="graph"``) or by a figure, largest first; the first ``top``."""
        if by not in NODE_ORDERS:
            raise ValueError(f"by must be one of {', '.join(NODE_ORDERS)}; got {by!r}")
        if top is not None and top < 0:
            raise ValueError(f"top must be at least 0; got {top}")
        nodes = list(self.nodes)
        if by != "graph":
            nodes.sort(key=lambda n: getattr(n, by), reverse=True)  # stable: graph order among ties
        return nodes if top is None else nodes[:top]

    def rows(self, by: str = "graph", top: int | None = None) -> list[dict[str, Any]]:
        """Plain data, one dict per node (its fields and ``saved``), for ``--json``."""
        return [_row(n) for n in self.ordered(by, top)]

    def to_json(self, by: str = "graph", top: int | None = None) -> dict[str, Any]:
        """``{"nodes": rows, "outside": row, "totals": {...}, "device", "precision", "seconds"}``."""
        return {
            "nodes": self.rows(by, top),
            "outside": _row(self.outside),
            "totals": asdict(self.totals),
            "device": self.device,
            "precision": self.precision,
            "seconds": round(self.seconds, 4),
        }

    def table(self, top: int | None = None, by: str = "graph") -> str:
        """A text table: one row per node (bytes in binary units, FLOPs in decimal ones), then the
        ``(outside)`` row and the totals.

        Example:
            >>> import torch
            >>> p = profile_graph(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
            ...                   torch.randn(2, 8))
            >>> print(p.table(top=1, by="saved"))
            node       op           target  fwd_in  fwd_tmp  fwd_out  bwd_tmp  bwd_out  fwd FLOPs  bwd FLOPs
            _1         call_module  1          0 B     64 B     64 B      0 B     64 B     0 FLOP     0 FLOP
            (outside)  outside      loss       0 B      0 B      0 B      0 B      4 B     0 FLOP     0 FLOP
            total                              0 B     64 B                              256 FLOP   256 FLOP
        """
        shown = self.ordered(by, top)
        header = (
            "node",
            "op",
            "target",
            "fwd_in",
            "fwd_tmp",
            "fwd_out",
            "bwd_tmp",
            "bwd_out",
            "fwd FLOPs",
            "bwd FLOPs",
        )
        body = [_cells(n) for n in (*shown, self.outside)]
        t = self.totals
        saved_in = sum(n.fwd_in for n in (*self.nodes, self.outside))
        total = (
            "total",
            "",
            "",
            format_bytes(saved_in),
            format_bytes(t.saved_bytes - saved_in),
            "",
            "",
            "",
            human_flops(t.fwd_flops),
            human_flops(t.bwd_flops),
        )
        return _render([header, *body, total], right_from=3)


def _row(n: NodeProfile) -> dict[str, Any]:
    row = asdict(n)
    row["saved"] = n.saved
    return row


def _cells(n: NodeProfile) -> tuple[str, ...]:
    return (
        n.name,
        n.op,
        _shorten(n.target, 40),
        format_bytes(n.fwd_in),
        format_bytes(n.fwd_tmp),
        format_bytes(n.fwd_out),
        format_bytes(n.bwd_tmp),
        format_bytes(n.bwd_out),
        human_flops(n.fwd_flops),
        human_flops(n.bwd_flops),
    )


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _render(rows: Sequence[Sequence[str]], right_from: int) -> str:
    """Columns two spaces apart; those from ``right_from`` on right-aligned, except in the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [
            c.rjust(w) if i >= right_from and k > 0 else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the run


def trace(model: nn.Module) -> torch.fx.GraphModule:
    """``model`` itself if it is a ``GraphModule``, else its ``torch.fx.symbolic_trace``.

    The trace shares the model's submodules and parameters (nothing is copied).

    Raises:
        TraceError: fx cannot trace the model; the message carries fx's reason.

    Example:
        >>> import torch
        >>> class Branchy(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x if x.sum() > 0 else -x
        >>> trace(Branchy())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_memest.errors.TraceError: torch.fx cannot trace Branchy: ... control flow...
    """
    if isinstance(model, torch.fx.GraphModule):
        return model
    try:
        return torch.fx.symbolic_trace(model)
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}: {reason} "
            "(estimate_step still gives the module-level report of this model)"
        ) from exc


def profile_graph(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn = sum_loss,
    precision: str = "32-true",
    device: str | torch.device | None = None,
) -> GraphProfile:
    """Profile one training step of ``model`` node by node, on fake tensors (see the module docstring).

    Args:
        model: a ``torch.fx.GraphModule``, or a module to trace with ``torch.fx.symbolic_trace``; real,
            meta-device or fake weights. It is left exactly as it was.
        example_inputs: the batch, as ``estimate_step`` takes it: ``loss_fn(model, example_inputs)``
            runs the forward (the default calls the model with it: a tensor, a tuple of positional
            arguments, or a dict of keyword arguments).
        loss_fn: ``loss_fn(model, batch) -> loss``; the default sums the model's (first) output.
        precision: Lightning's precision names (``32-true``, ``16-mixed``, ``bf16-mixed``, ``16-true``,
            ``bf16-true``).
        device: where the step would run; defaults to the model's device (``cpu`` for meta models).

    Raises:
        TraceError: the model cannot be traced (``estimate_step`` still works for it).
        EstimationError: the step fails on fake tensors.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3))
        >>> p = profile_graph(model, torch.randn(1, 3, 16, 16))
        >>> p.node("_1").fwd_in == 8 * 14 * 14 * 4  # the second conv saves its input, the first's output
        True
    """
    checked = check_precision(precision)
    gm = trace(model)
    config = StepConfig(loss_fn=loss_fn, optimizer=None, precision=checked)
    recorder = _Recorder(gm)
    start = time.perf_counter()
    with _interpreted(gm, recorder):
        sim = simulate(
            gm,
            example_inputs,
            recorder.runner_factory(config),
            device=device,
            steps=1,
            capture=captures_flops,
            precision=checked,
        )
    seconds = time.perf_counter() - start
    nodes, outside = _profiles(gm, sim.events, recorder)
    return GraphProfile(nodes, outside, str(sim.device), checked, seconds, gm)


def annotate(gm: torch.fx.GraphModule, profile: GraphProfile) -> torch.fx.GraphModule:
    """Set ``node.meta["memest"]`` to its :class:`NodeProfile` on every node of ``gm`` that has one
    (matched by name), for activation-checkpoint planners and other graph passes; returns ``gm``.

    Example:
        >>> import torch
        >>> p = profile_graph(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), torch.randn(2, 4))
        >>> gm = annotate(p.graph_module, p)
        >>> [n.meta["memest"].fwd_tmp for n in gm.graph.nodes]  # tanh saves its output
        [0, 0, 32, 0]
    """
    by_name = {n.name: n for n in profile.nodes}
    for node in gm.graph.nodes:
        found = by_name.get(node.name)
        if found is not None:
            node.meta[META_KEY] = found
    return gm


def annotated_graph_module(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn = sum_loss,
    precision: str = "32-true",
    device: str | torch.device | None = None,
) -> torch.fx.GraphModule:
    """:func:`profile_graph`, then the graph that ran with each ``node.meta["memest"]`` set.

    Example:
        >>> import torch
        >>> gm = annotated_graph_module(torch.nn.Linear(4, 2), torch.randn(3, 4))
        >>> [(n.op, n.meta["memest"].fwd_flops) for n in gm.graph.nodes]  # a Linear traced into F.linear
        [('placeholder', 0), ('get_attr', 0), ('get_attr', 0), ('call_function', 48), ('output', 0)]
    """
    profile = profile_graph(model, example_inputs, loss_fn=loss_fn, precision=precision, device=device)
    return annotate(profile.graph_module, profile)


# ------------------------------------------------------------------------------------------ recording


# A mark says that from event index ``at`` on, events belong to ``owner`` (a node's index in the graph,
# or _OUTSIDE), in forward or in backward.
_Mark = tuple[int, int, bool]


class _Recorder:
    """Marks in the tracker's event stream where each node's forward and backward begin and end."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.index = {node: i for i, node in enumerate(gm.graph.nodes)}
        self.events: list[Event] = []
        self.tracker: Tracker | None = None
        self.marks: list[_Mark] = []
        self.outputs: dict[int, set[int]] = {}  # node index -> storage handles of its outputs
        self.backward = False

    def runner_factory(self, config: StepConfig) -> Callable[[nn.Module, StepListener], Runner]:
        def make(model: nn.Module, listener: StepListener) -> Runner:
            if not isinstance(listener, Tracker):  # simulate passes its tracker
                raise TypeError(f"expected the engine's Tracker as listener; got {type(listener).__name__}")
            self.tracker = listener
            self.events = listener.events
            return StepRunner(model, config, listener=_PhaseListener(listener, self))

        return make

    def mark(self, owner: int, backward: bool) -> None:
        self.marks.append((len(self.events), owner, backward))

    def on_phase(self, phase: Phase) -> None:
        self.backward = phase is Phase.BACKWARD
        self.mark(_OUTSIDE, self.backward)

    def run_graph(self, interpreter: _NodeInterpreter, args: tuple[Any, ...]) -> Any:
        # Autograd nodes of tensors made before the graph runs (in loss_fn) are not the first node's.
        self.claim(args, _OUTSIDE)
        try:
            return interpreter.run(*args)
        finally:
            self.mark(_OUTSIDE, False)

    def run_node(self, interpreter: _NodeInterpreter, node: torch.fx.Node) -> Any:
        owner = self.index[node]
        self.mark(owner, False)
        result = torch.fx.Interpreter.run_node(interpreter, node)
        self.mark(_OUTSIDE, False)
        tracker = self.tracker
        if tracker is not None:
            handles = self.outputs.setdefault(owner, set())
            for t in tree_leaves(result):
                if isinstance(t, Tensor):
                    handle = tracker.handle_of(t)
                    if handle is not None:
                        handles.add(handle)
        if torch.is_grad_enabled():
            self.claim(result, owner)
        return result

    def claim(self, values: Any, owner: int) -> None:
        """Give ``owner`` every autograd node behind ``values`` that no earlier node claimed, with a
        pre-hook that marks its backward. The owner is kept in the node's ``metadata``, not here: a
        reference to an autograd node would keep its graph (and saved tensors) alive."""
        stack = [t.grad_fn for t in tree_leaves(values) if isinstance(t, Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            # A dict property on every autograd node (``torch.autograd.graph.Node`` declares a method).
            meta: dict[str, int] = fn.metadata  # type: ignore[assignment]
            if _GRAD_FN_KEY in meta:
                continue
            meta[_GRAD_FN_KEY] = owner
            fn.register_prehook(self._backward_hook(owner))
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)

    def _backward_hook(self, owner: int) -> Callable[[Any], None]:
        def hook(_: Any) -> None:
            self.mark(owner, True)

        return hook


class _PhaseListener:
    """The tracker's step listener, also telling the recorder where each phase begins."""

    def __init__(self, tracker: Tracker, recorder: _Recorder) -> None:
        self.tracker = tracker
        self.recorder = recorder

    def on_phase(self, phase: Phase, step: int) -> None:
        self.tracker.on_phase(phase, step)
        self.recorder.on_phase(phase)

    def on_gradients(self, grads: list[Tensor]) -> None:
        self.tracker.on_gradients(grads)

    def on_optimizer_state(self, state: list[Tensor]) -> None:
        self.tracker.on_optimizer_state(state)

    def on_communication(self, buffers: list[Tensor]) -> None:
        self.tracker.on_communication(buffers)


class _NodeInterpreter(torch.fx.Interpreter):
    """Runs the graph node by node, telling the recorder which node runs."""

    def __init__(self, gm: torch.fx.GraphModule, recorder: _Recorder) -> None:
        super().__init__(gm)
        self.recorder = recorder

    def run_node(self, n: torch.fx.Node) -> Any:
        return self.recorder.run_node(self, n)


@contextmanager
def _interpreted(gm: torch.fx.GraphModule, recorder: _Recorder) -> Iterator[None]:
    """While inside, calling ``gm`` runs its graph through a :class:`_NodeInterpreter` (module hooks
    still fire: ``gm.__call__`` is untouched, only its ``forward`` is replaced)."""
    signature = inspect.signature(gm.forward)
    had = "forward" in vars(gm)
    previous = vars(gm).get("forward")

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = _positional(bound)
        return recorder.run_graph(_NodeInterpreter(gm, recorder), args)

    setattr_raw(gm, "forward", forward)
    try:
        yield
    finally:
        if had:
            setattr_raw(gm, "forward", previous)
        else:
            del vars(gm)["forward"]


def _positional(bound: inspect.BoundArguments) -> tuple[Any, ...]:
    args: list[Any] = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            args.extend(value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            raise TypeError("a GraphModule with **kwargs cannot be profiled node by node")
        else:
            args.append(value)
    return tuple(args)


# ------------------------------------------------------------------------------------------ accounting


def _owners(events: Sequence[Event], marks: Sequence[_Mark]) -> Iterator[tuple[Event, int, bool]]:
    """Each event of the first step with its owner and whether it is in backward."""
    owner, backward = _OUTSIDE, False
    m = 0
    for i, e in enumerate(events):
        while m < len(marks) and marks[m][0] <= i:
            _, owner, backward = marks[m]
            m += 1
        if type(e) is OpEvent and e.step > 0:
            return
        yield e, owner, backward


def _profiles(
    gm: torch.fx.GraphModule, events: Sequence[Event], recorder: _Recorder
) -> tuple[tuple[NodeProfile, ...], NodeProfile]:
    graph_nodes = list(gm.graph.nodes)
    n = len(graph_nodes)
    # Figures by slot: a node's index in the graph, and n for what ran outside the graph.
    fwd_in = [0] * (n + 1)
    fwd_tmp = [0] * (n + 1)
    own_live = [0] * (n + 1)  # bytes a slot's backward allocated that are alive now
    own_high = [0] * (n + 1)
    out_at_end = [0] * (n + 1)  # own_live when its backward last ended
    names = [node.name for node in graph_nodes] + [""]  # "": count_flops' root
    roles = final_roles(events)
    allocated: dict[int, int] = {}  # storage -> bytes at allocation (as ModuleStats.saved_bytes has it)
    size: dict[int, int] = {}  # storage -> bytes now
    made_by: dict[int, tuple[int, bool]] = {}  # storage -> (slot, in backward) at its allocation
    backward_live: dict[int, int] = {}  # storage -> slot, for storages a backward allocated
    seen: set[int] = set()
    relabelled: list[Event] = []  # the ops, with their node's name as their module (for count_flops)
    previous: tuple[int, bool] = (n, False)
    for e, owner, backward in _owners(events, recorder.marks):
        s = owner if owner != _OUTSIDE else n
        if (s, backward) != previous:
            if previous[1]:
                out_at_end[previous[0]] = own_live[previous[0]]
            previous = (s, backward)
        kind = type(e)
        if kind is OpEvent:
            assert isinstance(e, OpEvent)
            relabelled.append(replace(e, module=names[s]))
        elif kind is Alloc:
            assert isinstance(e, Alloc)
            allocated[e.storage] = size[e.storage] = e.nbytes
            made_by[e.storage] = (s, backward)
            if backward:
                backward_live[e.storage] = s
                own_live[s] += e.nbytes
                own_high[s] = max(own_high[s], own_live[s])
        elif kind is Free:
            assert isinstance(e, Free)
            o = backward_live.pop(e.storage, None)
            if o is not None:
                own_live[o] -= size[e.storage]
        elif kind is Resize:
            assert isinstance(e, Resize)
            o = backward_live.get(e.storage)
            if o is not None:
                own_live[o] += e.nbytes - size[e.storage]
                own_high[o] = max(own_high[o], own_live[o])
            size[e.storage] = e.nbytes
        elif kind is Tag:
            assert isinstance(e, Tag)
            if (
                e.role is not Role.ACTIVATION
                or e.storage in seen
                or roles.get(e.storage) is not Role.ACTIVATION
            ):
                continue
            seen.add(e.storage)  # counted once, for the first node that saves it
            nbytes = allocated.get(e.storage, 0)
            if made_by.get(e.storage, (-1, False))[0] == s:
                fwd_tmp[s] += nbytes
            else:
                fwd_in[s] += nbytes
    if previous[1]:
        out_at_end[previous[0]] = own_live[previous[0]]

    flop_count = count_flops(relabelled)
    node_flops = {m.path: m for m in flop_count.modules}

    def fwd_out(i: int) -> int:
        handles = recorder.outputs.get(i, set())
        return sum(allocated.get(h, 0) for h in handles if made_by.get(h) == (i, False))

    profiles = []
    for i, node in enumerate(graph_nodes):
        counted = node_flops.get(node.name)
        profiles.append(
            NodeProfile(
                name=node.name,
                op=node.op,
                target=_target(node),
                fwd_in=fwd_in[i],
                fwd_tmp=fwd_tmp[i],
                fwd_out=fwd_out(i),
                bwd_tmp=max(own_high[i] - out_at_end[i], 0),
                bwd_out=out_at_end[i],
                fwd_flops=counted.forward if counted else 0,
                bwd_flops=counted.backward if counted else 0,
                fwd_other_flops=counted.other_forward if counted else 0,
                bwd_other_flops=counted.other_backward if counted else 0,
            )
        )
    root = node_flops.get("")

    def rest(field_name: str) -> int:
        total = getattr(root, field_name) if root is not None else 0
        return int(
            total - sum(getattr(node_flops[p.name], field_name) for p in profiles if p.name in node_flops)
        )

    outside = NodeProfile(
        name="(outside)",
        op="outside",
        target="loss",
        fwd_in=fwd_in[n],
        fwd_tmp=fwd_tmp[n],
        fwd_out=0,
        bwd_tmp=max(own_high[n] - out_at_end[n], 0),
        bwd_out=out_at_end[n],
        fwd_flops=rest("forward"),
        bwd_flops=rest("backward"),
        fwd_other_flops=rest("other_forward"),
        bwd_other_flops=rest("other_backward"),
    )
    return tuple(profiles), outside


def _target(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:
        return getattr(target, "__name__", repr(target))


# ------------------------------------------------------------------------------------------ modules


#: ``by`` values of :func:`module_rows` / :func:`module_table`: ``tree`` is depth-first module order.
MODULE_ORDERS: Final = ("tree", "saved", "parameters", "forward_peak", "backward_peak", "flops")

_MODULE_SORT: Final[Mapping[str, Callable[[ModuleStats], int]]] = {
    "saved": lambda m: m.saved_bytes,
    "parameters": lambda m: m.parameter_bytes,
    "forward_peak": lambda m: m.forward_peak_bytes or 0,
    "backward_peak": lambda m: m.backward_peak_bytes or 0,
    "flops": lambda m: (m.forward_flops or 0) + (m.backward_flops or 0),
}


def module_rows(
    modules: ModuleStats, by: str = "tree", top: int | None = None, *, leaves_only: bool = False
) -> list[dict[str, Any]]:
    """The module-level counterpart of :meth:`GraphProfile.rows`: one dict per module of an estimate's
    tree (``estimate_step(...).modules``; figures of the first step, each module including its
    children), in tree order or sorted by a figure, largest first.

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> est = estimate_step(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
        ...                     torch.randn(2, 4), steps=1)
        >>> [(r["path"], r["saved_bytes"]) for r in module_rows(est.modules, by="saved")]
        [('', 32), ('1', 32), ('0', 0)]
    """
    if by not in MODULE_ORDERS:
        raise ValueError(f"by must be one of {', '.join(MODULE_ORDERS)}; got {by!r}")
    if top is not None and top < 0:
        raise ValueError(f"top must be at least 0; got {top}")
    chosen = [m for m in modules.walk() if not leaves_only or not m.children]
    if by != "tree":
        chosen.sort(key=_MODULE_SORT[by], reverse=True)
    if top is not None:
        chosen = chosen[:top]
    return [{f.name: getattr(m, f.name) for f in fields(m) if f.name != "children"} for m in chosen]


def module_table(
    modules: ModuleStats, by: str = "tree", top: int | None = None, *, leaves_only: bool = False
) -> str:
    """:func:`module_rows` as a text table like :meth:`GraphProfile.table`.

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> est = estimate_step(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
        ...                     torch.randn(2, 4), steps=1)
        >>> print(module_table(est.modules, by="saved", top=2))
        module  type        params  saved  fwd peak  bwd peak  fwd FLOPs  bwd FLOPs
        (root)  Sequential    80 B   32 B     176 B     232 B    64 FLOP    64 FLOP
        1       ReLU           0 B   32 B     176 B     184 B     0 FLOP     0 FLOP
    """
    rows = module_rows(modules, by, top, leaves_only=leaves_only)
    header = ("module", "type", "params", "saved", "fwd peak", "bwd peak", "fwd FLOPs", "bwd FLOPs")

    def maybe(value: int | None, render: Callable[[int], str]) -> str:
        return "-" if value is None else render(value)

    body = [
        (
            r["path"] or "(root)",
            r["type_name"],
            format_bytes(r["parameter_bytes"]),
            format_bytes(r["saved_bytes"]),
            maybe(r["forward_peak_bytes"], format_bytes),
            maybe(r["backward_peak_bytes"], format_bytes),
            maybe(r["forward_flops"], human_flops),
            maybe(r["backward_flops"], human_flops),
        )
        for r in rows
    ]
    return _render([header, *body], right_from=2)
