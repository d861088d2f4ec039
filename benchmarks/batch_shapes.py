"""Batches that change shape (issue 13): what re-estimating a larger batch costs next to the first
estimate, what a batch of a shape seen before costs, and each estimate against the CPU allocator.

Run: ``python benchmarks/batch_shapes.py [--json]``. A transformers BERT classifier (built from its
config) trains on dict batches padded per batch by ``DataCollatorWithPadding`` (dynamic padding), the
batches' lengths as listed below: some longer than any before (re-estimated before their step), some
not. ``MemEstimate(check=False)`` beside the tests' independent probe (``tests/probe.py``: the CPU
allocator's events from each batch's start to its end, plus every live tensor at its start). *s*: the
wall time of what ``MemEstimate`` did at that batch's start: the first estimate (two steps, calibration,
the scan of other live tensors), the second batch's (both steps again where it differs), a re-estimate
where the batch is larger than any before, else the shape comparison alone; *estimate*: the peak
estimated for that batch (step 1 of the first estimate, the last step of a later one; for a batch
covered already, the covering estimate's); *error*: against the probe, for the batches estimated.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from probe import AllocatorProbe

from lightning_memest import MemEstimate
from lightning_memest.adapter.fit_batches import FitBatches
from lightning_memest.report import StepEstimate, format_bytes

#: Each batch's padded length (batch size 8): longer than any before at 2, 4, 5, 7 and 9 (counted from 1).
LENGTHS = (32, 64, 48, 96, 128, 32, 192, 96, 256, 128)
BATCH = 8


class Texts(Dataset[dict[str, Any]]):
    """Token-id lists, unpadded (as ``dataset.map(tokenize)`` leaves them); batch ``i``'s longest row
    is ``LENGTHS[i]`` tokens."""

    def __init__(self, vocab: int) -> None:
        rng = random.Random(0)
        self.rows: list[dict[str, Any]] = []
        for length in LENGTHS:
            for j in range(BATCH):
                n = length if j == 0 else rng.randint(8, length)
                self.rows.append({"input_ids": [rng.randrange(5, vocab) for _ in range(n)], "label": j % 3})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


class BertClassifier(pl.LightningModule):
    def __init__(self) -> None:
        from transformers import AutoModelForSequenceClassification, BertConfig, PreTrainedTokenizerFast
        from transformers.data.data_collator import DataCollatorWithPadding

        super().__init__()
        config = BertConfig(
            vocab_size=2000,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=512,
            num_labels=3,
        )
        self.model = AutoModelForSequenceClassification.from_config(config)
        self.data = Texts(config.vocab_size)
        self.collator = DataCollatorWithPadding(_tokenizer(PreTrainedTokenizerFast), return_tensors="pt")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=BATCH, shuffle=False, collate_fn=self.collator)


def _tokenizer(cls: Any) -> Any:
    from tokenizers import Tokenizer, models

    return cls(
        tokenizer_object=Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]")),
        pad_token="[PAD]",
    )


def run() -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = BertClassifier()
    # Every estimate FitBatches makes, timed, in batch order: the first (batch 1), the second (batch 2:
    # both steps again where it differs), then the check at each later batch's start.
    checks: list[tuple[float, StepEstimate | None]] = []
    originals = {
        name: getattr(FitBatches, name)
        for name in ("estimate_first", "estimate_second", "estimate_if_larger")
    }

    def timed(method: Any) -> Any:
        def wrapper(self: FitBatches, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = method(self, *args, **kwargs)
            checks.append((time.perf_counter() - t0, result))
            return result

        return wrapper

    for name, method in originals.items():
        setattr(FitBatches, name, timed(method))
    try:
        memest = MemEstimate(max_depth=0, check=False, memory_check="off")
        probe = AllocatorProbe(batches=len(LENGTHS))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=len(LENGTHS),
            callbacks=[memest, probe],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module)
    finally:
        for name, method in originals.items():
            setattr(FitBatches, name, method)
    assert memest.estimate is not None and len(checks) == len(LENGTHS)
    rows = []
    covering = None
    for i, (probed, (seconds, result)) in enumerate(zip(probe.probed, checks, strict=True)):
        estimated = None
        if result is not None:
            # The first estimate's step 1 for batch 1; a later estimate's last step for its batch.
            estimated = result.peaks[0 if i == 0 else -1].bytes
            covering = result.peaks[-1].bytes
        kind = "first estimate" if i == 0 else ("re-estimated" if result is not None else "seen")
        rows.append(
            {
                "batch": i + 1,
                "length": LENGTHS[i],
                "kind": kind,
                "seconds": seconds,
                "calibration_seconds": None
                if result is None or result.calibration is None
                else result.calibration.seconds,
                "calibrated_ops": None
                if result is None or result.calibration is None
                else result.calibration.measured,
                "estimate": covering if estimated is None else estimated,
                "measured": probed.peak,
                "error_pct": None if estimated is None else 100.0 * (estimated - probed.peak) / probed.peak,
            }
        )
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print("| batch | length | at its start | s | calibration s (ops run) | estimate | measured | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        error = "-" if r["error_pct"] is None else f"{r['error_pct']:+.2f} %"
        calibration = "-"
        if r["calibration_seconds"] is not None:
            calibration = f"{r['calibration_seconds']:.2f} ({r['calibrated_ops']})"
        print(
            f"| {r['batch']} | {r['length']} | {r['kind']} | {r['seconds']:.3f} | {calibration} | "
            f"{format_bytes(r['estimate'])} | {format_bytes(r['measured'])} | {error} |"
        )
    first = result["rows"][0]["seconds"]
    again = [r["seconds"] for r in result["rows"] if r["kind"] == "re-estimated"]
    seen = [r["seconds"] for r in result["rows"] if r["kind"] == "seen"]
    errors = [abs(r["error_pct"]) for r in result["rows"] if r["error_pct"] is not None]
    print(
        f"\nfirst estimate {first:.2f} s; re-estimates {min(again):.2f}-{max(again):.2f} s; a batch of a "
        f"shape covered already: at most {max(seen) * 1e3:.2f} ms; worst |error| {max(errors):.2f} %"
    )


if __name__ == "__main__":
    main()
