"""Real where fake fails: an op whose fake kernel raises, run for real on small real tensors.

Some fake (meta) kernels disagree with the real ones: ``aten._grouped_mm``'s applies CUDA's dtype checks
on every device, while the CPU kernel runs float32 (transformers' MoE experts take it); a user's op
(``torch.library.custom_op``) may have no fake kernel at all. Where an op's fake kernel raises:

* an op whose kernel is written in Python (``torch.library.custom_op``, ``Library.impl`` with a Python
  function: :func:`python_kernel`) runs that kernel on the fake tensors, its ops simulated as the
  step's own (``engine.tracker``) -- its outputs, temporaries and FLOPs are the real run's, nothing is
  allocated for real, and a data-dependent op inside gets the policy's answer and is listed
  (``engine.values.data_dependent``: ``x[x > 0]`` selects every element, an upper bound). A kernel
  that cannot run on fake tensors (it reads data through NumPy, say: :func:`runs_on_fake` tries it
  once per op, untracked) runs for real as below;
* any other op: :func:`run_for_real` runs it alone, for real, on real tensors of the same shapes,
  strides and dtypes -- zeros (valid indices, no NaN paths; no random generator drawn from), or the
  real values where the simulation knows them (the batch's small integer tensors: masks, ids) -- and
  hands back fake tensors with the real outputs' metadata; the simulation carries on with those, and
  the op's outputs are accounted as any op's. A nested output (the fast path of ``nn.TransformerEncoder``
in eval with a padding mask: ``_nested_tensor_from_mask``) cannot be fake: it stays real, and the ops
that take it run for real in turn, until one makes a dense tensor again. What the kernel allocates
beyond its outputs is measured as it runs (the CPU allocator's events) and accounted as the op's
workspace. Only where that is safe and small: never for an op that writes its inputs or returns a view
of them, never with more than :data:`REAL_OP_LIMIT` bytes of inputs (the error then says so), never
with the user's tensors (only stand-ins). A real kernel that raises too raises the fake kernel's
error: the step is wrong, not the fake kernel.

Zeros stand in for values nobody knows, and an output whose size follows values would come out wrong
(empty, for a selection of positives). So an op that may size its outputs by values -- any op outside
``aten`` and ``prims``, an aten op PyTorch tags ``dynamic_output_shape`` or ``data_dependent_output``,
and any op returning a nested tensor -- runs a second time with other values in the unknown stand-ins
(normal floats from a generator of its own, ones for integers and booleans). Where the outputs'
sizes differ, nothing bounds them: the op is not runnable, and the error says so (a fake kernel
returning the largest output, ``torch.library.register_fake``, makes it estimable); where the second
run raises, the sizes from zeros are kept and the call is listed as an assumption that could be low.
What a kernel run for real allocates is not known before it runs: its inputs are bounded, its
outputs are measured.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> mode = FakeTensorMode()
    >>> with mode:
    ...     x = torch.empty(8, 4)
    >>> out, workspace = run_for_real(mode, torch.ops.aten.mm.default, (x, x.t()), {}, lambda t: None)
    >>> type(out).__name__, tuple(out.shape), workspace
    ('FakeTensor', (8, 8), 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves, tree_map_only

from lightning_memest.allocator_events import CpuMemoryProfile, window_figures

__all__ = ["REAL_OP_LIMIT", "NotRunnable", "python_kernel", "run_for_real", "runs_on_fake", "zeros_strided"]

#: The most bytes of inputs an op is run for real with (stand-ins of them: real memory, briefly).
REAL_OP_LIMIT = 64 * 2**20


class NotRunnable(Exception):
    """The op cannot be run for real here; the message says why."""


def zeros_strided(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: Any) -> Tensor:
    """A zero-filled real tensor with these shape, strides and dtype (the storage its strides reach)."""
    if any(s == 0 for s in shape):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return torch.zeros(size, dtype=dtype, device=device).as_strided(shape, stride)


def python_kernel(func: torch._ops.OpOverload, device: torch.device) -> torch._C.DispatchKey | None:
    """The dispatch key of the kernel of ``func`` a real run on ``device`` takes, where that kernel is
    a Python function (registered through ``torch.library``: ``custom_op``, ``Library.impl``); ``None``
    for any other (aten's, a C++ extension's), or where torch does not say.

    Example:
        >>> python_kernel(torch.ops.aten.mm.default, torch.device("cpu")) is None
        True
    """
    impls = getattr(torch.library, "_impls", None)  # "ns/name[.overload]/DispatchKey" of Python kernels
    if not isinstance(impls, set) or func.namespace in ("aten", "prims"):
        return None
    ns, _, name = func._schema.name.partition("::")
    overload = func._schema.overload_name  # "" for the default overload
    names = (f"{name}.{overload}",) if overload else (name, f"{name}.default")
    qualified = f"{func._schema.name}.{overload}" if overload else func._schema.name
    backend = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    if backend is not None and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, backend):
        # the backend's own kernel runs: Python, or compiled
        found = any(f"{ns}/{n}/{backend}" in impls for n in names)
        return getattr(torch._C.DispatchKey, backend) if found else None
    if any(f"{ns}/{n}/CompositeExplicitAutograd" in impls for n in names):
        return torch._C.DispatchKey.CompositeExplicitAutograd
    return None


def runs_on_fake(func: torch._ops.OpOverload, key: torch._C.DispatchKey, trial: Callable[[], object]) -> bool:
    """Whether ``func``'s Python kernel at ``key`` runs on fake tensors: ``trial()`` runs it once (its ops
    not part of the step), and the answer is kept for the op. A data-dependent op inside does not count
    against it (the simulation's policy answers it)."""
    found = _ON_FAKE.get((func, key))
    if found is None:
        try:
            trial()
            found = True
        except (DataDependentOutputException, DynamicOutputShapeException):
            found = True
        except Exception:
            found = False  # it reads data (NumPy, data pointers), or calls an op with no fake kernel
        _ON_FAKE[(func, key)] = found
    return found


#: Per op and kernel, whether its Python kernel runs on fake tensors (:func:`runs_on_fake`).
_ON_FAKE: dict[tuple[torch._ops.OpOverload, torch._C.DispatchKey], bool] = {}


def _device(t: Tensor) -> torch.device:
    device = t.device
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")  # a CUDA what-if's tensors stand in on the CPU
    return device


def run_for_real(
    mode: FakeTensorMode,
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    known: Callable[[Tensor], Tensor | None],
    assumed: Callable[[str], None] | None = None,
) -> tuple[Any, int]:
    """``func`` run for real on stand-ins of its fake tensor arguments (``known(t)``: the real values
    of ``t`` where the simulation has them): its outputs made fake tensors of ``mode`` with the real
    outputs' metadata, and the bytes its kernel allocated beyond them (its workspace, measured on the
    CPU's allocator; 0 where it cannot be). :class:`NotRunnable` where it may not run (the reason: also
    where its outputs' sizes follow the stand-ins' values), or the real kernel's exception.
    ``assumed(what)`` is told where the outputs' sizes are those of zero stand-ins, unchecked."""
    schema = func._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        raise NotRunnable("it writes its inputs or returns a view of them")
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    if any(t.layout is not torch.strided for t in tensors if isinstance(t, FakeTensor)):
        raise NotRunnable("it takes a sparse tensor, which a fake mode does not carry")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if nbytes > REAL_OP_LIMIT:
        limit = REAL_OP_LIMIT // 2**20
        raise NotRunnable(f"its inputs take {nbytes / 2**20:.1f} MiB, more than the {limit} MiB run for real")

    key = _signature(func, args, kwargs, known)
    cached = _SEEN.get(key) if key is not None else None
    if cached is not None:  # the same op on the same shapes: the same outputs and workspace
        outputs, workspace, unchecked = cached
        if unchecked is not None and assumed is not None:
            assumed(unchecked)
        return tree_map_only(_Output, lambda o: o.fake(mode), outputs), workspace

    def stand_in(t: Tensor) -> Tensor:
        if not isinstance(t, FakeTensor):
            return t  # real already: a nested tensor an earlier op run for real made, say
        value = known(t)
        device = _device(t)
        if value is not None and tuple(value.shape) == tuple(t.shape) and value.dtype == t.dtype:
            return value.to(device)
        return zeros_strided(tuple(t.shape), tuple(t.stride()), t.dtype, device)

    with unset_fake_temporarily():
        real_args, real_kwargs = tree_map_only(Tensor, stand_in, (args, kwargs))
        out, rise = _run_measured(func, real_args, real_kwargs)
        unchecked = _value_check(func, args, kwargs, known, out)
    if unchecked is not None and assumed is not None:
        assumed(unchecked)
    wanted = tensors[0].device if tensors else None
    made = sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, Tensor))
    workspace = max(0, rise - made) if rise is not None else 0

    def faked(r: Tensor) -> Tensor:
        if r.is_nested:
            # A fake mode cannot carry a nested tensor: it stays real (small: a stand-in's), and the ops
            # that take it run for real too, until one makes a dense tensor again (to_padded_tensor).
            return r
        fake = mode.fake_tensor_converter.from_real_tensor(mode, r)
        if wanted is not None and fake.device != wanted:
            meta = torch.empty_strided(tuple(r.shape), tuple(r.stride()), dtype=r.dtype, device="meta")
            fake = mode.fake_tensor_converter.from_meta_and_device(mode, meta, wanted)
        return fake

    fakes = tree_map_only(Tensor, faked, out)
    if key is not None and not any(isinstance(t, Tensor) and t.is_nested for t in tree_leaves(out)):
        _SEEN[key] = (tree_map_only(Tensor, _Output.of, fakes), workspace, unchecked)
    return fakes, workspace


def _value_check(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    known: Callable[[Tensor], Tensor | None],
    out: Any,
) -> str | None:
    """Where ``func`` may size its outputs by values and some stand-in holds zeros for unknown values:
    ``func`` again with other values there. :class:`NotRunnable` where the outputs' sizes differ;
    what was assumed where the second run raised; ``None`` otherwise (nothing to check, or alike)."""
    if not _may_follow_values(func, out):
        return None
    unknown = [t for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor) and known(t) is None]
    if not unknown:
        return None  # every stand-in holds the real values: the outputs are the real ones
    generator = torch.Generator().manual_seed(0)  # its own: no draw from the user's streams
    others = {id(t): _other_values(t, generator) for t in unknown}

    def stand_in(t: Tensor) -> Tensor:
        other = others.get(id(t))
        if other is not None:
            return other
        value = known(t) if isinstance(t, FakeTensor) else None
        return t if value is None else value.to(_device(t))

    other_args, other_kwargs = tree_map_only(Tensor, stand_in, (args, kwargs))
    try:
        again = func(*other_args, **other_kwargs)
    except Exception as exc:
        return f"the output size from zero stand-ins (other values made it raise {type(exc).__name__})"
    first, second = _sizes(out), _sizes(again)
    if first != second:
        raise NotRunnable(
            f"its outputs' sizes follow its inputs' values ({first} from zeros, {second} from other "
            "values) and nothing bounds them: a fake kernel returning the largest output "
            "(torch.library.register_fake) makes it estimable"
        )
    return None


def _may_follow_values(func: torch._ops.OpOverload, out: Any) -> bool:
    """Whether ``func``'s outputs' sizes may follow its inputs' values: an op outside aten and prims
    (nothing says), an aten op tagged so, or one returning a nested tensor (its sizes are values)."""
    if func.namespace not in ("aten", "prims"):
        return True
    if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
        return True
    return any(isinstance(t, Tensor) and t.is_nested for t in tree_leaves(out))


def _other_values(t: FakeTensor, generator: torch.Generator) -> Tensor:
    """A real stand-in of ``t`` holding values other than zeros: normal floats, ones otherwise."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    base = zeros_strided(shape, stride, t.dtype, "cpu")
    if base.numel():
        if t.is_floating_point() or t.is_complex():
            base.copy_(torch.randn(shape, generator=generator, dtype=t.dtype))
        else:
            base.fill_(1)
    return base.to(_device(t))


def _sizes(out: Any) -> list[Any]:
    """The sizes of ``out``'s tensors, in order (a nested tensor's: each component's)."""
    return [
        tuple(map(tuple, t._nested_tensor_size().tolist())) if t.is_nested else tuple(t.shape)
        for t in tree_leaves(out)
        if isinstance(t, Tensor)
    ]


class _Output:
    """A fake output's metadata, to make it again for the next call of the same signature."""

    def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: Any):
        self.shape, self.stride, self.dtype, self.device = shape, stride, dtype, device

    @staticmethod
    def of(t: Tensor) -> _Output:
        return _Output(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def fake(self, mode: FakeTensorMode) -> Tensor:
        meta = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, self.device)


#: What each signature's real run gave: its outputs' metadata and workspace (bounded: a process plans
#: and estimates many steps, a step has few such ops).
_SEEN: dict[tuple[Any, ...], tuple[Any, int, str | None]] = {}


def _signature(
    func: torch._ops.OpOverload, args: Any, kwargs: Any, known: Callable[[Tensor], Tensor | None]
) -> tuple[Any, ...] | None:
    """The call's shapes, strides, dtypes and other arguments; ``None`` where its outputs may depend on
    values (an argument real, or with a known value -- but a floating-point one, a small weight of the
    model, given to an aten op whose outputs' sizes never follow values): those run each time."""
    parts: list[Any] = [func]
    sized_by_shapes = not _may_follow_values(func, None)
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, Tensor):
            if not isinstance(leaf, FakeTensor):
                return None
            if known(leaf) is not None and not (sized_by_shapes and leaf.is_floating_point()):
                return None
            parts.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device.type))
        elif isinstance(leaf, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            parts.append(leaf)
        else:
            return None
    if len(_SEEN) > 4096:
        _SEEN.clear()
    return tuple(parts)


_WINDOW = "memest_real_op_"


def _run_measured(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> tuple[Any, int | None]:
    """``func(*args, **kwargs)``, and how far the CPU allocator's running sum rose while it ran (its
    outputs and its workspace; the allocator's events in ``torch.profiler``). ``None`` where that
    cannot be measured: on CUDA (its peak statistics are the user's), or while a profiler runs."""
    on_cpu = all(t.device.type == "cpu" for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor))
    if not on_cpu or torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        return func(*args, **kwargs), None
    with CpuMemoryProfile() as profile, record_function(f"{_WINDOW}0"):
        out = func(*args, **kwargs)
    (window,) = window_figures(profile.timeline(), _WINDOW, 1)
    return out, window.peak_rise
