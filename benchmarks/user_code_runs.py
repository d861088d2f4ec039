"""How often your code runs with ``MemEstimate``: each hook of a LightningModule counted over a short fit,
without the callback and with it in three settings (docs/callback.md's table).

A fit of 3 training batches of 512 (six MLP blocks, AdamW), one sanity-check batch and one validation
batch after the third step; each setting in a fresh process so that nothing is shared:

    python benchmarks/user_code_runs.py

Prints one Markdown row per setting: the calls of ``configure_optimizers``, ``training_step``,
``validation_step`` and ``forward``.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from typing import Any

SETTINGS = {
    "without the callback": "[]",
    "MemEstimate()": "[MemEstimate(max_depth=0)]",
    "over the budget (memory_budget='60MiB'): the advice": (
        "[MemEstimate(max_depth=0, memory_budget='60MiB')]"
    ),
    "checkpointing='auto' (memory_budget='60MiB')": (
        "[MemEstimate(max_depth=0, memory_budget='60MiB', checkpointing='auto')]"
    ),
}


def fit(callbacks: str) -> dict[str, int]:
    """The calls of each counted hook in one fit with ``callbacks`` (Python source)."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memest import MemEstimate

    calls: collections.Counter[str] = collections.Counter()

    class Blocks(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(
                *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(6)]
            )
            self.head = nn.Linear(256, 4)

        def forward(self, x: torch.Tensor) -> Any:
            calls["forward"] += 1
            return self.head(self.blocks(x))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            calls["training_step"] += 1
            x, y = batch
            return F.cross_entropy(self(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            calls["validation_step"] += 1
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self) -> Any:
            calls["configure_optimizers"] += 1
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 256, generator=g), torch.randint(0, 4, (2048,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        val_check_interval=3,
        callbacks=eval(callbacks, {"MemEstimate": MemEstimate}),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Blocks(), DataLoader(data, batch_size=512), DataLoader(data, batch_size=512))
    return dict(calls)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fit", metavar="CALLBACKS", help="one fit with these callbacks (Python source), as JSON"
    )
    args = parser.parse_args()
    if args.fit is not None:
        print(json.dumps(fit(args.fit)))
        return
    hooks = ("configure_optimizers", "training_step", "validation_step", "forward")
    print("| Setting | " + " | ".join(f"`{h}`" for h in hooks) + " |")
    print("|---|" + "---|" * len(hooks))
    for name, callbacks in SETTINGS.items():
        out = subprocess.run(
            [sys.executable, __file__, "--fit", callbacks], capture_output=True, text=True, check=True
        ).stdout
        calls = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | " + " | ".join(str(calls.get(h, 0)) for h in hooks) + " |")


if __name__ == "__main__":
    main()
