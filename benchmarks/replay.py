"""Speed of block replay (``estimate_step(replay_blocks=True)``) against the full simulation and the
meta floor, on decoders built on the meta device, and whether the figures agree to the byte.

For each case: the simulation's seconds with replay and without (``StepEstimate.estimate_seconds``,
median of ``--repeats``), the meta floor (two plain steps of the same model on meta tensors, no fake
mode: ``benchmarks/benchmark.py``'s), their ratios, the blocks replayed per step, and whether every
figure of the two estimates is equal. Then the cost per layer: the slope of the seconds over the
depths given, with and without replay.

    python benchmarks/replay.py                    # a 32-layer 7B decoder, and the per-layer slope
    python benchmarks/replay.py --quick            # a small decoder at depths 8 and 32
    python benchmarks/replay.py --layers 32 80 --d-model 8192 --seq 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_memest import estimate_step  # noqa: E402
from lightning_memest.engine.step import StepConfig, StepRunner  # noqa: E402
from tests.models import TinyGPT, lm_loss  # noqa: E402


def build(layers: int, d_model: int, seq: int, vocab: int) -> tuple[torch.nn.Module, Any]:
    with torch.device("meta"):
        model = TinyGPT(
            n_layers=layers, d_model=d_model, n_heads=max(1, d_model // 128), vocab=vocab, seq_len=seq
        )
    tokens = torch.randint(0, vocab, (1, seq), device="meta")
    return model, (tokens, tokens)


def floor_seconds(model: torch.nn.Module, batch: Any) -> float:
    runner = StepRunner(model, StepConfig(lm_loss, torch.optim.AdamW))
    runner.device_type = "cpu"
    start = time.perf_counter()
    for _ in range(2):
        runner.run(batch)
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - start


def run_case(layers: int, d_model: int, seq: int, vocab: int, repeats: int) -> dict[str, Any]:
    model, batch = build(layers, d_model, seq, vocab)

    def est(replay: bool) -> Any:
        return estimate_step(model, batch, loss_fn=lm_loss, optimizer=torch.optim.AdamW, replay_blocks=replay)

    replayed = [est(True) for _ in range(repeats)]
    full = [est(False) for _ in range(repeats)]
    floors = [floor_seconds(*build(layers, d_model, seq, vocab)) for _ in range(repeats)]
    a = dataclasses.replace(replayed[0], estimate_seconds=0.0, replayed_blocks=None)
    b = dataclasses.replace(full[0], estimate_seconds=0.0)
    r, f, fl = (
        statistics.median(x)
        for x in ([e.estimate_seconds for e in replayed], [e.estimate_seconds for e in full], floors)
    )
    return {
        "layers": layers,
        "d_model": d_model,
        "seq": seq,
        "params": sum(p.numel() for p in model.parameters()),
        "replay_s": r,
        "full_s": f,
        "floor_s": fl,
        "replay_vs_floor": r / fl,
        "full_vs_floor": f / fl,
        "replay_vs_full": r / f,
        "replayed_blocks": replayed[0].replayed_blocks,
        "identical": a == b,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small decoder (d_model 512) at depths 8 and 32"
    )
    parser.add_argument("--layers", type=int, nargs="+", help="depths to measure (default: 8 32)")
    parser.add_argument("--d-model", type=int, default=4096, help="hidden size (default 4096: a 7B shape)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length of the batch of one")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, the median kept")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    layers = args.layers or [8, 32]
    d_model, seq = (512, 512) if args.quick else (args.d_model, args.seq)
    estimate_step(torch.nn.Linear(4, 4), torch.randn(2, 4), replay_blocks=True)  # imports, first dispatches
    rows = [run_case(n, d_model, seq, args.vocab, args.repeats) for n in layers]
    slope: dict[str, float] = {}
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        depth = hi["layers"] - lo["layers"]
        for key in ("replay_s", "full_s", "floor_s"):
            slope[key] = (hi[key] - lo[key]) / depth
    if args.json:
        print(json.dumps({"cases": rows, "per_layer_s": slope}, default=str))
        return
    print(
        "| layers | params | replay s | full s | floor s | replay/floor | full/floor | replay/full "
        "| replayed | equal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['params'] / 1e9:.2f} B | {r['replay_s']:.2f} | {r['full_s']:.2f} | "
            f"{r['floor_s']:.2f} | {r['replay_vs_floor']:.2f} | {r['full_vs_floor']:.2f} | "
            f"{r['replay_vs_full']:.2f} | {r['replayed_blocks']} | {r['identical']} |"
        )
    if slope:
        print(
            f"\nper layer: replay {slope['replay_s'] * 1e3:.1f} ms, full {slope['full_s'] * 1e3:.1f} ms, "
            f"floor {slope['floor_s'] * 1e3:.1f} ms (replayed layer / full layer: "
            f"{slope['replay_s'] / slope['full_s']:.2f})"
        )


if __name__ == "__main__":
    main()
