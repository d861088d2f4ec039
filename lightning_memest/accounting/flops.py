"""FLOPs of a training step, from the same fake run (the same event stream) as the memory estimate.

**Headline FLOPs** are 2 x the multiply-accumulates of matrix products, convolutions and attention --
the convention of ``torch.utils.flop_counter``, Lightning's ``ThroughputMonitor`` and MFU papers, so the
numbers compare with theirs and with a device's peak FLOP/s. They are built on torch's formula registry
(``torch.utils.flop_counter.flop_registry``, whose formulas take ``torch.Size`` shapes), with its defects
fixed (torch 2.14.1):

* the weight-gradient term of grouped (and depthwise) convolution backward ignores ``groups`` (torch gives
  mobilenet_v2 a backward/forward ratio of 19.4, efficientnet_b0 40.7; here both are 2);
* the CPU attention kernels ``_scaled_dot_product_flash_attention_for_cpu`` and its backward are unknown to
  it (attention counts 0 on CPU);
* oneDNN's LSTM (``mkldnn_rnn_layer`` and its backward) and cuDNN's RNN (``_cudnn_rnn`` and its backward),
  ``mv``/``addmv``/``dot``/``addbmm``/``_addmm_activation`` are unknown to it.

Attention follows torch's convention: the two ``seq x seq`` products are counted in full even when
``is_causal`` (4 * batch * heads * seq_q * seq_k * head_dim forward, 2.5 x that backward), as the kernels
of FlashAttention-style papers and ``FlopCounterMode`` report them.

**Other FLOPs** (elementwise, normalization, softmax, pooling, reductions, the optimizer's arithmetic) are
counted separately, with a simple convention, so that the headline stays comparable:

* a pointwise op (``torch.Tag.pointwise``, the ``*_backward`` of a pointwise op, ``_foreach_*``): 1 FLOP
  per output element (per element of its first tensor list for ``_foreach_*``); copies (``clone``,
  ``copy_``, ``_to_copy``) and data movement (views, ``cat``, indexing, ``embedding``) count 0;
* a reduction (``torch.Tag.reduction``: ``sum``, ``mean``, ``amax`` ...): 1 FLOP per input element;
* normalization (batch/layer/group/RMS norm): 5 per input element forward, 8 backward;
* softmax / log-softmax: 5 per element forward, 4 backward; the softmax inside fused attention kernels
  counts the same per ``seq_q x seq_k`` score (5 forward, 6 backward: recomputation included);
* pooling: kernel volume per output element (forward, and the backward of average pooling); 1 per element
  of the output gradient for max-pool backward; adaptive average pooling as a reduction;
* the loss: ``nll_loss`` 1 per target element; ``embedding_dense_backward`` 1 per gradient element;
* fused optimizers (``_fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_``): as many per parameter element
  as their unfused (for-loop) implementation's pointwise ops have.

Figures are those of the **first** step (step 0) of the simulation, by phase (forward, backward,
optimizer; ``zero_grad`` and set-up count nowhere), and per module (inclusive of its children; the root
module ``""`` also holds what ran outside any module, like the loss).

The formulas need the op's full call, so the engine must capture it: pass :func:`captures_flops` (or a
filter that includes it) as ``simulate(..., capture=...)``.

Example:
    >>> import torch
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> sim = simulate(torch.nn.Linear(64, 32), torch.randn(8, 64), StepConfig(), steps=1,
    ...                capture=captures_flops)
    >>> flops = count_flops(sim.events)
    >>> flops.forward, flops.backward  # 2*8*64*32; backward: grad-weight only (the input needs no grad)
    (32768, 32768)
    >>> flops.optimizer is None  # no optimizer in this step
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils import flop_counter as _torch_fc

from lightning_memest.engine.events import Event, ModuleEnter, OpCall, OpEvent, TensorMeta
from lightning_memest.engine.step import Phase

__all__ = [
    "FLOP_FORMULAS",
    "OTHER_FLOP_FORMULAS",
    "FlopCount",
    "FlopFormula",
    "ModuleFlops",
    "OpFlops",
    "captures_flops",
    "count_flops",
    "flop_formula_for",
    "other_flop_formula_for",
    "register_flop_formula",
    "register_other_flop_formula",
]

aten = torch.ops.aten

#: ``formula(call) -> FLOPs`` of one op call (argument shapes in ``call.args``, as :class:`TensorMeta`).
FlopFormula = Callable[[OpCall], int]
_F = TypeVar("_F", bound=FlopFormula)
_Op = OpOverloadPacket | OpOverload

#: Headline formulas (2 x MACs of matmul, convolution, attention), keyed by packet or overload.
FLOP_FORMULAS: dict[_Op, FlopFormula] = {}
#: "Other" formulas (elementwise, norms, softmax, pooling, reductions) registered explicitly; pointwise
#: and reduction ops without an entry get the default rules of :func:`other_flop_formula_for`.
OTHER_FLOP_FORMULAS: dict[_Op, FlopFormula] = {}


def register_flop_formula(*ops: _Op) -> Callable[[_F], _F]:
    """Register a headline FLOP formula for ops (an overload, or a packet for all its overloads)."""

    def register(fn: _F) -> _F:
        for op in ops:
            FLOP_FORMULAS[op] = fn
        return fn

    return register


def register_other_flop_formula(*ops: _Op) -> Callable[[_F], _F]:
    """Register an "other" FLOP formula (elementwise, norm ... work) for ops."""

    def register(fn: _F) -> _F:
        for op in ops:
            OTHER_FLOP_FORMULAS[op] = fn
        return fn

    return register


def flop_formula_for(op: OpOverload) -> FlopFormula | None:
    """The headline formula of ``op``: registered for the overload itself, else for its packet.

    Example:
        >>> flop_formula_for(torch.ops.aten.mm.default) is not None
        True
        >>> flop_formula_for(torch.ops.aten.add.Tensor) is None  # elementwise: "other" FLOPs
        True
    """
    formula = FLOP_FORMULAS.get(op)
    if formula is None:
        formula = FLOP_FORMULAS.get(op.overloadpacket)
    return formula


def other_flop_formula_for(op: OpOverload) -> FlopFormula | None:
    """The "other" formula of ``op``: registered (overload, then packet), else the default rule of its
    kind (pointwise, the backward of a pointwise op, ``_foreach_*``, reduction), else ``None``.

    Example:
        >>> other_flop_formula_for(torch.ops.aten.add.Tensor) is not None
        True
        >>> other_flop_formula_for(torch.ops.aten.clone.default) is None  # a copy: no arithmetic
        True
    """
    formula = OTHER_FLOP_FORMULAS.get(op)
    if formula is None:
        formula = OTHER_FLOP_FORMULAS.get(op.overloadpacket)
    if formula is not None:
        return formula
    if op.overloadpacket in _NO_FLOPS:
        return None
    if op.overloadpacket.__name__.startswith("_foreach_"):
        return _per_list_element
    if _is_elementwise(op):
        return _per_output_element
    if torch.Tag.reduction in op.tags:
        return _per_input_element
    return None


def captures_flops(op: OpOverload) -> bool:
    """Whether FLOPs need ``op``'s full call: the capture filter for ``simulate``.

    Elementwise ops (the most frequent by far) are not captured: their one FLOP per output element is
    read from ``OpEvent.numel``, which the engine records for every op, so FLOPs cost the fake run little.

    Example:
        >>> aten = torch.ops.aten
        >>> captures_flops(aten.convolution.default), captures_flops(aten.native_layer_norm.default)
        (True, True)
        >>> captures_flops(aten.view.default), captures_flops(aten.add.Tensor)  # no FLOPs; elementwise
        (False, False)
    """
    if flop_formula_for(op) is not None:
        return True
    formula = other_flop_formula_for(op)
    return formula is not None and formula is not _per_output_element


# ------------------------------------------------------------------------------------------ the count


@dataclass(frozen=True, slots=True)
class ModuleFlops:
    """FLOPs of one module in the first step, inclusive of its children (headline and other)."""

    path: str
    forward: int
    backward: int
    other_forward: int
    other_backward: int


@dataclass(frozen=True, slots=True)
class OpFlops:
    """FLOPs of one op (overload name) in the first step, over all its calls and phases."""

    op: str
    calls: int
    flops: int
    other: int


@dataclass(frozen=True, slots=True)
class FlopCount:
    """FLOPs of the first training step; a phase that did not run (no op in it) is ``None``."""

    forward: int
    backward: int | None
    optimizer: int | None
    other_forward: int
    other_backward: int | None
    other_optimizer: int | None
    modules: tuple[ModuleFlops, ...]
    """Per module (inclusive of children), in the order modules first ran; ``""`` is the root."""
    ops: tuple[OpFlops, ...]
    """Per op with a formula, most FLOPs (headline, then other) first."""
    uncounted: tuple[str, ...] = ()
    """Ops whose formula could not read their call (counted as 0)."""

    @property
    def total(self) -> int:
        """Headline FLOPs of the whole step (forward + backward + optimizer)."""
        return self.forward + (self.backward or 0) + (self.optimizer or 0)

    @property
    def other_total(self) -> int:
        return self.other_forward + (self.other_backward or 0) + (self.other_optimizer or 0)

    def module(self, path: str) -> ModuleFlops | None:
        """The figures of module ``path``, ``None`` when it did not run."""
        for m in self.modules:
            if m.path == path:
                return m
        return None


_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def count_flops(events: Sequence[Event]) -> FlopCount:
    """Headline and other FLOPs of the first step (``step == 0``), by phase, module and op.

    Only ops whose call was captured (``OpEvent.call``) are counted: simulate with a capture filter that
    includes :func:`captures_flops`. A pure function of the events.

    Example:
        >>> from lightning_memest.engine.events import OpEvent
        >>> x, w = TensorMeta.of(torch.empty(4, 16)), TensorMeta.of(torch.empty(16, 8))
        >>> out = TensorMeta.of(torch.empty(4, 8))
        >>> call = OpCall(torch.ops.aten.mm.default, (x, w), {}, (out,), "cpu")
        >>> ev = OpEvent(0, 0, Phase.FORWARD, "fc", "aten.mm.default", call, (0,))
        >>> c = count_flops([ev])
        >>> c.forward, c.backward, c.modules
        (1024, None, (ModuleFlops(path='', forward=1024, backward=0, other_forward=0, other_backward=0), \
ModuleFlops(path='fc', forward=1024, backward=0, other_forward=0, other_backward=0)))
    """
    head = dict.fromkeys(_PHASES, 0)
    other = dict.fromkeys(_PHASES, 0)
    ran: set[Phase] = set()
    order: dict[str, None] = {"": None}  # modules in the order they first ran (parents first)
    # path -> [forward, backward, other_forward, other_backward], exclusive of children for now
    own: dict[str, list[int]] = {}
    per_op: dict[str, list[int]] = {}
    uncounted: dict[str, None] = {}
    formulas: dict[str, _Formulas] = {}  # op name -> its formulas, looked up once per op
    for e in events:
        if isinstance(e, ModuleEnter):
            _add_path(order, e.path)
            continue
        if not isinstance(e, OpEvent) or e.step != 0 or e.phase not in head:
            continue
        ran.add(e.phase)
        found = formulas.get(e.op)
        if found is None:
            found = formulas[e.op] = _formulas(e.call.op if e.call is not None else _resolve(e.op))
        formula, other_formula, elementwise = found
        if e.call is None:
            if not elementwise:
                continue  # not captured: simulate with captures_flops in the filter
            f, o = 0, e.numel
        else:
            try:
                f = formula(e.call) if formula is not None else 0
                o = other_formula(e.call) if other_formula is not None else 0
            except (AssertionError, ValueError, TypeError, IndexError, AttributeError):
                uncounted[e.op] = None
                continue
        if formula is None and other_formula is None:
            continue
        head[e.phase] += f
        other[e.phase] += o
        stats = per_op.setdefault(e.op, [0, 0, 0])
        stats[0] += 1
        stats[1] += f
        stats[2] += o
        if e.phase is Phase.OPTIMIZER or not (f or o):
            continue
        _add_path(order, e.module)
        figures = own.setdefault(e.module, [0, 0, 0, 0])
        backward = e.phase is Phase.BACKWARD
        figures[1 if backward else 0] += f
        figures[3 if backward else 2] += o
    inclusive = {path: [0, 0, 0, 0] for path in order}
    for path, figures in own.items():
        for ancestor in _ancestors(path):
            acc = inclusive[ancestor]
            for i, v in enumerate(figures):
                acc[i] += v
    return FlopCount(
        forward=head[Phase.FORWARD],
        backward=head[Phase.BACKWARD] if Phase.BACKWARD in ran else None,
        optimizer=head[Phase.OPTIMIZER] if Phase.OPTIMIZER in ran else None,
        other_forward=other[Phase.FORWARD],
        other_backward=other[Phase.BACKWARD] if Phase.BACKWARD in ran else None,
        other_optimizer=other[Phase.OPTIMIZER] if Phase.OPTIMIZER in ran else None,
        modules=tuple(ModuleFlops(path, *inclusive[path]) for path in order),
        ops=tuple(
            OpFlops(name, *s) for name, s in sorted(per_op.items(), key=lambda kv: (-kv[1][1], -kv[1][2]))
        ),
        uncounted=tuple(uncounted),
    )


_Formulas = tuple[FlopFormula | None, FlopFormula | None, bool]


def _formulas(op: OpOverload | None) -> _Formulas:
    """Headline formula, other formula, and whether the other one is one FLOP per output element."""
    if op is None:
        return None, None, False
    other = other_flop_formula_for(op)
    return flop_formula_for(op), other, other is _per_output_element


def _resolve(name: str) -> OpOverload | None:
    """The op called ``name`` (``str(op)``, like ``"aten.add_.Tensor"``), ``None`` if unknown."""
    parts = name.split(".")
    if len(parts) != 3:
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, OpOverload) else None


def _ancestors(path: str) -> Iterable[str]:
    """``path`` and every module above it, the root ``""`` included."""
    yield ""
    if not path:
        return
    at = path.find(".")
    while at != -1:
        yield path[:at]
        at = path.find(".", at + 1)
    yield path


def _add_path(order: dict[str, None], path: str) -> None:
    if path not in order:
        for ancestor in _ancestors(path):
            order.setdefault(ancestor, None)


# ------------------------------------------------------------------------------------------ helpers


def _size(value: Any) -> Any:
    """A ``TensorMeta`` as the ``torch.Size`` torch's formulas expect (lists of them too)."""
    if isinstance(value, TensorMeta):
        return torch.Size(value.shape)
    if isinstance(value, (list, tuple)) and any(isinstance(v, TensorMeta) for v in value):
        return type(value)(_size(v) for v in value)
    return value


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, TensorMeta):
        raise TypeError(f"expected a tensor argument, got {type(value).__name__}")
    return value.shape


def _numel(value: Any) -> int:
    return value.numel if isinstance(value, TensorMeta) else 0


def _first_output_numel(call: OpCall) -> int:
    for out in call.outputs:
        if out is not None:
            return out.numel
    return 0


def _per_output_element(call: OpCall) -> int:
    # Pointwise: one FLOP per output element (in-place ops: their ``self``).
    n = _first_output_numel(call)
    return n if n else _numel(call.args[0] if call.args else None)


def _per_input_element(call: OpCall) -> int:
    # Reduction: one FLOP per input element.
    return _numel(call.args[0] if call.args else None)


def _list_numel(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return _numel(value)


def _per_list_element(call: OpCall) -> int:
    # ``_foreach_*``: one FLOP per element of the first tensor list (in-place variants return nothing).
    return _list_numel(call.args[0]) if call.args else 0


def _is_elementwise(op: OpOverload) -> bool:
    """Pointwise-tagged, the backward of a pointwise op, or a random draw per element."""
    if op.overloadpacket in _NO_FLOPS:
        return False
    return (
        torch.Tag.pointwise in op.tags
        or op.overloadpacket in _RANDOM
        or _is_pointwise_backward(op.overloadpacket.__name__)
    )


def _is_pointwise_backward(name: str) -> bool:
    # ``hardtanh_backward``, ``elu_backward``, ... (the forward has the pointwise tag, the backward not).
    if not name.endswith("_backward"):
        return False
    forward = getattr(aten, name[: -len("_backward")], None)
    if not isinstance(forward, OpOverloadPacket):
        return False
    return any(torch.Tag.pointwise in getattr(forward, o).tags for o in forward.overloads())  # type: ignore[no-untyped-call]


# One random draw per output element (dropout masks): counted as elementwise.
_RANDOM = frozenset({aten.bernoulli_, aten.bernoulli, aten.native_dropout, aten.rand_like, aten.randn_like})

# Copies and data movement: pointwise-tagged in part, but no arithmetic.
_NO_FLOPS = frozenset(
    {
        aten.clone,
        aten.copy_,
        aten._to_copy,
        aten.lift_fresh,
        aten.lift_fresh_copy,
        aten.zeros_like,
        aten.ones_like,
        aten.empty_like,
        aten.full_like,
        aten.fill_,
        aten.zero_,
        aten.masked_fill,
        aten.masked_fill_,
        aten._foreach_copy_,
        aten._foreach_zero_,
        aten.contiguous,
        aten.detach,
        aten.alias,
        aten.to,
    }
)


# ------------------------------------------------------------------------------- matrix products


def _from_torch(packet: OpOverloadPacket) -> FlopFormula:
    """Torch's shape formula for ``packet``, called with the call's shapes (``out_val``: its outputs')."""
    torch_formula = _torch_fc.flop_registry[packet]

    def formula(call: OpCall) -> int:
        outs = tuple(_size(o) for o in call.outputs)
        return int(
            torch_formula(
                *(_size(a) for a in call.args),
                out_val=outs[0] if len(outs) == 1 else outs,
                **{k: _size(v) for k, v in call.kwargs.items()},
            )
        )

    formula.__name__ = f"torch_{packet.__name__}_flop"
    formula.__doc__ = f"torch.utils.flop_counter's formula for aten.{packet.__name__}."
    return formula


# torch's formulas are right for these (2 x MACs of the product; bias adds are not counted).
for _packet in (
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten._scaled_mm,
    aten.convolution,
    aten._convolution,
    aten.cudnn_convolution,
    aten.convolution_overrideable,
    aten._slow_conv2d_forward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
):
    FLOP_FORMULAS[_packet] = _from_torch(_packet)


@register_flop_formula(aten.mv, aten.addmv)
def _mv(call: OpCall) -> int:
    # (m, n) @ (n,): 2*m*n.
    mat = call.arg("mat") if call.op.overloadpacket is aten.addmv else call.arg("self")
    m, n = _shape(mat)
    return 2 * m * n


@register_flop_formula(aten.dot, aten.vdot)
def _dot(call: OpCall) -> int:
    return 2 * _numel(call.arg("self"))


@register_flop_formula(aten.addbmm)
def _addbmm(call: OpCall) -> int:
    # sum over the batch of (b, m, k) @ (b, k, n): as bmm (the batch sum is an addition, not counted).
    b, m, k = _shape(call.arg("batch1"))
    n = _shape(call.arg("batch2"))[2]
    return 2 * b * m * n * k


@register_flop_formula(aten._addmm_activation)
def _addmm_activation(call: OpCall) -> int:
    m, k = _shape(call.arg("mat1"))
    n = _shape(call.arg("mat2"))[1]
    return 2 * m * n * k


@register_flop_formula(aten.mkldnn_convolution)
def _mkldnn_convolution(call: OpCall) -> int:
    out = call.outputs[0]
    if out is None:
        return 0
    x, w = _shape(call.arg("self")), _shape(call.arg("weight"))
    return int(_torch_fc.conv_flop_count(list(x), list(w), list(out.shape), transposed=False))


# ------------------------------------------------------------------------------------ convolution


@register_flop_formula(aten.convolution_backward)
def _convolution_backward(call: OpCall) -> int:
    # Each gradient, of the input (a transposed convolution of grad_output with the weight) and of the
    # weight (a convolution of the input with grad_output, per group), takes as many MACs as the forward
    # convolution. Torch's conv_backward_flop (2.14.1) gets the grad-input term right but computes the
    # grad-weight term as one convolution over all C_in x C_out channel pairs, ignoring ``groups``: a
    # ``groups``-fold overcount (mobilenet_v2's depthwise layers: 32-960x). It also reads the gradients'
    # shapes from the outputs by position, which shifts when ``output_mask[0]`` is false.
    go, x, w = _shape(call.arg("grad_output")), _shape(call.arg("input")), _shape(call.arg("weight"))
    transposed = bool(call.arg("transposed"))
    mask = call.arg("output_mask")
    out = list(go)  # the forward output's shape is grad_output's
    forward = int(_torch_fc.conv_flop_count(list(x), list(w), out, transposed=transposed))
    return forward * (int(bool(mask[0])) + int(bool(mask[1])))


# ------------------------------------------------------------------------------------ attention


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_cpu(call: OpCall) -> int:
    # torch's sdpa_flop_count: Q K^T and P V in full (also when is_causal; see the module docstring).
    q, k, v = (torch.Size(_shape(call.arg(n))) for n in ("query", "key", "value"))
    return int(_torch_fc.sdpa_flop_count(q, *_query_heads(q, k, v)))  # type: ignore[no-untyped-call]


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _sdpa_cpu_backward(call: OpCall) -> int:
    # torch's sdpa_backward_flop_count: the scores recomputed, then grads of P V and Q K^T (5 products).
    go, q, k, v = (torch.Size(_shape(call.arg(n))) for n in ("grad_out", "query", "key", "value"))
    k, v = _query_heads(q, k, v)
    return int(_torch_fc.sdpa_backward_flop_count(go, q, k, v))  # type: ignore[no-untyped-call]


def _query_heads(q: torch.Size, k: torch.Size, v: torch.Size) -> tuple[torch.Size, torch.Size]:
    # Grouped-query attention: each query head attends its group's key/value head, so the products
    # are those of as many key/value heads as query heads (torch < 2.14's formulas refuse the shapes).
    heads = q[-3] if len(q) >= 3 else None
    if heads is None or k[-3] == heads:
        return k, v
    return torch.Size((*k[:-3], heads, *k[-2:])), torch.Size((*v[:-3], heads, *v[-2:]))


@register_flop_formula(
    aten._scaled_dot_product_fused_attention_overrideable,
    aten._scaled_dot_product_fused_attention_overrideable_backward,
)
def _sdpa_overrideable(call: OpCall) -> int:
    # The same signatures as the CPU flash kernel's (query, key, value / grad_out, query, key, value).
    if call.op.overloadpacket is aten._scaled_dot_product_fused_attention_overrideable:
        return _sdpa_cpu(call)
    return _sdpa_cpu_backward(call)


def _scores(call: OpCall) -> int:
    # batch x heads x seq_q x seq_k: the attention matrix a fused kernel computes a softmax over.
    b, h, sq, _ = _shape(call.arg("query"))
    sk = _shape(call.arg("key"))[2]
    return b * h * sq * sk


@register_other_flop_formula(
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_fused_attention_overrideable,
)
def _sdpa_softmax(call: OpCall) -> int:
    return _SOFTMAX_FORWARD * _scores(call)


@register_other_flop_formula(
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._scaled_dot_product_fused_attention_overrideable_backward,
)
def _sdpa_softmax_backward(call: OpCall) -> int:
    # The probabilities are recomputed from the saved log-sum-exp (2: subtract, exp), then the softmax
    # backward (4).
    return (2 + _SOFTMAX_BACKWARD) * _scores(call)


# ------------------------------------------------------------------------------------ recurrent


def _rnn_forward_flops(x: tuple[int, ...], weights: Iterable[Any]) -> int:
    # Each time step of each sequence multiplies its layer input by W_ih and its state by W_hh, for every
    # layer and direction: 2 x (T*N) x (sum of the 2-d weight matrices' elements). x is (T, N, I), or
    # (N, T, I) when batch-first, or (sum of lengths, I) when packed.
    steps = x[0] if len(x) == 2 else x[0] * x[1]
    return 2 * steps * sum(w.numel for w in weights if isinstance(w, TensorMeta) and len(w.shape) == 2)


@register_flop_formula(aten.mkldnn_rnn_layer)
def _mkldnn_rnn_layer(call: OpCall) -> int:
    # oneDNN's LSTM layer (nn.LSTM on CPU): weight0 = W_ih (4H, I), weight1 = W_hh (4H, H).
    return _rnn_forward_flops(_shape(call.arg("input")), (call.arg("weight0"), call.arg("weight1")))


@register_flop_formula(aten.mkldnn_rnn_layer_backward)
def _mkldnn_rnn_layer_backward(call: OpCall) -> int:
    # grad of the layer input and of the state (through W_ih^T, W_hh^T) and of both weights: 2x forward.
    return 2 * _rnn_forward_flops(_shape(call.arg("input")), (call.arg("weight1"), call.arg("weight2")))


@register_flop_formula(aten._cudnn_rnn)
def _cudnn_rnn(call: OpCall) -> int:
    # cuDNN's RNN (all layers and directions in one op); ``weight`` lists every layer's matrices.
    # Layers above the first see the previous layer's output, of the same number of steps.
    return _rnn_forward_flops(_shape(call.arg("input")), call.arg("weight"))


@register_flop_formula(aten._cudnn_rnn_backward)
def _cudnn_rnn_backward(call: OpCall) -> int:
    mask = call.arg("output_mask")
    fwd = _rnn_forward_flops(_shape(call.arg("input")), call.arg("weight"))
    # grad of inputs and states (mask 0-2, one pass) and of weights (mask 3).
    return fwd * (int(any(mask[:3])) + int(bool(mask[3])))


def _lstm_cell_elements(call: OpCall, w_hh_name: str) -> int:
    # Per time step, sequence and hidden unit of an LSTM cell: bias and activation of 4 gates (8), the
    # cell update c = f*c + i*g (3), h = o * tanh(c) (2): 13.
    x, w_hh = _shape(call.arg("input")), _shape(call.arg(w_hh_name))
    steps = x[0] if len(x) == 2 else x[0] * x[1]
    return 13 * steps * w_hh[1] if w_hh[0] == 4 * w_hh[1] else 0


@register_other_flop_formula(aten.mkldnn_rnn_layer)
def _mkldnn_rnn_layer_cell(call: OpCall) -> int:
    return _lstm_cell_elements(call, "weight1")


@register_other_flop_formula(aten.mkldnn_rnn_layer_backward)
def _mkldnn_rnn_layer_cell_backward(call: OpCall) -> int:
    return 2 * _lstm_cell_elements(call, "weight2")  # the chain rule through each elementwise step


# ------------------------------------------------------------------------------------ other FLOPs

_NORM_FORWARD = 5  # mean (1), variance (2), normalize (1), affine (1) per element
_NORM_BACKWARD = 8  # two reductions over grad_out and grad_out * x_hat (4), grad_input (3), affine (1)
_SOFTMAX_FORWARD = 5  # max, subtract, exp, sum, divide (log-softmax: log, subtract)
_SOFTMAX_BACKWARD = 4  # product, sum, subtract, product


@register_other_flop_formula(
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten._batch_norm_with_update,
    aten._batch_norm_no_update,
    aten.cudnn_batch_norm,
    aten.miopen_batch_norm,
    aten.native_layer_norm,
    aten.native_group_norm,
    aten._fused_rms_norm,
)
def _norm(call: OpCall) -> int:
    return _NORM_FORWARD * _numel(call.args[0])


@register_other_flop_formula(
    aten.native_batch_norm_backward,
    aten.batch_norm_backward,
    aten.miopen_batch_norm_backward,
    aten.native_layer_norm_backward,
    aten.native_group_norm_backward,
    aten._fused_rms_norm_backward,
)
def _norm_backward(call: OpCall) -> int:
    return _NORM_BACKWARD * _numel(call.arg("input"))


@register_other_flop_formula(aten.cudnn_batch_norm_backward)
def _cudnn_norm_backward(call: OpCall) -> int:
    return _NORM_BACKWARD * _numel(call.arg("input"))


@register_other_flop_formula(aten._softmax, aten._log_softmax, aten._safe_softmax)
def _softmax(call: OpCall) -> int:
    return _SOFTMAX_FORWARD * _numel(call.args[0])


@register_other_flop_formula(aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward(call: OpCall) -> int:
    return _SOFTMAX_BACKWARD * _numel(call.arg("grad_output"))


def _kernel_volume(call: OpCall) -> int:
    size = call.arg("kernel_size")
    return math.prod(size) if len(size) > 1 else int(size[0]) ** (len(_shape(call.args[0])) - 2)


@register_other_flop_formula(
    aten.max_pool2d_with_indices,
    aten.max_pool3d_with_indices,
    aten.avg_pool2d,
    aten.avg_pool3d,
    aten.max_pool2d,
    aten.max_pool1d,
    aten.avg_pool1d,
)
def _pool(call: OpCall) -> int:
    # A comparison or an addition per window element, per output element.
    return _kernel_volume(call) * _first_output_numel(call)


@register_other_flop_formula(aten.avg_pool2d_backward, aten.avg_pool3d_backward)
def _avg_pool_backward(call: OpCall) -> int:
    return _kernel_volume(call) * _numel(call.arg("grad_output"))


@register_other_flop_formula(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward)
def _max_pool_backward(call: OpCall) -> int:
    # Each output gradient is added to the input element it came from.
    return _numel(call.arg("grad_output"))


@register_other_flop_formula(
    aten._adaptive_avg_pool2d,
    aten._adaptive_avg_pool3d,
    aten.adaptive_max_pool2d,
    aten.adaptive_max_pool3d,
)
def _adaptive_pool(call: OpCall) -> int:
    return _numel(call.args[0])  # a reduction: one per input element


@register_other_flop_formula(
    aten._adaptive_avg_pool2d_backward,
    aten._adaptive_avg_pool3d_backward,
    aten.adaptive_max_pool2d_backward,
    aten.adaptive_max_pool3d_backward,
)
def _adaptive_pool_backward(call: OpCall) -> int:
    return _numel(call.arg("self"))  # one per input-gradient element


@register_other_flop_formula(aten.nll_loss_forward, aten.nll_loss_backward, aten.nll_loss2d_forward)
def _nll_loss(call: OpCall) -> int:
    return _numel(call.arg("target"))  # a gather (and a sum) per target element


@register_other_flop_formula(aten.nll_loss2d_backward)
def _nll_loss2d_backward(call: OpCall) -> int:
    return _numel(call.arg("target"))


@register_other_flop_formula(aten.embedding_dense_backward)
def _embedding_backward(call: OpCall) -> int:
    return _numel(call.arg("grad_output"))  # each row is added into its token's gradient row


@register_other_flop_formula(aten._amp_foreach_non_finite_check_and_unscale_)
def _unscale(call: OpCall) -> int:
    return 2 * _list_numel(call.arg("self"))  # a multiplication and a finiteness check per element


# Pointwise ops per parameter element of torch.optim's single-tensor (for-loop) implementations
# (torch 2.14.1, defaults): Adam lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_ = 7; AdamW adds the
# decoupled weight decay (mul_) = 8; SGD with momentum mul_, add_ (buffer), add_ (step) = 3.
_ADAM_ELEMENT_OPS = 7
_SGD_ELEMENT_OPS = 3


@register_other_flop_formula(aten._fused_adam_, aten._fused_adamw_)
def _fused_adam(call: OpCall) -> int:
    decoupled = call.op.overloadpacket is aten._fused_adamw_ and bool(call.arg("weight_decay", 0.0))
    return (_ADAM_ELEMENT_OPS + int(decoupled)) * _list_numel(call.arg("self"))


@register_other_flop_formula(aten._fused_sgd_)
def _fused_sgd(call: OpCall) -> int:
    return _SGD_ELEMENT_OPS * _list_numel(call.arg("self"))
