"""Train a small transformer language model on random tokens with ``MemEstimate``.

Uses Lightning's own demo ``Transformer`` (``torch.nn.Transformer`` inside: its causal-mask check
reads tensor values, which the estimator answers by its documented policy) and bf16 mixed precision
by default. Runs on the CPU in well under a minute:

    python examples/train_transformer.py [--precision 32-true]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.transformer import Transformer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import MemEstimate

VOCAB = 2000


class LanguageModel(pl.LightningModule):
    def __init__(self, seq_len: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(vocab_size=VOCAB, ninp=256, nhead=4, nhid=512, nlayers=2)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self.model(tokens, targets)
        loss = F.nll_loss(logits, targets.reshape(-1))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-4)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LinearLR(optimizer)}

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        n, seq = 512, self.hparams["seq_len"]
        tokens = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return DataLoader(data, batch_size=self.hparams["batch_size"], shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the CPU profiler's start/stop chatter

    pl.seed_everything(0)
    memest = MemEstimate(max_depth=2)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.steps,
        precision=args.precision,
        callbacks=[memest],
        logger=TensorBoardLogger("lightning_logs", name="memest-transformer"),
        enable_checkpointing=False,
    )
    trainer.fit(LanguageModel())

    print()
    print(memest.describe())


if __name__ == "__main__":
    main()
