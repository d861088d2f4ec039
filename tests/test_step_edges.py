"""Legal steps at the edges of a fit: ``training_step`` returning ``None`` (Lightning's way to skip a
batch) or running no op at all, steps that act on ``batch_idx``, and a batch given up front.

Each case fits with and without ``MemEstimate``: fit ends as it would (the same optimizer steps, the
same weights, bit for bit), the callback adds no warning, each simulated step keeps a peak of its own
labelled by its step, and each measured step (the CPU allocator's events) is within 1 % of the
estimate of the same step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import MemEstimate

TOLERANCE_PCT = 1.0

#: What the steps and the hooks saw, in order: ("start", i) at a batch's start, ("step", i) in a step.
SEEN: list[tuple[str, int]] = []


class Skipping(pl.LightningModule):
    """A small classifier whose ``training_step`` does what ``behaviour(batch_idx)`` says: ``"skip"``
    (return None before any op), ``"late"`` (compute the loss, return None), ``"stop"`` (Ctrl+C),
    ``"channels_last"`` (switch the module's memory format, as some users do after a warm-up);
    anything else trains."""

    def __init__(self, behaviour: Callable[[int], str]) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4))
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(48, 3, 8, 8, generator=g), torch.randint(0, 4, (48,), generator=g)
        self.data = TensorDataset(x, y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        SEEN.append(("step", int(batch_idx)))
        what = self.behaviour(batch_idx)
        if what == "skip":
            return None
        if what == "stop":
            raise KeyboardInterrupt
        if what == "channels_last":
            self.to(memory_format=torch.channels_last)
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        return None if what == "late" else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=8)


class Order(pl.Callback):
    """Put first among the callbacks: notes each batch's start before ``MemEstimate`` acts on it."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        SEEN.append(("start", batch_idx))


def _fit(behaviour: Callable[[int], str], callbacks: list[Any]) -> tuple[int, list[Tensor], list[str]]:
    pl.seed_everything(0, verbose=False)
    module = Skipping(behaviour)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        callbacks=[Order(), *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(SystemExit):  # Lightning's answer to Ctrl+C in fit
            trainer.fit(module)
    ours = [str(w.message) for w in caught if "MemEstimate" in str(w.message)]
    return trainer.global_step, [p.detach().clone() for p in module.parameters()], ours


CASES: dict[str, Callable[[int], str]] = {
    "none-on-the-first-batch": lambda i: "skip" if i == 0 else "train",
    "none-on-the-second-batch": lambda i: "skip" if i == 1 else "train",
    "none-after-the-forward": lambda i: "late" if i == 0 else "train",
    "none-always": lambda i: "skip",
    "every-other-batch": lambda i: "skip" if i % 2 else "train",
}


@pytest.mark.parametrize("name", list(CASES))
def test_steps_that_skip_are_steps(name: str) -> None:
    behaviour = CASES[name]
    steps, weights, _ = _fit(behaviour, [])
    memest = MemEstimate(max_depth=0)
    steps_with, weights_with, warned = _fit(behaviour, [memest])
    assert warned == [] and steps_with == steps
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_with, strict=True))
    estimate = memest.estimate
    assert estimate is not None and [p.step for p in estimate.peaks] == [1, 2]
    assert [m.step for m in memest.measured] == [1, 2]
    for measured, peak in zip(memest.measured, estimate.peaks, strict=True):
        assert measured.estimated_bytes == peak.bytes
        assert abs(measured.error_pct) <= TOLERANCE_PCT, (name, memest.describe())


@pytest.mark.parametrize("stage", ["stop", "channels_last"])
def test_no_step_sees_a_batch_idx_before_its_batch(stage: str) -> None:
    """A step that acts at ``batch_idx == 1`` acts when batch 1 has come, not in the estimate of batch 0;
    fit ends as it would without the callback."""

    def behaviour(i: int) -> str:
        return stage if i == 1 else "train"

    SEEN.clear()
    steps, weights, _ = _fit(behaviour, [])
    SEEN.clear()
    memest = MemEstimate(max_depth=0)
    steps_with, weights_with, warned = _fit(behaviour, [memest])
    assert warned == [] and steps_with == steps
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_with, strict=True))
    started: set[int] = set()
    for what, index in SEEN:
        if what == "start":
            started.add(index)
        else:
            assert index in started, f"a step saw batch_idx={index} before that batch started: {SEEN}"
    if stage == "channels_last":
        # The step read its batch_idx: batch 1's estimate ran with batch 1's index, and held.
        assert memest.estimate is not None and len(memest.measured) == 2
        assert all(abs(m.error_pct) <= TOLERANCE_PCT for m in memest.measured), memest.describe()


def test_a_batch_given_up_front_is_counted_once(capsys: pytest.CaptureFixture[str]) -> None:
    """``example_batch``: the summary, ``describe()`` and the check show one estimate, which the
    measured steps meet (the batch given stays alive beside the batches training gets)."""
    g = torch.Generator().manual_seed(1)
    example = (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
    memest = MemEstimate(example_batch=example)
    pl.seed_everything(0, verbose=False)
    pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[memest],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    ).fit(Skipping(lambda i: "train" if i % 1000 != 999 else "skip"))  # reads batch_idx: estimated again
    out = capsys.readouterr().out
    estimate = memest.estimate
    assert estimate is not None
    from lightning_memest.report import format_bytes

    assert f"Estimated peak memory, first step (cpu): {format_bytes(estimate.first_step.bytes)}" in out
    assert f"estimated {format_bytes(estimate.first_step.bytes)}" in memest.describe()
    assert all(abs(m.error_pct) <= TOLERANCE_PCT for m in memest.measured), memest.describe()
