"""What a scalar read of a value the simulation cannot know assumes: that unknown values equal no
particular value -- a generated token is not the end-of-sequence token, a prediction does not match
its target exactly (values "in general position") -- and that they are what a healthy run has: finite
numbers that pass the checks libraries make of them.

Why: a branch or a loop on a read decides how much the step does, and a fake run has no value to read.
Where the read is of a *comparison* of unknown values with a given one, the general-position answer is
the one that keeps code going: a generation loop's ``this_peer_finished = unfinished.max() == 0`` and
``while unfinished.any()`` both read "not finished", so generation runs to its maximum length (the
largest KV cache: memory is not under-estimated), and ``while not (tokens == eos).all()`` too. The
neutral answer (``False``, ``engine.values.data_dependent``) gets the first right and stops the second after
one token. Reads with no comparison of unknowns behind them keep the neutral answer.

Checks that only validate are the other kind of read: a run that does not crash passed them, so the
assumed case is the one that passes. ``isnan``, ``isinf``, ``isposinf`` and ``isneginf`` of an unknown
value give ``{False}`` and ``isfinite`` ``{True}`` (pytorch-forecasting asserts ``not isnan(loss)`` and
then ``isfinite(loss)``: no one neutral answer passes both); ``torch._is_all_true`` of unknown truths
gives ``{True}`` (``torch.distributions`` validates every distribution's arguments with it, on by
default: a distribution built from a network's output raised). Such a check decides no memory of the
step it guards; the read is listed in the report as any assumed read is.

The assumption is kept as a fact of the tensor (``engine.values.tensor_facts``): the set of values it
holds *in the assumed case* (a sorted 1-d CPU tensor, as ``engine.values.value_sets``' sets). Its
sources are the comparisons with an operand of unknown value (:func:`source_assumption`): ``==`` and
``isin`` give ``{False}``, ``!=`` and ``isin(..., invert=True)`` ``{True}`` (of a tensor with itself,
the other way: ``x == x`` is a NaN check, which a healthy value passes), and the checks above.
``engine.values.value_sets`` carries it op to op with its own rules, reading an operand's assumed set
where it has one and its exact set otherwise (``~``, ``&``/``|`` with a known operand,
``any``/``all``/``max``, ``== 0`` of an assumed value...). A read answers from the exact set first (then
nothing is assumed), from the assumed set where it holds one value, and neutrally otherwise
(``engine.values.data_dependent``). Sizes never use the assumption: a mask of an assumed ``False`` still
selects as many elements as the exact bounds allow.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     tokens = torch.empty(4, dtype=torch.long)  # unknown values
    >>> source_assumption(torch.ops.aten.eq.Scalar, (tokens, 2), {}, lambda t: None).tolist()
    [False]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memest.engine.values.tensor_facts import fact_of, file_fact

__all__ = [
    "assumed_reason",
    "assumed_set",
    "file_assumed",
    "has_assumption",
    "is_source",
    "source_assumption",
    "source_reason",
]

aten = torch.ops.aten

#: The fact (``engine.values.tensor_facts``) holding the values a tensor holds in the assumed case.
_ASSUMED = "_memest_assumed_values"
#: The fact holding why: what was assumed, in words, for the report.
_WHY = "_memest_assumed_why"

UNEQUAL = "an unknown value equals no given value"
FINITE = "a healthy run's values are finite"
VALID = "the library's check passes, as in a run that does not crash"

#: Ops whose result, for an unknown operand, is assumed: comparisons (``True`` for ``!=``, else
#: ``False``) and the checks a healthy run passes (finite values, a validation that holds).
_SOURCES = {
    aten.eq: False,
    aten.eq_: False,
    aten.isin: False,
    aten.ne: True,
    aten.ne_: True,
    aten.isnan: False,
    aten.isinf: False,
    aten.isposinf: False,
    aten.isneginf: False,
    aten.isfinite: True,
    aten._is_all_true: True,
}
#: The sources that check for NaN or infinity.
_CHECKS = frozenset({aten.isnan, aten.isinf, aten.isposinf, aten.isneginf, aten.isfinite})


def assumed_set(t: Tensor) -> Tensor | None:
    """The values ``t`` holds in the assumed case (sorted, 1-d, on the CPU), or ``None``."""
    return fact_of(t, _ASSUMED)  # type: ignore[no-any-return]


def assumed_reason(t: Tensor) -> str:
    """What the assumed case of ``t`` assumes, in words (:data:`UNEQUAL` where not said)."""
    return fact_of(t, _WHY) or UNEQUAL


def file_assumed(t: Tensor, values: Tensor, why: str = UNEQUAL) -> None:
    """File ``values`` as what ``t`` holds in the assumed case, assumed because ``why`` (as long as its
    storage is unwritten)."""
    file_fact(t, _ASSUMED, values)
    file_fact(t, _WHY, why)


def source_reason(func: torch._ops.OpOverload, args: Sequence[Any]) -> str:
    """Why an op's result holds what it holds in the assumed case: its own assumption where it is a
    source, else what its operands' assumed cases assume (joined, each once)."""
    packet = func.overloadpacket
    if packet is aten._is_all_true:
        return VALID
    itself = len(args) > 1 and args[0] is args[1]
    infinite = any(isinstance(a, float) and math.isinf(a) for a in args[1:2])  # ``isfinite``: |x| != inf
    if packet in _CHECKS or (packet in _SOURCES and (itself or infinite)):
        return FINITE
    if packet in _SOURCES:
        return UNEQUAL
    reasons: list[str] = []
    for a in args:
        for t in [a] if isinstance(a, Tensor) else a if isinstance(a, (list, tuple)) else ():
            if isinstance(t, Tensor) and assumed_set(t) is not None and assumed_reason(t) not in reasons:
                reasons.append(assumed_reason(t))
    return "; ".join(reasons) or UNEQUAL


def has_assumption(args: Sequence[Any]) -> bool:
    """Whether a tensor argument (lists opened one level) carries an assumption."""
    for a in args:
        if isinstance(a, Tensor):
            if _ASSUMED in a.__dict__ and assumed_set(a) is not None:
                return True
        elif isinstance(a, (list, tuple)) and has_assumption([x for x in a if isinstance(x, Tensor)]):
            return True
    return False


def is_source(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` is a comparison that makes an assumption (see :func:`source_assumption`)."""
    return func.overloadpacket in _SOURCES


def source_assumption(
    func: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    read: Callable[[Tensor], Tensor | None],
) -> Tensor | None:
    """The assumed values of a comparison's result where an operand's value is unknown (``read`` gives
    ``None``): ``{False}`` for ``==`` / ``isin``, ``{True}`` for ``!=`` / ``isin(invert=True)``."""
    result = _SOURCES.get(func.overloadpacket)
    if result is None:
        return None
    if not any(isinstance(a, Tensor) and read(a) is None for a in args[:2]):
        return None
    if len(args) > 1 and args[0] is args[1]:
        # ``x == x`` is a NaN check (``isnan`` and ``isfinite`` are made of it): a healthy value is no NaN.
        if func.overloadpacket not in (aten.eq, aten.eq_, aten.ne, aten.ne_):
            return None
        result = func.overloadpacket in (aten.eq, aten.eq_)
    if func.overloadpacket is aten.isin:
        invert = kwargs.get("invert", args[3] if len(args) > 3 else False)
        result = bool(invert)
    with unset_fake_temporarily():
        return torch.tensor([result])
