"""Speed of block replay (``estimate_step(replay_blocks=True)``) against the full simulation and the
meta floor, on decoders built on the meta device, and whether the figures agree to the byte.

For each case: the simulation's seconds with replay and without (``StepEstimate.estimate_seconds``,
median of ``--repeats``), the meta floor (two plain steps of the same model on meta tensors, no fake
mode: ``benchmarks/benchmark.py``'s), their ratios, the blocks replayed per step, and whether every
figure of the two estimates is equal. Then the cost per layer, with and without replay: the slope of
the seconds between the shallowest and the deepest depth given, measured ``--slope-reps`` times, each
time the four runs back to back (replay at both depths, or at ``--replay-depth`` for the deeper one, then
the full simulation at both), and the median of the per-repetition ratios reported with its quartiles:
on a shared machine whose speed drifts, a ratio of runs taken together is the stable figure, a ratio
of medians taken minutes apart is not. Each timed run starts from a full collection (``gc.collect()``),
so that no run pays for the garbage of the one before: the simulations' events are tens of thousands of
objects, and where a full collection of the heap falls (some 0.3 s with torch loaded) otherwise depends
on the runs before; a run still pays for the collections its own objects cause.

    python benchmarks/replay.py                    # a 32-layer 7B decoder, and the per-layer slope
    python benchmarks/replay.py --quick            # a small decoder at depths 8 and 32
    python benchmarks/replay.py --slope-reps 15 --replay-depth 64   # the per-layer cost, 15 times
    python benchmarks/replay.py --layers 32 80 --d-model 8192 --seq 1024
    python benchmarks/replay.py --llama --heads 32 --kv-heads 32 --ffn 11008 --vocab 32000  # Llama-2-7B
    python benchmarks/replay.py --llama --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 --seq 512
    python benchmarks/replay.py --llama --layers 8 126 --d-model 16384 --heads 128 --kv-heads 8 \
        --ffn 53248 --vocab 128256 --seq 128 --no-full    # the 405B shape (transformers' Llama)

``--llama`` builds transformers' ``LlamaForCausalLM`` (grouped-query attention, SwiGLU) instead of the
small GPT of ``tests/models.py``; ``--no-full`` skips the full simulation (minutes on the deepest).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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


def build(
    layers: int, d_model: int, seq: int, vocab: int, llama: dict[str, int] | None = None
) -> tuple[torch.nn.Module, Any]:
    if llama is not None:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=d_model,
            intermediate_size=llama["ffn"],
            num_hidden_layers=layers,
            num_attention_heads=llama["heads"],
            num_key_value_heads=llama["kv_heads"],
            max_position_embeddings=max(seq, 128),
        )
        with torch.device("meta"):
            model: torch.nn.Module = transformers.LlamaForCausalLM(config)
        return model, torch.randint(0, vocab, (1, seq), device="meta")
    with torch.device("meta"):
        model = TinyGPT(
            n_layers=layers, d_model=d_model, n_heads=max(1, d_model // 128), vocab=vocab, seq_len=seq
        )
    tokens = torch.randint(0, vocab, (1, seq), device="meta")
    return model, (tokens, tokens)


def hf_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def floor_seconds(model: torch.nn.Module, batch: Any, loss: Any = lm_loss) -> float:
    runner = StepRunner(model, StepConfig(loss, torch.optim.AdamW))
    runner.device_type = "cpu"
    start = time.perf_counter()
    for _ in range(2):
        runner.run(batch)
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - start


def run_case(
    layers: int, d_model: int, seq: int, vocab: int, repeats: int, llama: dict[str, int] | None, full: bool
) -> dict[str, Any]:
    model, batch = build(layers, d_model, seq, vocab, llama)
    loss = hf_loss if llama is not None else lm_loss

    def est(replay: bool) -> Any:
        gc.collect()
        return estimate_step(model, batch, loss_fn=loss, optimizer=torch.optim.AdamW, replay_blocks=replay)

    def floor() -> float:
        fresh = build(layers, d_model, seq, vocab, llama)
        gc.collect()
        return floor_seconds(*fresh, loss)

    replayed = [est(True) for _ in range(repeats)]
    fulls = [est(False) for _ in range(repeats)] if full else []
    floors = [floor() for _ in range(repeats)]
    r = statistics.median(e.estimate_seconds for e in replayed)
    fl = statistics.median(floors)
    row: dict[str, Any] = {
        "layers": layers,
        "d_model": d_model,
        "seq": seq,
        "params": sum(p.numel() for p in model.parameters()),
        "replay_s": r,
        "floor_s": fl,
        "replay_vs_floor": r / fl,
        "replayed_blocks": replayed[0].replayed_blocks,
        "full_s": None,
        "full_vs_floor": None,
        "replay_vs_full": None,
        "identical": None,
    }
    if fulls:
        f = statistics.median(e.estimate_seconds for e in fulls)
        a = dataclasses.replace(replayed[0], estimate_seconds=0.0, replayed_blocks=None)
        b = dataclasses.replace(fulls[0], estimate_seconds=0.0)
        row.update(full_s=f, full_vs_floor=f / fl, replay_vs_full=r / f, identical=a == b)
    return row


def per_layer(
    lo: int,
    hi: int,
    replay_hi: int,
    d_model: int,
    seq: int,
    vocab: int,
    reps: int,
    llama: dict[str, int] | None,
) -> dict[str, Any]:
    """The seconds a replayed layer and a fully simulated layer add, measured ``reps`` times with the
    four runs of each repetition back to back; medians, and the per-repetition ratios' median and
    quartiles."""
    models = {n: build(n, d_model, seq, vocab, llama) for n in {lo, hi, replay_hi}}
    loss = hf_loss if llama is not None else lm_loss

    def seconds(n: int, replay: bool) -> float:
        gc.collect()
        model, batch = models[n]
        est = estimate_step(model, batch, loss_fn=loss, optimizer=torch.optim.AdamW, replay_blocks=replay)
        return float(est.estimate_seconds)

    replayed, full = [], []
    for _ in range(reps):
        r_lo, r_hi = seconds(lo, True), seconds(replay_hi, True)
        f_lo, f_hi = seconds(lo, False), seconds(hi, False)
        replayed.append((r_hi - r_lo) / (replay_hi - lo))
        full.append((f_hi - f_lo) / (hi - lo))
    ratios = sorted(r / f for r, f in zip(replayed, full, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "replay_s": statistics.median(replayed),
        "full_s": statistics.median(full),
        "ratio": statistics.median(ratios),
        "ratio_q1": quartiles[0],
        "ratio_q3": quartiles[2],
        "reps": reps,
        "depths": [lo, hi, replay_hi],
    }


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


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
    parser.add_argument("--llama", action="store_true", help="transformers' Llama (GQA, SwiGLU)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default d_model / 128)")
    parser.add_argument(
        "--kv-heads", type=int, default=None, help="key/value heads (--llama; default: heads)"
    )
    parser.add_argument("--ffn", type=int, default=None, help="MLP width (--llama; default 4 x d_model)")
    parser.add_argument("--no-full", action="store_true", help="skip the full simulation")
    parser.add_argument(
        "--slope-reps", type=int, default=5, help="repetitions of the per-layer cost (0: none; default 5)"
    )
    parser.add_argument(
        "--replay-depth",
        type=int,
        default=None,
        help="the deeper depth of the replayed slope (default: the deepest)",
    )
    args = parser.parse_args()
    layers = args.layers or [8, 32]
    d_model, seq = (512, 512) if args.quick else (args.d_model, args.seq)
    llama = None
    if args.llama:
        heads = args.heads or max(1, d_model // 128)
        llama = {"heads": heads, "kv_heads": args.kv_heads or heads, "ffn": args.ffn or 4 * d_model}
    estimate_step(torch.nn.Linear(4, 4), torch.randn(2, 4), replay_blocks=True)  # imports, first dispatches
    rows = [run_case(n, d_model, seq, args.vocab, args.repeats, llama, not args.no_full) for n in layers]
    slope: dict[str, Any] = {}
    if len(layers) >= 2 and args.slope_reps > 0:
        lo, hi = min(layers), max(layers)
        if args.no_full:  # no full simulation to compare with: the replayed slope over the table's runs
            depth = rows[-1]["layers"] - rows[0]["layers"]
            slope = {"replay_s": (rows[-1]["replay_s"] - rows[0]["replay_s"]) / depth}
        else:
            replay_hi = args.replay_depth or hi
            slope = per_layer(lo, hi, replay_hi, d_model, seq, args.vocab, args.slope_reps, llama)
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
            f"| {r['layers']} | {r['params'] / 1e9:.2f} B | {r['replay_s']:.2f} | {_num(r['full_s'])} | "
            f"{r['floor_s']:.2f} | {r['replay_vs_floor']:.2f} | {_num(r['full_vs_floor'])} | "
            f"{_num(r['replay_vs_full'])} | {r['replayed_blocks']} | {_num(r['identical'], '')} |"
        )
    if slope:
        full = slope.get("full_s")
        line = f"\nper layer: replay {slope['replay_s'] * 1e3:.1f} ms"
        if full is not None:
            line += (
                f", full {full * 1e3:.1f} ms (medians of {slope['reps']}); replayed layer / full layer: "
                f"{slope['ratio'] * 100:.1f} % (quartiles {slope['ratio_q1'] * 100:.1f}-"
                f"{slope['ratio_q3'] * 100:.1f} %, each repetition's four runs back to back)"
            )
        print(line)


if __name__ == "__main__":
    main()
