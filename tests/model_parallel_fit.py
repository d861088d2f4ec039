"""A real multi-process CPU fit under Lightning's ModelParallelStrategy with ``MemEstimate``: run by
``tests/test_distributed.py`` as a script (Lightning starts the other ranks by running this file
again). Each rank prints one JSON line: its estimate and measurement of both steps.

``python model_parallel_fit.py tp``: 2 ranks of tensor parallelism (a Llama-style feed-forward,
``parallelize_module`` as Lightning's own example writes it); ``tp_fsdp``: that and FSDP2 on a 2 x 2
mesh (4 ranks), where each block, never called below a root's forward, is its own FSDP root, and the
first step's peak falls inside gloo's reduce-scatter.

The ranks settle their collectives (``tests/dist_worker.settle_collectives``: a pause after each
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
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from lightning_memest import MemEstimate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's root
from tests.dist_worker import settle_collectives


class Settle(pl.Callback):
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        settle_collectives()  # in each rank's process


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TensorParallel(pl.LightningModule):
    """Lightning's tensor-parallel example: each feed-forward's w1/w3 split by columns, w2 by rows;
    with a data-parallel dimension, each block and the root then sharded with ``fully_shard``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward(256, 1024) for _ in range(3))

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
        for block in self.blocks:
            parallelize_module(block, self.device_mesh["tensor_parallel"], plan)
        if self.device_mesh["data_parallel"].size() > 1:
            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0]
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def main(mode: str) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 256))
    memest = MemEstimate(max_depth=0)
    sizes = {"tp": (1, 2), "tp_fsdp": (2, 2)}[mode]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=sizes[0] * sizes[1],
        strategy=ModelParallelStrategy(data_parallel_size=sizes[0], tensor_parallel_size=sizes[1]),
        max_steps=3,
        callbacks=[Settle(), memest],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(TensorParallel(), torch.utils.data.DataLoader(data, batch_size=32))
    report = {
        "rank": trainer.global_rank,
        "estimated": [p.bytes for p in memest.estimate.peaks] if memest.estimate else None,
        "measured": [m.peak_bytes for m in memest.measured],
    }
    print("MEMEST " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tp_fsdp")
