"""Ground truth: the memory of real training steps, measured by a mechanism independent of the estimator.

:func:`measure_step` runs :class:`~lightning_memest.engine.step.StepRunner` on the real model and batch
(it **trains the model in place**: parameters, buffers such as batch-norm statistics, and the optimizer it
builds all change; pass a copy if the model must stay as it was) and reports the peak bytes of each step.

How the peak is measured:

* **CPU** -- PyTorch's CPU allocator reports every allocation and free to the profiler. All steps run
  inside one ``torch.profiler.profile(activities=[CPU], profile_memory=True)``, each step inside
  ``record_function("memest_step_<i>")``. The ``"[memory]"`` events of
  ``prof.profiler.kineto_results.events()``, sorted by start time, are summed in order (``nbytes`` is
  negative on a free): the running sum is the bytes the allocator holds above what existed before
  profiling. The peak of step ``i`` is the bytes resident before profiling (see :func:`resident_bytes`)
  plus the largest running sum seen inside step ``i``'s ``record_function`` window, or at the window's
  start. The running sum carries what earlier steps left behind (optimizer state, momentum buffers), so
  the second step's peak includes it. Events between two windows (the harness dropping the previous
  step's returned loss) belong to no step's peak but are carried by the running sum.
  Measured this way a case is deterministic: the same step measured twice gives the same bytes.
  Allocations made outside PyTorch's allocator (the Python heap, oneDNN primitive caches, glibc arenas)
  are not counted -- only what PyTorch's allocator hands out, which is what the estimator models.
* **CUDA** -- ``torch.cuda.reset_peak_memory_stats()`` before each step and, after a synchronize,
  ``max_memory_allocated()`` / ``max_memory_reserved()`` after it. These count the caching allocator's
  blocks (sizes rounded up to 512 B and whole blocks), not the CUDA context.

For the ``*-true`` precisions the caller converts the model and the batch first (the ``memest`` CLI
does); :func:`measure_step` only runs the steps that ``config`` describes (autocast for ``*-mixed``).

Example:
    >>> import torch
    >>> from lightning_memest.engine.step import StepConfig
    >>> from lightning_memest.measure import measure_step
    >>> model = torch.nn.Linear(256, 512)
    >>> config = StepConfig(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> m = measure_step(model, torch.randn(64, 256), config, steps=2)
    >>> m.device, len(m.peak_bytes)
    ('cpu', 2)
    >>> m.first_step == m.steady_state  # plain SGD keeps no state between steps
    True
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import record_function

from lightning_memest.allocator_events import AllocatorTimeline, CpuMemoryProfile, quiet_gc, window_figures
from lightning_memest.batches import iter_tensors
from lightning_memest.engine.fake import local_tensor, resident_tensors
from lightning_memest.engine.inference_step import PlainLoop, loop_runner
from lightning_memest.engine.step import Runner, StepConfig, StepListener
from lightning_memest.engine.tracker import storages_of
from lightning_memest.report import format_bytes

__all__ = [
    "STEP_LABEL",
    "LiveTensorScan",
    "Measurement",
    "StepProbe",
    "cpu_step_peaks",
    "live_tensors",
    "measure_step",
    "module_tensors",
    "resident_blocks",
    "resident_bytes",
]

#: The ``record_function`` label of step ``i`` is ``f"{STEP_LABEL}{i}"``.
STEP_LABEL = "memest_step_"


@dataclass(frozen=True)
class Measurement:
    """The measured memory of real training steps.

    ``peak_bytes[i]`` is the largest number of bytes held by PyTorch's allocator during step ``i``,
    counting what was resident before it (parameters, buffers, batch, gradients and optimizer state).
    ``reserved_bytes`` is CUDA's ``max_memory_reserved()`` per step (``None`` on CPU).
    ``step_seconds`` is the mean wall time of one step: of the steps after the first when there are
    several (the first pays for lazy initialisation), and on CPU including the profiler's overhead.
    """

    peak_bytes: tuple[int, ...]
    reserved_bytes: tuple[int, ...] | None
    step_seconds: float
    device: str

    @property
    def first_step(self) -> int:
        """The peak of the first step (the optimizer creates its state here)."""
        return self.peak_bytes[0]

    @property
    def steady_state(self) -> int:
        """The peak of the last step measured, which later steps repeat."""
        return self.peak_bytes[-1]

    def __str__(self) -> str:
        """``'measured on cpu: step 1 191.66 MiB, step 2 290.19 MiB; 0.123 s per step'``."""
        peaks = ", ".join(f"step {i} {format_bytes(n)}" for i, n in enumerate(self.peak_bytes, 1))
        return f"measured on {self.device}: {peaks}; {self.step_seconds:.3f} s per step"


def module_tensors(model: nn.Module) -> Iterator[Tensor]:
    """Every tensor a module holds: parameters (and their grads), buffers, plain tensor attributes."""
    # Plain tensor attributes (caches such as positional encodings) are resident too.
    for _, t, _ in resident_tensors(model):
        yield t
    for p in model.parameters():
        if p.grad is not None:
            yield local_tensor(p.grad)


def live_tensors(device: torch.device, *, besides: Iterable[Tensor] = (), full: bool = True) -> list[Tensor]:
    """Every tensor alive in this process on ``device`` (a scan of the garbage collector's objects, after
    a collection), one per storage, but those sharing a storage with ``besides``: the memory that
    "simply sits there" -- another callback's copy of the weights, metric states, a dataset held in
    memory, a prefetched batch. Fake and meta tensors hold no memory and are left out.

    >>> kept = torch.ones(1000)
    >>> any(t.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
    ...     for t in live_tensors(torch.device("cpu")))
    True
    """
    # A full collection (a quarter of a second with transformers loaded): a young one leaves an earlier
    # fit's tensors in unreachable cycles counted (a sanity check +25 %). ``full=False``: a young one,
    # where a full one ran moments ago in the same trainer call (see ``LiveTensorScan``).
    gc.collect() if full else gc.collect(1)
    seen = {key for t in besides if t.device.type != "meta" for key in _storage_keys(t)}
    found: list[Tensor] = []
    # The tensors among the collector's objects, picked by exact type in C-level loops (a process with
    # Lightning and a model holds half a million objects; isinstance on each took twice as long, and
    # warned on some deprecated objects).
    kinds = _tensor_types()
    objects = gc.get_objects()
    candidates = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects
    for obj in candidates:
        if isinstance(obj, FakeTensor) or obj.device.type != device.type:
            continue
        if device.index is not None and obj.device.index not in (None, device.index):
            continue
        try:
            keys = [key for key in _storage_keys(obj) if key[0] != 0 and key not in seen]
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            continue
        if keys:
            seen.update(keys)
            found.append(obj)
    return found


class LiveTensorScan:
    """:func:`live_tensors` within one trainer call (a ``fit``, a ``validate``, ...), with a full
    collection only where it can matter. A full collection clears what earlier calls left in
    unreachable cycles (an earlier fit's tensors: a sanity check read +25 % without it), but costs a
    quarter of a second to seconds in a large process. So each scan collects young generations first;
    the first scan of the call then collects in full and scans again only where what it found is more
    than ``negligible`` bytes -- where it is not, no garbage among it can move the estimate by more.
    Garbage this call made that reached the old generation before it died stays counted until Python
    collects it.

    >>> scan = LiveTensorScan()
    >>> kept = torch.ones(1000)
    >>> first, later = scan(torch.device("cpu")), scan(torch.device("cpu"))
    >>> len(first) == len(later)
    True
    """

    def __init__(self) -> None:
        self.collected = False
        """Whether one of its scans needed a full collection (at most one does)."""

    def __call__(
        self, device: torch.device, *, besides: Iterable[Tensor] = (), negligible: int = 0
    ) -> list[Tensor]:
        known = list(besides)
        found = live_tensors(device, besides=known, full=False)
        if self.collected or resident_bytes(found) <= negligible:
            return found
        del found  # (held, the garbage among them would survive the collection)
        self.collected = True
        return live_tensors(device, besides=known, full=True)


def _tensor_types() -> set[type]:
    """``Tensor`` and every subclass of it defined now (``Parameter``, ``FakeTensor``, ...)."""
    found: set[type] = {Tensor}
    todo: list[type] = [Tensor]
    while todo:
        subclasses: list[type] = todo.pop().__subclasses__()
        for sub in subclasses:
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _storage_keys(t: Tensor) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each storage behind ``t`` (a sparse tensor's parts: two or three)."""
    return [(s.data_ptr(), s.nbytes()) for s in storages_of(local_tensor(t))]


def resident_bytes(tensors: Iterable[Tensor]) -> int:
    """The bytes of the distinct storages behind ``tensors``, each storage counted once.

    A storage is identified by its data pointer and size, so views and tied weights count once.
    Meta and fake tensors (no real storage) count as nothing.

    >>> import torch
    >>> w = torch.zeros(10, 10)
    >>> resident_bytes([w, w[0], w.t(), torch.zeros(3, dtype=torch.float64)])
    424
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        for key in _storage_keys(t):
            if key in seen or key[0] == 0:
                continue
            seen.add(key)
            total += key[1]
    return total


def resident_blocks(tensors: Iterable[Tensor]) -> dict[int, int]:
    """``address: bytes`` of the CPU storages behind ``tensors``: the resident blocks whose frees a
    profile's running sum counts (``allocator_events.window_figures``).

    >>> w = torch.zeros(10)
    >>> resident_blocks([w, w[2:]]) == {w.untyped_storage().data_ptr(): 40}
    True
    """
    blocks: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "cpu" or isinstance(t, FakeTensor):
            continue
        for address, nbytes in _storage_keys(t):
            if address:
                blocks[address] = nbytes
    return blocks


def cpu_step_peaks(
    timeline: AllocatorTimeline,
    steps: int,
    baseline: int = 0,
    carry: bool = True,
    resident: Mapping[int, int] | None = None,
) -> tuple[int, ...]:
    """Per-step peaks from a CPU profile's allocator timeline (``CpuMemoryProfile.timeline()``).

    ``baseline`` is the bytes resident before profiling started; ``resident`` their blocks
    (``resident_blocks``), whose frees count. With ``carry`` (the default) a step's peak counts what
    earlier steps left behind; without, each step's peak is the rise of the running sum inside its
    window (for callers that know each step's resident bytes themselves).
    """
    windows = window_figures(timeline, STEP_LABEL, steps, resident)
    return tuple(baseline + (w.peak if carry else w.peak_rise) for w in windows)


def measure_step(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    config: StepConfig,
    *,
    steps: int = 2,
    loop: PlainLoop = "train",
) -> Measurement:
    """Run ``steps`` real training steps of ``model`` on ``batch`` and measure each one's peak memory.

    The model is trained in place (see the module docstring). The device is the model's (its first
    parameter's, else buffer's); the batch must already be there, and for ``*-true`` precisions already
    converted. With a ``config.strategy`` the model is wrapped in real DDP / FSDP over the default
    process group (``init_process_group`` first). ``model`` may be a factory (``lambda: Net()``): on
    CPU the model is then built inside the measurement, which FSDP needs -- it frees the full parameters
    when it shards them, and the profiler only sees frees of what it saw allocated. ``loop`` as in
    ``estimate_step``: a validation or predict batch (``steps`` of them; the model's training flags
    restored after each).

    Example:
        >>> import torch
        >>> from lightning_memest.engine.step import StepConfig
        >>> model = torch.nn.Linear(4, 2)
        >>> m = measure_step(model, torch.randn(3, 4), StepConfig(optimizer=torch.optim.Adam), steps=2)
        >>> m.first_step > 0 and m.steady_state > 0
        True
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    built = model if isinstance(model, nn.Module) else None
    device = _model_device(built) if built is not None else _batch_device(batch)
    make = loop_runner(loop)

    def runner(module: nn.Module) -> Runner:
        # No listener: nothing here is fake, the allocator's events say what happened.
        return make(module, config, cast(StepListener, None))

    if device.type == "cuda":
        return _measure_cuda(runner(built if built is not None else model()), batch, steps, device)
    if device.type != "cpu":
        raise ValueError(f"measure_step measures CPU or CUDA models; this one is on {device}")
    before = [*(module_tensors(built) if built is not None else ()), *iter_tensors(batch)]
    baseline, resident = resident_bytes(before), resident_blocks(before)
    seconds: list[float] = []
    with quiet_gc(), CpuMemoryProfile() as prof:
        # Built in the profile: what the constructors keep (optimizer state some optimizers create
        # there, DDP's buckets, FSDP's shards) is in the running sum when the first step starts.
        step = runner(built if built is not None else model())
        for i in range(steps):
            t0 = time.perf_counter()
            with record_function(f"{STEP_LABEL}{i}"):
                loss = step.run(batch)
            seconds.append(time.perf_counter() - t0)
            # The loss is dropped between steps: its free falls in no step's window.
            del loss
    peaks = cpu_step_peaks(prof.timeline(), steps, baseline, resident=resident)
    return Measurement(peaks, None, _mean_seconds(seconds), "cpu")


def _model_device(model: nn.Module) -> torch.device:
    return next((t.device for t in module_tensors(model)), torch.device("cpu"))


def _batch_device(batch: Any) -> torch.device:
    return next((t.device for t in iter_tensors(batch)), torch.device("cpu"))


def _measure_cuda(runner: Runner, batch: Any, steps: int, device: torch.device) -> Measurement:
    peaks: list[int] = []
    reserved: list[int] = []
    seconds: list[float] = []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss = runner.run(batch)
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated(device))
        reserved.append(torch.cuda.max_memory_reserved(device))
        del loss
    index = device.index if device.index is not None else torch.cuda.current_device()
    return Measurement(tuple(peaks), tuple(reserved), _mean_seconds(seconds), f"cuda:{index}")


def _mean_seconds(seconds: list[float]) -> float:
    timed = seconds[1:] if len(seconds) > 1 else seconds
    return sum(timed) / len(timed)


class StepProbe:
    """Measures training steps from inside a training loop: ``start(resident)`` before each step,
    ``stop()`` after it; the peaks come from ``finish()``.

    Used by the ``MemEstimate`` callback around real batches. On CPU one profiler with
    ``profile_memory`` runs from the first ``start`` to ``finish`` -- the way :func:`measure_step`
    measures --, each step inside a ``record_function`` window; a step's peak is the bytes resident at
    its ``start`` (the tensors given, each storage once) plus the largest rise of the allocator's
    running sum inside its window. On CUDA the peak statistics are reset at ``start`` and read at
    ``stop``.

    Example:
        >>> import torch
        >>> probe = StepProbe(torch.device("cpu"))
        >>> x = torch.ones(1024)
        >>> probe.start([x])
        >>> y = x.clone()  # 4 KiB more
        >>> probe.stop()
        >>> probe.finish()
        [(8192, None)]
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._baselines: list[int] = []
        self._resident: dict[int, int] = {}  # the blocks of what was resident at each step's start
        self._cuda_peaks: list[tuple[int, int | None]] = []
        self._profiler: CpuMemoryProfile | None = None
        self._window: record_function | None = None
        self._gc: contextlib.AbstractContextManager[None] | None = None
        self._measured: list[tuple[int, int | None]] = []  # the steps of profiles closed by pause()
        self._first = 0  # the first step of the open profile

    def start(self, resident: Iterable[Tensor]) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            if self._gc is None:
                self._gc = quiet_gc()
                self._gc.__enter__()
            if self._profiler is None:
                profiler = CpuMemoryProfile()
                profiler.__enter__()
                self._profiler = profiler
                self._first = len(self._baselines)
            tensors = list(resident)
            self._baselines.append(resident_bytes(tensors))
            self._resident.update(resident_blocks(tensors))
            window = record_function(f"{STEP_LABEL}{len(self._baselines) - 1 - self._first}")
            window.__enter__()  # type: ignore[no-untyped-call]
            self._window = window
        except BaseException:
            self.close()  # half started: nothing left open
            raise

    @property
    def profiling(self) -> bool:
        """Whether the CPU profiler runs (from the first ``start`` to ``finish`` or :meth:`pause`)."""
        return self._profiler is not None

    @property
    def collector_off(self) -> bool:
        """Whether the garbage collector is off, since a full collection at the first ``start`` (until
        ``finish``): a scan for live tensors needs only a young collection."""
        return self._gc is not None

    def pause(self) -> None:
        """Between two steps, close the CPU profile, keeping what it measured, so that something else
        may run a profiler (the calibration of an estimate of the next batch); the next ``start`` opens
        another. The garbage collector stays off."""
        profiler = self._profiler
        if profiler is None or self._window is not None:
            return
        self._profiler = None
        profiler.__exit__(None, None, None)
        self._measured.extend(self._peaks(profiler))

    def stop(self, unseen_bytes: int = 0) -> None:
        """End the step. ``unseen_bytes``: memory resident through the step that the profiler cannot
        see and ``start``'s tensors did not name (DDP's buckets, allocated before it started)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
            self._cuda_peaks.append(peak)
            return
        window, self._window = self._window, None
        if window is None:
            raise RuntimeError("StepProbe.stop() without start()")
        window.__exit__(None, None, None)
        self._baselines[-1] += unseen_bytes

    def close(self) -> None:
        """End any open step window, stop the profiler and give the garbage collector back, measuring
        nothing (``finish`` does this; call it when the steps never end -- an exception in fit): a
        profiler or ``record_function`` left open until interpreter exit crashes it (SIGSEGV)."""
        window, self._window = self._window, None
        profiler, self._profiler = self._profiler, None
        quiet, self._gc = self._gc, None
        try:
            if window is not None:
                window.__exit__(None, None, None)
        finally:
            try:
                if profiler is not None:
                    profiler.__exit__(None, None, None)
            finally:
                if quiet is not None:
                    quiet.__exit__(None, None, None)

    def finish(self) -> list[tuple[int, int | None]]:
        """Each measured step's peak bytes, and on CUDA its peak reserved bytes."""
        if self.device.type == "cuda":
            return list(self._cuda_peaks)
        profiler = self._profiler
        self.close()  # a step still open (fit ended inside it) is ended with the profile
        return [*self._measured, *(self._peaks(profiler) if profiler is not None else [])]

    def _peaks(self, profiler: CpuMemoryProfile) -> list[tuple[int, int | None]]:
        """The peaks of the steps ``profiler`` (closed) measured: those since :attr:`_first`."""
        baselines = self._baselines[self._first :]
        timeline = profiler.timeline()
        rises = cpu_step_peaks(timeline, len(baselines), baseline=0, carry=False, resident=self._resident)
        return [(base + rise, None) for base, rise in zip(baselines, rises, strict=True)]
