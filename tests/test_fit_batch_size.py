"""FitBatchSize (adapter/fit_batch_size.py) in a real ``Trainer.fit``: where it sets the batch size,
its errors, and under DDP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import FitBatchSize
from lightning_memest.errors import MemoryBudgetError


class Net(pl.LightningModule):
    def __init__(self, batch_size: int = 4, *, hparam: bool = False) -> None:
        super().__init__()
        if hparam:
            self.save_hyperparameters()
        else:
            self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g))


class WithLoader(Net):
    def train_dataloader(self) -> DataLoader[Any]:
        size = self.hparams.get("batch_size") or self.batch_size  # hparams, or the attribute
        return DataLoader(_data(), batch_size=size)


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_data(), batch_size=self.batch_size)


class Seen(pl.Callback):
    """The sizes of the real batches (the estimator's fake runs call training_step, not this hook)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.sizes.append(batch[0].shape[0])


def _fit(module: pl.LightningModule, callback: FitBatchSize, datamodule: Any = None) -> list[int]:
    seen = Seen()
    trainer = pl.Trainer(
        callbacks=[callback, seen], max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert trainer.train_dataloader is not None
    return seen.sizes


BUDGET = 2**20  # about 1 MiB: the answer is a few dozen samples


@pytest.mark.parametrize("where", ["attribute", "hparams", "datamodule"])
def test_fit_batch_size_sets_the_dataloader(where: str) -> None:
    callback = FitBatchSize(BUDGET, margin=0.0)
    if where == "datamodule":
        module: Net = Net()
        del module.batch_size
        data: Data | None = Data()
    else:
        module, data = WithLoader(hparam=where == "hparams"), None
    seen = _fit(module, callback, data)
    r = callback.result
    assert r is not None and 4 < r.max_batch_size < 512
    assert seen == [r.max_batch_size]
    holder: Any = data if data is not None else (module.hparams if where == "hparams" else module)
    value = holder["batch_size"] if where == "hparams" else holder.batch_size
    assert value == r.max_batch_size
    # Exact with respect to the Lightning estimator: the next size is over the budget.
    assert dict(r.probes)[r.max_batch_size] <= BUDGET < dict(r.probes)[r.max_batch_size + 1]


def test_fit_batch_size_raises_before_any_step() -> None:
    seen = Seen()
    trainer = pl.Trainer(
        callbacks=[FitBatchSize("16KiB"), seen],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
    )
    with pytest.raises(MemoryBudgetError, match="even batch size 1") as info:
        trainer.fit(WithLoader())
    assert info.value.batch_size == 4 and info.value.max_batch_size == 0
    assert seen.sizes == []


class SeenOnDisk(pl.Callback):
    """Each rank writes the size of its first real batch (spawned workers share no memory with us)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        (self.folder / f"rank{trainer.global_rank}").write_text(str(batch[0].shape[0]))


def test_fit_batch_size_under_ddp_counts_the_buckets(tmp_path: Path) -> None:
    # Two CPU processes (gloo): each rank searches as a DDP rank (its gradient buckets count, one more
    # copy of the parameters), on a fake group of its own (no collective to deadlock on), and all take
    # the smallest answer. The buckets leave less room than a single process has.
    single = FitBatchSize(BUDGET, margin=0.0)
    _fit(WithLoader(), single)
    assert single.result is not None
    trainer = pl.Trainer(
        callbacks=[FitBatchSize(BUDGET, margin=0.0), SeenOnDisk(tmp_path)], max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=2, strategy="ddp_spawn",
    )  # fmt: skip
    trainer.fit(WithLoader())
    sizes = {int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)}
    assert len(sizes) == 1
    (ddp_size,) = sizes
    assert 4 < ddp_size < single.result.max_batch_size
