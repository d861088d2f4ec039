"""Every training batch the callback estimates is checked against the budget before it runs -- the second
like every later one -- and under ``checkpointing="auto"`` a larger batch than the plan was made for is
planned again, before its step. Checked against the peaks the callback measures (the CPU profiler's
allocator events), and a batch past the measured steps by the same means, from a callback of the test's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_memest import MemEstimate, MemoryBudgetError
from lightning_memest.adapter.fit_batches import resident_at_start
from lightning_memest.measure import StepProbe

MiB = 2**20


class _Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(6)]
        )
        self.head = nn.Linear(256, 4)
        self.steps_run = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.steps_run += 1
        x, y = batch
        return F.cross_entropy(self.head(self.blocks(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Sizes(Sampler[list[int]]):
    """Batches of the given sizes, in order (a bucketing sampler's, or the last partial batch's)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


def _fit(sizes: list[int], callbacks: list[Any]) -> _Blocks:
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    data = TensorDataset(torch.randn(n, 256, generator=g), torch.randint(0, 4, (n,), generator=g))
    module = _Blocks()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=len(sizes),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_sampler=_Sizes(sizes)))
    return module


def test_a_larger_second_batch_is_checked_before_it_runs() -> None:
    # Batch 512 fits 60 MiB (about 46 MiB); the second, 1024, does not (about 83 MiB).
    memest = MemEstimate(max_depth=0, memory_budget=60 * MiB, memory_check="raise")
    with pytest.raises(MemoryBudgetError, match="at batch size 1024") as raised:
        _fit([512, 1024, 1024], [memest])
    assert raised.value.peak_bytes > 60 * MiB
    assert len(memest.measured) == 0  # step 2 never ran: nothing was measured


def test_a_larger_second_batch_is_warned_about() -> None:
    memest = MemEstimate(max_depth=0, memory_budget=60 * MiB, memory_check="warn")
    with pytest.warns(UserWarning, match="over the memory budget"):
        _fit([512, 1024], [memest])
    assert memest.measured[1].peak_bytes > 60 * MiB  # and it was right: step 2 ran over


def test_auto_checkpointing_plans_again_for_a_larger_second_batch() -> None:
    budget = 60 * MiB
    memest = MemEstimate(max_depth=0, memory_budget=budget, checkpointing="auto")
    _fit([512, 1024, 1024], [memest])
    assert memest.plan is not None and memest.plan.modules
    assert memest.plan.estimate.batch_shapes is not None
    assert memest.plan.estimate.batch_shapes[-1][0] == (1024, 256)  # made for the larger batch
    assert len(memest.measured) == 2
    for step in memest.measured:
        assert step.peak_bytes <= budget  # measured: the plan made step 2 fit
        assert abs(step.error_pct) <= 1.0, step


class _MeasureStep(pl.Callback):
    """The real peak of one training batch, by the CPU profiler's allocator events (``StepProbe``, as
    the callback measures its first two), from the tensors resident at its start."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.probe = StepProbe(torch.device("cpu"))
        self.peak: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.index:  # (MemEstimate, before this callback, has planned for this batch)
            self.probe.start(resident_at_start(trainer, module, batch))

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.index:
            self.probe.stop()
            self.peak = self.probe.finish()[0][0]


def test_auto_checkpointing_plans_again_for_a_larger_third_batch() -> None:
    budget = 60 * MiB
    memest = MemEstimate(max_depth=0, memory_budget=budget, checkpointing="auto")
    third = _MeasureStep(2)
    _fit([512, 512, 1024], [memest, third])  # 512 fits as it is; 1024 needs a plan, made at batch 3
    plan = memest.plan
    assert plan is not None and plan.modules
    assert plan.estimate.batch_shapes is not None and plan.estimate.batch_shapes[-1][0] == (1024, 256)
    assert third.peak is not None
    assert third.peak <= budget  # measured: the plan made for batch 3 made it fit
    assert abs(third.peak - plan.estimate.steady_state.bytes) <= 0.01 * third.peak


def test_a_failure_while_planning_again_is_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_memest.adapter.callback as callback

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a plan that cannot be made here")

    monkeypatch.setattr(callback, "replan", broken)
    memest = MemEstimate(max_depth=0, memory_budget=60 * MiB, checkpointing="auto")
    with pytest.warns(UserWarning, match="planning activation checkpointing"):
        module = _fit([512, 1024, 1024], [memest])
    assert module.steps_run == 3  # the fit went on
