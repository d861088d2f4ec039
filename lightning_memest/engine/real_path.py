"""The code path of a real eager run, taken on fake tensors: what libraries check is answered as the
real run would answer it.

Libraries take another code path when they think they are traced or compiled; each check and the
simulation's answer are in ``engine.tracing_checks`` (only transformers' ``is_fake_tensor`` differs).

Not tracing, transformers reads values: whether the position ids restart (packed sequences), whether
the padding mask masks anything. The real run answers from the values, so the simulation must know
them too. Fake tensors have none, so :func:`real_path` also keeps **known values** for the tensors whose
values decide code paths -- integer and boolean tensors (positions, lengths, indices, masks) of at
most :data:`VALUE_LIMIT` elements -- computed on small real CPU tensors beside the fake run:

* the batch's integer and boolean tensors (copies; the batch is never touched); its floating-point
  ones of at most :data:`FLOAT_VALUE_LIMIT` elements only for ``torch.equal``/``allclose`` (the
  inputs a Gaussian process checks are its training inputs), so that their selections and reads stay
  the policy's, as a larger batch's would;
* the model's own parameters, buffers and tensor attributes (:func:`know_module_value`, called as
  ``engine.fake`` converts the model): integer and boolean ones of at most :data:`VALUE_LIMIT`
  elements, floating-point ones of at most :data:`FLOAT_VALUE_LIMIT` (a step count, a per-block
  setting, a temperature, a learned scale: not a weight matrix, whose copy would cost its size and
  whose every op would run a second time beside the fake one). A model built on the meta device has
  no values: its reads stay assumed;
* deterministic factories (``arange``, ``linspace``, ``full``, ``zeros``, ``ones``, their ``_like``
  and ``new_`` forms; not ``empty`` or random ones) and ``torch.tensor(...)``: integer and boolean
  ones up to :data:`VALUE_LIMIT` elements, floating-point ones up to :data:`FLOAT_VALUE_LIMIT`;
* any op whose tensor arguments all have known values: the same op on the values (views stay views
  of the values, in-place ops update them; an in-place write from an unknown value forgets them:
  a counter such as batch norm's ``num_batches_tracked`` follows the step, an average of
  activations becomes unknown, and so does a parameter once the optimizer updates it from its
  gradient).

A step that failed after an assumed read is simulated again with the floating-point tensors of the
model and the batch known too, up to ``followed_values.FOLLOW_LIMIT`` elements, with zeros in the
buffers ``empty`` makes and copies of the real constants the step's code makes outside the fake mode
(``engine.values.followed_values``): an adaptive solver's control flow on activations.

A scalar read (``.item()``, ``bool(t)``, ``torch.equal``) of a known value returns it, and an op whose
output size depends on known values (``nonzero``, boolean indexing) gets its real size; neither is a
data-dependent assumption any more. Reads of anything else still go to the engine's policy
(``engine.values.data_dependent``). Floating-point tensors carry values only where they are made from known
values alone (a padding mask turned into a float mask): activations and weights stay fake, and no
memory of the user's size is allocated.

One thing a real step allocates is no op at all: ``torch.get_rng_state()`` copies the CPU generator's
state into a new 5,056-byte tensor (activation checkpointing keeps one per checkpointed segment until its
recomputation). For a step simulated for the CPU, it returns a fake tensor of that size inside the
simulation, allocated and freed where the real copy is, and ``torch.set_rng_state`` takes it back.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> mode = FakeTensorMode()
    >>> with real_path(mode), mode:
    ...     positions = torch.arange(6).unsqueeze(0)
    ...     packed = bool((torch.diff(positions) != 1).any())  # a real run reads this value too
    >>> packed, known_value(positions)
    (False, tensor([[0, 1, 2, 3, 4, 5]]))
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._mode_utils import no_dispatch

from lightning_memest.engine.tracing_checks import transformers_sees_real_tensors
from lightning_memest.engine.values.followed_values import (
    FOLLOW_LIMIT,
    float_value_limit,
    read_site,
    values_followed,
)
from lightning_memest.engine.values.tensor_facts import BATCH_FLOATS, file_fact

__all__ = [
    "FLOAT_VALUE_LIMIT",
    "VALUE_LIMIT",
    "KnownValues",
    "ValueCopies",
    "know_module_value",
    "known_value",
    "real_path",
]

#: The most elements a tensor with a known value may have: masks and positions of a batch, not
#: activations. Larger integer tensors stay fake (their reads go to the policy).
VALUE_LIMIT = 1 << 20

#: The most elements a floating-point parameter or buffer of the model may have for its value to be
#: known: numbers code reads as numbers (``.item()``, a comparison), not weights.
FLOAT_VALUE_LIMIT = 1 << 12

_VALUE = "_memest_value"
"""The attribute of a fake tensor that holds its known value (a real CPU tensor)."""

aten = torch.ops.aten

#: Scalar reads: answered from known values without running the fake op (which cannot answer them).
_READS = frozenset(
    {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
)

#: Factories whose values depend only on their tensor argument's shape and dtype, never its values.
_SHAPE_ONLY = frozenset(
    {
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.full_like.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
    }
)

#: Data-dependent ops whose outputs the engine's policy makes even where every input is known: a
#: packed sequence's batch sizes must be a real CPU tensor, which the recurrent kernels read through a
#: data pointer (``engine.values.data_dependent``'s ``_pack_padded``).
_POLICY_MADE = frozenset({aten._pack_padded_sequence})

#: ``torch.tensor(data)``: the fake mode gets the data as a real tensor.
_LIFTS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})

_NO_VALUE = object()


def known_value(t: Tensor) -> Tensor | None:
    """The real value the simulation knows for the fake tensor ``t`` (a CPU tensor), or ``None``."""
    value = t.__dict__.get(_VALUE) if isinstance(t, FakeTensor) else None
    if value is None or _forgotten(value):
        return None
    return value  # type: ignore[no-any-return]


@contextmanager
def real_path(
    mode: FakeTensorMode, batch: Iterable[tuple[Tensor, Tensor]] = (), *, cpu_allocator: bool = False
) -> Iterator[KnownValues]:
    """Inside: the simulation's libraries take a real eager run's code path (see the module docstring).

    ``mode`` is the simulation's fake mode; ``batch`` pairs ``(fake, real)`` of the batch's tensors,
    whose integer and boolean values are known to the simulation. With ``cpu_allocator`` (a step
    simulated for the CPU) the copies of the CPU generator's state that a real step makes are fake
    tensors, allocated and freed where the real ones are. On exit transformers' check, torch's RNG
    functions and ``mode`` are exactly as they were. Yields the known values (their ``on_read``: told
    each time one decided a read or a size).
    """
    values = KnownValues(mode)
    for fake, real in batch:
        values.add_batch_tensor(fake, real)
    with ExitStack() as stack:
        stack.enter_context(transformers_sees_real_tensors(mode))
        if cpu_allocator:
            stack.enter_context(_rng_state_copies(mode))
        mode.dispatch = values.dispatch  # type: ignore[method-assign]
        try:
            yield values
        finally:
            del mode.dispatch


@contextmanager
def _rng_state_copies(mode: FakeTensorMode) -> Iterator[None]:
    """``torch.get_rng_state()`` copies the CPU generator's state into a new 5,056-byte tensor of
    the CPU allocator -- activation checkpointing keeps one per checkpointed segment from forward to
    its recomputation. Not an op, so the fake run would not see it: inside ``mode`` it returns a fake
    tensor of the same size (tracked like any allocation) that knows the state, and
    ``torch.set_rng_state`` takes it back."""
    get_state, set_state = torch.random.get_rng_state, torch.random.set_rng_state

    def get_rng_state() -> Tensor:
        state = get_state()
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not mode:
            return state
        fake = torch.empty(state.shape, dtype=state.dtype, device="cpu")
        setattr(fake, _VALUE, state)
        return fake

    def set_rng_state(new_state: Tensor) -> None:
        if isinstance(new_state, FakeTensor):
            value = known_value(new_state)
            if value is not None:  # (an unknown fake state has nothing to set)
                set_state(value)
        else:
            set_state(new_state)

    replacements: dict[str, Callable[..., Any]] = {
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
    }
    # ``torch.get_rng_state`` is ``torch.random.get_rng_state`` imported by name: both are replaced.
    originals = [(m, name, getattr(m, name)) for m in (torch, torch.random) for name in replacements]
    for m, name, _ in originals:
        setattr(m, name, replacements[name])
    try:
        yield
    finally:
        for m, name, fn in originals:
            setattr(m, name, fn)


class KnownValues:
    """The fake mode's ``dispatch``, wrapped: the fake op runs as before, and values are kept beside it.

    An instance attribute in place of the mode's method, rather than a dispatch mode stacked above
    the fake one: no second Python dispatch layer per op, and ops without known values cost one
    scan of their arguments.
    """

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self.fake_dispatch = mode.dispatch
        self.on_read: Callable[[torch._ops.OpOverload, str, bool], None] | None = None
        """Told of each time a known value decided something (the op, what it answered): a scalar
        read, a data-dependent size."""
        self._copies: ValueCopies = {}
        self._following = values_followed()

    def add_batch_tensor(self, fake: Tensor, real: Tensor) -> None:
        """Know ``fake``'s value: a CPU copy of ``real`` (views of one storage share one copy) -- an
        integer or boolean tensor of at most :data:`VALUE_LIMIT` elements. A floating-point one of at
        most :data:`FLOAT_VALUE_LIMIT` gets a copy for equality checks alone (``tensor_facts.BATCH_FLOATS``: a
        Gaussian process checks that it trains on its training inputs)."""
        if type(real) is not Tensor or real.is_meta:
            return
        if _valued_kind(real):
            _know(fake, real, self._copies, VALUE_LIMIT)
        elif self._following and real.is_floating_point():
            _know(fake, real, self._copies, FOLLOW_LIMIT)  # a step followed on its values
        elif real.is_floating_point() and real.numel() <= FLOAT_VALUE_LIMIT and isinstance(fake, FakeTensor):
            # Read by equality checks only (``engine.values.data_dependent``): the batch's floats stay
            # unknown to everything else (the size of a selection of them stays an upper bound).
            file_fact(fake, BATCH_FLOATS, real.detach().to("cpu", copy=True))

    def dispatch(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        valued, unvalued = _count(args, kwargs)
        if not _computable(func):
            out = self.fake_dispatch(func, types, args, kwargs)
            if valued:
                _forget_written(func, args, kwargs)
            if self._following and _is_empty_factory(func) and _all_small(out):
                _attach(out, _zeros_like(out))  # a buffer code fills before it reads (a solver's stages)
            return out
        all_known = valued > 0 and unvalued == 0
        if func in _READS and all_known:
            answer = _run_real(func, args, kwargs)
            if answer is not _NO_VALUE:
                self._read(func, "its real value")
                return answer
        try:
            out = self.fake_dispatch(func, types, args, kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if not all_known or func.overloadpacket in _POLICY_MADE:
                raise
            real = _run_real(func, args, kwargs)
            if real is _NO_VALUE or not _all_small(real):
                raise
            self._read(func, "the real size")
            return self._fake_of(real, _first_fake(args, kwargs))  # the real size
        # Integer and boolean outputs of known values or of constants keep their values; floating-point
        # ones only where every tensor argument is known, and not of a float's shape alone (an
        # optimizer's zeros_like of a weight, known or not; a padding mask's float zeros_like is kept).
        shape_only = func in _SHAPE_ONLY and _floating_argument(args)
        from_values = (all_known and not shape_only) or (
            (valued == 0 or shape_only) and _from_constants(func, unvalued) and _all_small(out, False)
        )
        if from_values and _all_small(out) and _attach(out, _run_real(func, args, kwargs)):
            return out
        if valued:
            _forget_written(func, args, kwargs)
        return out

    def _read(self, func: torch._ops.OpOverload, what: str) -> None:
        if self.on_read is not None:
            # In a step followed on its values (``engine.values.followed_values``) the answer is this
            # batch's, not one that holds for every batch: not exact.
            if not self._following:
                self.on_read(func, what, True)
            else:  # by call site: a loop's condition is listed with its trip count
                self.on_read(func, f"{what}, this batch's (followed), at {read_site()}", False)

    def _fake_of(self, real: Any, like: FakeTensor) -> Any:
        """A fake tensor of ``like``'s device for each real output, knowing its value."""
        if isinstance(real, (tuple, list)):
            return type(real)(self._fake_of(r, like) for r in real)
        if not isinstance(real, Tensor):
            return real
        meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        fake = self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, like.device)
        setattr(fake, _VALUE, real)
        return fake


#: The CPU copies of the storages whose values are known, by the real storage's device and address:
#: views of one storage share one copy, so a write through one is seen through the others.
ValueCopies = dict[tuple[torch.device, int], torch.UntypedStorage]


def know_module_value(fake: Tensor, real: Tensor, copies: ValueCopies) -> None:
    """Know the value of ``fake``, the simulation's stand-in for the model's own tensor ``real`` (a
    parameter, a buffer, a tensor attribute): a CPU copy of ``real``, filed in ``copies``, where it is
    small (integer and boolean tensors of at most :data:`VALUE_LIMIT` elements, floating-point ones of
    at most :data:`FLOAT_VALUE_LIMIT`) and real (not meta, not fake, not a tensor subclass). Where
    ``fake`` was converted to another floating-point dtype (``*-true`` precisions), so is its value.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> mode, reps = FakeTensorMode(), torch.tensor([3])
        >>> fake = mode.from_tensor(reps)
        >>> know_module_value(fake, reps, {})
        >>> with real_path(mode), mode:
        ...     int(fake.item())
        3
    """
    if type(real) not in _PLAIN or real.is_meta:
        return
    if real.is_floating_point():
        limit = float_value_limit(FLOAT_VALUE_LIMIT)  # a weight matrix too, in a step followed
    elif real.is_complex() or real.is_quantized:
        return
    else:
        limit = VALUE_LIMIT
    if real.numel() <= limit:
        _know(fake, real, copies, limit)


_PLAIN = (Tensor, torch.nn.Parameter)


def _know(fake: Tensor, real: Tensor, copies: ValueCopies, limit: int) -> None:
    """File a CPU copy of ``real`` (its storage's, shared by its views) as ``fake``'s value, where its
    storage holds at most ``limit`` elements."""
    if not isinstance(fake, FakeTensor) or real.is_meta or real.layout != torch.strided:
        return
    if fake.shape != real.shape:
        return
    storage = real.untyped_storage()
    if storage.nbytes() > limit * real.element_size():
        return  # a small view of a large storage (a flat parameter): the copy would be the storage's
    key = (storage.device, storage.data_ptr())
    copy = copies.get(key)
    if copy is None:
        raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        copy = raw.to("cpu", copy=True).untyped_storage()
        copies[key] = copy
    value = torch.empty(0, dtype=real.dtype).set_(copy, real.storage_offset(), real.shape, real.stride())
    if fake.dtype != value.dtype:
        if not (fake.is_floating_point() and value.is_floating_point()):
            return
        value = value.to(fake.dtype)  # a *-true conversion: the value the real run converts to
    setattr(fake, _VALUE, value)


def _valued_kind(t: Tensor) -> bool:
    """Integer and boolean tensors carry values; floating-point ones never do."""
    return not (t.is_floating_point() or t.is_complex() or t.is_quantized) and t.numel() <= VALUE_LIMIT


def _forgotten(value: Tensor) -> bool:
    """Values forgotten after an unknown in-place write have a zero-byte storage (see below)."""
    return value.numel() > 0 and value.untyped_storage().nbytes() == 0


def _args(args: Sequence[object], kwargs: Mapping[str, object]) -> Iterator[object]:
    """The arguments, with one level of lists opened (``Tensor[]`` and ``Tensor?[]``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _count(args: Sequence[object], kwargs: Mapping[str, object]) -> tuple[int, int]:
    """How many tensor arguments have a known value, and how many do not."""
    valued = unvalued = 0
    for a in _args(args, kwargs):
        if isinstance(a, Tensor):
            if known_value(a) is None and not _followed_constant(a):
                unvalued += 1
            else:
                valued += 1
    return valued, unvalued


def _is_empty_factory(func: object) -> bool:
    return isinstance(func, torch._ops.OpOverload) and func.overloadpacket.__name__.startswith(_EMPTY)


def _zeros_like(out: Any) -> Any:
    """Zeros of ``out``'s shape, strides and dtype on the CPU (for each tensor of a tuple)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_zeros_like(o) for o in out)
    with no_dispatch():
        return torch.zeros(0, dtype=out.dtype).new_empty_strided(out.shape, out.stride()).zero_()


def _followed_constant(t: Tensor) -> bool:
    """A real tensor the step's code made outside the fake mode (a solver's coefficient table), whose
    values a step followed on its values computes with (on a copy: it is never written)."""
    return type(t) is Tensor and not t.is_meta and t.numel() <= FOLLOW_LIMIT and values_followed()


def _floating_argument(args: Sequence[object]) -> bool:
    """Whether the first argument is a floating-point tensor (a ``_like`` factory's template)."""
    return bool(args) and isinstance(args[0], Tensor) and args[0].is_floating_point()


def _first_fake(args: Sequence[object], kwargs: Mapping[str, object]) -> FakeTensor:
    return next(a for a in _args(args, kwargs) if isinstance(a, FakeTensor))


def _computable(func: object) -> bool:
    """Whether values may be computed by running ``func`` for real: aten's deterministic ops only
    (not collectives, other libraries' kernels or higher-order operators; not random ones; not the
    ``empty`` factories, whose real values are whatever the memory held, also with a tensor argument:
    ``empty_like(a)``, ``a.new_empty(n)``)."""
    return (
        isinstance(func, torch._ops.OpOverload)
        and func.namespace == "aten"
        and torch.Tag.nondeterministic_seeded not in func.tags
        and not func.overloadpacket.__name__.startswith(_EMPTY)
    )


_EMPTY = ("empty", "new_empty", "_empty")


def _from_constants(func: torch._ops.OpOverload, tensors: int) -> bool:
    """An op whose values follow from its non-tensor arguments: a deterministic factory,
    ``torch.tensor(data)``, or a ``_like`` / ``new_`` factory (its tensor gives only a shape)."""
    if func in _SHAPE_ONLY or func in _LIFTS:
        return True
    return not tensors


def _all_small(out: Any, floats: bool = True) -> bool:
    """Every output is a tensor of at most :data:`VALUE_LIMIT` elements, of an integer or boolean dtype or,
    with ``floats``, a floating-point one (without, a floating-point one of at most
    :data:`FLOAT_VALUE_LIMIT`: ``linspace``, ``full`` of a constant): an op of known values keeps its
    outputs' values whatever their dtype (a padding mask made a float mask of ``0``/``-inf``, as
    ``nn.MultiheadAttention`` does, then compared again), though only integer and boolean tensors are
    known to begin with."""
    if isinstance(out, Tensor):
        if out.is_complex() or out.is_quantized:
            return False
        if out.is_floating_point() and not floats:
            # A float factory's grid (``linspace``); a scalar made of a number is the fake mode's own
            # constant already (an optimizer's step counter: read silently, as before), except in a
            # followed step, whose solver lifts its step sizes with ``torch.tensor``.
            smallest = 1 if values_followed() else 2
            return smallest <= out.numel() <= float_value_limit(FLOAT_VALUE_LIMIT)
        return out.numel() <= VALUE_LIMIT
    if isinstance(out, (tuple, list)):
        return len(out) > 0 and all(_all_small(o, floats) for o in out)
    return False


def _attach(out: Any, real: Any) -> bool:
    """Give each fake output its real value; ``False`` if they do not match."""
    if isinstance(out, Tensor) and isinstance(real, Tensor):
        if isinstance(out, FakeTensor) and real.shape == out.shape and real.dtype == out.dtype:
            setattr(out, _VALUE, real)
            return True
        return False
    if isinstance(out, (tuple, list)) and isinstance(real, (tuple, list)) and len(out) == len(real):
        return all([_attach(o, r) for o, r in zip(out, real, strict=True)])
    return False


def _forget_written(func: object, args: Sequence[object], kwargs: Mapping[str, object]) -> None:
    """An op wrote into tensors with known values from something unknown: forget those values, and
    those of every view of them (they share the value's storage, which is emptied)."""
    for i, name in _written_arguments(func):
        written = args[i] if i < len(args) else kwargs.get(name)
        for t in written if isinstance(written, (list, tuple)) else (written,):
            value = known_value(t) if isinstance(t, Tensor) else None
            if value is not None:
                value.untyped_storage().resize_(0)


def _written_arguments(func: object) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes into (``Tensor(a!)`` in its schema, and the
    running statistics the batch-norm kernels update unannotated); a keyword-only one has no position
    (``sys.maxsize``)."""
    found = _WRITTEN.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        arguments = list(enumerate(schema.arguments if schema is not None else ()))
        unannotated = _UNANNOTATED_WRITES.get(getattr(func, "overloadpacket", None), ())
        found = tuple(
            (sys.maxsize if arg.kwarg_only else i, arg.name)
            for i, arg in arguments
            if (arg.alias_info is not None and arg.alias_info.is_write) or arg.name in unannotated
        )
        _WRITTEN[func] = found
    return found


_WRITTEN: dict[object, tuple[tuple[int, str], ...]] = {}

#: Ops that write arguments their schema does not mark written: the eager batch-norm kernels update
#: ``running_mean`` and ``running_var`` in place (``nn.BatchNorm*`` in training on CPU calls
#: ``native_batch_norm``; ``_native_batch_norm_legit`` is the annotated twin torch made for tracing).
_UNANNOTATED_WRITES: dict[object, tuple[str, ...]] = {
    op: ("running_mean", "running_var")
    for op in (aten.native_batch_norm, aten.cudnn_batch_norm, aten.miopen_batch_norm, aten.instance_norm)
}


def _run_real(func: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> Any:
    """``func`` on the known values (on the CPU), or ``_NO_VALUE`` if it cannot run there."""
    try:
        real_args = [_real(a, func) for a in args]
        real_kwargs = {k: _real(v, func) for k, v in kwargs.items()}
        if "pin_memory" in real_kwargs:
            real_kwargs["pin_memory"] = False
        if func in _SHAPE_ONLY:
            real_kwargs["device"] = torch.device("cpu")
        with no_dispatch():
            return func(*real_args, **real_kwargs)
    except Exception:
        return _NO_VALUE


class _Unknown(Exception):
    """An argument has no value the CPU can compute with."""


def _real(a: object, func: torch._ops.OpOverload) -> object:
    if isinstance(a, (list, tuple)):
        return type(a)(_real(x, func) for x in a)
    if isinstance(a, torch.device):
        return torch.device("cpu")
    if not isinstance(a, Tensor):
        return a
    if func in _SHAPE_ONLY:  # only the shape and dtype are read: a meta tensor allocates nothing
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, FakeTensor):
        value = known_value(a)
        if value is None:
            raise _Unknown
        return value
    if (func in _LIFTS and not a.is_meta) or _followed_constant(a):
        with no_dispatch():
            return a.detach().cpu().clone()
    raise _Unknown  # a real tensor of the user's: never computed on (an in-place op would change it)
