"""Kernel memory measured on this machine: each distinct op signature of a simulation, run once for real.

The hand models (``cpu.py``, ``cpu_conv.py``, ...) were fitted on one CPU; oneDNN, cuDNN and cuBLAS
choose their algorithms -- and their scratch buffers -- by the machine, the shapes and the library
versions. The machine itself can say what its kernels allocate. :func:`calibrate` takes every distinct
op signature of a simulation (the op overload, each tensor argument's shape, strides and dtype, and the
other arguments), builds real zero-filled inputs of exactly that metadata on the simulated device, runs
the op alone, and measures:

* on the CPU, with the allocator's events (``allocator_events.py``; one profiler around all the ops,
  each op in its own window): the highest point inside the op above what existed before it, and what
  the op leaves allocated;
* on CUDA, with ``memory_allocated``/``max_memory_allocated`` around the op (which also lets cuDNN
  choose, and cache, the algorithm the real step will use).

From those: the op's outputs as the real kernel allocates them (``extra_output_bytes``: beyond what the
fake kernel reported) and its transient excess (``workspace_bytes``: the high point beyond what
existed before plus the outputs), the :class:`KernelMemory` the accounting reads. A calibrated
signature takes the place of the hand model; ops it cannot run (values it cannot guess, an input that
would not fit the memory available, a failure) keep the hand model.

Answers are cached on disk under the machine's key (``machine.py``: ISA and flags, thread count,
torch and library releases, the environment variables that change kernels), in ``MEMEST_CACHE_DIR``
or the user's cache directory: a second estimate of the same model on the same machine measures
nothing.

Example:
    >>> import torch
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> from lightning_memest.accounting import capture_filter
    >>> sim = simulate(torch.nn.Linear(64, 64), torch.randn(8, 64), StepConfig(), capture=capture_filter(
    ...     flops=False, calibrate=True))
    >>> table = calibrate(sim, cache_dir=None)
    >>> table.measured > 0 and table.failed == ()
    True
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._pytree import tree_leaves

from lightning_memest.accounting.kernels.model import KernelMemory
from lightning_memest.accounting.kernels.op_runs import Guard, fits, hand_model, measure_cpu, measure_cuda
from lightning_memest.engine.events import OpCall, OpEvent, TensorMeta
from lightning_memest.engine.simulate import Simulation
from lightning_memest.machine import machine_facts, machine_key, mem_available
from lightning_memest.report import CalibrationSummary

__all__ = [
    "CACHE_ENV",
    "Calibration",
    "calibratable",
    "calibrate",
    "calibrate_calls",
    "calibrated_calls",
    "default_cache_dir",
    "outputs_only",
    "signature",
]

#: The environment variable naming the cache directory (default: ``~/.cache/lightning_memest``).
CACHE_ENV = "MEMEST_CACHE_DIR"
_CACHE_VERSION = 1
#: Ops that never allocate beyond their outputs or cannot run alone: scalar reads, aliasing helpers.
_NEVER = frozenset({"aten::_local_scalar_dense", "aten::detach", "aten::lift_fresh", "aten::alias"})


def calibratable(op: OpOverload) -> bool:
    """Whether ``op`` can be calibrated: an aten op that allocates (not a view), whose outputs do not
    depend on its inputs' values (those follow the engine's data-dependent policy)."""
    if op.namespace != "aten" or op.is_view or op._schema.name in _NEVER:
        return False
    tags = op.tags
    return torch.Tag.dynamic_output_shape not in tags and torch.Tag.data_dependent_output not in tags


def outputs_only(call: OpCall) -> bool:
    """Whether ``call`` needs no measuring: a pointwise op (or a ``_foreach_`` one) whose tensors all
    have one dtype allocates exactly its outputs (TensorIterator computes strided and in place; measured
    here: relu on a strided input, bf16 gelu and sigmoid, ``_foreach_add``). With mixed dtypes it does
    not -- ``bf16.add_(fp32)`` holds two float32 copies, 8 MiB for 1 Mi elements -- so those are
    measured. The optimizer's ``_foreach_`` updates over all parameters are most of the work this
    rule saves. A Python number where a tensor goes (``x / 3.0``) is wrapped into one first: measured.
    """
    op = call.op
    if torch.Tag.pointwise not in op.tags and not op.overloadpacket.__name__.startswith("_foreach_"):
        return False
    if _wraps_numbers(call):
        return False
    dtypes = {v.dtype for v in tree_leaves((call.args, call.kwargs)) if isinstance(v, TensorMeta)}
    dtypes.update(o.dtype for o in call.outputs if o is not None)
    return len(dtypes) <= 1


def _wraps_numbers(call: OpCall) -> bool:
    """Whether a Python number goes where the schema takes a tensor (``x / 3.0`` is ``div.Tensor``): the
    kernel wraps it in a tensor of its own first, a few bytes the fake run never sees (Adam's first
    step peaks in such a ``div``: 12 B)."""
    for argument, value in zip(call.op._schema.arguments, call.args, strict=False):
        if isinstance(value, (int, float, bool, complex)) and isinstance(argument.type, torch.TensorType):
            return True
    return False


def _describe(value: Any) -> str:
    if isinstance(value, TensorMeta):
        return f"T{value.shape}{value.stride}{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe(v) for v in value) + "]"
    return repr(value)


def signature(call: OpCall) -> str:
    """What decides an op's kernel memory: the overload, the device, grad mode, each argument (tensors
    by shape, strides and dtype).

    >>> from lightning_memest.engine.events import TensorMeta
    >>> x = TensorMeta.of(torch.empty(2, 3))
    >>> signature(OpCall(torch.ops.aten.relu.default, (x,), {}, (x,), "cpu"))
    'aten.relu.default|cpu|T(2, 3)(3, 1)float32'
    >>> signature(OpCall(torch.ops.aten.relu.default, (x,), {}, (x,), "cpu", grad_enabled=False))
    'aten.relu.default|cpu|no_grad|T(2, 3)(3, 1)float32'
    """
    args = ";".join(_describe(a) for a in call.args)
    kwargs = "".join(f";{k}={_describe(v)}" for k, v in sorted(call.kwargs.items()))
    grad = "" if call.grad_enabled else "|no_grad"
    return f"{call.op}|{call.device_type}{grad}|{args}{kwargs}"


@dataclass(frozen=True)
class Calibration:
    """The measured kernel memory of a simulation's op signatures, and what measuring them took."""

    entries: Mapping[str, KernelMemory | None]
    """Signature -> what the real kernel allocates beyond the fake outputs (``None``: nothing)."""
    device: str
    seconds: float
    """Wall seconds of the calibration (0 when everything came from the cache)."""
    measured: int
    """Signatures measured now."""
    cached: int
    """Signatures found in the cache."""
    failed: tuple[str, ...] = ()
    """Ops (overload names) of the signatures that could not be measured: their hand models hold."""

    def summary(self) -> CalibrationSummary:
        """The report's account of this calibration."""
        return CalibrationSummary(self.device, self.seconds, self.measured, self.cached, self.failed)

    def lookup(self, call: OpCall) -> tuple[bool, KernelMemory | None]:
        """``(found, kernel memory)`` of ``call``'s signature."""
        key = signature(call)
        if key in self.entries:
            return True, self.entries[key]
        return False, None


# ------------------------------------------------------------------------------------------- the cache


def default_cache_dir() -> Path:
    """``$MEMEST_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_memest``, else
    ``~/.cache/lightning_memest``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning_memest"


_Stored = list[Any] | None  # [workspace_bytes, extra_output_bytes or None], or None for nothing


def _to_json(km: KernelMemory | None) -> _Stored:
    if km is None:
        return None
    return [km.workspace_bytes, list(km.extra_output_bytes) if km.extra_output_bytes is not None else None]


def _from_json(value: _Stored) -> KernelMemory | None:
    if value is None:
        return None
    workspace, extra = value
    return KernelMemory(int(workspace), True, tuple(int(e) for e in extra) if extra is not None else None)


_MEMORY: dict[Path, dict[str, _Stored]] = {}  # the files read in this process


def _cache_file(directory: Path, device: str) -> Path:
    return directory / f"kernels-{device}-{machine_key(device)}.json"


def _load(path: Path) -> dict[str, _Stored]:
    if path in _MEMORY:
        return _MEMORY[path]
    entries: dict[str, _Stored] = {}
    try:
        data = json.loads(path.read_text())
        if data.get("version") == _CACHE_VERSION:
            entries = dict(data["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no cache yet, or an unreadable one: measure again
    _MEMORY[path] = entries
    return entries


def _store(path: Path, device: str, new: dict[str, _Stored]) -> None:
    entries = _MEMORY.setdefault(path, {})
    entries.update(new)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Another process (a DDP rank) may have added entries meanwhile: merge, then replace atomically.
        merged = dict(_load_fresh(path))
        merged.update(entries)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        data = {"version": _CACHE_VERSION, "machine": machine_facts(device), "entries": merged}
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory: the entries stay in this process's memory


def _load_fresh(path: Path) -> dict[str, _Stored]:
    try:
        data = json.loads(path.read_text())
        return dict(data["entries"]) if data.get("version") == _CACHE_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


# ------------------------------------------------------------------------------------------ calibrate


@contextmanager
def _preserved_generators(device: torch.device) -> Iterator[None]:
    """torch's CPU generator and ``device``'s CUDA one as they were (the only ones aten ops draw from)."""
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=devices):
        yield


def calibrated_calls(sim: Simulation) -> list[OpCall]:
    """The calls of ``sim`` that calibration measures, in the order the step made them (repeats too);
    not those of sparse tensors (``engine.sparse`` says what their kernels allocate)."""
    calls = (e.call for e in sim.events if type(e) is OpEvent)
    return [c for c in calls if c is not None and calibratable(c.op) and not outputs_only(c) and c.strided]


def _distinct_calls(sim: Simulation) -> dict[str, OpCall]:
    calls: dict[str, OpCall] = {}
    for call in calibrated_calls(sim):
        calls.setdefault(signature(call), call)
    return calls


def calibrate(
    sim: Simulation, *, cache_dir: Path | str | bool | None = True, measure: bool = True
) -> Calibration:
    """Measure the kernel memory of every distinct op signature of ``sim`` on its device (the CPU, or
    this machine's GPU), from the cache where it has the answer.

    ``sim`` must have been simulated with ``capture_filter(..., calibrate=True)`` (so that every op's
    call was recorded) on a device that is present: a what-if cannot be calibrated. ``cache_dir``:
    ``True`` for :func:`default_cache_dir`, a directory, or ``None``/``False`` for no disk cache.
    ``measure=False`` answers from the cache only (when nothing may run: a CPU profiler of the caller's
    is measuring); the rest keeps its hand models.
    """
    if sim.what_if is not None:
        raise ValueError(f"a {sim.what_if} what-if ran on another device: there is nothing to calibrate")
    return calibrate_calls(_distinct_calls(sim), sim.device, cache_dir=cache_dir, measure=measure)


def calibrate_calls(
    calls: Mapping[str, OpCall],
    device: torch.device,
    *,
    cache_dir: Path | str | bool | None = True,
    measure: bool = True,
) -> Calibration:
    """:func:`calibrate` of some calls (by :func:`signature`) on ``device``: the few a batch-size
    search measures at a probe's size (``search_kernels.py``). A call whose input is a placeholder
    another call of the step produces is measured only where that producer's size is known (the
    cache, or ``calls``); the others keep their hand models."""
    start = time.perf_counter()
    directory = default_cache_dir() if cache_dir is True else Path(cache_dir) if cache_dir else None
    path = _cache_file(directory, device.type) if directory is not None else None
    known = _load(path) if path is not None else {}
    entries: dict[str, KernelMemory | None] = {k: _from_json(known[k]) for k in calls if k in known}
    todo = {k: c for k, c in calls.items() if k not in known}
    available = (
        mem_available()
        if device.type == "cpu"
        else torch.cuda.mem_get_info(device)[0]
        if device.type == "cuda"
        else None
    )
    runnable = {k: c for k, c in todo.items() if measure and fits(c, available)}
    failed = {str(c.op) for k, c in todo.items() if k not in runnable} if measure else set()
    measured: dict[str, _Stored] = {}
    guard = Guard()
    for key, call in calls.items():  # placeholders the hand models know of; sizes the cache knows
        guard.note(call, hand_model(call), measured=False)
        if key in entries:
            guard.note(call, entries[key], measured=True)
    if runnable:
        keys = list(runnable)
        chosen = list(runnable.values())
        # The step's random ops (dropout's bernoulli_, a sampler's randperm) run for real here: they
        # must not move the generators training draws from.
        with _preserved_generators(device):
            if device.type == "cuda":
                results = measure_cuda(chosen, device, guard)
            else:
                results = measure_cpu(chosen, guard)
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                failed.add(str(runnable[key].op))
                continue
            entries[key] = result
            measured[key] = _to_json(result)
        if path is not None and measured:
            _store(path, device.type, measured)
    seconds = time.perf_counter() - start if runnable else 0.0
    return Calibration(
        entries=entries,
        device=device.type,
        seconds=seconds,
        measured=len(measured),
        cached=len(calls) - len(todo),
        failed=tuple(sorted(failed)),
    )
