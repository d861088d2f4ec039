"""The tracker that follows every storage's life during a step, and emits events.

``TrackingFakeTensorMode`` (``engine.tracking_mode``) runs each aten op on fake tensors, then its
``Tracker`` registers the storages of the op's outputs it has not seen (an allocation) and a weak
reference to each, whose callback marks the free the moment the last tensor on that storage dies --
the same moment the real allocator would free it. Module scopes (forward and backward), the step's
phases, what autograd saves for backward, which storages become gradients and optimizer state are
recorded in the same stream.

An op whose fake kernel needs values it does not have gets the answer of ``engine.values.data_dependent``'s
policy, recorded as a ``DataDependent`` event; the policy reads the values the simulation knows
(``engine.real_path``: the batch's lengths and masks) through :func:`real_value`.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
import torch._subclasses.fake_tensor as fake_tensor_module
from torch import Tensor
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_leaves

from lightning_memest.engine.events import (
    NO_OP,
    Alloc,
    DataDependent,
    Event,
    Free,
    ModuleEnter,
    ModuleExit,
    OpCall,
    OpEvent,
    Phase,
    PhaseStart,
    Resize,
    Role,
    Tag,
    TensorMeta,
)
from lightning_memest.engine.fake import local_tensor
from lightning_memest.engine.real_ops import NotRunnable, python_kernel, run_for_real, runs_on_fake
from lightning_memest.engine.real_path import known_value
from lightning_memest.engine.values import data_dependent
from lightning_memest.engine.values.read_guard import ReadGuard
from lightning_memest.errors import EstimationError

__all__ = [
    "CaptureFilter",
    "Tracker",
    "plain_fake",
    "plain_layout",
    "real_value",
    "storages_of",
]

#: Decides for which ops the full call (argument shapes) is recorded, for kernel models and FLOPs.
CaptureFilter = Callable[[torch._ops.OpOverload], bool]

#: Answers an op whose fake kernel needs values (``data_dependent.answer`` with the values known).
Answerer = Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]], data_dependent.Answer | None]


_aten = torch.ops.aten
_ADD = _aten.add.Tensor


class Tracker:
    """Records the event stream of everything dispatched inside it (see ``engine.events``)."""

    def __init__(self, capture: CaptureFilter | None = None) -> None:
        self.events: list[Event] = []
        self._capture = capture
        self._captured: dict[torch._ops.OpOverload, bool] = {}
        # StorageImpl address -> handle, for live storages only (addresses are reused after a free).
        self._handles: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._next_handle = 0
        self._residents: set[int] = set()
        # Backward: which autograd node's evaluation made each live storage (a serial, counted as the
        # node running changes), for what autograd sums in place (``_accumulate_in_place``).
        self._node: object = None  # held: its id is not reused while compared
        self._node_serial = 0
        self._made_in: dict[int, int] = {}
        self.op_index = -1
        self.phase = Phase.SETUP
        self.step = 0
        self._open_step: int | None = None  # the step whose phases are running
        self._step_start = 0  # where its events begin
        self._step_ran_op = False
        self._forward_stack: list[str] = []
        self._backward_stack: list[str] = []
        self._read_guard = ReadGuard()  # a loop on assumed reads must fail, not spin
        self.mode: FakeTensorMode | None = None
        """The fake mode the ops run in (set by it): where an op runs for real, its outputs are made
        fake in it."""
        self.op_context: tuple[tuple[str, Any], ...] = ()
        """Recorded with each op call (``OpCall.context``) while set (``engine.cuda_paths``)."""
        self.workspace = 0
        """What the op just run allocated beyond its outputs while it ran (run for real, or a sparse
        rule's kernel): taken by its ``OpEvent``."""
        self.real_ops: Counter[str] = Counter()
        """Ops whose fake kernel failed, run for real on stand-ins (``engine.real_ops``), by op."""
        self.value_reads = 0
        """How many ``DataDependent`` events were recorded (``Simulation.value_reads``): counted as they
        are, not by a walk of every event at the end."""
        self._within: list[str] = []  # the ops whose Python kernels are running on fake tensors
        self.layout_writes = 0
        """How many ops so far could change a tensor's layout in place (in-place views, ``set_``,
        ``resize_``, ``out=``: the tracking mode counts them), for what caches tensors' layouts."""

    # --- storages -------------------------------------------------------------------------------
    def _register(self, storage: torch.UntypedStorage, resident: bool, events: list[Event]) -> int:
        key = storage._cdata
        handle = self._handles.get(key)
        nbytes = storage.nbytes()
        if handle is not None:
            if self._sizes[key] != nbytes:
                self._sizes[key] = nbytes
                events.append(Resize(handle, nbytes))
            return handle
        handle = self._next_handle
        self._next_handle += 1
        self._handles[key] = handle
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(storage, self._free_callback(key, handle))
        self._made_in[handle] = self._node_serial
        events.append(Alloc(handle, nbytes, resident))
        return handle

    def _register_tensor(self, t: Tensor, events: list[Event]) -> int:
        """Register every storage of an op's output (a sparse tensor's indices and values); its handle
        (the values', for a sparse one; -1 for a tensor with no storage of its own to follow)."""
        handles = [self._register(s, False, events) for s in storages_of(t)]
        return handles[-1] if handles else -1

    def _free_callback(self, key: int, handle: int) -> Callable[[object], None]:
        def on_free(_: object) -> None:
            if self._handles.get(key) == handle:
                del self._handles[key], self._sizes[key], self._refs[key]
                self._made_in.pop(handle, None)
                self.events.append(Free(handle))

        return on_free

    def handle_of(self, t: Tensor) -> int | None:
        """The handle of ``t``'s storage (a DTensor's local shard's; a sparse tensor's values), if it is
        tracked."""
        if plain_fake(t):
            return self._handles.get(t.untyped_storage()._cdata)
        storages = storages_of(local_tensor(t))
        return self._handles.get(storages[-1]._cdata) if storages else None

    def handle_and_layout(self, t: Tensor) -> tuple[int | None, tuple[Any, ...]]:
        """:meth:`handle_of` and ``t``'s device, shape, stride, storage offset, dtype, storage bytes and
        ``requires_grad``, its storage read once (what the optimizer's replay asks of every entry of a
        stand-in parameter's lists: some 120 a replayed layer)."""
        if plain_fake(t):
            s = t.untyped_storage()
            plain = plain_layout(
                t.fake_device, t.shape, t.stride(), t.storage_offset(), t.dtype, s.nbytes(), t.requires_grad
            )
            return self._handles.get(s._cdata), plain
        storages = storages_of(local_tensor(t))
        offset = t.storage_offset() if t.layout is torch.strided else 0
        stride = t.stride() if t.layout is torch.strided else ()
        nbytes = tuple(s.nbytes() for s in storages)
        layout = (type(t), t.device, t.layout, t.shape, stride, offset, t.dtype, nbytes, t.requires_grad)
        return (self._handles.get(storages[-1]._cdata) if storages else None), layout

    def handles_of(self, t: Tensor) -> list[int]:
        """The handles of all of ``t``'s storages that are tracked (a sparse tensor has two or three)."""
        if plain_fake(t):
            h = self._handles.get(t.untyped_storage()._cdata)
            return [] if h is None else [h]
        found = (self._handles.get(s._cdata) for s in storages_of(local_tensor(t)))
        return [h for h in found if h is not None]

    def add_resident(self, t: Tensor, role: Role, path: str) -> None:
        """A tensor whose storages exist before the step (parameter, buffer, batch tensor, a sparse
        gradient's parts)."""
        for storage in storages_of(local_tensor(t)):
            handle = self._register(storage, True, self.events)
            self._residents.add(handle)
            self.events.append(Tag(handle, role, path))

    def settle_residents(self, residents: list[tuple[Tensor, Role, str]]) -> None:
        """The step's residents once a wrapper has been built: FSDP replaces each parameter by its shard,
        and the full one no longer exists on this rank (the real run frees it, or never had it)."""
        keep = {s._cdata for t, _, _ in residents for s in storages_of(local_tensor(t))}
        for key, handle in list(self._handles.items()):
            if handle in self._residents and key not in keep:
                del self._handles[key], self._sizes[key], self._refs[key]
                self._residents.discard(handle)
                self.events.append(Free(handle))
        for t, role, path in residents:
            self.add_resident(t, role, path)

    def replace_inputs(self, old: list[Tensor], new: list[Tensor]) -> None:
        """A new batch between two steps: the old batch's storages are freed (those the new one does not
        share), the new one's are resident from here on."""
        keep = {local_tensor(t).untyped_storage()._cdata for t in new}
        for t in old:
            key = local_tensor(t).untyped_storage()._cdata
            handle = self._handles.get(key)
            if key not in keep and handle is not None and handle in self._residents:
                del self._handles[key], self._sizes[key], self._refs[key]
                self._residents.discard(handle)
                self.events.append(Free(handle))
        for t in new:
            self.add_resident(t, Role.INPUT, "")

    def on_storage_resize(self, storage: torch.UntypedStorage) -> None:
        """``UntypedStorage.resize_`` (FSDP frees and re-allocates unsharded parameters so) bypasses
        the dispatcher: the fake mode never sees it."""
        key = storage._cdata
        handle = self._handles.get(key)
        nbytes = storage.nbytes()
        if handle is not None and self._sizes[key] != nbytes:
            self._sizes[key] = nbytes
            self.events.append(Resize(handle, nbytes))

    def tag(self, tensors: list[Tensor], role: Role) -> None:
        module, events, handles = self.module, self.events, self._handles
        for t in tensors:
            if plain_fake(t):  # every gradient and state tensor of every step: no list of one
                handle = handles.get(t.untyped_storage()._cdata)
                if handle is not None:
                    events.append(Tag(handle, role, module))
                continue
            for handle in self.handles_of(t):
                events.append(Tag(handle, role, module))

    # --- scopes and phases -------------------------------------------------------------------------
    @property
    def module(self) -> str:
        """The innermost module running now."""
        stack = self._backward_stack if self.phase is Phase.BACKWARD else self._forward_stack
        return stack[-1] if stack else ""

    def on_phase(self, phase: Phase, step: int) -> None:
        if phase is not Phase.SETUP and step != self._open_step:
            self.end_step()
            self._open_step, self._step_start, self._step_ran_op = step, len(self.events), False
        if (phase, step) != (self.phase, self.step):
            self.events.append(PhaseStart(step, phase))
        self.phase = phase
        self.step = step
        if phase is Phase.BACKWARD:
            self._backward_stack.clear()
        else:
            self._node = None  # (the graph's last node is not kept alive past its backward)

    def end_step(self) -> None:
        """The step that is running has ended (the next one starts, or the simulation ends): where it
        ran no op at all (a ``training_step`` that returned ``None`` at once), a :data:`NO_OP` event at
        its start stands for it, so that it has a peak of its own -- what was live as it began."""
        step, self._open_step = self._open_step, None
        if step is None or self._step_ran_op:
            return
        self.op_index += 1
        marker = OpEvent(self.op_index, step, Phase.FORWARD, "", NO_OP, None, None)
        self.events.insert(self._step_start, marker)

    def on_gradients(self, grads: list[Tensor]) -> None:
        self.tag(grads, Role.GRADIENT)

    def on_optimizer_state(self, state: list[Tensor]) -> None:
        self.tag(state, Role.OPTIMIZER_STATE)

    def on_communication(self, buffers: list[Tensor]) -> None:
        self.tag(buffers, Role.COMMUNICATION)

    def enter_module(self, path: str, backward: bool) -> None:
        if backward:
            # Hooks on one tensor fire in registration order, so an ancestor sharing its output with a
            # child (a Sequential and its last layer) enters after the child: keep it below.
            stack = self._backward_stack
            at = len(stack)
            while at and _is_below(stack[at - 1], path):
                at -= 1
            stack.insert(at, path)
        else:
            self._forward_stack.append(path)
        self.events.append(ModuleEnter(path, Phase.BACKWARD if backward else Phase.FORWARD))

    def exit_module(self, path: str, backward: bool, outputs: Sequence[Tensor] = ()) -> None:
        stack = self._backward_stack if backward else self._forward_stack
        # Backward exits can come out of order (a module whose inputs need no grad never exits).
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] == path:
                del stack[i]
                break
        handles = tuple(h for h in (self.handle_of(t) for t in outputs) if h is not None)
        self.events.append(ModuleExit(path, Phase.BACKWARD if backward else Phase.FORWARD, handles))

    # --- ops ------------------------------------------------------------------------------------
    def value_read(
        self, func: torch._ops.OpOverload, what: str, exact: bool = True, *, bound: bool = False
    ) -> None:
        """A read answered outside the data-dependent policy, listed with its answer: from values the
        simulation knows (``engine.real_path``: exact), or by a rule of ``engine.sparse`` (where not
        exact, an upper bound: ``bound``)."""
        self.events.append(DataDependent(str(func), self.module, what, exact, bound))
        self.value_reads += 1

    def run_op(
        self,
        run: Callable[[], Any],
        func: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        answer: Answerer = data_dependent.answer,
    ) -> Any:
        """Run one op on fake tensors (``run``), apply the data-dependent policy (``answer``), record it."""
        try:
            out = run()
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            ans = answer(func, args, kwargs)
            if ans is None:
                raise EstimationError(
                    f"{func} needs the values of a tensor, which a fake run does not have ({exc})",
                    op=str(func),
                    module=self.module,
                ) from exc
            said = f"{ans.assumed}, inside {self._within[-1]}" if self._within else ans.assumed
            self.events.append(DataDependent(str(func), self.module, said, ans.exact, ans.bound))
            self.value_reads += 1
            if not ans.exact:
                self._read_guard.count(str(func), self.module, self.step)
            out = ans.value
        except EstimationError:
            raise
        except Exception as exc:
            out = self._for_real(func, args, kwargs, exc)
        if out is NotImplemented:
            return out  # a tensor subclass (DTensor) runs it as ops on its local tensors, seen next
        self._record(func, args, kwargs, out)
        return out

    def _for_real(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception
    ) -> Any:
        """An op whose fake kernel raised ``exc``: its Python kernel run on the fake tensors, its ops the
        step's, where it has one that runs there; else run for real on stand-ins (``engine.real_ops``),
        counted in :attr:`real_ops`. An ``EstimationError`` with the fake kernel's error, and why the
        op did not run for real, where it could not."""
        mode = self.mode
        if mode is not None:
            key = python_kernel(func, _device_of(args, kwargs))
            if key is not None and runs_on_fake(func, key, _trial(mode, func, key, args, kwargs)):
                return self._on_fake(mode, func, key, args, kwargs)

        def assumed(what: str) -> None:
            self.value_read(func, what, exact=False)

        try:
            if mode is None:
                raise NotRunnable("no fake mode to run it beside")
            out, self.workspace = run_for_real(mode, func, args, kwargs, real_value, assumed)
        except Exception as real:
            why = f"not run for real: {real}" if isinstance(real, NotRunnable) else "and for real"
            raise EstimationError(
                f"{func} failed on fake tensors: {type(exc).__name__}: {exc} ({why})",
                op=str(func),
                module=self.module,
            ) from exc
        self.real_ops[str(func)] += 1
        return out

    def _on_fake(
        self,
        mode: FakeTensorMode,
        func: torch._ops.OpOverload,
        key: torch._C.DispatchKey,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``func``'s Python kernel run on the fake tensors inside ``mode``: each op it runs is recorded as
        the step's (what the real kernel allocates, frees and computes), its data-dependent reads listed
        as inside ``func``."""
        self._within.append(str(func))
        try:
            with mode:
                return func._op_dk(key, *args, **kwargs)
        except EstimationError:
            raise
        except Exception as exc:
            raise EstimationError(
                f"{func} has no fake kernel, and its Python kernel failed on fake tensors: "
                f"{type(exc).__name__}: {exc}",
                op=str(func),
                module=self.module,
            ) from exc
        finally:
            self._within.pop()

    def _accumulate_in_place(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> None:
        """Autograd's engine sums two gradients of one input (``InputBuffer::accumulate``, a tensor used
        twice: an LSTM's hidden state, a residual connection) in place, into the one it holds the last
        reference to -- unless the tensor is a subclass, such as a fake tensor: then out of place, one
        more allocation, which the real run never makes. This sum is the real one: the output takes over
        the storage (and the handle) of the gradient the real run adds into, and allocates nothing.

        The engine sums after a node's formula ran, the gradient it made into the one an earlier node
        left in the buffer; the formulas' own sums (``cholesky_backward``'s ``gA + gA.tril(-1).mH()``,
        of a local holding the last reference) allocate. So the gradient added into must come from an
        earlier node's evaluation than the one running (``torch._C._current_autograd_node``, which is
        the same while its formula runs and while its outputs are summed into the buffers): a sum of
        two gradients of one node (``x * x``) is then taken out of place, one tensor high, never low.
        Nor is a gradient summed into that other code still holds (``InputBuffer`` steals only a
        tensor of use count 1): the output gradient a pipeline stage received and passed to backward
        (``PipelineStage``'s receive buffer) is added to out of place, as on the real rank."""
        if kwargs or len(args) != 2 or args[0] is args[1] or torch.is_grad_enabled():
            return
        new = out.untyped_storage()
        if new._cdata in self._handles:
            return
        for grad in args:
            if not (
                isinstance(grad, Tensor)
                and grad.shape == out.shape
                and grad.dtype == out.dtype
                and is_non_overlapping_and_dense_or_false(grad)
            ):
                continue
            storage = grad.untyped_storage()
            key = storage._cdata
            handle = self._handles.get(key)
            # No other tensor on its storage (the count includes the ``storage`` object here).
            if handle is None or torch._C._storage_Use_Count(key) != 2 or storage.nbytes() != new.nbytes():
                continue
            if sys.getrefcount(grad) - 1 > max(sys.getrefcount(a) for a in args if a is not grad):
                # Held by Python beyond this call (less this loop's name): autograd steals only a
                # gradient it alone holds -- a pipeline stage's received gradient stays the stage's.
                continue
            if self._made_in.get(handle) == self._node_serial:
                continue  # made by the node running: a sum of its formula (or of two of its gradients)
            del self._handles[key], self._sizes[key], self._refs[key]  # its death frees nothing now
            key = new._cdata
            self._handles[key] = handle
            self._sizes[key] = new.nbytes()
            self._refs[key] = weakref.ref(new, self._free_callback(key, handle))
            return

    def _record(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        self.op_index += 1
        self._step_ran_op = True
        leaves = [out] if isinstance(out, Tensor) else [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        capture = self._captured.get(func)
        if capture is None:
            capture = self._capture is not None and self._capture(func)
            self._captured[func] = capture
        call = (
            OpCall(
                func,
                tuple(_meta(a) for a in args),
                {k: _meta(v) for k, v in kwargs.items()},
                tuple(TensorMeta.of(t) if isinstance(t, Tensor) else None for t in tree_leaves(out)),
                _device_type(args, leaves),
                torch.is_grad_enabled(),
                self.op_context,
            )
            if capture
            else None
        )
        # The op's event comes before its outputs' allocations, which it may need to name.
        allocs: list[Event] = []
        if self.phase is Phase.BACKWARD:
            node = torch._C._current_autograd_node()
            if node is not self._node:
                self._node = node
                self._node_serial += 1
            if func is _ADD and isinstance(out, Tensor):
                self._accumulate_in_place(args, kwargs, out)
        # Meta outputs hold no memory (DTensor propagates shardings on meta tensors of global shape).
        handles = tuple(-1 if t.is_meta else self._register_tensor(t, allocs) for t in leaves)
        self.events.append(
            OpEvent(
                self.op_index,
                self.step,
                self.phase,
                self.module,
                str(func),
                call,
                handles if capture else None,
                leaves[0].numel() if leaves else 0,
                self.workspace,
            )
        )
        self.workspace = 0
        self.events.extend(allocs)


#: A tensor's layout as stored (no subclass's property: FakeTensor.layout asks is_mkldnn first, in Python).
_LAYOUT: Callable[[Tensor], torch.layout] = torch._C.TensorBase.layout.__get__  # type: ignore[attr-defined]


#: Whether a fake tensor is mkldnn only by its ``dispatch_keys`` (torch 2.14: ``FakeTensor.is_mkldnn`` is a
#: Python property that reads them), so that ``dispatch_keys is None`` says it is not.
_MKLDNN_BY_KEYS = hasattr(fake_tensor_module, "_dispatch_keys_has_mkldnn")


def plain_layout(
    device: torch.device,
    shape: Sequence[int],
    stride: Sequence[int],
    offset: int | torch.SymInt,
    dtype: torch.dtype,
    nbytes: int,
    requires_grad: bool,
) -> tuple[Any, ...]:
    """The layout :meth:`Tracker.handle_and_layout` gives a :func:`plain_fake` tensor, in its order (also
    what a stand-in vouches for a tensor it made: ``ReplayTracker.vouch``)."""
    return (device, shape, stride, offset, dtype, nbytes, requires_grad)


def plain_fake(t: Tensor) -> TypeGuard[FakeTensor]:
    """A strided fake tensor of no subclass and no DTensor: one storage, its own (the common case, asked
    of every tensor the stand-ins meet and of every gradient and state tensor a step tags)."""
    return (
        type(t) is FakeTensor
        and t.dispatch_keys is None
        and _LAYOUT(t) is torch.strided
        # (FakeTensor.layout says _mkldnn then: storages_of finds none)
        and (_MKLDNN_BY_KEYS or not t.is_mkldnn)
        and getattr(t, "_local_tensor", None) is None
    )


def storages_of(t: Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or a sparse tensor's compressed parts (indices and values),
    read below the dispatcher's Python layer so that reading them runs no op of the step."""
    if t.layout is torch.strided:
        return [t.untyped_storage()]
    with torch._C._DisableTorchDispatch():
        if t.layout is torch.sparse_coo:
            parts = [t._indices(), t._values()]
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = [t.crow_indices(), t.col_indices(), t.values()]
        elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = [t.ccol_indices(), t.row_indices(), t.values()]
        else:
            return []
        return [part.untyped_storage() for part in parts]


def real_value(t: Tensor) -> Tensor | None:
    """The real values the simulation knows for ``t`` (a ``value_sets.ValueLookup``): a fake tensor's
    constant or known value (``engine.real_path``), a real tensor's own; ``None`` when unknown."""
    if isinstance(t, FakeTensor):
        return t.constant if t.constant is not None else known_value(t)
    return None if t.is_meta else t


def _meta(value: Any) -> Any:
    """An aten argument with tensors replaced by ``TensorMeta`` (aten args nest one list deep at most);
    a hand-written map, as pytree's costs more than the rest of recording an op."""
    if isinstance(value, Tensor):
        return TensorMeta.of(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) for v in value):
        return type(value)(TensorMeta.of(v) if isinstance(v, Tensor) else v for v in value)
    return value


def _is_below(path: str, ancestor: str) -> bool:
    """Whether module ``path`` is a strict descendant of module ``ancestor``."""
    return path != ancestor and (not ancestor or path.startswith(ancestor + "."))


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device of an op's first tensor argument (the CPU where none)."""
    for a in tree_leaves((args, kwargs)):
        if isinstance(a, Tensor):
            return a.device
    return torch.device("cpu")


def _trial(
    mode: FakeTensorMode,
    func: torch._ops.OpOverload,
    key: torch._C.DispatchKey,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Callable[[], object]:
    """``func``'s kernel at ``key`` run on the fake tensors with none of its ops recorded (whether it
    runs there at all: ``engine.real_ops.runs_on_fake``)."""
    untracked = getattr(mode, "untracked", None)

    def trial() -> object:
        if untracked is None:
            raise NotRunnable("the fake mode records every op")
        with untracked(), mode:
            return func._op_dk(key, *args, **kwargs)

    return trial


def _device_type(args: tuple[Any, ...], outputs: list[Tensor]) -> str:
    for t in outputs:
        return t.device.type
    for a in tree_leaves(args):
        if isinstance(a, Tensor):
            return a.device.type
    return "cpu"
