"""Block replay inside a real ``Trainer.fit``: the callback's estimate replays a module's repeated
blocks by default, through everything Lightning's loop does around a step -- gradient accumulation and
clipping, manual optimization, mixed precision, an EMA copy of the weights -- and every figure equals
the estimate with every block simulated (``MemEstimate(replay_blocks=False)``), which the measured
first step (the CPU profiler's allocator events) holds within a percent."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import MemEstimate
from lightning_memest.report import MeasuredStep, StepEstimate


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Stack(pl.LightningModule):
    """Eight residual MLP blocks in a ``ModuleList``, as a user writes a small transformer-like model."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(_Block(32) for _ in range(8))
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
            opt.step()  # type: ignore[union-attr]
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
        return DataLoader(data, batch_size=16)


def _fit(
    memest: MemEstimate, manual: bool, callbacks: list[Any], **kwargs: Any
) -> tuple[StepEstimate | None, list[MeasuredStep]]:
    """The callback's estimate and measured steps; nothing of the fit kept (Lightning gives every
    callback the module's ``log``: an earlier fit's model would count among the next's other tensors)."""
    gc.collect()
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[memest, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )
    trainer.fit(Stack(manual=manual))
    return memest.estimate, memest.measured


def _figures(est: StepEstimate | None) -> StepEstimate:
    assert est is not None
    # The calibration's own account differs by design: the second fit finds the first's in the cache.
    return dataclasses.replace(
        est, estimate_seconds=0.0, replayed_blocks=None, replay_note=None, calibration=None
    )


@pytest.mark.parametrize(
    ("manual", "callbacks", "trainer"),
    [
        (False, [], {}),
        (False, [], {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0}),
        (True, [], {}),
        (False, [], {"precision": "bf16-mixed"}),
        (False, [EMAWeightAveraging], {}),
    ],
    ids=["plain", "accumulate-clip", "manual", "bf16-mixed", "ema"],
)
def test_the_callback_replays_and_every_figure_is_the_full_simulations(
    manual: bool, callbacks: list[Any], trainer: dict[str, Any]
) -> None:
    replayed, measured = _fit(MemEstimate(), manual, [c() for c in callbacks], **trainer)
    full, _ = _fit(MemEstimate(replay_blocks=False), manual, [c() for c in callbacks], **trainer)
    assert replayed is not None and full is not None
    assert replayed.replayed_blocks == {"blocks": 3}  # blocks 3, 4, 5 of 0-7, every step
    assert full.replayed_blocks is None
    a, b = _figures(replayed), _figures(full)
    assert a.peaks == b.peaks
    assert a == b
    assert abs(measured[0].error_pct) < 1.0, measured[0]


def test_replay_blocks_must_be_a_flag(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="replay_blocks must be True or False"):
        MemEstimate(replay_blocks="yes")  # type: ignore[arg-type]
