"""Index ops checked against the values their indices can hold (``lightning_memest.cases.index_bounds``): each
rejection is one the real step makes too, and nothing the real step accepts is rejected."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memest.cases.index_bounds import IndexBounds, OutOfBoundsError

VOCAB = 50


def _run_fake(model: nn.Module, forward: Callable[[nn.Module, Tensor], object], high: int) -> None:
    """``forward(model, ids)`` on fake token ids declared to hold ``0 .. high``."""
    names = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.empty(2, 8, dtype=torch.long)
        with IndexBounds({ids: (0, high, "the token ids")}, names):
            forward(model, ids)


def _run_real(model: nn.Module, forward: Callable[[nn.Module, Tensor], object], high: int) -> None:
    """The same forward for real, on ids that reach ``high``: the ground truth."""
    ids = torch.randint(0, high + 1, (2, 8))
    ids[0, 0] = ids[1, -1] = high  # in every slice the cases take
    with torch.no_grad():
        forward(model, ids)


class Lookups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.pos = nn.Embedding(8, 4)
        self.register_buffer("position_ids", torch.arange(8).unsqueeze(0))
        self.table = nn.Parameter(torch.zeros(VOCAB, 3))


CASES: dict[str, Callable[[nn.Module, Tensor], object]] = {
    "embedding": lambda m, ids: m.embed(ids),
    "embedding of a view": lambda m, ids: m.embed(ids[:, 1:].reshape(-1)),
    "shifted ids": lambda m, ids: m.embed(ids + 1),
    "concatenated ids": lambda m, ids: m.embed(torch.cat([ids, ids * 2], dim=1)),
    "index_select": lambda m, ids: m.table.index_select(0, ids.flatten()),
    "advanced indexing": lambda m, ids: m.table[ids],
    "gather": lambda m, ids: m.table.gather(0, ids[:, :3]),
    "positions from arange": lambda m, ids: m.pos(torch.arange(ids.shape[1] + 1)),
    "positions from a buffer": lambda m, ids: m.pos(m.position_ids[:, : ids.shape[1]] + 1),
}


@pytest.mark.parametrize("case", CASES)
def test_rejected_where_the_real_step_fails(case: str) -> None:
    model, forward = Lookups(), CASES[case]
    # A range the real step rejects: rejected here, and the real forward indeed fails.
    with pytest.raises(OutOfBoundsError, match="the real step fails with"):
        _run_fake(model, forward, high=VOCAB)
    with pytest.raises((IndexError, RuntimeError)):
        _run_real(model, forward, high=VOCAB)


@pytest.mark.parametrize(
    "forward",
    [
        lambda m, ids: m.embed(ids),
        lambda m, ids: m.table[ids],
        lambda m, ids: m.pos(torch.arange(ids.shape[1])),
        lambda m, ids: m.pos(m.position_ids[:, : ids.shape[1]]),
        lambda m, ids: m.table[ids - VOCAB // 2],  # negatives count from the end, as indexing allows
    ],
)
def test_a_range_the_real_step_accepts_passes(forward: Callable[[nn.Module, Tensor], object]) -> None:
    model = Lookups()
    _run_fake(model, forward, high=VOCAB - 1)
    _run_real(model, forward, high=VOCAB - 1)


def test_what_the_ranges_cannot_follow_is_not_checked() -> None:
    # `% VOCAB` brings any id into range; an in-place write may too: neither is a reason to reject.
    model = Lookups()
    _run_fake(model, lambda m, ids: m.embed(ids % VOCAB), high=10 * VOCAB)

    def clamp_in_place(m: nn.Module, ids: Tensor) -> object:
        ids = ids.clone()
        ids.clamp_(max=VOCAB - 1)
        return m.embed(ids)

    _run_fake(model, clamp_in_place, high=10 * VOCAB)


def test_the_message_names_the_tensor_and_the_real_error() -> None:
    with pytest.raises(OutOfBoundsError) as error:
        _run_fake(Lookups(), CASES["positions from arange"], high=VOCAB - 1)
    assert str(error.value) == (
        "torch.arange (0 .. 8) index pos.weight (aten.embedding), which has 8 rows: the real step fails "
        "with IndexError: index out of range in self"
    )
