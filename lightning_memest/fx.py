"""A node-level profile of a training step over a ``torch.fx`` graph: what each node saves for backward,
allocates, and computes (tracing, the recorder that marks which node runs, and the report; the figures
are computed by ``accounting/attribution.py``).

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
module-level report (``lightning_memest.report.tables`` renders that one the same way).

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, cast

import torch
import torch.fx
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_memest.accounting.attribution import OUTSIDE, NodeFigures
from lightning_memest.accounting.flops import captures_flops
from lightning_memest.accounting.replay import final_roles, walk
from lightning_memest.engine.events import Event, Mark, Phase
from lightning_memest.engine.fake import setattr_raw
from lightning_memest.engine.simulate import simulate
from lightning_memest.engine.step import (
    LossFn,
    Precision,
    Runner,
    StepConfig,
    StepListener,
    StepRunner,
    sum_loss,
)
from lightning_memest.engine.tracker import Tracker
from lightning_memest.errors import TraceError
from lightning_memest.report.nodes import NODE_ORDERS, GraphProfile, GraphTotals, NodeProfile

__all__ = [
    "META_KEY",
    "NODE_ORDERS",
    "GraphProfile",
    "GraphTotals",
    "NodeProfile",
    "annotate",
    "annotated_graph_module",
    "profile_graph",
    "trace",
]

#: The key of ``node.meta`` that :func:`annotate` sets.
META_KEY: Final = "memest"

_GRAD_FN_KEY = "lightning_memest.fx.node"  # marks an autograd node's owner in its ``metadata``


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
    config = StepConfig(loss_fn=loss_fn, optimizer=None, precision=cast(Precision, precision))
    gm = trace(model)
    recorder = _Recorder(gm)
    start = time.perf_counter()
    with _interpreted(gm, recorder):
        sim = simulate(
            gm, example_inputs, config, runner=recorder.runner, device=device, steps=1, capture=captures_flops
        )
    seconds = time.perf_counter() - start
    graph_nodes = list(gm.graph.nodes)
    figures = NodeFigures(final_roles(sim.events), [node.name for node in graph_nodes])
    walk(sim.events, figures)
    nodes, outside = figures.profiles(
        [(node.name, node.op, _target(node)) for node in graph_nodes], recorder.outputs
    )
    device, approximate = str(sim.device), sim.what_if is not None
    return GraphProfile(nodes, outside, device, config.precision, seconds, gm, approximate=approximate)


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


class _Recorder:
    """Marks in the tracker's event stream where each node's forward and backward begin and end."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.index = {node: i for i, node in enumerate(gm.graph.nodes)}
        self.events: list[Event] = []
        self.tracker: Tracker | None = None
        self.outputs: dict[int, set[int]] = {}  # node index -> storage handles of its outputs
        self.backward = False

    def runner(self, model: nn.Module, config: StepConfig, listener: StepListener) -> Runner:
        """The engine's runner factory: the plain step, telling this recorder where phases begin."""
        if not isinstance(listener, Tracker):  # simulate passes its tracker
            raise TypeError(f"expected the engine's Tracker as listener; got {type(listener).__name__}")
        self.tracker = listener
        self.events = listener.events
        return StepRunner(model, config, listener=_PhaseListener(listener, self))

    def mark(self, owner: int, backward: bool) -> None:
        # From here on, events belong to ``owner`` (a node's index in the graph, or OUTSIDE).
        self.events.append(Mark(owner, backward))

    def on_phase(self, phase: Phase) -> None:
        self.backward = phase is Phase.BACKWARD
        self.mark(OUTSIDE, self.backward)

    def run_graph(self, interpreter: _NodeInterpreter, args: tuple[Any, ...]) -> Any:
        # Autograd nodes of tensors made before the graph runs (in loss_fn) are not the first node's.
        self.claim(args, OUTSIDE)
        try:
            return interpreter.run(*args)
        finally:
            self.mark(OUTSIDE, False)

    def run_node(self, interpreter: _NodeInterpreter, node: torch.fx.Node) -> Any:
        owner = self.index[node]
        self.mark(owner, False)
        result = torch.fx.Interpreter.run_node(interpreter, node)
        self.mark(OUTSIDE, False)
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


def _target(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:
        return getattr(target, "__name__", repr(target))
