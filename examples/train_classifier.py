"""Train a torchvision classifier on FakeData with ``MemEstimate``: the estimate, then the proof.

At the first training batch the callback runs two training steps of *this* module on fake tensors
(no real memory, no real compute) and puts the estimate in the model summary; after the first two
real batches it checks them against the measured peaks, and logs both, with the loss of every step,
to TensorBoard (``lightning_logs/``). Runs on the CPU in well under a minute:

    python examples/train_classifier.py
    tensorboard --logdir lightning_logs   # the Text tab first: the breakdown, estimated and measured
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from lightning_memest import MemEstimate


class Classifier(pl.LightningModule):
    def __init__(self, arch: str = "resnet18", batch_size: int = 16, image_size: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = torchvision.models.get_model(arch, weights=None, num_classes=10)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        size = self.hparams["image_size"]
        transform = v2.Compose([v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True)])
        data = torchvision.datasets.FakeData(
            size=256, image_size=(3, size, size), num_classes=10, transform=transform
        )
        return DataLoader(data, batch_size=self.hparams["batch_size"], shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="resnet18", help="a torchvision classification model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=16, help="training batches (one epoch: 16)")
    args = parser.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the CPU profiler's start/stop chatter

    pl.seed_everything(0)
    memest = MemEstimate()
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_epochs=1,
        limit_train_batches=args.steps,
        precision=args.precision,
        callbacks=[memest],
        logger=TensorBoardLogger("lightning_logs", name=f"memest-{args.arch}"),
        enable_checkpointing=False,
        log_every_n_steps=1,  # the loss of every step, beside the peak of the same batch
    )
    trainer.fit(Classifier(args.arch, args.batch_size))

    print()
    print(memest.describe())


if __name__ == "__main__":
    main()
