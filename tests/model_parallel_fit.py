"""A real two-process CPU fit under Lightning's ModelParallelStrategy (FSDP2 applied in
``configure_model``) with ``MemEstimate``: run by ``tests/test_distributed.py`` as a script (Lightning
starts the second rank by running this file again). Each rank prints one JSON line: its estimate and
measurement of both steps.

The ranks settle their collectives (``tests/dist_worker.settle_collectives``: a 2 ms pause after each
wait, so that gloo's worker thread lets go of a collective's tensors before the main thread does and
the CPU profiler sees every free): an instrument fix of the ground truth, not a change to the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from lightning_memest import MemEstimate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root
from tests.dist_worker import settle_collectives


class Settle(pl.Callback):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        settle_collectives()  # in each rank's process


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.head = nn.Linear(256, 10)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in [*self.layers, self.head]:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0]
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def main() -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 256))
    memest = MemEstimate(max_depth=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=3,
        callbacks=[Settle(), memest],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Sharded(), torch.utils.data.DataLoader(data, batch_size=32))
    report = {
        "rank": trainer.global_rank,
        "estimated": [p.bytes for p in memest.estimate.peaks] if memest.estimate else None,
        "measured": [m.peak_bytes for m in memest.measured],
    }
    print("MEMEST " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
