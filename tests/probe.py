"""The CPU ground truth of a real fit's batches, written apart from ``lightning_memest``'s measuring code.

``AllocatorProbe`` is a callback. Around each probed batch (its batch-start to its batch-end hook) a
``torch.profiler`` with ``profile_memory=True`` records the CPU allocator's events; a batch's peak is what
was resident when it started -- every distinct storage, counted once, of every live CPU tensor (a scan of
the garbage collector's objects: the module's parameters, buffers and gradients, the optimizers' state,
the batch, and what else sits there: an EMA copy, metric states, a tensor kept on the module with the
graph behind it, the dataset), but what the estimator itself holds -- plus the largest rise of the
allocator's running sum inside the batch. Used by ``test_zoo.py`` (training) and ``test_loops.py`` (the
other loops).
"""

from __future__ import annotations

import gc
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Dataset

from lightning_memest import MemEstimate

PROBED_BATCHES = 2


class _Storages:
    """Distinct storages of real tensors, each counted once (by data pointer and size)."""

    def __init__(self) -> None:
        self.keys: dict[tuple[int, int], int] = {}

    def add(self, t: Tensor) -> None:
        if t.device.type == "meta" or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a real storage
            return
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] and key[1]:
            self.keys[key] = key[1]

    @property
    def bytes(self) -> int:
        return sum(self.keys.values())


_SKIP = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    pl.Trainer,
    pl.LightningDataModule,
    Dataset,
    DataLoader,
    torch.optim.Optimizer,  # counted through trainer.optimizers
    torch.Generator,
    str,
    bytes,
    int,
    float,
    bool,
)


def _reachable_tensors(roots: Iterable[Any], max_depth: int = 12) -> Iterator[Tensor]:
    """Every tensor reachable from ``roots`` through attributes, containers and autograd graphs
    (the saved tensors of the graph behind a non-leaf tensor); datasets, loaders, the trainer and
    optimizers are not followed."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(r, 0) for r in roots]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > max_depth or obj is None or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            yield obj
            if obj.is_leaf:
                if obj.grad is not None:
                    yield obj.grad
            elif obj.grad_fn is not None:
                stack.append((obj.grad_fn, depth + 1))
            continue
        if type(obj).__module__ == "torch.autograd.graph" or hasattr(obj, "next_functions"):
            # an autograd node: its saved tensors, then the nodes it feeds from
            for name in dir(obj):
                if name.startswith("_saved_"):
                    try:
                        value = getattr(obj, name)
                    except RuntimeError:  # freed by a backward
                        continue
                    stack.append((value, depth + 1))
            for nxt, _ in getattr(obj, "next_functions", ()):
                if nxt is not None:
                    stack.append((nxt, depth + 1))
            variable = getattr(obj, "variable", None)  # AccumulateGrad: the leaf
            if variable is not None:
                stack.append((variable, depth + 1))
            continue
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend((v, depth + 1) for v in obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend((v, depth + 1) for v in attrs.values())


def _live_cpu_tensors() -> list[Tensor]:
    """Every live CPU tensor with real memory (fake and meta ones have none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some deprecated torch objects warns
        found = [o for o in gc.get_objects() if isinstance(o, Tensor)]
    return [t for t in found if not isinstance(t, FakeTensor) and t.device.type == "cpu"]


def _optimizer_state(trainer: pl.Trainer) -> Iterator[Tensor]:
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    yield value


def _batch_tensors(batch: Any) -> Iterator[Tensor]:
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, dict) or hasattr(batch, "items"):
        for value in batch.values():
            yield from _batch_tensors(value)
    elif isinstance(batch, list | tuple):
        for value in batch:
            yield from _batch_tensors(value)


def _allocations(prof: profile) -> list[tuple[int, int, int]]:
    """(time, bytes, address) of each CPU allocation (bytes > 0) and free of the finished profile, in
    time order (its event tree: the kineto event list has no addresses)."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    found = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            found.append((node.start_time_ns, fields.alloc_size, fields.ptr))
    return sorted(found, key=lambda x: x[0])


def storage_blocks(tensors: Iterable[Tensor]) -> dict[int, int]:
    """``address: bytes`` of the distinct storages of ``tensors`` (what is resident before a profile)."""
    storages = _Storages()
    for t in tensors:
        storages.add(t)
    return {address: size for address, size in storages.keys}


def largest_rise(prof: profile, resident: Mapping[int, int]) -> int:
    """The largest rise of the CPU allocator's running sum in the finished profile ``prof``.

    A free counts for a block allocated in the profile or in ``resident`` (address: bytes, what was
    held when it started); the allocator also reports, with a stale size, frees of blocks at an address
    an earlier profile saw allocated, which were never held here."""
    return max([0, *(held for _, held in running_sum(prof, resident))])  # (0: nothing rose)


def running_sum(prof: profile, resident: Mapping[int, int]) -> Iterator[tuple[int, int]]:
    """``(time, rise)`` after each CPU allocation and free of the finished profile ``prof``: the running
    sum of its events above what was held when it began, frees counted as :func:`largest_rise` says."""
    blocks = dict(resident)
    held = 0
    allocated: dict[int, int] = {}
    for time, nbytes, address in _allocations(prof):
        if nbytes > 0:
            allocated[address] = nbytes
        else:
            size = allocated.pop(address, None)
            nbytes = -(blocks.pop(address, 0) if size is None else size)
        held += nbytes
        yield time, held


@dataclass
class ProbedBatch:
    resident: int
    """Bytes resident at the batch's start: the module's parameters, buffers and gradients, the
    optimizer state, the batch, and what the module and the callbacks hold besides."""
    held_elsewhere: int
    """The part of ``resident`` that is not parameters, buffers, gradients, optimizer state or batch."""
    rise: int
    """The largest rise of the allocator's running sum inside the batch."""

    @property
    def peak(self) -> int:
        return self.resident + self.rise


class AllocatorProbe(Callback):
    """The CPU ground truth of a fit's first training batches, and of the first batch of each other loop
    (the sanity check, validation, test, predict), independent of lightning_memest.

    A batch's peak: what was resident at its start (every distinct storage of every live CPU tensor, but
    what ``MemEstimate`` holds) plus the largest rise of the allocator's running sum inside the batch
    (``torch.profiler`` with ``profile_memory``), from the batch-start hook to the batch-end hook.
    """

    def __init__(self, batches: int = PROBED_BATCHES) -> None:
        self.batches = batches
        self.probed: list[ProbedBatch] = []
        """The first ``batches`` training batches."""
        self.loops: dict[str, ProbedBatch] = {}
        """The first batch of each other loop: ``sanity_check``, ``validate``, ``test``, ``predict``."""
        self._profile: profile | None = None
        self._loop: str | None = None
        self._gc_was_enabled = False
        self._resident = (0, 0)
        self._blocks: dict[int, int] = {}  # address: bytes of what was resident at the batch's start

    # --- training ---
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if len(self.probed) < self.batches:
            self._open(trainer, pl_module, batch, None)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close(record=True)

    # --- the other loops: their first batch ---
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._open_loop(trainer, pl_module, batch, "sanity_check" if trainer.sanity_checking else "validate")

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._close(record=True)

    def on_test_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._open_loop(trainer, pl_module, batch, "test")

    def on_test_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._close(record=True)

    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._open_loop(trainer, pl_module, batch, "predict")

    def on_predict_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._close(record=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(record=False)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(record=False)

    # ---
    def _open_loop(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, loop: str) -> None:
        if loop not in self.loops:
            self._open(trainer, pl_module, batch, loop)

    def _open(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, loop: str | None) -> None:
        if self._profile is not None:
            return  # a batch inside another's window (validation inside a probed training batch)
        gc.collect()
        core = _Storages()
        for t in [*pl_module.parameters(), *pl_module.buffers()]:
            core.add(t)
            if t.grad is not None:
                core.add(t.grad)
        for t in [*_optimizer_state(trainer), *_batch_tensors(batch)]:
            core.add(t)
        # Everything else alive on the CPU: another callback's copy of the weights, metric states, the
        # dataset, a prefetched batch -- every live tensor (a scan of the garbage collector's objects),
        # but those the estimator itself holds (its bookkeeping is not the user's training).
        estimators = _Storages()
        for t in _reachable_tensors([c for c in trainer.callbacks if isinstance(c, MemEstimate)]):
            estimators.add(t)
        everything = _Storages()
        for t in _live_cpu_tensors():
            everything.add(t)
        for key in estimators.keys:
            everything.keys.pop(key, None)
        everything.keys.update(core.keys)
        self._resident = (everything.bytes, everything.bytes - core.bytes)
        self._blocks = {address: size for address, size in everything.keys}
        # no collection inside the window: a collected object of an earlier profile corrupts the sum
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        try:
            prof.__enter__()
        except BaseException:
            if self._gc_was_enabled:
                gc.enable()
            raise
        self._profile, self._loop = prof, loop

    def _close(self, record: bool) -> None:
        prof, self._profile = self._profile, None
        if prof is None:
            return
        try:
            prof.__exit__(None, None, None)
            if record:
                rise = largest_rise(prof, self._blocks)
                probed = ProbedBatch(*self._resident, rise)
                if self._loop is None:
                    self.probed.append(probed)
                else:
                    self.loops[self._loop] = probed
        finally:
            if self._gc_was_enabled:
                gc.enable()
