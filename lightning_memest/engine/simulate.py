"""Run training steps on fake tensors and return the event stream: the engine's one entry point.

Knows nothing of accounting or reports: ``accounting.account`` turns the stream into numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_memest.batches import iter_tensors, map_tensors
from lightning_memest.engine.autograd_threads import settle_device_threads
from lightning_memest.engine.collector import collector_off
from lightning_memest.engine.compiled import (
    compile_failure,
    compiled_modules,
    eager_compiled,
    inside_compiled,
    simulated_compiles,
)
from lightning_memest.engine.cuda_autocast import cuda_autocast_lists
from lightning_memest.engine.cuda_paths import cuda_code_paths
from lightning_memest.engine.events import DataDependent, Event, OpEvent, Phase, PhaseStart, Role
from lightning_memest.engine.fake import (
    FakeConverter,
    fake_module,
    local_tensor,
    outermost_modules,
    resident_tensors,
    swappable_fakes,
)
from lightning_memest.engine.hooks import module_scopes, saved_tensor_tags, storage_resizes
from lightning_memest.engine.parallel.arrived import strip_fully_shard
from lightning_memest.engine.parallel.distributed import DDP, fake_process_group
from lightning_memest.engine.parallel.fake_groups import untracked_sharding_propagation
from lightning_memest.engine.parallel.meta_init import initialised_sharded
from lightning_memest.engine.parallel.pipeline import Pipeline
from lightning_memest.engine.real_path import real_path
from lightning_memest.engine.replay.block_replay import (
    ReplayMismatch,
    ReplayTracker,
    block_replay,
)
from lightning_memest.engine.replay.blocks import repeated_blocks
from lightning_memest.engine.replay.optimizer_replay import optimizer_replay
from lightning_memest.engine.step import (
    Precision,
    RunnerFactory,
    StepConfig,
    StepRunner,
    autocast_dtype,
    plain_runner,
    true_dtype,
)
from lightning_memest.engine.tracker import CaptureFilter, Tracker
from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode
from lightning_memest.engine.values.followed_values import (
    AssumedReadFailure,
    following_values,
    not_followable,
    unfollowed,
    values_followed,
)
from lightning_memest.errors import EstimationError

__all__ = ["ModuleNode", "Simulation", "simulate", "simulate_replaying"]


@dataclass(frozen=True)
class ModuleNode:
    """The module tree as the simulation found it: a module's path, class name and children (in
    ``named_children`` order), for per-module figures that need no live model."""

    path: str
    type_name: str
    children: tuple[ModuleNode, ...]

    @staticmethod
    def of(module: nn.Module, path: str = "") -> ModuleNode:
        return ModuleNode(
            path,
            type(module).__name__,
            tuple(
                ModuleNode.of(child, f"{path}.{name}" if path else name)
                for name, child in module.named_children()
            ),
        )


@dataclass(frozen=True)
class Simulation:
    """What a fake run of training steps produced."""

    events: list[Event]
    device: torch.device
    """The device the step was simulated on."""
    steps: int
    seconds: float
    """Wall seconds of the simulation (conversion to fake tensors and the steps)."""
    precision: Precision
    """The step's precision (``StepConfig.precision``)."""
    modules: ModuleNode
    """The model's module tree."""
    batch_shapes: tuple[tuple[tuple[int, ...], ...], ...]
    """Per simulated step, the shapes of its batch's tensors."""
    value_reads: int
    """How often the step's code read tensor values (known ones, or assumed by the data-dependent
    policy): where it did, a batch with other values may need another memory."""
    what_if: str | None = None
    """``"cuda"`` when CUDA was asked for on a machine without one: the step ran on fake CPU tensors
    with CUDA's optimizer defaults, and the accounting treats it as CUDA (approximate)."""
    real_ops: tuple[tuple[str, int], ...] = ()
    """Ops whose fake kernel failed, run for real on stand-ins (``engine.real_ops``), with their calls."""
    replayed_blocks: tuple[tuple[str, int], ...] = ()
    """Per group of repeated blocks (its container's path), how many blocks of a step were replayed
    rather than run (``engine.replay.block_replay``); empty where none were."""
    replayed_updates: int = 0
    """How many parameters' iterations of torch.optim's loops (state creation, update) were replayed
    rather than run, over all steps (``engine.replay.optimizer_replay``)."""
    replay_note: str | None = None
    """Where replay was asked for and alike blocks were found but not replayed, why (the first check
    that failed, per container), or that the step was simulated again without replay and why; ``None``
    otherwise."""
    compiled: tuple[str, ...] = ()
    """The modules ``torch.compile`` compiled (``engine.compiled.compiled_modules``)."""
    compiled_eagerly: str | None = None
    """Where compiled code ran its eager code here rather than what ``torch.compile`` made of it, why
    (asked for: ``eager=True``, or its compile failed on fake tensors); ``None`` where it ran compiled."""
    compiled_graphs: tuple[str, ...] = ()
    """The inductor graphs the step ran, compiled, on fake tensors, in call order (``0_forward``...)."""
    compile_seconds: float = 0.0
    """Of ``seconds``, the time dynamo, AOTAutograd and inductor spent compiling (cache hits included)."""
    eval_modules: tuple[str, ...] = ()
    """The outermost modules in eval mode when the step began, simulated so (as Lightning runs them)."""
    followed_note: str | None = None
    """Where the step failed after an assumed read and was simulated again on this batch's values and the
    model's weights (``engine.values.followed_values``), the failure; ``None`` otherwise."""

    @property
    def is_cuda(self) -> bool:
        """Whether the step is CUDA's: simulated on a GPU, or a CUDA what-if."""
        return self.device.type == "cuda" or self.what_if == "cuda"


def simulate(
    model: nn.Module,
    batch: Any,
    config: StepConfig,
    *,
    runner: RunnerFactory = plain_runner,
    device: str | torch.device | None = None,
    steps: int = 2,
    capture: CaptureFilter | None = None,
    next_batches: Sequence[Any] = (),
    residents: Sequence[Tensor] = (),
    kept: Sequence[tuple[Tensor, Role]] = (),
    companions: Sequence[nn.Module] = (),
    replay_blocks: bool = False,
    eager: bool = False,
    cuda_capability: tuple[int, int] | None = None,
) -> Simulation:
    """Run ``steps`` training steps of ``model`` on fake tensors of ``device``; record every event.

    ``config`` says what a step does (its precision converts the batch and weights for ``*-true``;
    with a ``strategy``, DDP or FSDP, the step runs as one rank of it on a fake process group, see
    ``engine.parallel.distributed``). ``runner`` builds what runs each step: the plain :class:`StepRunner` by
    default, or another (the Lightning adapter's fit-loop runner), from the same config. ``model`` is
    left exactly as it was (see ``engine.fake``), and so are the global random generators (torch's,
    NumPy's, Python's), whatever the step draws and however it ends. Libraries take the code path of
    a real eager run, with the values it reads (``engine.real_path``). ``capture`` picks the ops whose
    full call (argument shapes) is recorded.

    ``batch`` is the first step's batch; ``next_batches`` those of the steps after it (the last one
    repeats; none: ``batch`` every step), each resident from its step on, its predecessor gone (a
    dataloader whose batches change shape: dynamic padding). ``residents`` are tensors alive on the
    device that are not the step's own -- other callbacks' state (an EMA copy of the weights), metric
    states, a dataset held in memory; real, fake or meta (of the right size): they count as
    ``Role.OTHER``. ``kept`` are tensors of the training state that stay alive through a step that
    does not make them, each with its role: the gradients and the optimizer's state through a
    validation batch inside ``fit``. ``companions`` are modules beside ``model`` whose state the step
    updates -- the averaged copy of the weights a callback updates after each optimizer step (see
    ``adapter.weight_averaging``): faked for the simulation as ``model`` is (and left as they were),
    in their own dtype, resident as ``Role.OTHER`` in place of their real tensors among ``residents``,
    the values of their small integer tensors known (a counter decides the first update).
    ``replay_blocks`` replays repeated blocks where they repeat (``engine.replay.block_replay``); where a
    check fails after a block was replayed it raises ``ReplayMismatch``: simulate again without.
    Compiled code (``torch.compile``'d modules and functions) runs as compiled: dynamo, AOTAutograd and
    inductor compile it for real, and the buffer plan inductor generated runs on fake tensors
    (``engine.compiled``); ``eager=True`` runs its eager code instead, as does a step whose compile
    fails on fake tensors (simulated again eagerly: ``Simulation.compiled_eagerly`` says why). Blocks
    inside a compiled module are not replayed (dynamo traces them). In a CUDA what-if,
    ``cuda_capability`` is the GPU's (``None``: an A100): selective-checkpoint policies are shown the
    attention op CUDA runs on it (``engine.cuda_paths``).

    Example:
        >>> import torch
        >>> from lightning_memest.engine.step import StepConfig
        >>> sim = simulate(torch.nn.Linear(8, 8), torch.randn(4, 8), StepConfig(), steps=1)
        >>> sim.device, sim.steps, len(sim.events) > 0
        (device(type='cpu'), 1, True)
    """
    kwargs: dict[str, Any] = dict(
        runner=runner,
        device=device,
        steps=steps,
        capture=capture,
        next_batches=next_batches,
        residents=residents,
        kept=kept,
        companions=companions,
        replay_blocks=replay_blocks,
        cuda_capability=cuda_capability,
    )

    def run(eager_why: str | None) -> Simulation:
        try:
            return _simulate(model, batch, config, eager=eager_why, **kwargs)
        except AssumedReadFailure as failure:
            # It may be the assumption's doing: simulate again on the values (engine.values.followed_values).
            named = [(f"the parameter or buffer {n!r}", t) for n, t, _ in resident_tensors(model)]
            named += [("a batch tensor", t) for b in (batch, *next_batches) for t in iter_tensors(b)]
            why = not_followable(named)
            if why is not None:
                raise unfollowed(failure.error, why) from failure.error
            start = time.perf_counter()
            with following_values():
                sim = _simulate(model, batch, config, eager=eager_why, **kwargs)
            note = f"simulated again on this batch's values and the model's weights: {failure.error}"
            seconds = sim.seconds + time.perf_counter() - start
            return dataclasses.replace(sim, seconds=seconds, followed_note=note)

    if eager:
        return run(_ASKED_EAGER)
    try:
        return run(None)
    except EstimationError as exc:
        failure = compile_failure(exc)
        if failure is None:
            raise
    return run(f"its compile failed on fake tensors: {failure}")


#: ``Simulation.compiled_eagerly`` where ``eager=True`` asked for it.
_ASKED_EAGER = "asked for (eager=True)"


def _simulate(
    model: nn.Module,
    batch: Any,
    config: StepConfig,
    *,
    runner: RunnerFactory,
    device: str | torch.device | None,
    steps: int,
    capture: CaptureFilter | None,
    next_batches: Sequence[Any],
    residents: Sequence[Tensor],
    kept: Sequence[tuple[Tensor, Role]],
    companions: Sequence[nn.Module],
    replay_blocks: bool,
    eager: str | None,
    cuda_capability: tuple[int, int] | None,
) -> Simulation:
    """:func:`simulate`, compiled code run compiled, or eagerly where ``eager`` says why."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    target, what_if = _target_device(model, device)
    start = time.perf_counter()
    modules = ModuleNode.of(model)
    compiled, in_eval = compiled_modules(model), outermost_modules(model, lambda m: not m.training)
    on_meta = all(t.is_meta for _, t, _ in resident_tensors(model)) and any(True for _ in model.parameters())
    # Nothing can be compiled in a process that never imported dynamo (torch.compile imports it).
    as_compiled = eager is None and "torch._dynamo" in sys.modules
    inside, in_place = inside_compiled(model) if as_compiled else (frozenset(), ())
    groups = repeated_blocks(model) if replay_blocks and not inside else []  # before any hook of ours
    tracker = ReplayTracker(capture=capture) if groups else Tracker(capture=capture)
    mode = TrackingFakeTensorMode(tracker)
    settle_device_threads(mode)  # before the mode is first entered: no idle autograd threads
    precision, strategy = config.precision, config.strategy
    converter = FakeConverter(mode, target, true_dtype(precision))
    with ExitStack() as stack:
        stack.enter_context(collector_off())  # engine/collector.py: no collection inside a step
        stack.enter_context(_preserved_rng())
        if target.type == "cuda" or what_if == "cuda":
            stack.enter_context(_cuda_optimizer_defaults(what_if=what_if == "cuda"))
        if what_if == "cuda" and autocast_dtype(precision) is not None:
            stack.enter_context(cuda_autocast_lists())  # the CPU's autocast, with CUDA's op lists
        if what_if == "cuda":
            stack.enter_context(cuda_code_paths(tracker, cuda_capability))  # CUDA's branches, its op names
        record = stack.enter_context(simulated_compiles(mode)) if as_compiled else None
        if record is None:
            # compiled code runs eagerly, and is compiled at its first real call as it would have been
            stack.enter_context(eager_compiled())
        stack.enter_context(fake_module(model, converter))
        companion_reals = [t for c in companions for _, t, _ in resident_tensors(c)]
        residents = _besides(residents, companion_reals)
        plain = FakeConverter(mode, target, None)  # *-true converts the model, not a callback's copy
        for companion in companions:
            stack.enter_context(fake_module(companion, plain))
        batches = [batch, *next_batches]
        fakes = [converter.batch(b) for b in batches]
        fake_batch = fakes[0]
        # Libraries take the real eager run's code path: see engine.real_path.
        known = [(converter.tensor(t), t) for b in batches for t in iter_tensors(b)]
        known += [(plain.tensor(t), t) for t in companion_reals]
        values = stack.enter_context(
            real_path(mode, known, cpu_allocator=target.type == "cpu" and what_if is None)
        )
        values.on_read = tracker.value_read
        setup_start = len(tracker.events)
        for t, role, path in _residents(model, fake_batch):
            tracker.add_resident(t, role, path)
        companion_fakes = [t for c in companions for _, t, _ in resident_tensors(c)]
        for t in [*residents, *companion_fakes]:
            tracker.add_resident(t, Role.OTHER, "")
        for t, role in kept:
            tracker.add_resident(t, role, "")
        # Each module runs in the mode it is in, as Lightning's fit runs it (it keeps the modes the user
        # set: a from_pretrained model comes in eval, without dropout); no train() here.
        if strategy is not None and not isinstance(strategy, DDP):
            # a module that arrived parallelised is parallelised again, on fake tensors
            strip_fully_shard(model)
        if strategy is not None:
            stack.enter_context(fake_process_group(strategy))
            stack.enter_context(storage_resizes(tracker))
            stack.enter_context(untracked_sharding_propagation(mode.untracked))
        stack.enter_context(swappable_fakes(mode))
        stack.enter_context(_quiet_fake_kernel_failures())
        stack.enter_context(mode)
        stack.enter_context(module_scopes(model, tracker, inside=inside, in_place=in_place))
        stack.enter_context(saved_tensor_tags(tracker))
        replay = stack.enter_context(block_replay(groups, tracker)) if groups else None
        updates = stack.enter_context(optimizer_replay(groups, tracker)) if groups else None
        try:
            step = runner(model, config, tracker)
            if strategy is not None:
                # FSDP replaced the parameters by their shards: those are what this rank holds.
                others = [(t, Role.OTHER, "") for t in [*residents, *companion_fakes]]
                others += [(t, role, "") for t, role in kept]
                held = model
                if isinstance(strategy, Pipeline) and isinstance(step, StepRunner):
                    held = step.model  # a pipeline stage holds its part alone (the split left the rest)
                tracker.settle_residents([*_residents(held, fake_batch), *others])
                if on_meta and not isinstance(strategy, DDP):  # built on meta, sharded, then materialised
                    initialised_sharded(tracker.events, setup_start)
            current = fake_batch
            for i in range(steps):
                following = fakes[min(i, len(fakes) - 1)]
                if following is not current:
                    tracker.replace_inputs(list(iter_tensors(current)), list(iter_tensors(following)))
                    current = following
                # Each step gets its batch as a loader hands it, in containers of its own: a step that
                # writes into its batch's dicts (sentence-transformers' embeddings) leaves those writes
                # to that step alone. The tensors are the same fake ones (a resident input, its values).
                step.run(map_tensors(current, _same))
            tracker.end_step()
            # The steps' end: what follows frees the fake model, batch and optimizer (no step's memory).
            tracker.events.append(PhaseStart(steps, Phase.SETUP))
        except ReplayMismatch:
            raise
        except Exception as exc:
            if replay is not None and replay.stood_in():
                # Stand-ins ran before it failed: replay may be at fault (a device or a setting no test
                # reached), so the caller simulates again without it.
                raise ReplayMismatch(f"the replayed step failed: {type(exc).__name__}: {exc}") from exc
            error = (
                exc
                if isinstance(exc, EstimationError)
                else EstimationError(
                    f"the step failed on fake tensors: {type(exc).__name__}: {exc}",
                    op=_last_op(tracker.events),
                    module=tracker.module or None,
                )
            )
            assumed = any(isinstance(e, DataDependent) and not e.exact for e in tracker.events)
            if assumed and not values_followed():
                raise AssumedReadFailure(error) from exc  # simulate() follows the values, where it can
            if error is exc:
                raise
            raise error from exc
        del step
    seconds = time.perf_counter() - start
    shapes = tuple(
        tuple(tuple(t.shape) for t in iter_tensors(batches[min(i, len(batches) - 1)])) for i in range(steps)
    )
    reads = tracker.value_reads
    return Simulation(
        tracker.events,
        target,
        steps,
        seconds,
        precision,
        modules,
        shapes,
        reads,
        what_if,
        tuple(sorted(tracker.real_ops.items())),
        replayed_blocks=tuple(sorted(replay.replayed.items())) if replay is not None else (),
        replayed_updates=updates.count if updates is not None else 0,
        replay_note=replay.note() if replay is not None else None,
        compiled=compiled,
        compiled_eagerly=eager if compiled or eager not in (None, _ASKED_EAGER) else None,
        compiled_graphs=tuple(record.graphs) if record is not None else (),
        compile_seconds=record.seconds if record is not None else 0.0,
        eval_modules=in_eval,
    )


def _same(t: Tensor) -> Tensor:
    return t


def simulate_replaying(run: Callable[[bool], Simulation], replay: bool) -> Simulation:
    """``run(replay)``, a simulation with block replay on or off; where replay's checks fail after a
    stand-in ran (``ReplayMismatch``: the blocks did not repeat after all, or the step failed in any
    other way after a stand-in ran: a device or a setting no test reached), ``run(False)``, its
    seconds counting the attempt: replay never makes an estimate fail that would succeed without it.
    A step that fails before any stand-in ran fails once (its code is not run again)."""
    if not replay:
        return run(False)
    start = time.perf_counter()
    try:
        return run(True)
    except ReplayMismatch as exc:
        spent = time.perf_counter() - start
        sim = run(False)
        note = f"simulated again without replay: {exc}"
        return dataclasses.replace(sim, seconds=sim.seconds + spent, replay_note=note)


def _target_device(model: nn.Module, device: str | torch.device | None) -> tuple[torch.device, str | None]:
    """Where to simulate, and ``"cuda"`` for a what-if (CUDA asked for, none here: fake CPU tensors).

    Backward on fake CUDA tensors needs a real device (NOTES.md), so without one the step runs on the
    CPU and only the accounting is CUDA's.
    """
    if device is None:
        first = next((t for _, t, _ in resident_tensors(model)), None)
        device = "cpu" if first is None or first.device.type == "meta" else first.device
    target = torch.device(device)
    if target.type == "cuda":
        # MEMEST_CUDA_WHAT_IF=1 takes the what-if path on a GPU machine too, to measure it there.
        if not torch.cuda.is_available() or os.environ.get("MEMEST_CUDA_WHAT_IF") == "1":
            return torch.device("cpu"), "cuda"
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    elif target.type != "cpu":
        raise EstimationError(f"device must be cpu or cuda; got {target}")
    return target, None


@contextmanager
def _cuda_optimizer_defaults(what_if: bool) -> Iterator[None]:
    """torch.optim picks the ``foreach`` implementation by default on CUDA, whose intermediate tensor
    lists raise the optimizer step's peak. Its check looks at the parameters' type, which is
    ``FakeTensor`` here, and (for a what-if) at their device, which is the CPU: admit both."""
    import torch.optim.optimizer as optim_module

    supported = optim_module._foreach_supported_types
    name = "_get_foreach_kernels_supported_devices"  # looked up in optim.optimizer at each call
    original: Callable[[], list[str]] = getattr(optim_module, name)

    def with_cpu() -> list[str]:
        return [*original(), "cpu"]

    supported.append(FakeTensor)
    if what_if:
        setattr(optim_module, name, with_cpu)
    try:
        yield
    finally:
        supported.remove(FakeTensor)
        setattr(optim_module, name, original)


@contextmanager
def _quiet_fake_kernel_failures() -> Iterator[None]:
    """The fake mode logs every meta kernel that raises, with its traceback, at error level; the
    simulation handles those (``engine.real_ops`` runs the op for real, or the estimate says why it
    failed), so the user is not shown them."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def _preserved_rng() -> Iterator[None]:
    """Every global random generator as it was, on every way out (exceptions and interrupts too).

    The user's real step code runs in the simulation, and it, its data transforms and its libraries
    draw from or reseed any of them (timm's Mixup draws from NumPy's; activation checkpointing sets
    torch's). Training after an estimate must get the numbers it would have got without one: torch's
    CPU generator and, once CUDA is initialized, every CUDA device's (a CUDA generator not yet
    initialized has drawn nothing, and fake tensors draw nothing); NumPy's global generator (if NumPy
    is importable; not ``numpy.random.Generator`` objects, which are the user's own); Python's
    ``random``. ``torch.default_generator`` directly: the simulation replaces
    ``torch.get_rng_state`` (``engine.real_path``).
    """
    cpu = torch.default_generator.get_state()
    cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized
    cuda = torch.cuda.get_rng_state_all() if cuda_initialized() else None
    python = random.getstate()
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    try:
        yield
    finally:
        torch.default_generator.set_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)


def _numpy_random() -> Any:
    """``numpy.random`` (its global generator's functions), or ``None`` without NumPy."""
    try:
        import numpy.random
    except ImportError:
        return None
    return numpy.random


def _residents(model: nn.Module, batch: Any) -> list[tuple[Tensor, Role, str]]:
    found = [
        (t, Role.PARAMETER if is_param else Role.BUFFER, path)
        for path, t, is_param in resident_tensors(model)
    ]
    found.extend((t, Role.INPUT, "") for t in iter_tensors(batch))
    return found


def _besides(residents: Sequence[Tensor], own: Sequence[Tensor]) -> list[Tensor]:
    """``residents`` but those sharing a storage with ``own`` (the companions' real tensors, counted
    through their fake mirrors instead)."""
    mine = {_real_storage(t) for t in own} - {None}
    if not mine:  # no companion (the usual case; a batch-size search simulates many times)
        return list(residents)
    return [t for t in residents if _real_storage(t) not in mine]


def _real_storage(t: Tensor) -> int | None:
    if t.device.type == "meta" or isinstance(t, FakeTensor):
        return None
    return int(local_tensor(t).untyped_storage().data_ptr())


def _last_op(events: Sequence[Event]) -> str | None:
    for e in reversed(events):
        if isinstance(e, OpEvent):
            return e.op
    return None
