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
