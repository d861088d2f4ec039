"""A one-step fit with ``MemEstimate``, as a user writes it, for ``tests/test_summary.py``.

``python summary_fit.py [ModelSummary | RichModelSummary | no-summary]``: the summary callback passed
beside ``MemEstimate`` (or ``enable_model_summary=False``).
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_memest import MemEstimate


class Net(BoringModel):
    """Lightning's BoringModel with a nested layer, for ``max_depth``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))


def main(extra: str | None) -> None:
    callbacks: list[Callback] = [MemEstimate(max_depth=2, calibrate=False)]
    if extra == "ModelSummary":
        callbacks.append(ModelSummary())
    elif extra == "RichModelSummary":
        from lightning.pytorch.callbacks import RichModelSummary

        callbacks.insert(0, RichModelSummary())  # before MemEstimate: its on_fit_start runs first
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=extra != "no-summary",
        accelerator="cpu",
    )
    trainer.fit(Net())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
