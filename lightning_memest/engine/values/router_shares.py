"""A router's choices, shared out: ``ids == e`` for each expert ``e`` of positions ``ids`` that
``topk``/``argmax``/``sort`` picked (the tokens a hand-written mixture of experts routes to expert
``e``) take an even share of the picks between them (``engine.values.nonzero_bounds``' rule for ``==``).

Why: a simulation runs one scenario, and the values a router picks follow its activations, which
fake tensors do not have. Taking each selection at its own largest size (every token routed to every
expert) counted a hand-written top-k router's expert activations once per expert (+248 % on a zoo
MoE language model). An even share keeps the total exact -- what each expert saves for backward adds
up to the same bytes whatever the split -- and gives every expert tokens, so its weights get
gradients as in a real run (handing all picks to the last experts instead left the others without
gradients: -7.9 %). The busiest expert's own transient memory is what the even share misses.

Picks are marked when ``topk``/``sort``/``max`` (their positions) or ``argmax``/``argsort`` make them,
and the mark follows views and copies (:func:`mark_picks`); selections of other unknown values keep
their bounds (torchvision's FPN levels, far from even).

Example:
    >>> import torch
    >>> from lightning_memest.engine.tracker import Tracker
    >>> from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode
    >>> with TrackingFakeTensorMode(Tracker()):
    ...     ids = torch.randn(1000, 6).topk(2, dim=-1).indices
    ...     [len(torch.where(ids == e)[0]) for e in range(6)]
    [334, 334, 333, 333, 333, 333]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload, OpOverloadPacket

from lightning_memest.engine.values.tensor_facts import fact_of, file_fact

__all__ = ["file_share", "is_picked", "mark_picks", "selection_share", "shared_selection"]

aten = torch.ops.aten

#: The fact name of the shares of a tensor's elements its ``==`` selections took (:func:`shared_selection`).
_SELECTIONS = "_memest_selections"
#: The fact name of a selection whose bound is such a share: of how many values.
_SHARED = "_memest_shared"
#: The fact name of positions picked by ``topk``/``argmax``/``sort`` (a router's choice of experts),
#: carried through views and copies: what :func:`shared_selection` shares out.
_PICKED = "_memest_picked"
#: The ops whose position outputs are picks: which output (``None``: the only one).
_PICKS: dict[OpOverloadPacket, int | None] = {
    aten.topk: 1,
    aten.sort: 1,
    aten.max: 1,
    aten.argmax: None,
    aten.argsort: None,
}
#: Ops whose output holds their first argument's values, rearranged or copied.
_SAME_VALUES = frozenset(
    {
        *(aten.view, aten._unsafe_view, aten.reshape, aten.flatten, aten.clone, aten.contiguous),
        *(aten.t, aten.transpose, aten.permute, aten.squeeze, aten.unsqueeze, aten.select, aten.slice),
        *(aten._to_copy, aten.alias, aten.detach),
    }
)


def mark_picks(func: OpOverload, args: Sequence[Any], out: Any) -> None:
    """File :data:`_PICKED` on a pick's positions, and on what keeps a marked tensor's values."""
    packet = func.overloadpacket
    if packet in _PICKS:
        which = _PICKS[packet]
        picked = out if which is None else (out[which] if isinstance(out, (tuple, list)) else None)
        if isinstance(picked, Tensor) and not picked.is_floating_point():
            file_fact(picked, _PICKED, True)
    elif packet in _SAME_VALUES and isinstance(out, Tensor) and args and isinstance(args[0], Tensor):
        same = out.dtype == args[0].dtype
        if same and fact_of(args[0], _PICKED) is not None:
            file_fact(out, _PICKED, True)


def is_picked(t: Tensor) -> bool:
    """Whether ``t`` holds positions a pick made (:func:`mark_picks`)."""
    return fact_of(t, _PICKED) is not None


def file_share(t: Tensor, bound: int) -> None:
    """File on the selection ``t`` that its ``bound`` is a share (where :func:`shared_selection` made it)."""
    if isinstance(bound, _Share):
        file_fact(t, _SHARED, bound.values)


class _Share(int):
    """A bound that is an even share of ``values`` disjoint selections (:func:`shared_selection`)."""

    values: int


def selection_share(t: Tensor) -> int | None:
    """Of how many disjoint selections ``t``'s bound is an even share (:func:`shared_selection`), or ``None``
    where it is a bound (the report says which)."""
    shared = fact_of(t, _SHARED)
    return int(shared) if shared is not None else None


def shared_selection(t: Tensor, value: Any, values: int, cap: int) -> int:
    """How many elements of ``t == value`` are set, where ``t`` holds one of ``values`` possible values
    in each element: one of disjoint selections that share ``t``'s elements (a router's
    ``topk_ids == e`` for each expert ``e``: ``t`` holds picks). The scenario the simulation runs: the
    elements spread evenly over the values (each selection what is left over the values not yet
    selected, at most ``cap``, the bound of one) -- so that, in a loop over every value, the total is
    every element, exactly, and every value is selected by some (each expert trains: its weights get
    gradients).
    A selection's own size is the even share, not its largest (a router's busiest expert runs a little
    more: its transient memory is that much larger). Each value's share is kept with ``t``, so selecting
    it again gives the same."""
    ledger: dict[Any, int] | None = fact_of(t, _SELECTIONS)
    if ledger is None:
        ledger = {}
        file_fact(t, _SELECTIONS, ledger)
    if value not in ledger:
        left = t.numel() - sum(ledger.values())
        unselected = values - len(ledger)  # this one among them
        ledger[value] = max(0, min(cap, -(-left // unselected)))
    share = _Share(ledger[value])
    share.values = values
    return share
