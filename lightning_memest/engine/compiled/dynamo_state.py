"""Dynamo compiling inside a simulation, as the real run will compile, and its state left as it was.

A compiled module in a simulation compiles for real: dynamo traces its frames (graph breaks and the
eager code between them included), AOTAutograd builds the joint graph and the partitioner picks what
is saved for backward (under the user's ``activation_memory_budget``), inductor plans the buffers --
the user's backend, mode and options, unchanged. Only running the result differs
(``engine.compiled.fake_graphs``). Inside :func:`simulated_compiles`:

* **The simulation's tracker is paused while anything compiles**: dynamo's frame conversion
  (``convert_frame._compile``), inductor's compile of each graph (``_compile_fx_inner``), and
  AOTAutograd's lazy compile of the backward at its first call. Compiling is not the step; and with the
  simulation's fake mode off, inductor compiles (and autotunes, where asked) as outside it.
* **The compiles go to a cache region of their own** (dynamo's ``isolate_recompiles``): lookups fall
  back to the run's entries, but the simulation's entries -- guarded on fake tensors -- are apart, count
  against no recompile limit of the run, and are all invalidated when the simulation ends.
* **The graphs are the run's**: dynamo annotates each graph input with its type, which is
  ``FakeTensor`` here and ``Parameter`` or ``Tensor`` in the run; the annotations are made the run's
  before the backend gets the graph, so AOTAutograd's and inductor's cache keys are the run's.
* **Dynamo's counters and its automatic-dynamic shape profile are put back**: the simulation's shapes
  do not make the run's first compile dynamic, and ``counters["frames"]`` says what the run compiled.
  What the compiles wrote to inductor's and AOTAutograd's on-disk caches stays: the run's first step
  finds its graphs there (compiled once).

Example:
    >>> import torch
    >>> from torch._dynamo.utils import counters
    >>> from lightning_memest.engine.tracker import Tracker
    >>> from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode
    >>> counters.clear()
    >>> mode = TrackingFakeTensorMode(Tracker())
    >>> net = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    >>> with simulated_compiles(mode) as record, mode:
    ...     _ = net(torch.ones(1, 2))
    >>> record.frames, dict(counters["frames"])  # compiled once, and nothing left behind
    (1, {})
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from types import CodeType
from typing import Any

from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode

__all__ = ["CompileRecord", "compile_failure", "simulated_compiles"]

#: The cache region of every simulation's compiles (one per process: each simulation clears its own).
_REGION: int | None = None


@dataclasses.dataclass
class CompileRecord:
    """What compiled during a simulation."""

    frames: int = 0
    """Frames dynamo compiled (a graph break starts another)."""
    graphs: list[str] = dataclasses.field(default_factory=list)
    """The inductor graphs run on fake tensors, by AOT id (``0_forward``, ``0_backward``), per call."""
    seconds: float = 0.0
    """Time spent compiling (tracing, AOTAutograd, inductor; cache lookups included)."""


@contextmanager
def simulated_compiles(mode: TrackingFakeTensorMode) -> Iterator[CompileRecord]:
    """Inside, compiled code compiles for real with ``mode``'s tracking paused, in a cache region of its
    own, and inductor's graphs run on fake tensors; dynamo's state is left as it was (module docstring).
    """
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.eval_frame as eval_frame
    from torch._dynamo import pgo
    from torch._dynamo.output_graph import OutputGraph
    from torch._dynamo.utils import counters
    from torch._functorch._aot_autograd.runtime_wrappers import _AutogradBackwardCompiler

    record = CompileRecord()
    region = _region(eval_frame)
    codes: dict[int, CodeType] = {}
    counted = {key: Counter(value) for key, value in counters.items()}
    profile = copy.deepcopy(pgo._CODE_STATE)

    def paused(fn: Callable[..., Any]) -> Callable[..., Any]:
        def compiling(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            depth.append(True)
            try:
                with mode.untracked(), _disable_current_modes():
                    return fn(*args, **kwargs)
            finally:
                depth.pop()
                if not depth:  # (inductor's compile runs inside dynamo's: counted once)
                    record.seconds += time.perf_counter() - start

        return compiling

    def compile_frame(code: CodeType, *args: Any, **kwargs: Any) -> Any:
        codes[id(code)] = code
        record.frames += 1
        inductor()
        return trace(code, *args, **kwargs)

    def call_user_compiler(graph: Any, gm: Any, example_inputs: Any) -> Any:
        _as_run_types(gm, example_inputs)
        return user_compiler(graph, gm, example_inputs)

    def inductor() -> None:
        """Inductor's parts, patched at the first compile (importing inductor takes seconds; a process
        that compiles nothing, as most Lightning processes, which import dynamo, never pays for it) --
        or at once where inductor was imported: a graph compiled before might run here."""
        if on_fake:
            return
        import torch._inductor.compile_fx as compile_fx

        from lightning_memest.engine.compiled.fake_graphs import inductor_graphs_on_fake

        stack.enter_context(inductor_graphs_on_fake(record.graphs.append))
        on_fake.append(True)
        patch(compile_fx, "_compile_fx_inner", paused(compile_fx._compile_fx_inner))

    def patch(owner: Any, name: str, value: Any) -> None:
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    on_fake: list[bool] = []
    depth: list[bool] = []
    originals: list[tuple[Any, str, Any]] = []
    trace = paused(convert_frame._compile)
    user_compiler = OutputGraph.call_user_compiler
    set_region = getattr(eval_frame, "set_eval_frame_isolate_recompiles_id")  # noqa: B009 (not exported)
    previous_region = set_region(region)  # frames entered by graph breaks outside a compiled call
    with ExitStack() as stack:
        try:
            patch(convert_frame, "_compile", compile_frame)
            patch(OutputGraph, "call_user_compiler", call_user_compiler)
            patch(eval_frame, "set_eval_frame_isolate_recompiles_id", lambda _: set_region(region))
            backward = _AutogradBackwardCompiler
            patch(backward, "get_or_compile", paused(backward.get_or_compile))  # AOT's lazy backward
            if "torch._inductor.output_code" in sys.modules:
                inductor()
            yield record
        finally:
            for owner, name, value in reversed(originals):
                setattr(owner, name, value)
            set_region(previous_region)
            _invalidate(codes.values(), region)
            _restore_counters(counters, counted)
            pgo._CODE_STATE = profile


def compile_failure(exc: BaseException) -> str | None:
    """Where ``exc`` (or an exception it was raised from) is dynamo's, AOTAutograd's or inductor's --
    a compile that failed, not the step -- what failed, in a line; else ``None``."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, BackendCompilerFailed):
            inner = current.inner_exception
            return f"backend {current.backend_name!r} raised {type(inner).__name__}: {_first_line(inner)}"
        if isinstance(current, TorchDynamoException):
            return f"{type(current).__name__}: {_first_line(current)}"
        current = current.__cause__ or current.__context__
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


def _as_run_types(gm: Any, example_inputs: Any) -> None:
    """Annotate ``gm``'s inputs as the run's: a fake parameter as ``Parameter``, any other fake tensor as
    ``Tensor`` (what the run passes there), and regenerate its code (which the cache keys hash)."""
    changed = False
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, value in zip(placeholders, example_inputs, strict=False):
        if isinstance(node.type, type) and issubclass(node.type, FakeTensor):
            node.type = nn.Parameter if isinstance(value, nn.Parameter) else Tensor
            changed = True
    if changed:
        gm.recompile()


def _region(eval_frame: Any) -> int:
    global _REGION
    if _REGION is None:
        _REGION = next(eval_frame._next_isolate_recompiles_id)
    return _REGION


def _invalidate(codes: Iterable[CodeType], region: int) -> None:
    """Drop every cache entry of ``region`` on ``codes``: a code with no other entries is reset (as
    ``torch._dynamo.reset`` resets it: no entry is left); on one the run compiled too (an estimate in the
    middle of a fit), the region's entries are invalidated (dynamo's own invalidation, for a module
    that died: they fail every lookup, and the run's region never looks at them)."""
    import torch._dynamo.eval_frame as eval_frame
    from torch._C._dynamo.eval_frame import reset_code
    from torch._dynamo.guards import DeletedGuardManagerWrapper

    for code in codes:
        ours = eval_frame._get_cache_entries_for_region(code, region)
        if len(ours) == eval_frame._get_total_cache_entry_count(code):
            reset_code(code)
            continue
        for entry in ours:
            extra = getattr(entry.guard_manager, "extra_state", None)
            if extra is not None:
                extra.invalidate(entry, DeletedGuardManagerWrapper("the simulation's compile"))


def _restore_counters(counters: Any, counted: dict[str, Counter[str]]) -> None:
    """Put dynamo's counters back in place (a caller holding ``counters["frames"]`` keeps its object)."""
    for key in list(counters):
        if key not in counted:
            del counters[key]
    for key, value in counted.items():
        current = counters[key]
        current.clear()
        current.update(value)
