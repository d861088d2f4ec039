"""The policy for reading values of fake tensors, which have none.

Real training code reads tensor values all the time: ``loss.item()`` for logging, ``if torch.isnan(x)``,
``GradScaler``'s inf check, ``torch.nn.Transformer``'s check whether a mask is causal, boolean-mask
indexing. Plain ``FakeTensorMode`` raises on each. The estimate goes on instead, with a deliberate
answer, and the report lists every place it happened (op, module, what was assumed):

* a scalar read (``.item()``, ``bool(t)``, ``int(t)``, ``torch.equal``) is answered with a *neutral*
  value: ``0`` / ``0.0`` / ``False`` -- the "nothing unusual happened" branch of typical checks
  (no inf found, no NaN, not causal), and a harmless number for logging;
* an op whose output *size* depends on values (``nonzero``, ``masked_select``, indexing with a
  boolean mask ``x[mask]``) is assumed to select every element: the largest output it can have, so
  memory is not under-estimated there.

Any other data-dependent op cannot be simulated and raises ``EstimationError`` naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Answer",
    "answer",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class Answer:
    """What the simulation uses instead of a data-dependent result, and how to say so."""

    value: Any
    assumed: str


def _neutral_scalar(t: Tensor) -> Answer:
    if t.dtype == torch.bool:
        return Answer(False, "False")
    if t.is_floating_point() or t.is_complex():
        return Answer(0.0, "0.0")
    return Answer(0, "0")


def _all_selected_nonzero(t: Tensor) -> Answer:
    n = math.prod(t.shape)
    return Answer(
        torch.empty((n, t.dim()), dtype=torch.long, device=t.device),
        f"every element nonzero ({n} of {n})",
    )


def _all_selected_masked(t: Tensor, mask: Tensor) -> Answer:
    shape = torch.broadcast_shapes(t.shape, mask.shape)  # type: ignore[no-untyped-call]
    n = math.prod(shape)
    return Answer(torch.empty((n,), dtype=t.dtype, device=t.device), f"every element selected ({n})")


def _all_selected_index(op: torch._ops.OpOverload, t: Tensor, indices: list[Tensor | None]) -> Answer:
    # A boolean mask of k dims indexes like the k columns of its nonzero(): assume all of it is set.
    expanded: list[Tensor | None] = []
    selected = 0
    for index in indices:
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            n = math.prod(index.shape)
            selected = max(selected, n)
            expanded.extend(
                torch.empty((n,), dtype=torch.long, device=index.device) for _ in range(index.dim())
            )
        else:
            expanded.append(index)
    return Answer(op(t, expanded), f"every element of the mask set ({selected})")


def answer(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Answer | None:
    """The policy's answer for ``op``, or ``None`` if the op has no deliberate answer.

    Runs below the tracker and above the fake mode, so tensors it creates are fake and tracked.
    """
    packet = op.overloadpacket
    if packet in (aten._local_scalar_dense, aten.is_nonzero):
        return _neutral_scalar(args[0])
    if packet is aten.equal:
        return Answer(False, "False")
    if packet is aten.nonzero:
        return _all_selected_nonzero(args[0])
    if packet is aten.masked_select:
        return _all_selected_masked(args[0], args[1])
    if op is aten.index.Tensor and any(
        i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    ):
        return _all_selected_index(op, args[0], list(args[1]))
    return None
