"""Real where fake fails: an op whose fake kernel raises, run for real on small real tensors.

Some fake (meta) kernels disagree with the real ones: ``aten._grouped_mm``'s applies CUDA's dtype checks
on every device, while the CPU kernel runs float32 (transformers' MoE experts take it). Where an op's
fake kernel raises, :func:`run_for_real` runs that op alone, for real, on real tensors of the same
shapes, strides and dtypes -- zeros (valid indices, no NaN paths; no random generator drawn from), or
the real values where the simulation knows them (the batch's small integer tensors: masks, ids) -- and
hands back fake tensors with the real outputs' metadata; the simulation carries on with those, and the
op's outputs are accounted as any op's. A nested output (the fast path of ``nn.TransformerEncoder``
in eval with a padding mask: ``_nested_tensor_from_mask``) cannot be fake: it stays real, and the ops
that take it run for real in turn, until one makes a dense tensor again. What the kernel allocates
beyond its outputs is measured as it runs (the CPU allocator's events) and accounted as the op's
workspace. Only where that is safe and small: never for an op that writes its inputs or returns a view
of them, never with more than :data:`REAL_OP_LIMIT` bytes of inputs (the error then says so), never
with the user's tensors (only stand-ins). A real kernel that raises too raises the fake kernel's
error: the step is wrong, not the fake kernel.

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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves, tree_map_only

from lightning_memest.allocator_events import CpuMemoryProfile, window_figures

__all__ = ["REAL_OP_LIMIT", "NotRunnable", "run_for_real", "zeros_strided"]

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
) -> tuple[Any, int]:
    """``func`` run for real on stand-ins of its fake tensor arguments (``known(t)``: the real values
    of ``t`` where the simulation has them): its outputs made fake tensors of ``mode`` with the real
    outputs' metadata, and the bytes its kernel allocated beyond them (its workspace, measured on the
    CPU's allocator; 0 where it cannot be). :class:`NotRunnable` where it may not run (the reason), or
    the real kernel's exception."""
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
        outputs, workspace = cached
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
        _SEEN[key] = (tree_map_only(Tensor, _Output.of, fakes), workspace)
    return fakes, workspace


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
_SEEN: dict[tuple[Any, ...], tuple[Any, int]] = {}


def _signature(
    func: torch._ops.OpOverload, args: Any, kwargs: Any, known: Callable[[Tensor], Tensor | None]
) -> tuple[Any, ...] | None:
    """The call's shapes, strides, dtypes and other arguments; ``None`` where its outputs may depend on
    values (an argument real, or with a known value): those run each time."""
    parts: list[Any] = [func]
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, Tensor):
            if not isinstance(leaf, FakeTensor) or known(leaf) is not None:
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
