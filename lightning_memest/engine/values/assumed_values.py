"""What a scalar read of a value the simulation cannot know assumes: that unknown values equal no
particular value -- a generated token is not the end-of-sequence token, a prediction does not match
its target exactly (values "in general position").

Why: a branch or a loop on a read decides how much the step does, and a fake run has no value to read.
Where the read is of a *comparison* of unknown values with a given one, the general-position answer is
the one that keeps code going: a generation loop's ``this_peer_finished = unfinished.max() == 0`` and
``while unfinished.any()`` both read "not finished", so generation runs to its maximum length (the
largest KV cache: memory is not under-estimated), and ``while not (tokens == eos).all()`` too. The
neutral answer (``False``, ``engine.values.data_dependent``) gets the first right and stops the second after
one token. Reads with no comparison of unknowns behind them keep the neutral answer.

The assumption is kept as a fact of the tensor (``engine.values.tensor_facts``): the set of values it holds
*in the assumed case* (a sorted 1-d CPU tensor, as ``engine.values.value_sets``' sets). Its sources are the
comparisons with an operand of unknown value (:func:`source_assumption`): ``==`` and ``isin`` give
``{False}``, ``!=`` and ``isin(..., invert=True)`` ``{True}`` (not of a tensor with itself: ``x == x``
is a NaN check). ``engine.values.value_sets`` carries it op to
op with its own rules, reading an operand's assumed set where it has one and its exact set otherwise
(``~``, ``&``/``|`` with a known operand, ``any``/``all``/``max``, ``== 0`` of an assumed value...).
A read answers from the exact set first (then nothing is assumed), from the assumed set where it holds
one value, and neutrally otherwise (``engine.values.data_dependent``). Sizes never use the assumption: a mask
of an assumed ``False`` still selects as many elements as the exact bounds allow.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     tokens = torch.empty(4, dtype=torch.long)  # unknown values
    >>> source_assumption(torch.ops.aten.eq.Scalar, (tokens, 2), {}, lambda t: None).tolist()
    [False]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memest.engine.values.tensor_facts import fact_of, file_fact

__all__ = ["assumed_set", "file_assumed", "has_assumption", "is_source", "source_assumption"]

aten = torch.ops.aten

#: The fact (``engine.values.tensor_facts``) holding the values a tensor holds in the assumed case.
_ASSUMED = "_memest_assumed_values"

#: Comparisons whose result, for an unknown operand, is assumed: ``True`` for ``!=``, else ``False``.
_SOURCES = {aten.eq: False, aten.eq_: False, aten.isin: False, aten.ne: True, aten.ne_: True}


def assumed_set(t: Tensor) -> Tensor | None:
    """The values ``t`` holds in the assumed case (sorted, 1-d, on the CPU), or ``None``."""
    return fact_of(t, _ASSUMED)  # type: ignore[no-any-return]


def file_assumed(t: Tensor, values: Tensor) -> None:
    """File ``values`` as what ``t`` holds in the assumed case (as long as its storage is unwritten)."""
    file_fact(t, _ASSUMED, values)


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
        return None  # a value equals itself: ``x == x`` is a NaN check
    if func.overloadpacket is aten.isin:
        invert = kwargs.get("invert", args[3] if len(args) > 3 else False)
        result = bool(invert)
    with unset_fake_temporarily():
        return torch.tensor([result])
