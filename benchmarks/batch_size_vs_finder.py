"""FitBatchSize against Lightning's BatchSizeFinder, side by side, on a GPU (issue 5's comparison).

For each model: Lightning's ``BatchSizeFinder`` (``binsearch``, real trial steps on the GPU) and
``FitBatchSize`` (fake probes, no real step), each in a fresh process: the batch size found, the
seconds the search took, and whether training then runs 5 steps at that size without an OOM. Also the
peak ``max_memory_reserved`` of those steps against the GPU's memory. Run on a machine with a GPU:

    python benchmarks/batch_size_vs_finder.py [--models resnet50,vit_b_16] [--json]

Needs CUDA; exits with a message otherwise. Each run is a subprocess so that one OOM cannot poison the
next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_RUN = r"""
import json, sys, time
import lightning.pytorch as pl
import torch, torch.nn.functional as F, torchvision
from torch.utils.data import DataLoader, Dataset
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning_memest import FitBatchSize

arch, finder = sys.argv[1], sys.argv[2]


class Images(Dataset):
    def __len__(self): return 100_000
    def __getitem__(self, i): return torch.randn(3, 224, 224), i % 1000


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.batch_size = 2
        self.net = torchvision.models.get_model(arch, weights=None)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
    def train_dataloader(self):
        return DataLoader(Images(), batch_size=self.batch_size, num_workers=4)


class Timer(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0 and not hasattr(self, "searched"):
            self.searched = time.perf_counter()


callback = BatchSizeFinder(mode="binsearch", max_trials=25) if finder == "lightning" else FitBatchSize()
model = Model()
start = time.perf_counter()
trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=5, precision="bf16-mixed",
                     callbacks=[callback], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
torch.cuda.reset_peak_memory_stats()
ok, error = True, None
try:
    trainer.fit(model)
except torch.OutOfMemoryError as e:
    ok, error = False, str(e).splitlines()[0]
print(json.dumps({"model": arch, "finder": finder, "batch_size": model.batch_size, "ok": ok, "error": error,
                  "seconds": time.perf_counter() - start,
                  "max_reserved": torch.cuda.max_memory_reserved(), "total": torch.cuda.mem_get_info()[1]}))
"""


def run(arch: str, finder: str) -> dict[str, Any]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, arch, finder], capture_output=True, text=True, cwd=ROOT, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {
            "model": arch,
            "finder": finder,
            "ok": False,
            "error": proc.stderr.strip().splitlines()[-1:],
            "seconds": time.perf_counter() - started,
        }
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="resnet50,vit_b_16,convnext_tiny")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("batch_size_vs_finder: no CUDA device here; run it on a machine with a GPU")
    rows = [run(arch, finder) for arch in args.models.split(",") for finder in ("lightning", "memest")]
    print(f"{torch.cuda.get_device_name()}, bf16-mixed, AdamW, 3x224x224, fit of 5 steps after the search\n")
    print("| model | finder | batch size | fit seconds (search + 5 steps) | trained | max reserved |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        reserved = f"{r['max_reserved'] / 2**30:.1f} GiB" if "max_reserved" in r else "-"
        trained = "yes" if r.get("ok") else f"no ({r.get('error')})"
        size = r.get("batch_size", "-")
        print(f"| {r['model']} | {r['finder']} | {size} | {r['seconds']:.1f} | {trained} | {reserved} |")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
