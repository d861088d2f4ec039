"""The policy for reading values of fake tensors, which have none.

Real training code reads tensor values all the time: ``loss.item()`` for logging, ``if torch.isnan(x)``,
``GradScaler``'s inf check, ``torch.nn.Transformer``'s check whether a mask is causal, boolean-mask
indexing, ``torch.unique`` in metrics and in torchvision's ``batched_nms``, ``pack_padded_sequence``.
Plain ``FakeTensorMode`` raises on each (PyTorch tags such ops ``dynamic_output_shape`` or
``data_dependent_output``). The estimate goes on instead, with a deliberate answer per op
(:data:`POLICIES`), and the report lists every place it happened (op, module, what was assumed):

* **the real values**, where the inputs that decide the size have them: the simulation knows the values
  of the batch's integer and boolean tensors and of what small code derives from them
  (``engine.real_path``), and a policy reads the inputs it needs through ``read`` --
  ``pack_padded_sequence`` packs the batch's own lengths, a mask from the batch selects what it selects.
  (An op whose inputs *all* have values does not get here: it runs for real, and nothing is assumed.)
  The estimate is then exact;
* **an upper bound** where they are unknown: the largest output the inputs allow -- ``nonzero``,
  ``masked_select`` and ``x[mask]`` select every element, ``unique`` finds every element distinct,
  ``nms`` keeps every box, every sequence of a packed batch is full length -- so memory is not
  under-estimated there. Where the inputs bound nothing (``bincount``'s largest value,
  ``repeat_interleave``'s counts) the assumption is said in the report;
* **one answer for every possible value** for a scalar read (``.item()``, ``bool(t)``, ``int(t)``) of a
  tensor whose value set (``engine.values.value_sets``) gives only one: ``x & False``, ``~True``, ``max()`` of
  zeros, ``== 0`` of them. Exact: a generation loop's "finished?" once its maximum length is reached;
* **the assumed case** for a scalar read of a comparison of unknown values
  (``engine.values.assumed_values``): an unknown value equals no given value, so ``(tokens == eos).any()``
  reads ``False`` and ``(tokens != eos).all()`` ``True`` -- generation runs to its maximum length (the
  largest cache) rather than stopping at a token nobody can predict;
* **a neutral value** for any other scalar read of an unknown value (``.item()``, ``bool(t)``,
  ``int(t)``, ``torch.equal``): ``0`` / ``0.0`` / ``False`` -- the "nothing unusual happened" branch of
  typical checks (no inf found, no NaN, not causal), and a harmless number for logging.

A loop whose exit hangs on assumed reads could run forever where the real one ends: reads repeated at
one line of code are capped (``engine.values.read_guard``), and the estimate fails there with the line named.

Each answer says whether it is an **upper bound** (``Answer.bound``: the largest output the inputs allow,
or the real values' size) or could be below the real run's (a neutral or assumed scalar read, a guessed
count): the report says how many of the second kind there were, as where the estimate could be low.

Ops whose fake kernel sizes the output from the arguments alone are listed in
:data:`FAKE_KERNEL_SUFFICES`. Any other data-dependent op raises ``EstimationError`` naming it.

Example:
    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> def loss_fn(model, batch):
    ...     out = model(batch)
    ...     return out[out > 0].sum() * len(torch.unique(out.detach()))
    >>> est = estimate_step(torch.nn.Linear(4, 4), torch.randn(8, 4), loss_fn=loss_fn)
    >>> sorted((r.op, r.assumed) for r in est.data_dependent)
    [('aten._unique2.default', 'all 32 values distinct'), ('aten.index.Tensor', 'every element of the mask set (32)')]
"""  # noqa: E501

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_leaves

from lightning_memest.engine.values.assumed_values import assumed_reason, assumed_set
from lightning_memest.engine.values.nonzero_bounds import (
    nonzero_bound,
    set_holds,
    set_only_zero,
    spread_bound,
)
from lightning_memest.engine.values.router_shares import selection_share
from lightning_memest.engine.values.tensor_facts import BATCH_FLOATS, fact_of
from lightning_memest.engine.values.value_sets import ValueLookup, int_values, values_in
from lightning_memest.registry import Op, OpRegistry

__all__ = [
    "FAKE_KERNEL_SUFFICES",
    "POLICIES",
    "Answer",
    "Call",
    "Policy",
    "answer",
    "policy_of",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class Answer:
    """What the simulation uses instead of a data-dependent result, and how to say so."""

    value: Any
    assumed: str
    """What was assumed, in a few words, for the report."""
    exact: bool = False
    """Whether the answer is the real run's (its values were known): then a loop repeating the read
    repeats as the real one does, and no cap applies (``engine.values.read_guard``)."""
    bound: bool = False
    """Where not exact, whether the answer is an upper bound of the real run's (the largest output the
    inputs allow): memory is not under-estimated there. Otherwise (a neutral or assumed scalar read, a
    guessed count) the real values could make the step need more than the estimate."""


@dataclass(frozen=True)
class Call:
    """One call of a data-dependent op, for its policy: the op, its arguments on fake tensors, and the
    lookup of real values (``read``)."""

    op: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    read: ValueLookup

    def values_in(self, t: Tensor) -> Tensor | None:
        """The values ``t`` can hold (sorted, 1-d, on the CPU; a superset), where known: see
        ``engine.values.value_sets``."""
        return values_in(t, self.read)

    def __getitem__(self, name: str) -> Any:
        """The argument called ``name`` in the op's schema (its default when not given)."""
        for i, arg in enumerate(self.op._schema.arguments):
            if arg.name != name:
                continue
            if i < len(self.args) and not arg.kwarg_only:
                return self.args[i]
            if name in self.kwargs:
                return self.kwargs[name]
            return arg.default_value if arg.has_default_value() else None
        raise KeyError(f"{self.op} has no argument {name!r}")

    @property
    def device(self) -> torch.device:
        """The device of the op's first tensor argument (where its outputs live)."""
        for a in tree_leaves((self.args, self.kwargs)):
            if isinstance(a, Tensor):
                return a.device
        return torch.device("cpu")


#: A policy answers one call of its op.
Policy = Callable[[Call], Answer]

#: The policy of each data-dependent op, keyed by overload or packet.
POLICIES: OpRegistry[Policy] = OpRegistry("data-dependent policies")

#: Policies of ops from optional libraries, keyed by the op's qualified name: the library may be imported
#: after this module, and its ops do not exist until it is.
_BY_NAME: dict[str, Policy] = {}

#: Ops that look data dependent but whose fake kernel sizes the output from the arguments alone (proved
#: by a test): what it says, why.
FAKE_KERNEL_SUFFICES: dict[Op, str] = {
    aten.histc: "bins is an argument",
    aten.histogram: "bins is an argument",
    aten.nonzero_static: "size is an argument",
    aten.index_put: "writes into self: no new size",
    aten.index_put_: "writes into self: no new size",
    aten.masked_scatter: "writes into a copy of self: no new size",
}

#: Ops whose policy reads the values it needs itself (their outputs do not all live on the inputs'
#: device).
_OWN_VALUES: frozenset[OpOverloadPacket] = frozenset({aten._pack_padded_sequence})


def policy_of(op: OpOverload) -> Policy | None:
    """The policy of ``op`` (its overload's, else its packet's, else by name), or ``None``.

    Example:
        >>> policy_of(torch.ops.aten._unique2.default).__name__, policy_of(torch.ops.aten.mm.default)
        ('_all_distinct', None)
    """
    policy = POLICIES.lookup(op)
    return policy if policy is not None else _BY_NAME.get(op._schema.name)


def answer(
    op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], read: ValueLookup | None = None
) -> Answer | None:
    """The answer for a call of ``op`` whose fake kernel needed values, or ``None`` if the op has no policy.

    ``read`` gives the real values behind a tensor where they are known (by default: a fake tensor's
    constant). Call it inside the fake mode, so that the tensors it makes are fake.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode():
        ...     ans = answer(torch.ops.aten.bincount.default, (torch.zeros(6, dtype=torch.long),), {"minlength": 9})
        >>> tuple(ans.value.shape), ans.assumed
        ((9,), 'values below minlength (9)')
    """  # noqa: E501
    read = read if read is not None else _constant
    out_names = [a.name for a in op._schema.arguments if a.is_out]
    if out_names:  # an ``out=`` overload: answer as the functional op, then size ``out`` so
        functional = op.overloadpacket.default
        call = Call(functional, args, {k: v for k, v in kwargs.items() if k not in out_names}, read)
        ans = _answer_call(call)
        if ans is None:
            return None
        results = ans.value if isinstance(ans.value, tuple) else (ans.value,)
        outs = tuple(kwargs[name].resize_(r.shape) for name, r in zip(out_names, results, strict=True))
        return Answer(outs if len(outs) > 1 else outs[0], ans.assumed, ans.exact, ans.bound)
    return _answer_call(Call(op, args, kwargs, read))


def _answer_call(call: Call) -> Answer | None:
    policy = policy_of(call.op)
    if policy is None:
        return None
    if call.op.overloadpacket not in _OWN_VALUES:
        real = _run_real(call)
        if real is not None:
            return real
    return policy(call)


def _constant(t: Tensor) -> Tensor | None:
    return t.constant if isinstance(t, FakeTensor) else None


def _run_real(call: Call) -> Answer | None:
    """The op run for real (on the CPU), when every tensor argument has values: the exact answer.

    (The simulation's ``real_path`` answers most such calls before the fake kernel raises; this covers
    the rest: values ``read`` knows that it does not, outputs it does not keep values of.)
    """
    with unset_fake_temporarily(), torch.no_grad():
        real_args = _reals(call.args, call.read)
        real_kwargs = _reals(tuple(call.kwargs.values()), call.read)
        if real_args is None or real_kwargs is None:
            return None
        try:
            out = call.op(*real_args, **dict(zip(call.kwargs, real_kwargs, strict=True)))
        except Exception:
            return None  # the policy answers instead
    device = call.device
    if isinstance(out, Tensor):
        return Answer(_fake_like(out, device), "the real values", exact=True)
    if isinstance(out, tuple):
        return Answer(
            tuple(_fake_like(o, device) if isinstance(o, Tensor) else o for o in out),
            "the real values",
            exact=True,
        )
    return Answer(out, "its real value", exact=True)


def _reals(values: Sequence[Any], read: ValueLookup) -> list[Any] | None:
    """``values`` with every tensor replaced by its real values on the CPU (lists of tensors too), or
    ``None`` if one is unknown."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, Tensor):
            r = read(v)
            if r is None:
                return None
            out.append(r if r.device.type == "cpu" else r.cpu())
        elif isinstance(v, (list, tuple)) and any(isinstance(x, Tensor) for x in v):
            inner = _reals(v, read)
            if inner is None:
                return None
            out.append(type(v)(inner))
        else:
            out.append(v)
    return out


def _fake_like(real: Tensor, device: torch.device) -> Tensor:
    """A tensor of ``real``'s size, strides and storage size on ``device`` (fake inside the fake mode)."""
    size = real.untyped_storage().nbytes()
    if size == real.numel() * real.element_size() and real.is_contiguous() and real.storage_offset() == 0:
        return torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
    base = torch.empty((-(-size // real.element_size()),), dtype=real.dtype, device=device)
    return base.as_strided(real.shape, real.stride(), real.storage_offset())


# --- policies ------------------------------------------------------------------------------------------


@POLICIES.register(aten._local_scalar_dense, aten.item, aten.is_nonzero)
def _scalar_read(call: Call) -> Answer:
    # Exact where every value the tensor can hold gives one answer (a generation loop's "finished" flag
    # once the maximum length is reached); else what the assumed case holds (``engine.values.assumed_values``:
    # an unknown value equals no given one -- "not finished", the longer run); else neutral.
    t = call.args[0]
    truth = call.op.overloadpacket is aten.is_nonzero or t.dtype == torch.bool
    exact = _one_answer(call.values_in(t), t, truth)
    if exact is not None:
        return Answer(exact, f"{exact} (the only value it can hold)", exact=True)
    assumed = _one_answer(assumed_set(t), t, truth)
    if assumed is not None:
        return Answer(assumed, f"{assumed} (assumed: {assumed_reason(t)})")
    if truth:
        return Answer(False, "False")
    if t.is_floating_point() or t.is_complex():
        return Answer(0.0, "0.0")
    return Answer(0, "0")


def _one_answer(possible: Tensor | None, t: Tensor, truth: bool) -> bool | int | None:
    """The one answer a read of ``t`` gives for every value in ``possible`` (its truth for ``bool``),
    or ``None``."""
    if possible is None or possible.numel() == 0:
        return None
    if truth:
        if set_only_zero(possible):
            return False
        return True if not set_holds(possible, 0) else None
    if possible.numel() != 1 or t.is_floating_point() or t.is_complex():
        return None
    with unset_fake_temporarily():
        return int(possible[0])


@POLICIES.register(aten.equal, aten.allclose)
def _equal(call: Call) -> Answer:
    # A tensor equals itself, or a view of its own elements as they are (gpytorch checks in debug
    # mode, on by default, that the inputs are its training inputs: the same tensor). Else neutral.
    a, b = call.args[0], call.args[1]
    if isinstance(a, Tensor) and isinstance(b, Tensor) and _same_elements(a, b):
        return Answer(True, "True (the same elements)", exact=True)
    values = [_equality_values(t, call.read) for t in (a, b)]
    if values[0] is not None and values[1] is not None:  # a batch's floats against a module's copy
        with unset_fake_temporarily():
            real = call.op(values[0], values[1], *call.args[2:], **call.kwargs)
        return Answer(bool(real), f"{bool(real)} (the real values)", exact=True)
    return Answer(False, "False")


def _equality_values(t: Any, read: ValueLookup) -> Tensor | None:
    """The real values of ``t`` where known, or the copy of a small floating-point batch tensor kept
    for equality checks (``tensor_facts.BATCH_FLOATS``)."""
    if not isinstance(t, Tensor):
        return None
    known = read(t)
    return known if known is not None else fact_of(t, BATCH_FLOATS)


def _same_elements(a: Tensor, b: Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
        return False
    if a.storage_offset() != b.storage_offset():
        return False
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)


@POLICIES.register(aten.nonzero, aten.argwhere)
def _all_nonzero(call: Call) -> Answer:
    t = call.args[0]
    n, known = _set_count(t, call)
    # the CPU kernel's layout: column-major
    out = torch.empty_strided((n, t.dim()), (1, max(n, 1)), dtype=torch.long, device=t.device)
    shared = None if known else selection_share(t)
    if shared is not None:
        return Answer(out, f"{n} of {t.numel()} nonzero (an even share of {shared} values selected apart)")
    return Answer(out, _said(n, t.numel(), f"every element nonzero ({n} of {n})", "nonzero"), bound=True)


@POLICIES.register(aten.nonzero_numpy)
def _all_nonzero_numpy(call: Call) -> Answer:
    ans = _all_nonzero(call)
    return Answer(tuple(ans.value.unbind(1)), ans.assumed, bound=ans.bound)


def _set_count(mask: Tensor, call: Call, shape: Sequence[int] | None = None) -> tuple[int, bool]:
    """How many elements of ``mask`` (broadcast to ``shape``) are set: from its real values (then
    ``True``), else at most its carried bound (``engine.values.nonzero_bounds``; every element without
    one)."""
    real = call.read(mask)
    if real is not None:
        with unset_fake_temporarily():
            return int(torch.count_nonzero(real.expand(tuple(shape)) if shape is not None else real)), True
    n = math.prod(shape if shape is not None else mask.shape)
    return spread_bound(mask, n, call.read, call.values_in), False


def _said(n: int, size: int, every: str, what: str) -> str:
    """The report's words for ``n`` of ``size`` elements taken: ``every`` when all are, else the bound."""
    return every if n >= size else f"{n} of {size} {what} (the most the ops that made it allow)"


@POLICIES.register(aten.masked_select)
def _masked_select(call: Call) -> Answer:
    t, mask = call["self"], call["mask"]
    shape = torch.broadcast_shapes(t.shape, mask.shape)  # type: ignore[no-untyped-call]
    n, known = _set_count(mask, call, shape)
    out = torch.empty((n,), dtype=t.dtype, device=t.device)
    if known:
        return Answer(out, f"the mask's real values ({n} selected)", bound=True)
    every = f"every element selected ({n})"
    return Answer(out, _said(n, math.prod(shape), every, "selected"), bound=True)


@POLICIES.register(aten.index.Tensor)
def _bool_index(call: Call) -> Answer:
    # A boolean mask of k dims indexes like the k columns of its nonzero(): its set elements (all of
    # them when its values are unknown, at most its carried bound).
    t, indices = call.args[0], list(call.args[1])
    expanded: list[Tensor | None] = []
    selected, all_known, size = 0, True, 0
    for index in indices:
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            n, known = _set_count(index, call)
            selected, all_known, size = max(selected, n), all_known and known, max(size, index.numel())
            expanded.extend(
                torch.empty((n,), dtype=torch.long, device=index.device) for _ in range(index.dim())
            )
        else:
            expanded.append(index)
    text = f"the mask's real values ({selected} set)"
    if not all_known:
        text = _said(selected, size, f"every element of the mask set ({selected})", "of the mask set")
    return Answer(call.op(t, expanded), text, bound=True)


@POLICIES.register(
    aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive
)
def _all_distinct(call: Call) -> Answer:
    t = call["self"]
    names = {a.name for a in call.op._schema.arguments}
    dim = call["dim"] if "dim" in names else None
    if dim is not None:
        dim %= max(t.dim(), 1)
    inverse = "return_inverse" in names and bool(call["return_inverse"])
    counts = "return_counts" in names and bool(call["return_counts"])
    # the CPU kernels of unique along a dim return inverse and counts whatever was asked
    both = dim is not None and t.device.type == "cpu"
    n = t.numel() if dim is None else t.shape[dim]
    text = f"all {n} values distinct"
    possible = call.values_in(t) if dim is None else None
    if possible is not None and possible.numel() < n:
        n = possible.numel()
        text = f"all {n} possible values present"
    nonzero = nonzero_bound(t, call.read, call.values_in) if dim is None else n
    if nonzero + 1 < n:  # at most that many nonzero values, and 0
        n = nonzero + 1
        text = f"all {n} values distinct (at most {nonzero} nonzero, and 0)"
    long: dict[str, Any] = {"dtype": torch.long, "device": t.device}
    outs = [torch.empty((n,) if dim is None else tuple(t.shape), dtype=t.dtype, device=t.device)]
    inverse_shape = tuple(t.shape) if dim is None else (n,)
    outs.append(torch.empty(inverse_shape if inverse or both else (0,), **long))
    if len(call.op._schema.returns) == 3:
        outs.append(torch.empty((n,) if counts or both else (0,), **long))
    return Answer(tuple(outs), text, bound=True)


@POLICIES.register(aten.bincount)
def _bincount(call: Call) -> Answer:
    # No bound follows from the input's size; the values torchmetrics and most code count are class
    # indices below ``minlength``.
    t, weights, minlength = call["self"], call["weights"], int(call["minlength"])
    possible = call.values_in(t)
    bound = True  # where the values possible say how many bins there can be
    if t.numel() == 0:
        n, text = minlength, f"no values ({minlength} bins)"
    elif possible is not None and possible.numel():
        largest = int_values(possible)[-1]
        n, text = max(minlength, largest + 1), f"values up to {largest} (of those possible)"
    elif minlength > 0:
        n, text, bound = minlength, f"values below minlength ({minlength})", False
    else:
        n, text, bound = t.numel(), f"values below the element count ({t.numel()})", False
    dtype = torch.long
    if weights is not None:
        dtype = torch.float32 if weights.dtype == torch.float32 else torch.float64
    return Answer(torch.empty((n,), dtype=dtype, device=t.device), text, bound=bound)


@POLICIES.register(aten.repeat_interleave.Tensor)
def _repeat_once(call: Call) -> Answer:
    repeats = call["repeats"]
    n = repeats.numel()
    return Answer(
        torch.empty((n,), dtype=repeats.dtype, device=repeats.device),
        f"each of {n} repeated once (pass output_size= to be exact)",
    )


@POLICIES.register(aten.one_hot)
def _one_hot(call: Call) -> Answer:
    t, classes = call["self"], int(call["num_classes"])
    text, bound = f"{classes} classes", True  # given, or the largest value possible + 1
    possible = call.values_in(t)
    if classes < 0 and possible is not None and possible.numel():
        classes = int_values(possible)[-1] + 1
        text = f"{classes} classes (the largest possible value + 1)"
    elif classes < 0:
        classes = max(t.numel(), 1)
        text, bound = f"{classes} classes (as many as elements)", False
    return Answer(torch.empty((*t.shape, classes), dtype=torch.long, device=t.device), text, bound=bound)


@POLICIES.register(aten._pack_padded_sequence)
def _pack_padded(call: Call) -> Answer:
    # The lengths almost always come straight from the batch: use them; else every sequence is full.
    data, lengths, batch_first = call["input"], call["lengths"], bool(call["batch_first"])
    steps, batch = (data.shape[1], data.shape[0]) if batch_first else (data.shape[0], data.shape[1])
    real = call.read(lengths)
    if real is not None:
        real_lengths = int_values(real)
        text = f"the real lengths ({sum(real_lengths)} of {batch}x{steps} steps)"
    else:
        real_lengths = [steps] * batch
        text = f"every sequence full length ({steps})"
    # The batch sizes are a real CPU tensor, as in the real run (a few bytes): the recurrent kernels (C++
    # inside nn.LSTM / nn.GRU, the backward) read them through a data pointer, which a fake tensor does
    # not have. Python code reads them as tensors (``batch_sizes[0]``): the fake mode converts them to
    # a fake tensor (memoized, weakly), made here with a copy of them as its constant, so that those
    # reads are answered too; the real tensor holds it (the copy: no reference cycle).
    with unset_fake_temporarily():
        longest = max(real_lengths, default=0)
        batch_sizes = torch.tensor(
            [sum(n > t for n in real_lengths) for t in range(longest)], dtype=torch.long
        )
        constant = batch_sizes.clone()
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is not None:
        converter = mode.fake_tensor_converter
        fake = converter.from_real_tensor(mode, batch_sizes)
        fake.constant = constant
        batch_sizes._memest_fake = fake  # type: ignore[attr-defined]
    packed = torch.empty((sum(real_lengths), *data.shape[2:]), dtype=data.dtype, device=data.device)
    return Answer((packed, batch_sizes), text, bound=True)


@POLICIES.register(aten._ctc_loss)
def _ctc_loss(call: Call) -> Answer:
    # log_alpha is (batch, time, 2 * longest target + 1)
    log_probs, targets, target_lengths = call["log_probs"], call["targets"], call["target_lengths"]
    if isinstance(target_lengths, Tensor):
        real = call.read(target_lengths)
        lengths = None if real is None else int_values(real)
    else:
        lengths = [int(n) for n in target_lengths]
    if lengths is not None:
        longest, text = max(lengths, default=0), "the real target lengths"
    else:
        longest = targets.shape[1] if targets.dim() == 2 else targets.numel()
        text = f"targets up to {longest} long"
    steps, batch = log_probs.shape[0], log_probs.shape[1]
    kw: dict[str, Any] = {"dtype": log_probs.dtype, "device": log_probs.device}
    alpha = torch.empty((batch, steps, 2 * longest + 1), **kw)
    return Answer((torch.empty((batch,), **kw), alpha), text, bound=True)


@POLICIES.register(aten.linalg_lstsq)
def _lstsq(call: Call) -> Answer:
    # Residuals exist only at full rank (for gelsd/gelss): assume it, the larger output.
    a, b, driver = call["self"], call["b"], call["driver"]
    if driver is None:
        driver = "gels" if a.device.type == "cuda" else "gelsy"
    vector = b.dim() == a.dim() - 1
    m, n = a.shape[-2], a.shape[-1]
    k = 1 if vector else b.shape[-1]
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-1] if vector else b.shape[:-2]))  # type: ignore[no-untyped-call]
    real = a.real.dtype if a.is_complex() else a.dtype
    kw: dict[str, Any] = {"device": a.device}
    # the solution is computed in a (max(m, n), k) buffer and narrowed to n rows
    solution = torch.empty((*batch, max(m, n), k), dtype=a.dtype, **kw).narrow(-2, 0, n)
    if vector:
        solution = solution.squeeze(-1)
    residuals = torch.empty((*batch, k) if m > n and driver != "gelsy" else (0,), dtype=real, **kw)
    rank = torch.empty(batch if driver != "gels" else (0,), dtype=torch.long, **kw)
    singular = torch.empty((*batch, min(m, n)) if driver in ("gelsd", "gelss") else (0,), dtype=real, **kw)
    return Answer((solution, residuals, rank, singular), "full rank", bound=True)


@POLICIES.register(aten._padded_dense_to_jagged_forward)
def _padded_to_jagged(call: Call) -> Answer:
    dense, offsets = call["dense"], call["offsets"]
    real = call.read(offsets[0])
    if real is not None:
        rows, text = int_values(real)[-1], "the real offsets"
    else:
        rows = dense.shape[0] * dense.shape[1]
        text = f"no padding ({rows} rows)"
    jagged = torch.empty((rows, *dense.shape[2:]), dtype=dense.dtype, device=dense.device)
    return Answer(jagged, text, bound=True)


def _keep_every_box(call: Call) -> Answer:
    n = call.args[0].shape[0]
    kept = torch.empty((n,), dtype=torch.long, device=call.args[0].device)
    return Answer(kept, f"every box kept ({n})", bound=True)


_BY_NAME["torchvision::nms"] = _keep_every_box
