"""Every global random generator is left as it was by an estimate -- torch's (CPU and CUDA), NumPy's and
Python's -- on every way out: training after an estimate draws the numbers it would have drawn without
one. The step code runs for real in the simulation, and code such as timm's Mixup draws from NumPy."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from lightning_memest import EstimationError, estimate_step


def seed_all(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def next_draws() -> tuple[float, ...]:
    """The next numbers of each generator, Gaussian caches included (``random.gauss`` and NumPy's
    ``standard_normal`` keep the second number of a pair)."""
    return (
        random.random(),
        random.gauss(0.0, 1.0),
        float(np.random.rand()),
        float(np.random.standard_normal()),
        torch.rand(1).item(),
        torch.randn(1).item(),
    )


class Drawing:
    """A ``loss_fn`` that draws from every global generator (and reseeds torch's: fake tensors draw
    nothing from it, a reseed is what step code does to it), as augmentation in a step does."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.drawn: list[tuple[float, float]] = []

    def __call__(self, model: nn.Module, batch: Tensor) -> Tensor:
        self.drawn.append((random.random(), float(np.random.rand())))
        random.gauss(0.0, 1.0)
        np.random.standard_normal()
        torch.seed()
        if self.fail is not None:
            raise self.fail
        return model(batch).sum()  # type: ignore[no-any-return]


def test_every_generator_is_left_as_it_was() -> None:
    model, batch = nn.Linear(8, 4), torch.randn(2, 8)
    seed_all()
    expected = next_draws()

    seed_all()
    loss_fn = Drawing()
    estimate_step(model, batch, loss_fn=loss_fn, optimizer=torch.optim.Adam)

    # The step drew the very numbers training will draw next (the same generators) ...
    assert len(loss_fn.drawn) == 2  # once per simulated step
    assert loss_fn.drawn[0] == (expected[0], expected[2])
    # ... and they are drawn again after the estimate, as if it had not run.
    assert next_draws() == expected


@pytest.mark.parametrize(
    "fail", [ValueError("bad batch"), KeyboardInterrupt()], ids=["exception", "interrupt"]
)
def test_generators_are_restored_when_the_step_fails(fail: BaseException) -> None:
    model, batch = nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.5)), torch.randn(2, 8)
    weight = model[0].weight
    seed_all()
    expected = next_draws()

    seed_all()
    # An error of the step is an EstimationError; an interrupt stays what it is (Ctrl-C stops training).
    raised: type[BaseException] = EstimationError if isinstance(fail, Exception) else KeyboardInterrupt
    with pytest.raises(raised):
        estimate_step(model, batch, loss_fn=Drawing(fail))

    assert next_draws() == expected
    # the module is restored too: its own parameter, real
    assert model[0].weight is weight and type(weight) is nn.Parameter and not hasattr(weight, "fake_mode")


def test_generators_are_restored_with_activation_checkpointing() -> None:
    # Checkpointing saves and sets torch's generator state in forward and in its recomputation.
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))

        def forward(self, x: Tensor) -> Any:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)

    model, batch = Checkpointed(), torch.randn(2, 8)
    seed_all()
    expected = next_draws()
    seed_all()
    estimate_step(model, batch, optimizer=torch.optim.SGD)
    assert next_draws() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_generators_are_left_as_they_were() -> None:
    model, batch = nn.Linear(8, 4).cuda(), torch.randn(2, 8, device="cuda")
    seed_all()
    expected = torch.cuda.get_rng_state_all()

    def reseeding(model: nn.Module, batch: Tensor) -> Tensor:
        torch.cuda.manual_seed_all(1234)
        return model(batch).sum()  # type: ignore[no-any-return]

    estimate_step(model, batch, loss_fn=reseeding)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), expected, strict=True))
