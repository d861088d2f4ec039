"""Checkpointing plans (issue 24): what they cost to make, and whether the real step keeps to them.

Run: ``python benchmarks/plan.py [--quick] [--json]``.

1. The project's planner cases (``tests/plan_cases.py``: a 12-block decoder, resnet18, a UNet, a
   transformers Llama), each at budgets a fifth, half and four fifths of the way from its floor (every
   candidate checkpointed in full) to its peak without checkpointing: the plan, its re-simulated peak,
   the real step's peak with the plan applied (two steps, the CPU allocator's events), the recompute
   FLOPs it costs, the simulations and seconds it took.
2. A 32-block, 6.7 B-parameter decoder (d_model 4096, batch 4 of 2,048 tokens, bf16-mixed, AdamW) built on
   the meta device: one estimate's time, then plans for 95 %, 85 % and 75 % of its peak, each against the
   estimate's time, and the solver's own time. Skipped with ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from lightning_memest import estimate_step, plan_checkpointing  # noqa: E402
from lightning_memest.engine.step import StepConfig  # noqa: E402
from lightning_memest.measure import measure_step  # noqa: E402
from lightning_memest.report import format_bytes  # noqa: E402


def cases(names: list[str] | None) -> list[dict[str, Any]]:
    from plan_cases import CASES

    rows = []
    for name, (make, batch_of, loss) in CASES.items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        model, batch = make(), batch_of()
        settings: dict[str, Any] = {"loss_fn": loss, "optimizer": torch.optim.AdamW, "calibrate": True}
        top = plan_checkpointing(model, batch, 2**50, **settings).peak_bytes
        floor = plan_checkpointing(model, batch, 1, **settings).floor_bytes or top
        for share in (0.2, 0.5, 0.8):
            budget = int(floor + (top - floor) * share)
            began = time.perf_counter()
            plan = plan_checkpointing(model, batch, budget, **settings)
            seconds = time.perf_counter() - began
            real = make()
            real.load_state_dict(model.state_dict())
            plan.apply(real)
            config = StepConfig(loss_fn=loss, optimizer=torch.optim.AdamW)
            measured = max(measure_step(real, batch, config).peak_bytes)
            kinds = list(plan.modules.values())
            rows.append(
                {
                    "case": name,
                    "budget": budget,
                    "peak_before": top,
                    "plan_peak": plan.peak_bytes,
                    "measured": measured,
                    "error_pct": 100 * (plan.peak_bytes - measured) / measured,
                    "modules": f"{kinds.count('full')} full, {kinds.count('selective')} selective "
                    f"of {len(plan.candidates)}",
                    "recompute_pct": 100 * plan.recompute_share,
                    "simulations": plan.simulations,
                    "seconds": seconds,
                }
            )
    return rows


def seven_b() -> dict[str, Any]:
    from models import TinyGPT, lm_loss

    with torch.device("meta"):
        model = TinyGPT(n_layers=32, d_model=4096, n_heads=32, vocab=32000, seq_len=2048)
    tokens = torch.randint(0, 32000, (4, 2048), device="meta")
    settings: dict[str, Any] = {"loss_fn": lm_loss, "optimizer": torch.optim.AdamW, "precision": "bf16-mixed"}
    began = time.perf_counter()
    estimate = estimate_step(model, (tokens, tokens), **settings)
    one = time.perf_counter() - began
    plans = []
    for share in (0.95, 0.85, 0.75):
        began = time.perf_counter()
        plan = plan_checkpointing(model, (tokens, tokens), int(estimate.peak_bytes * share), **settings)
        seconds = time.perf_counter() - began
        plans.append(
            {
                "budget_share": share,
                "plan": plan.describe(),
                "seconds": seconds,
                "of_one_estimate": seconds / one,
                "solver_seconds": plan.solver_seconds,
                "simulations": plan.simulations,
            }
        )
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "estimate_seconds": one, "peak": estimate.peak_bytes, "plans": plans}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the planner cases only, no 7B run")
    parser.add_argument("--case", action="append", help="only this planner case (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON value instead of tables")
    args = parser.parse_args()
    rows = cases(args.case)
    big = None if args.quick else seven_b()
    if args.json:
        print(json.dumps({"cases": rows, "seven_b": big}))
        return
    head = "| case | budget | peak without | plan's peak | measured | error | checkpointed | recompute |"
    print(head + " sims | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {format_bytes(r['budget'])} | {format_bytes(r['peak_before'])} | "
            f"{format_bytes(r['plan_peak'])} | {format_bytes(r['measured'])} | {r['error_pct']:+.3f} % | "
            f"{r['modules']} | +{r['recompute_pct']:.1f} % | {r['simulations']} | {r['seconds']:.1f} |"
        )
    if big is not None:
        print(
            f"\n{big['params'] / 1e9:.2f} B-parameter decoder on the meta device: one estimate "
            f"{big['estimate_seconds']:.2f} s, peak {format_bytes(big['peak'])}"
        )
        print("| budget | plan | s | x one estimate | solver ms | simulations |")
        print("|---|---|---|---|---|---|")
        for p in big["plans"]:
            print(
                f"| {100 * p['budget_share']:.0f} % of the peak | {p['plan']} | {p['seconds']:.2f} | "
                f"{p['of_one_estimate']:.2f}x | {1000 * p['solver_seconds']:.1f} | {p['simulations']} |"
            )


if __name__ == "__main__":
    main()
