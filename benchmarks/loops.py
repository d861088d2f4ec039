"""The loops besides training (issue 17): each loop's first-batch estimate against the CPU allocator, and
what estimating them costs next to the training estimate.

Run: ``python benchmarks/loops.py [--json]``. Each case fits (a sanity check, one validation), then runs
``trainer.test`` and ``trainer.predict`` on the same trainer, with ``MemEstimate(check=False)`` and the
tests' independent probe (``tests/probe.py``: the CPU allocator's events from the batch-start to the
batch-end hook, plus every live tensor at the start). *training alone s*: the wall time
``MemEstimate`` adds to a fit of the module with no other loop (``setup_seconds``: the batch, two
steps simulated, calibration, the scan of other live tensors, the accounting; after one such fit to
warm up, so that neither side pays the calibration cache's first fill); *fit's loops add s*:
what the same fit with a sanity check and a validation took for all its estimates (training and the
two loops) beyond that, and as a multiple of it; *test, predict s*: each later call's estimate (the
first batch of ``trainer.test``, ``trainer.predict``). The
cases are the tests' modules and, held out from the tests, a timm classifier, a torchvision
segmentation model and a transformers BERT classifier.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from probe import AllocatorProbe
from test_loops import ConvClassifier, Generator, HFCausalLM, _trainer

from lightning_memest import MemEstimate
from lightning_memest.adapter.loop_checks import LoopChecks

LOOPS = ("sanity_check", "validate", "test", "predict")


class Classifier(pl.LightningModule):
    """Any image classifier, the usual Lightning way: cross-entropy, AdamW, evaluation batches 4x."""

    def __init__(self, net: nn.Module, size: int, classes: int = 10) -> None:
        super().__init__()
        self.net = net
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(64, 3, size, size, generator=g), torch.randint(0, classes, (64,))
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self._logits(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.cross_entropy(self._logits(batch[0]), batch[1]))

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._logits(batch[0]).argmax(-1)

    def _logits(self, x: Tensor) -> Tensor:
        out = self.net(x)
        logits: Tensor = out["out"].mean((2, 3)) if isinstance(out, dict) else out
        return logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=4)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=16)

    test_dataloader = predict_dataloader = val_dataloader


class BertClassifier(pl.LightningModule):
    """A transformers sequence classifier from its config, dict batches with attention masks."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            vocab_size=3000,
        )
        self.model = BertForSequenceClassification(config)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 3000, (64, 96), generator=g)
        self.data = TensorDataset(ids, torch.ones_like(ids), torch.randint(0, 2, (64,)))

    def _out(self, batch: Any) -> Any:
        ids, mask, labels = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=labels)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._out(batch).loss  # type: ignore[no-any-return]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._out(batch).loss)

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._out(batch).logits.softmax(-1)  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=8)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=32)

    test_dataloader = predict_dataloader = val_dataloader


def _timm() -> pl.LightningModule:
    import timm

    return Classifier(timm.create_model("resnet18", pretrained=False, num_classes=10), 64)


def _deeplab() -> pl.LightningModule:
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    net = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=10, aux_loss=False)
    return Classifier(net, 64)


CASES: list[tuple[str, Callable[[], pl.LightningModule], str]] = [
    ("CNN + torchmetrics (tests)", ConvClassifier, "32-true"),
    ("CNN + torchmetrics (tests)", ConvClassifier, "bf16-mixed"),
    ("GPT-2, transformers (tests)", HFCausalLM, "32-true"),
    ("GPT-2 generate in predict_step (tests)", Generator, "32-true"),
    ("timm resnet18", _timm, "32-true"),
    ("torchvision deeplabv3_mobilenet_v3", _deeplab, "32-true"),
    ("transformers BERT classifier", BertClassifier, "bf16-mixed"),
]


def training_alone(build: Callable[[], pl.LightningModule], precision: str) -> float | None:
    """What ``MemEstimate`` adds to a fit of the module without any other loop: the training estimate."""
    module = build()
    if not is_overridden("training_step", module):
        return None
    pl.seed_everything(0, verbose=False)
    memest = MemEstimate(max_depth=0, check=False, memory_check="off")
    _trainer([memest], precision, num_sanity_val_steps=0, limit_val_batches=0).fit(module)
    return memest.setup_seconds


def run_case(build: Callable[[], pl.LightningModule], precision: str) -> dict[str, Any]:
    training_alone(build, precision)  # once to warm up: the calibration cache, first-call costs
    alone = training_alone(build, precision)
    pl.seed_everything(0, verbose=False)
    module = build()
    seconds: list[float] = []
    start = LoopChecks.on_batch_start

    def timed(self: LoopChecks, *args: Any, **kwargs: Any) -> Any:
        if not self.untried(args[0]):  # a later batch of the loop: nothing estimated
            return start(self, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return start(self, *args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    LoopChecks.on_batch_start = timed  # type: ignore[method-assign]
    try:
        memest, probe = MemEstimate(max_depth=0, check=False, memory_check="off"), AllocatorProbe()
        trainer = _trainer([memest, probe], precision)
        in_fit = 0
        if is_overridden("training_step", module):
            trainer.fit(module)
            in_fit = len(seconds)
        if is_overridden("test_step", module):
            trainer.test(module, verbose=False)
        trainer.predict(module)
    finally:
        LoopChecks.on_batch_start = start  # type: ignore[method-assign]
    errors = {
        loop: 100.0 * (memest.loop_estimates[loop].peak_bytes - probed.peak) / probed.peak
        for loop, probed in probe.loops.items()
        if loop in memest.loop_estimates
    }
    return {
        "errors": errors,
        "train_alone_seconds": alone,
        "train_seconds": memest.setup_seconds,
        "fit_loop_seconds": sum(seconds[:in_fit]),
        "call_loop_seconds": seconds[in_fit:],
        "loop_seconds": sum(seconds),
        "loops": len(memest.loop_estimates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, build, precision in CASES:
        result = run_case(build, precision)
        rows.append({"case": name, "precision": precision, **result})
        print(f"{name} ({precision}): {result}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        "| module | precision | " + " | ".join(LOOPS) + " | training alone s | fit's loops add s | "
        "test, predict s |"
    )
    print("|---|---|" + "---|" * len(LOOPS) + "---|---|---|")
    ratios = []
    for r in rows:
        cells = [f"{r['errors'][loop]:+.2f} %" if loop in r["errors"] else "-" for loop in LOOPS]
        alone = r["train_alone_seconds"]
        added = "-"
        if alone is not None and r["train_seconds"] is not None:
            # What the fit's estimates took beyond the training estimate of a fit without other loops.
            extra = r["train_seconds"] + r["fit_loop_seconds"] - alone
            added = f"{extra:.2f} ({extra / alone:.2f}x)"
            ratios.append(extra / alone)
        later = r["call_loop_seconds"]
        calls = ", ".join(f"{x:.2f}" for x in later)
        if alone is not None:
            calls += " (" + ", ".join(f"{x / alone:.2f}x" for x in later) + ")"
        train = "-" if alone is None else f"{alone:.2f}"
        print(
            f"| {r['case']} | {r['precision']} | " + " | ".join(cells) + f" | {train} | {added} | {calls} |"
        )
    worst = max(abs(e) for r in rows for e in r["errors"].values())
    span = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    print(f"\nworst |error|: {worst:.2f} %; the fit's loops add {span} a training estimate")


if __name__ == "__main__":
    main()
