"""The pre-check's advice is an estimate too: the largest batch size the budget error names fits.

For a budget just under a step's peak and for one far under it, the ``MemoryBudgetError`` names a batch
size ``n``; a fit at ``n`` passes the same pre-check (its estimate within the budget) and runs, one at
``n + 1`` does not -- with the dataset held in memory (other live tensors the estimate counts) and the
kernels calibrated, as ``MemEstimate`` runs by default. Then the same for the loop the pre-check stops
first: the sanity check's validation batch, larger than the training batch. And at ``n`` the real
step's measured peak (the CPU allocator's events) is within the budget too.

Each case runs in a fresh process, its fits one after another (the test checks that the fits it compares
saw the same other live tensors).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parent

_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys, warnings
    sys.path.insert(0, {tests!r})
    os.environ["MEMEST_CACHE_DIR"] = {cache!r}
    import lightning.pytorch as pl
    from test_loops import ConvClassifier
    from lightning_memest import MemEstimate, MemoryBudgetError

    warnings.filterwarnings("ignore")
    LOOP = {loop!r}

    def fit(train_batch, eval_batch, budget):
        pl.seed_everything(0, verbose=False)
        module = ConvClassifier(train_batch, eval_batch)
        memest = MemEstimate(max_depth=0, memory_check="off" if budget is None else "raise",
                             memory_budget=budget)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=2, callbacks=[memest], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=1 if LOOP == "sanity_check" else 0,
            limit_val_batches=1 if LOOP == "sanity_check" else 0,
        )
        error = None
        try:
            trainer.fit(module)
        except MemoryBudgetError as e:
            error = e
        estimate = memest.estimate if LOOP == "train" else memest.loop_estimates.get(LOOP)
        result = {{
            "max_batch_size": None if error is None else error.max_batch_size,
            "message": None if error is None else str(error),
            "peak": None if estimate is None else estimate.peak_bytes,
            "other": None if estimate is None else estimate.first_step.breakdown.other_tensors,
            "measured": [m.peak_bytes for m in memest.measured],
        }}
        del module, memest, trainer, estimate, error
        gc.collect()
        return result

    base = fit(8, 32, None)
    sizes = (8, 32)
    out = {{"base": base, "cases": []}}
    for fraction in {fractions!r}:
        # Just under the peak, and far under it: what the parameters, optimizer and dataset take, plus
        # a fraction of the rest.
        fixed = base["other"] + 600_000
        budget = base["peak"] - 1 if fraction is None else int(fixed + (base["peak"] - fixed) * fraction)
        stopped = fit(*sizes, budget)
        n = stopped["max_batch_size"]
        at = fit(n, 32, budget) if LOOP == "train" else fit(8, n, budget)
        above = fit(n + 1, 32, budget) if LOOP == "train" else fit(8, n + 1, budget)
        out["cases"].append({{"budget": budget, "stopped": stopped, "at": at, "above": above}})
    print("RESULT " + json.dumps(out))
    """
)


def _run(loop: str, fractions: list[float | None], tmp_path: Path) -> dict[str, Any]:
    script = _SCRIPT.format(tests=str(TESTS), cache=str(tmp_path / "cache"), loop=loop, fractions=fractions)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("loop", "fractions"),
    [("train", [None, 0.3]), ("sanity_check", [None])],
    ids=["training", "sanity-check"],
)
def test_the_largest_batch_named_fits_and_the_next_does_not(
    loop: str, fractions: list[float | None], tmp_path: Path
) -> None:
    out = _run(loop, fractions, tmp_path)
    base = out["base"]
    assert base["other"] > 1_500_000  # the dataset held in memory counts (128 x 3 x 32 x 32 floats)
    for case in out["cases"]:
        budget, stopped, at, above = case["budget"], case["stopped"], case["at"], case["above"]
        n = stopped["max_batch_size"]
        assert n is not None and n > 0, stopped["message"]
        assert f"the largest batch size that fits is {n}" in stopped["message"]
        # The estimate at the answer fits, the one above it does not: the fit at n ran, n + 1 stopped.
        assert at["message"] is None and at["peak"] <= budget, (budget, at)
        assert above["message"] is not None and above["peak"] > budget, (budget, above)
        # The three fits counted the same other tensors (the dataset; a fit that ran to its end, as the
        # first did, leaves a few bytes of its own behind): the comparison is like with like.
        assert stopped["other"] == at["other"] == above["other"]
        if loop == "train":
            # And the real steps at n: their measured peaks are within the budget too.
            assert at["measured"] and max(at["measured"]) <= budget, (budget, at)


_OPTIONS = textwrap.dedent(
    """
    import gc, json, os, sys, warnings
    sys.path.insert(0, {tests!r})
    os.environ["MEMEST_CACHE_DIR"] = {cache!r}
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader
    from models import TinyGPT, lm_batch, lm_loss
    from lightning_memest import MemEstimate, MemoryBudgetError
    from lightning_memest.plan.checkpointing import apply_checkpointing

    warnings.filterwarnings("ignore")

    class LM(pl.LightningModule):
        def __init__(self, batch_size=8):
            super().__init__()
            self.model = TinyGPT(n_layers=6, d_model=64, n_heads=4, vocab=256, seq_len=32)
            self.data = list(zip(*lm_batch(64, 32, vocab=256)))
            self.batch_size = batch_size

        def training_step(self, batch, batch_idx):
            return lm_loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=self.batch_size)

    def fit(budget=None, checkpoints=None, precision="32-true", batch_size=8, auto=False):
        pl.seed_everything(0, verbose=False)
        module = LM(batch_size)
        if checkpoints:
            apply_checkpointing(module, checkpoints)
        memest = MemEstimate(max_depth=0, memory_budget=budget, checkpointing="auto" if auto else "off",
                             memory_check="off" if budget is None else ("warn" if auto else "raise"))
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, callbacks=[memest], logger=False,
                             precision=precision, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        error = None
        try:
            trainer.fit(module)
        except MemoryBudgetError as e:
            error = e
        out = {{
            "error": None if error is None else str(error),
            "options": [] if error is None else [
                {{"kind": o.kind, "peak": o.peak_bytes, "batch_size": o.batch_size,
                  "modules": None if o.plan is None else o.plan.modules}} for o in error.options],
            "peak": memest.estimate.peak_bytes if memest.estimate is not None else None,
            "measured": [m.peak_bytes for m in memest.measured],
            "errors_pct": [m.error_pct for m in memest.measured],
            "plan": None if memest.plan is None else memest.plan.modules,
            # (bytes, not tensors: a tensor kept here would be one of the next fit's other tensors)
            "weights": [p.detach().numpy().tobytes() for p in module.parameters()],
        }}
        del module, memest, trainer, error
        gc.collect()
        return out

    plain = fit()
    budget = plain["peak"] - plain["peak"] // 6
    stopped = fit(budget)
    shown = lambda out: {{k: v for k, v in out.items() if k != "weights"}}
    results = {{"budget": budget, "stopped": shown(stopped), "tried": []}}
    for option in stopped["options"]:
        if option["kind"] == "checkpointing":
            tried = fit(budget, checkpoints=option["modules"])
        elif option["kind"] == "batch size":
            tried = fit(budget, batch_size=option["batch_size"])
        else:
            tried = fit(budget, precision=option["kind"].split()[-1])
        results["tried"].append({{"option": option, **shown(tried)}})
    auto = fit(budget, auto=True)
    by_hand = fit(budget, checkpoints=auto["plan"])
    results["auto"] = shown(auto)
    results["same_weights_by_hand"] = auto["weights"] == by_hand["weights"]
    results["same_weights_unplanned"] = auto["weights"] == plain["weights"]
    print("RESULT " + json.dumps(results))
    """
)


def test_every_option_the_budget_error_offers_fits(tmp_path: Path) -> None:
    """Over the budget, the error lists what would fit -- a checkpointing plan, a smaller batch --, each
    estimated: a fit that takes each option runs (its estimate within the budget, no error) and its
    measured peak is within the budget. ``checkpointing="auto"`` applies the cheapest plan: the measured
    steps agree with the plan's estimate, and the weights equal those of the plan applied by hand and of
    no checkpointing at all, bit for bit."""
    script = _OPTIONS.format(tests=str(TESTS), cache=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    budget, stopped = out["budget"], out["stopped"]
    assert (
        stopped["error"] is not None and "what would fit, each estimated, cheapest first" in stopped["error"]
    )
    kinds = [o["kind"] for o in stopped["options"]]
    assert "checkpointing" in kinds and "batch size" in kinds, kinds
    for tried in out["tried"]:
        assert tried["option"]["peak"] <= budget
        assert tried["error"] is None and tried["peak"] <= budget, tried
        assert tried["measured"] and max(tried["measured"]) <= budget, tried
    auto = out["auto"]
    assert auto["plan"], auto
    assert auto["peak"] <= budget and max(auto["measured"]) <= budget
    assert all(abs(e) <= 1.0 for e in auto["errors_pct"]), auto
    assert out["same_weights_by_hand"] and out["same_weights_unplanned"]
