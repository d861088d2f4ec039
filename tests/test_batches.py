"""Batches of any structure (batches.py): their tensors, batch size and resized meta copies."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch

from lightning_memest.batches import batch_size_of, iter_tensors, map_tensors, resize_batch
from lightning_memest.errors import MemestError


def test_resize_batch_keeps_other_tensors_and_layout() -> None:
    x = torch.zeros(4, 3, 8, 8).to(memory_format=torch.channels_last)
    out = resize_batch({"x": x, "mask": torch.zeros(7), "k": 3}, 4, 1000)
    assert out["x"].shape == (1000, 3, 8, 8) and out["x"].device.type == "meta"
    assert out["x"].is_contiguous(memory_format=torch.channels_last)
    assert out["mask"].shape == (7,) and out["k"] == 3


def test_one_walker_for_every_structure() -> None:
    Pair = namedtuple("Pair", "x y")

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor
        extra: dict[str, object]

    batch = [Pair(torch.zeros(3, 2), "a"), Batch(torch.zeros(3, dtype=torch.long), {"m": (torch.ones(3),)})]
    assert [tuple(t.shape) for t in iter_tensors(batch)] == [(3, 2), (3,), (3,)]
    doubled = map_tensors(batch, lambda t: torch.cat([t, t]))
    assert isinstance(doubled[0], Pair) and doubled[0].y == "a" and isinstance(doubled[1], Batch)
    assert batch_size_of(doubled) == 6 and batch_size_of(batch) == 3
    with pytest.raises(MemestError, match="no tensor with a batch dimension"):
        batch_size_of({"n": 3, "scalar": torch.tensor(1.0)})
