"""The loops besides training (issue 17): each loop's first batch estimated with the batch in hand, checked
against the budget before it runs, and measured; against an independent probe of the real run
(``tests/probe.py``: the CPU allocator's events from the batch-start to the batch-end hook, plus every
live tensor at the start).

Each case fits with a sanity check and one validation inside the fit, then runs ``trainer.test`` and
``trainer.predict`` on the same trainer; ``MemEstimate(check=False)`` (only the probe's profiler runs).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from probe import AllocatorProbe
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_memest import MemEstimate, MemoryBudgetError

TOLERANCE_PCT = 1.0


# --- modules written as their users write them -------------------------------------------------------------
class ConvClassifier(pl.LightningModule):
    """A CNN with torchmetrics in validation and test, predictions as probabilities; evaluation batches
    four times the training batch (the usual pattern: no activations to keep, so larger)."""

    def __init__(self, train_batch: int = 8, eval_batch: int = 32) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )
        self.val_acc = MulticlassAccuracy(num_classes=10)
        self.test_acc = MulticlassAccuracy(num_classes=10)
        self.train_batch, self.eval_batch = train_batch, eval_batch
        self.data = TensorDataset(torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.val_acc.update(logits, y)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc.update(self.net(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.net(batch[0]).softmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.train_batch)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.eval_batch)

    test_dataloader = val_dataloader

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.eval_batch // 2)


class _Tokens(Dataset[dict[str, Tensor]]):
    def __init__(self, n: int = 64, seq_len: int = 64, vocab: int = 2000) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class HFCausalLM(pl.LightningModule):
    """A transformers GPT-2 from its config; validation reports the loss and perplexity, dict batches."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=2000, n_positions=128)
        self.model = GPT2LMHeadModel(config)
        self.data = _Tokens()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss = self.model(**batch).loss
        self.log_dict({"val_loss": loss, "val_ppl": loss.exp()})

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.model(**batch).loss)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch["input_ids"]).logits.argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=4)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=16)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class PaddedEncoder(pl.LightningModule):
    """``nn.TransformerEncoder`` over padded token batches with a ``src_key_padding_mask``: in eval
    (validation, test, predict) PyTorch takes its nested-tensor fast path, packing only the real tokens
    (``_nested_tensor_from_mask``, which fake tensors cannot carry: those ops run for real)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(300, 64)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
        self.head = nn.Linear(64, 2)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 300, (64, 24), generator=g)
        lengths = torch.randint(6, 25, (64,), generator=g)
        pad = torch.arange(24)[None] >= lengths[:, None]
        ids[pad] = 0
        self.data = TensorDataset(ids, pad, torch.randint(0, 2, (64,), generator=g))

    def forward(self, ids: Tensor, pad: Tensor) -> Tensor:
        hidden = self.enc(self.emb(ids), src_key_padding_mask=pad)
        return self.head(hidden.masked_fill(pad[..., None], 0).sum(1))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, pad, y = batch
        return nn.functional.cross_entropy(self(ids, pad), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, pad, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(ids, pad), y))

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, pad, _ = batch
        return self(ids, pad).softmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=8)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=16)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


@dataclass
class LoopCase:
    name: str
    build: Callable[[], pl.LightningModule]
    precision: str = "32-true"

    def __str__(self) -> str:
        return self.name


CASES = (
    LoopCase("conv_torchmetrics", ConvClassifier),
    LoopCase("conv_bf16_mixed", ConvClassifier, precision="bf16-mixed"),
    LoopCase("hf_gpt2", HFCausalLM),
    LoopCase("padded_encoder_nested_fast_path", PaddedEncoder),
)


def _trainer(callbacks: list[pl.Callback], precision: str = "32-true", **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "max_steps": 2,
        "val_check_interval": 2,
        "limit_val_batches": 1,
        "limit_test_batches": 1,
        "limit_predict_batches": 2,
        "num_sanity_val_steps": 1,
        "accelerator": "cpu",
        "devices": 1,
        "precision": precision,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": callbacks,
    }
    settings.update(kwargs)
    return pl.Trainer(**settings)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_first_batch_of_every_loop(case: LoopCase) -> None:
    """The sanity check, the fit's validation, test and predict: each first batch within 1 % of the probe."""
    pl.seed_everything(0, verbose=False)
    module = case.build()
    memest, probe = MemEstimate(check=False, memory_check="off"), AllocatorProbe()
    trainer = _trainer([memest, probe], case.precision)
    trainer.fit(module)
    trainer.test(module, verbose=False)
    trainer.predict(module)
    assert set(probe.loops) == {"sanity_check", "validate", "test", "predict"}
    assert set(memest.loop_estimates) == set(probe.loops)
    errors = {}
    for loop, probed in probe.loops.items():
        estimate = memest.loop_estimates[loop]
        errors[loop] = 100.0 * (estimate.peak_bytes - probed.peak) / probed.peak
    assert all(abs(e) <= TOLERANCE_PCT for e in errors.values()), errors
    assert memest.loop_estimates["validate"].steady_state.breakdown.optimizer_state > 0  # kept through it
    assert memest.loop_estimates["sanity_check"].steady_state.breakdown.optimizer_state == 0  # none yet
    assert all(e.loop in ("validate", "test", "predict") for e in memest.loop_estimates.values())


def test_validate_outside_fit_and_measured() -> None:
    """``trainer.validate`` alone: estimated and measured by the callback itself, logged per loop."""
    pl.seed_everything(0, verbose=False)
    module = ConvClassifier()
    memest = MemEstimate()
    trainer = _trainer([memest])
    trainer.validate(module, verbose=False)
    assert set(memest.loop_estimates) == {"validate"}
    measured = memest.loop_measured["validate"]
    assert abs(measured.error_pct) <= TOLERANCE_PCT, measured
    assert measured.estimated_bytes == memest.loop_estimates["validate"].peak_bytes


def test_sanity_check_oom_is_predicted_before_it_happens() -> None:
    """A budget between the training peak and the (larger) validation peak: fit stops before the sanity
    check's first batch runs, naming the loop, the batch size and the largest that fits."""
    pl.seed_everything(0, verbose=False)
    module = ConvClassifier(train_batch=2, eval_batch=64)
    ran: list[str] = []

    class Steps(pl.Callback):
        def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
            ran.append("validation")

    first = MemEstimate(check=False, memory_check="off")
    _trainer([first], max_steps=1, limit_val_batches=1, val_check_interval=1).fit(ConvClassifier(2, 64))
    train_peak = first.estimate.peak_bytes if first.estimate is not None else 0
    val_peak = first.loop_estimates["sanity_check"].peak_bytes
    assert train_peak < val_peak
    budget = (train_peak + val_peak) // 2
    memest = MemEstimate(check=False, memory_check="raise", memory_budget=budget)
    with pytest.raises(MemoryBudgetError) as caught:
        _trainer([memest, Steps()]).fit(module)
    assert ran == []
    message = str(caught.value)
    assert "sanity check" in message and "validation batch" in message
    assert "at batch size 64" in message and "the largest batch size that fits is" in message
    assert 0 < (caught.value.max_batch_size or 0) < 64


def test_loop_estimates_in_the_summary_and_logged(tmp_path: Any) -> None:
    """What a user sees: the sanity check's estimate under the summary; every loop's figures logged."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        import lightning.pytorch as pl
        from lightning.pytorch.loggers import CSVLogger
        from test_loops import ConvClassifier, _trainer
        from lightning_memest import MemEstimate
        pl.seed_everything(0, verbose=False)
        module = ConvClassifier()
        trainer = _trainer([MemEstimate()], logger=CSVLogger({str(tmp_path)!r}, name="run"),
                           enable_model_summary=True)
        trainer.fit(module)
        trainer.test(module, verbose=False)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Estimated peak memory, sanity check" in done.stdout, done.stdout
    metrics = "\n".join(p.read_text() for p in tmp_path.rglob("metrics.csv"))
    for loop in ("sanity_check", "validate", "test"):
        assert f"memest/{loop}/peak_MiB/estimate" in metrics
        assert f"memest/{loop}/peak_MiB/measured" in metrics
        assert f"memest/{loop}/error_pct" in metrics


class Generator(pl.LightningModule):
    """A predict step that generates, as users of transformers write it: ``self.model.generate`` on the
    prompts of the batch, greedy, to a fixed number of new tokens."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=128, eos_token_id=7)
        self.model = GPT2LMHeadModel(config)
        g = torch.Generator().manual_seed(1)
        self.prompts = TensorDataset(torch.randint(8, 128, (8, 4), generator=g))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        out: Tensor = self.model.generate(batch[0], max_new_tokens=24, do_sample=False, pad_token_id=0)
        return out

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.prompts, batch_size=2)


def test_a_generating_predict_step() -> None:
    """``model.generate`` in ``predict_step``, through Lightning's predict loop: within 1 % of the probe,
    the reads that decide when generation stops listed."""
    pl.seed_everything(0, verbose=False)
    module = Generator()
    memest, probe = MemEstimate(check=False, memory_check="off"), AllocatorProbe()
    predictions = _trainer([memest, probe]).predict(module)
    assert predictions is not None and all(p.shape == (2, 4 + 24) for p in predictions)  # type: ignore[union-attr]
    estimate, real = memest.loop_estimates["predict"], probe.loops["predict"].peak
    assert abs(estimate.peak_bytes - real) <= 0.01 * real, (estimate.peak_bytes, real)
    assert estimate.data_dependent, "the stopping criteria's reads are listed"
    assert {r.op for r in estimate.data_dependent} == {"aten.is_nonzero.default"}
