"""Sparse gradients and sparse optimizers (``engine.sparse``), against the CPU allocator's events of a real
step (``measure_step``): the fake kernels of ``clone``/``_coalesce``/sparse ``add`` make empty sparse
tensors, so without the rules the estimate missed the sparse gradient and the optimizer's update."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memest import estimate_step
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step


class Clicks(nn.Module):
    """A user embedding and a mean bag of item embeddings, both sparse, and a linear head."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.users = nn.Embedding(20000, 32, sparse=True)
        self.items = nn.EmbeddingBag(50000, 32, mode="mean", sparse=True) if bag else None
        self.head = nn.Linear(64 if bag else 32, 1)

    def forward(self, users: Tensor, items: Tensor) -> Tensor:
        x = self.users(users)
        if self.items is not None:
            x = torch.cat([x, self.items(items)], 1)
        return self.head(x).squeeze(1)


def _batch() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, 20000, (512,), generator=g),
        torch.randint(0, 50000, (512, 16), generator=g),
        torch.randint(0, 2, (512,), generator=g).float(),
    )


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    users, items, clicks = batch
    return F.binary_cross_entropy_with_logits(model(users, items), clicks)


def _embeddings(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not name.startswith("head")]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sparse_adam": lambda params: torch.optim.SparseAdam(list(params)[:-2], lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sparse_gradients_and_optimizers_are_estimated_within_1_percent(optimizer: str, bag: bool) -> None:
    model, batch = Clicks(bag), _batch()
    opt = OPTIMIZERS[optimizer]
    est = estimate_step(model, batch, loss_fn=_loss, optimizer=opt)
    real = measure_step(copy.deepcopy(model), batch, StepConfig(loss_fn=_loss, optimizer=opt))
    for estimated, measured in (
        (est.first_step.bytes, real.first_step),
        (est.steady_state.bytes, real.steady_state),
    ):
        assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)
    # The ids are the batch's: coalescing the gradient counts its distinct rows exactly.
    reads = [r for r in est.data_dependent or () if r.op == "aten._coalesce.default"]
    if optimizer != "sgd":  # (sparse SGD adds the gradient uncoalesced)
        assert reads and all(r.exact for r in reads), reads


def test_accumulated_sparse_gradients_concatenate() -> None:
    # Two micro-batches before the step: the second sparse gradient is added to the first (both parts
    # concatenated), then SparseAdam coalesces the sum.
    model, batch = Clicks(False), _batch()

    def twice(m: nn.Module, b: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        _loss(m, b).backward()
        return _loss(m, b)

    opt = OPTIMIZERS["sparse_adam"]
    est = estimate_step(model, batch, loss_fn=twice, optimizer=opt)
    real = measure_step(copy.deepcopy(model), batch, StepConfig(loss_fn=twice, optimizer=opt))
    assert abs(est.steady_state.bytes - real.steady_state) <= 0.01 * real.steady_state, (est, real)


def test_indices_the_simulation_cannot_know_are_assumed_distinct() -> None:
    # Ids predicted by the model: unknown, so coalescing keeps every one (the most it can) and the
    # report says it assumed so.
    class Predicted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pick = nn.Linear(8, 1000)
            self.table = nn.Embedding(1000, 16, sparse=True)

        def forward(self, x: Tensor) -> Tensor:
            return self.table(self.pick(x).argmax(1)).sum() + self.pick(x).sum()

    est = estimate_step(
        Predicted(), torch.randn(64, 8), loss_fn=lambda m, b: m(b), optimizer=torch.optim.Adagrad, steps=1
    )
    assumed = [r.assumed for r in est.assumed_reads if r.op == "aten._coalesce.default"]
    assert assumed == ["all 64 indices distinct"]
