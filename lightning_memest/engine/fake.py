"""Real, meta or fake modules and batches -> fake tensors of a target device, and back.

The user's module is changed in place for the simulation (so that ``self`` inside their code is the
module they wrote) and restored exactly afterwards: every module's attributes (also ones set lazily
inside ``forward``, such as a cached positional-encoding tensor), parameters, buffers, submodules,
training flags, and every list, dict, set, deque or plain object reachable from them
(``engine.containers``). The original ``Parameter`` objects are never touched, so ``requires_grad``, ``.grad``
and the values stay as they were.

No real memory is allocated: real tensors become fake through ``FakeTensorMode.from_tensor`` (which
keeps shared storages shared), meta and foreign tensors through ``from_meta_and_device``. The values of
the module's small real tensors are copied beside them (``engine.real_path.know_module_value``), so that
code reading them as numbers reads the real ones.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode

from lightning_memest.batches import map_tensors
from lightning_memest.engine.containers import Reachable
from lightning_memest.engine.real_path import ValueCopies, know_module_value

__all__ = [
    "FakeConverter",
    "device_of",
    "fake_module",
    "fake_tensor",
    "local_tensor",
    "outermost_modules",
    "resident_tensors",
    "setattr_raw",
    "swappable_fakes",
]


class FakeConverter:
    """Turns tensors into fake tensors of one device (and dtype, for ``*-true`` precisions)."""

    def __init__(self, mode: FakeTensorMode, device: torch.device, float_dtype: torch.dtype | None) -> None:
        self.mode = mode
        self.device = device
        self.float_dtype = float_dtype
        self._memo: dict[int, Tensor] = {}

    def tensor(self, t: Tensor) -> Tensor:
        """The fake counterpart of ``t`` (the same one for the same tensor object)."""
        key = id(t)
        fake = self._memo.get(key)
        if fake is None:
            fake = self._convert(t)
            self._memo[key] = fake
        return fake

    def _convert(self, t: Tensor) -> Tensor:
        if isinstance(t, FakeTensor) and t.fake_mode is self.mode and t.device == self.device:
            fake: Tensor = t
        elif not isinstance(t, FakeTensor) and t.device == self.device and not _is_sharded(t):
            fake = self.mode.from_tensor(t)
        else:
            # Meta tensors, fake tensors of another mode or device, real tensors of another device,
            # and sharded (DTensor) parameters -- whole, at their global shape, for the simulation
            # to shard again: describe them on the meta device (free) and fake that on the target.
            meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
            fake = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, self.device)
        if self.float_dtype is not None and fake.is_floating_point() and fake.dtype != self.float_dtype:
            with self.mode:
                fake = fake.to(self.float_dtype)
        return fake

    def parameter(self, p: nn.Parameter) -> nn.Parameter:
        key = id(p)
        fake = self._memo.get(key)
        if fake is None:
            fake = self._from_meta(p)
            if fake is None:
                fake = _parameter(self.mode, self._convert(p.detach()), p.requires_grad)
            self._memo[key] = fake
        return fake  # type: ignore[return-value]

    def _from_meta(self, p: nn.Parameter) -> Tensor | None:
        """A parameter of a model built on the meta device, made a fake parameter at once (what
        ``_convert`` and ``_parameter`` make, less the fake tensor between them: a 70B-405B shape has
        thousands); ``None`` where the general path is needed (other devices, a dtype to convert)."""
        if not _PARAM_FAKES or p.device.type != "meta" or p.layout is not torch.strided:
            return None
        if isinstance(p, FakeTensor) or _is_sharded(p):
            return None
        if self.float_dtype is not None and p.is_floating_point() and p.dtype != self.float_dtype:
            return None
        shape, stride = tuple(p.shape), tuple(p.stride())
        return fake_tensor(
            self.mode, shape, stride, p.dtype, self.device, requires_grad=p.requires_grad, is_param=True
        )

    def any(self, value: Any) -> Any:
        """``value`` made fake if it is a tensor (a parameter stays a parameter), else as it is."""
        if isinstance(value, nn.Parameter):
            return self.parameter(value)
        if isinstance(value, Tensor):
            return self.tensor(value)
        return value

    def batch(self, batch: Any) -> Any:
        """The batch with every tensor made fake (any structure ``batches.map_tensors`` walks)."""
        return map_tensors(batch, self.tensor)


def device_of(t: Tensor) -> torch.device:
    """``t.device``, read without ``FakeTensor.device``'s property (a fake tensor's ``fake_device``)."""
    return t.fake_device if isinstance(t, FakeTensor) else t.device


def fake_tensor(
    mode: FakeTensorMode,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    constant: Tensor | None = None,
    *,
    requires_grad: bool = False,
    is_param: bool = False,
) -> Tensor:
    """A fake tensor of ``mode`` with a storage of its own, made without running an op: what a
    stand-in makes, whose allocation is replayed (an op through the fake mode costs 5x more), and a
    model's parameter where it was built on the meta device (``is_param``: ``isinstance(t,
    nn.Parameter)`` holds, as ``FakeTensor(..., _is_param=True)`` makes it)."""
    with below():  # (1 us of the tensor's 6 where it enters: callers making many go below first)
        meta = torch.empty_strided(shape, stride, dtype=dtype, device=_META)
    state = None if FakeTensorConfig.debug else _fresh_state(mode, device)
    if state is None or "_fake_device" not in state or state.get("constant", 0) is not None:
        # (torch before 2.14 names its attributes otherwise, and takes no requires_grad: no parameters)
        if requires_grad or is_param:
            return FakeTensor(
                mode, meta, device, constant=constant, requires_grad=requires_grad, _is_param=is_param
            )
        return FakeTensor(mode, meta, device, constant=constant)
    # FakeTensor.__new__'s work less its checks and per-attribute descriptors (half its cost; a replayed
    # layer makes some 50, a model some ten a layer): the attributes of a fresh fake tensor of this
    # device, copied from one it made.
    t = Tensor._make_subclass(
        FakeTensor, meta, requires_grad, dispatch_device=True, device_for_backend_keys=state["_fake_device"]
    )
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    t.__dict__.update(state)
    t.fake_mode = mode
    if constant is not None:  # a plain attribute, as __new__ sets it (an optimizer's step counter)
        t.constant = constant
    if is_param:
        t._is_param = True
    return t


_FRESH: dict[torch.device, dict[str, Any]] = {}
_META = torch.device("meta")  # an object, not the string: no parse at each tensor made (a quarter less)
_EXCLUDED = torch._C._dispatch_tls_is_dispatch_key_excluded
_PYTHON_KEY = torch._C.DispatchKey.Python  # excluded below the modes (torch._C._DisableTorchDispatch)


def below_modes() -> bool:
    """Whether the code running is below the dispatcher's Python layer (inside
    ``torch._C._DisableTorchDispatch``): no op reaches a mode or subclass, and another such block
    (1 us to enter and leave) is not needed."""
    return _EXCLUDED(_PYTHON_KEY)


_ALREADY_BELOW: AbstractContextManager[None] = nullcontext()  # reusable: it holds no state


def below() -> AbstractContextManager[Any]:
    """A block below the modes: ``torch._C._DisableTorchDispatch()``, or nothing where the caller is
    already below them (:func:`below_modes`), so that code called both ways enters at most one.

    >>> with below():
    ...     with below():
    ...         below_modes()
    True
    """
    return _ALREADY_BELOW if _EXCLUDED(_PYTHON_KEY) else torch._C._DisableTorchDispatch()


# torch's classmethod, as the class holds it (every supported torch defines it there; were one not to,
# quick_device_queries leaves the class alone)
_TORCH_DISPATCH = FakeTensor.__dict__.get("__torch_dispatch__")
_PRIM_DEVICE = torch.ops.prim.device.default


def _device_first(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    # FakeTensor.__torch_dispatch__'s answer to a device query, without its call counter, its checks and
    # its handler lookups on the way; anything else to it.
    if func is _PRIM_DEVICE:
        t = args[0]
        return _META if t.fake_mode.in_kernel_invocation else t.fake_device
    return _TORCH_DISPATCH.__func__(cls, func, types, args, {} if kwargs is None else kwargs)  # type: ignore[union-attr]


@contextmanager
def quick_device_queries() -> Iterator[None]:
    """Inside, C++ asking a fake tensor for its device (``prim.device``, which reaches Python) is answered
    as ``FakeTensor.__torch_dispatch__`` answers it, a quarter cheaper: what setting ``p.grad`` costs,
    whose checks ask both tensors three times each (a replayed layer sets 24). Other ops go to torch's
    handler unchanged.

    >>> mode = FakeTensorMode()
    >>> p = fake_tensor(mode, (2,), (1,), torch.float32, torch.device("cpu"), requires_grad=True)
    >>> with quick_device_queries():
    ...     p.grad = fake_tensor(mode, (2,), (1,), torch.float32, torch.device("cpu"))
    >>> p.grad.device, FakeTensor.__dict__["__torch_dispatch__"] is _TORCH_DISPATCH
    (device(type='cpu'), True)
    """
    if not isinstance(_TORCH_DISPATCH, classmethod):
        yield
        return
    FakeTensor.__torch_dispatch__ = classmethod(_device_first)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        FakeTensor.__torch_dispatch__ = _TORCH_DISPATCH  # type: ignore[assignment,method-assign]


def _fresh_state(mode: FakeTensorMode, device: torch.device) -> dict[str, Any]:
    """The instance attributes ``FakeTensor.__new__`` gives a tensor on ``device`` without a constant,
    less its mode (the same for every such tensor: none depends on the tensor)."""
    state = _FRESH.get(device)
    if state is None:
        with torch._C._DisableTorchDispatch():
            meta = torch.empty(0, device="meta")
        state = dict(FakeTensor(mode, meta, device).__dict__)
        del state["fake_mode"]  # set per tensor: a mode kept here would keep its simulation alive
        _FRESH[device] = state
    return state


#: Whether this torch's ``FakeTensor`` constructor makes parameters (``requires_grad``, ``_is_param``:
#: torch 2.14; 2.11's takes neither, and the supported range starts there).
_PARAM_FAKES = {"requires_grad", "_is_param"} <= set(inspect.signature(FakeTensor.__new__).parameters)


def _parameter(mode: FakeTensorMode, fake: Tensor, requires_grad: bool) -> Tensor:
    """``nn.Parameter(fake, requires_grad)``, made without the op it runs (``fake.detach()``, which
    re-enters the tracking mode: four fifths of a parameter's conversion): a fake tensor on the same
    storage, marked a parameter as ``nn.Parameter`` marks a tensor subclass."""
    if fake.layout is not torch.strided or not isinstance(fake, FakeTensor) or not _PARAM_FAKES:
        return nn.Parameter(fake, requires_grad=requires_grad)
    with torch._C._DisableTorchDispatch():
        meta = torch.empty(0, dtype=fake.dtype, device="meta")
        meta.set_(fake.untyped_storage(), fake.storage_offset(), fake.shape, fake.stride())
    return FakeTensor(mode, meta, fake.device, requires_grad=requires_grad, _is_param=True)


#: Exact types of attribute values that hold no tensor :func:`fake_module` converts (a subclass, a list
#: or a tuple is looked into).
_NO_TENSORS = frozenset({dict, OrderedDict, set, bool, int, float, str, type(None)})


@contextmanager
def fake_module(module: nn.Module, converter: FakeConverter) -> Iterator[nn.Module]:
    """Inside the block, ``module`` holds fake tensors; on exit it is exactly as it was."""
    modules = [(m, type(m)) for m in module.modules()]
    # Contents, not only references: code adds in place to the hook dicts (FSDP), ``_buffers``
    # (``register_buffer`` inside forward, lazy modules) and the user's lists, dicts, sets and objects.
    reachable = Reachable(m for m, _ in modules)
    composed = _composable_modules()
    # The values of the module's small tensors are known (``engine.real_path``): code that reads them
    # (a loop count in a buffer, a step counter) takes the real run's path.
    copies: ValueCopies = {}
    try:
        for m, _ in modules:
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = fake_p = converter.parameter(p)
                    know_module_value(fake_p, p, copies)
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = fake_b = converter.tensor(b)
                    know_module_value(fake_b, b, copies)
            for name, value in list(vars(m).items()):
                if type(value) in _NO_TENSORS:  # most of a module's attributes: its dicts, its flags
                    continue
                # Plain tensor attributes (not registered as buffers) are read by forward too, and
                # lists of parameters kept beside _parameters (nn.LSTM's _flat_weights) must follow.
                if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                    setattr_raw(m, name, fake := converter.tensor(value))
                    know_module_value(fake, value, copies)
                elif isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) for v in value):
                    fakes = [converter.any(v) for v in value]
                    for fake_v, v in zip(fakes, value, strict=True):  # (gpytorch's train_inputs)
                        if isinstance(v, Tensor) and not isinstance(v, nn.Parameter):
                            know_module_value(fake_v, v, copies)
                    setattr_raw(m, name, type(value)(fakes))
        yield module
    finally:
        _forget_composable_state(composed)
        for m, cls in modules:
            if type(m) is not cls:
                m.__class__ = cls  # fully_shard makes each unit an FSDPModule subclass
        reachable.restore()


@contextmanager
def swappable_fakes(mode: FakeTensorMode) -> Iterator[None]:
    """Inside the block, a module's fake parameters can be converted in place, as a step may do to the
    real ones (``self.to(memory_format=torch.channels_last)``): ``nn.Module._apply`` swaps a fake
    parameter's contents with its converted copy (``torch.utils.swap_tensors``), which refuses a tensor
    with a weak reference, and the fake mode's converter keeps one to every tensor it made (its memo,
    for converting the same real tensor again -- done by then). Those are dropped before a swap."""
    original = torch.utils.swap_tensors
    memo = mode.fake_tensor_converter.tensor_memo

    def swap(t1: Tensor, t2: Tensor) -> None:
        for t in (t1, t2):
            if isinstance(t, FakeTensor) and weakref.getweakrefcount(t):
                for key in [k for k, v in memo.items() if v is t]:
                    del memo[key]
        original(t1, t2)  # type: ignore[no-untyped-call]

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def setattr_raw(module: nn.Module, name: str, value: Any) -> None:
    """Set an instance attribute without nn.Module's ``__setattr__`` bookkeeping."""
    object.__setattr__(module, name, value)


def _composable_modules() -> dict[nn.Module, Any] | None:
    """The composable-API (``fully_shard``) state registry as it is now, or ``None`` without
    distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed import _composable_state

    return dict(_composable_state._module_state_mapping)


def _forget_composable_state(before: dict[nn.Module, Any] | None) -> None:
    """Put the composable-API registry back as it was: ``fully_shard`` refuses a module it has seen
    once (the next simulation shards the same modules again), and a module that arrived sharded was
    taken out of it for the simulation."""
    if before is None:
        return
    from torch.distributed import _composable_state

    mapping = _composable_state._module_state_mapping
    mapping.clear()
    mapping.update(before)


def _is_sharded(t: Tensor) -> bool:
    """A DTensor: the memory is its local shard's."""
    return local_tensor(t) is not t


def local_tensor(t: Tensor) -> Tensor:
    """The tensor that holds the memory: a DTensor's local shard, else ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Tensor) else t


def outermost_modules(model: nn.Module, chosen: Callable[[nn.Module], bool]) -> tuple[str, ...]:
    """The dotted paths (``""``: ``model`` itself) of the modules ``chosen`` picks, none inside another.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(), nn.Dropout()))
    >>> outermost_modules(net, lambda m: isinstance(m, (nn.Sequential, nn.Dropout)))
    ('',)
    >>> outermost_modules(net, lambda m: isinstance(m, nn.Dropout))
    ('1.0', '1.1')
    """
    found: list[str] = []
    # named_modules walks depth first: a chosen module's descendants come right after it.
    for path, module in model.named_modules():
        inside = bool(found) and (found[-1] == "" or path.startswith(f"{found[-1]}."))
        if not inside and chosen(module):
            found.append(path)
    return tuple(found)


def resident_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor, bool]]:
    """``(path, tensor, is_parameter)`` for every tensor a module holds: parameters, buffers, and
    plain tensor attributes (of a sharded parameter, the local shard)."""
    for path, m in module.named_modules():
        prefix = f"{path}." if path else ""
        for name, p in m._parameters.items():
            if p is not None:
                yield prefix + name, local_tensor(p), True
        for name, b in m._buffers.items():
            if b is not None:
                yield prefix + name, b, False
        for name, value in vars(m).items():
            if isinstance(value, Tensor) and name not in m._parameters and name not in m._buffers:
                yield prefix + name, value, False
