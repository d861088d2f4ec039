"""Running one op for real, alone, at the exact metadata a simulation recorded, and measuring what its
kernel allocates beyond its outputs: the measuring half of calibration (``calibrate.py`` decides what to
run and keeps the answers).

Inputs are zero-filled tensors of the call's shapes, strides and dtypes (zeros: valid indices and
targets, and no denormal or NaN slow paths), made before the op; the op runs in the grad mode the step
called it in, without autocast; its outputs are dropped after it. On the CPU the inputs an op only
reads are views of one zero-filled pool, made once for all the ops (zero-filling fresh memory for each
input took a quarter of a calibration); those it writes are its own. On the CPU one profiler of the
allocator's events runs around all the ops, each in its own window; on CUDA ``memory_allocated`` and
``max_memory_allocated`` bracket each op. A :class:`Guard` keeps consumers of placeholder outputs (a meta
kernel's empty stand-in for a real buffer) from reading past the end of an input.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves

from lightning_memest.accounting.kernels.model import CPU_KERNELS, CUDA_KERNELS, KernelMemory
from lightning_memest.allocator_events import CpuMemoryProfile, window_figures
from lightning_memest.engine.collector import collector_off
from lightning_memest.engine.events import OpCall, TensorMeta
from lightning_memest.engine.real_ops import zeros_strided

__all__ = ["Guard", "fits", "hand_model", "measure_cpu", "measure_cuda"]

_WINDOW = "memest_kernel_"
#: An op is run only if its inputs and outputs take at most this share of the memory available.
_MEMORY_SHARE = 0.5


def _real(meta: TensorMeta, device: torch.device) -> Tensor:
    """A zero-filled tensor of ``meta`` (zeros: valid indices and targets, and no denormal or NaN slow
    paths)."""
    return zeros_strided(tuple(meta.shape), tuple(meta.stride), meta.dtype, device)


def _extent(meta: TensorMeta) -> int:
    """Bytes from a tensor's first element to one past its last (what its storage needs)."""
    if any(s == 0 for s in meta.shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride, strict=True))) * meta.itemsize


def _written(call: OpCall) -> set[str]:
    """The names of the arguments ``call``'s op writes (``Tensor(a!)`` in its schema)."""
    return {a.name for a in call.op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def _read_only_bytes(call: OpCall) -> int:
    """The largest extent among the tensors ``call`` only reads (what the pool must hold for it)."""
    written = _written(call)
    sizes = [0]
    for argument, value in _named_args(call):
        if argument not in written:
            sizes.extend(_extent(v) for v in tree_leaves(value) if isinstance(v, TensorMeta))
    return max(sizes)


def _named_args(call: OpCall) -> list[tuple[str, Any]]:
    names = [a.name for a in call.op._schema.arguments]
    return [*zip(names, call.args, strict=False), *call.kwargs.items()]


def _tensor_bytes(values: Any) -> int:
    return sum(v.bytes for v in tree_leaves(values) if isinstance(v, TensorMeta))


def fits(call: OpCall, available: int | None) -> bool:
    needed = _tensor_bytes((call.args, call.kwargs)) + sum(o.bytes for o in call.outputs if o is not None)
    return available is None or needed <= _MEMORY_SHARE * available


@contextmanager
def _as_called(call: OpCall) -> Iterator[None]:
    """Grad mode as it was when the step called the op (some kernels allocate by it: oneDNN's LSTM makes
    its workspace only with grad mode on); no autocast (the arguments are already cast). The inputs
    require no grad, so nothing is recorded for autograd."""
    with torch.set_grad_enabled(call.grad_enabled), torch.autocast(call.device_type, enabled=False):
        yield


class Guard:
    """Placeholder inputs. A meta kernel may return an empty placeholder for a real buffer (oneDNN's LSTM
    workspace, cuDNN's RNN reserve): the fake run hands it to the consumer (the backward), whose real
    kernel would read far past the end of an empty tensor -- a crash, not an exception. So outputs that
    are empty in the fake run but not for real are remembered by their metadata, in the simulation's
    order: with their real size where it was measured (then a consumer gets an input of that size,
    the largest such producer's, as in the real run), as unknown where only a hand model or a failed
    measurement says so (then a consumer is not run: its hand model holds). A placeholder a hand model
    knows of stays unknown until a measurement sizes it."""

    def __init__(self) -> None:
        self.sizes: dict[TensorMeta, int] = {}
        self.unknown: set[TensorMeta] = set()

    def note(self, call: OpCall, result: KernelMemory | None, *, measured: bool) -> None:
        if result is None or result.extra_output_bytes is None:
            return
        for meta, extra in zip(call.outputs, result.extra_output_bytes, strict=False):
            if meta is None or extra <= 0 or meta.numel != 0:
                continue
            if measured:
                self.sizes[meta] = max(self.sizes.get(meta, 0), meta.nbytes + extra)
            else:
                self.unknown.add(meta)

    def safe(self, call: OpCall) -> bool:
        values = tree_leaves((call.args, call.kwargs))
        return not any(
            isinstance(v, TensorMeta) and v in self.unknown and v not in self.sizes for v in values
        )

    def materialize(self, value: Any, device: torch.device, pool: Tensor | None = None) -> Any:
        """``value`` with every ``TensorMeta`` made a real zero-filled tensor (a placeholder at its real
        size), nested lists and tuples included; a view of ``pool`` (zero-filled bytes) where given."""
        if isinstance(value, TensorMeta):
            real = self.sizes.get(value)
            if real is not None:
                return torch.zeros(-(-real // value.itemsize), dtype=value.dtype, device=device)
            if pool is not None and 0 < _extent(value) <= pool.numel():
                flat = pool[: _extent(value)].view(value.dtype)
                return flat.as_strided(value.shape, value.stride)
            return _real(value, device)
        if isinstance(value, (list, tuple)):
            return type(value)(self.materialize(v, device, pool) for v in value)
        return value

    def inputs(
        self, call: OpCall, device: torch.device, pool: Tensor | None = None
    ) -> tuple[Any, dict[str, Any], set[int]]:
        """Real inputs of ``call`` on ``device``, and the storages they hold (outputs on those are not
        new allocations); those the op only reads are views of ``pool`` where given."""
        written = _written(call)
        names = [a.name for a in call.op._schema.arguments]

        def real(name: str, value: Any) -> Any:
            return self.materialize(value, device, None if name in written else pool)

        args = tuple(real(name, v) for name, v in zip(names, call.args, strict=False))
        kwargs = {k: real(k, v) for k, v in call.kwargs.items()}
        held = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        return args, kwargs, held


class _Unsafe(Exception):
    """An op left alone: an input of it would be a placeholder of unknown real size (see ``_Guard``)."""


def measure_cpu(calls: Sequence[OpCall], guard: Guard) -> list[KernelMemory | BaseException | None]:
    """Each call run alone on the CPU, inside one profiler of the allocator's events: inputs are made
    before the op's window, outputs dropped after it."""
    device = torch.device("cpu")
    outcomes: list[tuple[_Sizes, set[int]] | BaseException] = []
    # Aligned for any dtype: a view's offset is 0.
    pool = torch.zeros(max((_read_only_bytes(c) for c in calls), default=0), dtype=torch.uint8)
    # No cyclic collection while the ops run: one inside an op's window would free older blocks there
    # (without quiet_gc's collection first: half a second after a simulation; with the collector off,
    # nothing but the ops themselves frees anything inside a window).
    with collector_off(), CpuMemoryProfile() as prof:
        for i, call in enumerate(calls):
            failure: BaseException | None = None if guard.safe(call) else _Unsafe(str(call.op))
            args: Any = ()
            kwargs: dict[str, Any] = {}
            inputs: set[int] = set()
            if failure is None:
                try:
                    args, kwargs, inputs = guard.inputs(call, device, pool)
                except Exception as exc:  # an input this machine cannot make: the hand model holds
                    failure = exc
            with record_function(f"{_WINDOW}{i}"):
                if failure is None:
                    try:
                        with _as_called(call):
                            out = call.op(*args, **kwargs)
                    except Exception as exc:
                        failure = exc
            if failure is None:
                sizes = _sizes(out)
                del out  # freed between windows: the next window starts from what is left
                outcomes.append((sizes, inputs))
                guard.note(call, _result_from_sizes(call, sizes, inputs, 0, 0), measured=True)
            else:
                outcomes.append(failure)
                guard.note(call, hand_model(call), measured=False)
            del args, kwargs
    windows = window_figures(prof.timeline(), _WINDOW, len(calls))
    results: list[KernelMemory | BaseException | None] = []
    for call, outcome, w in zip(calls, outcomes, windows, strict=True):
        if isinstance(outcome, BaseException):
            results.append(outcome)
        else:
            results.append(_result_from_sizes(call, *outcome, w.peak_rise, w.end - w.start))
    return results


_Sizes = list[tuple[int, int] | None]  # per flattened output: (storage pointer, storage bytes)


def _sizes(out: Any) -> _Sizes:
    return [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if isinstance(t, Tensor) else None
        for t in tree_leaves(out)
    ]


def _result_from_sizes(
    call: OpCall, sizes: _Sizes, inputs: set[int], peak_rise: int, held: int
) -> KernelMemory | None:
    """The kernel memory of one measured call: ``peak_rise`` above what existed before it, ``held``
    what it left allocated (its new outputs, as the real kernel sized them)."""
    extra: list[int] = []
    seen = set(inputs)
    for fake, real in zip(call.outputs, sizes, strict=False):
        if fake is None or real is None or real[0] in seen or real[0] == 0:
            extra.append(0)
            continue
        seen.add(real[0])
        extra.append(max(0, real[1] - fake.nbytes))
    workspace = max(0, peak_rise - held)
    extra_bytes = tuple(extra) if any(extra) else None
    if workspace == 0 and extra_bytes is None:
        return None
    return KernelMemory(workspace, True, extra_bytes)


def measure_cuda(
    calls: Sequence[OpCall], device: torch.device, guard: Guard
) -> list[KernelMemory | BaseException | None]:
    """Each call run alone on the GPU, between ``memory_allocated`` and ``max_memory_allocated``."""
    results: list[KernelMemory | BaseException | None] = []
    with torch.no_grad():  # (each op runs in its own grad mode, below)
        # cuBLAS takes its workspace at its first matmul and keeps it (a library workspace, modelled
        # apart in accounting/cuda_device.py): take it before measuring.
        torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
        for call in calls:
            if not guard.safe(call):
                results.append(_Unsafe(str(call.op)))
                guard.note(call, hand_model(call), measured=False)
                continue
            try:
                args, kwargs, inputs = guard.inputs(call, device)
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                with _as_called(call):
                    out = call.op(*args, **kwargs)
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - before
                held = torch.cuda.memory_allocated(device) - before
                result = _result_from_sizes(call, _sizes(out), inputs, peak, held)
                del out, args, kwargs
                guard.note(call, result, measured=True)
                results.append(result)
            except Exception as exc:
                results.append(exc)
                guard.note(call, hand_model(call), measured=False)
    return results


def hand_model(call: OpCall) -> KernelMemory | None:
    """What the hand model of ``call``'s device says (for the guard: outputs bigger than faked)."""
    if call.device_type == "cuda":
        cuda = CUDA_KERNELS.lookup(call.op)
        return cuda(call, None) if cuda is not None else None
    cpu = CPU_KERNELS.lookup(call.op)
    return cpu(call) if cpu is not None else None
