"""Speed, accuracy and memory of the estimator, on CPU. Prints markdown tables for the README.

For each case:
  * estimate s -- ``StepEstimate.estimate_seconds`` (median of ``--repeats`` runs; the simulation
    alone, after one warm-up estimate of another model has paid for imports and first dispatches);
  * floor s    -- the same two steps (``StepRunner``, same loss/optimizer/precision) on plain
    meta-device tensors with no tracking at all (median of ``--repeats``): the speed floor, since any
    estimator has to at least run every op's shape function;
  * ratio      -- estimate / floor;
  * error      -- estimate vs ``measure`` (real steps; peaks from the profiler's allocator events) for
    the first step and the steady state, with the hand-fitted kernel models;
  * calibrated -- the same with the kernels calibrated on this machine (``estimate_case(calibrate=True)``,
    a fresh cache), and the seconds the calibration took the first time (the second estimate reads
    the cache: its calibration seconds are printed too).
Then what calibration costs against one real step, in the same process (resnet50 at batch 8 with
SGD and with Adam: calibration from nothing, interleaved with real steps, median of 3 each; and a
second estimate from the cache). Then the memory of estimating a 7-billion-parameter transformer built
on the meta device: the process's peak resident-memory growth during the estimate (in a fresh
subprocess).

    python benchmarks/benchmark.py            # everything (about 10 minutes on 2 cores)
    python benchmarks/benchmark.py --quick    # three models, no 7B run

Last, the cost of counting FLOPs in the same run: a simulation that captures only what the kernel
models need, against one that also captures for the FLOP formulas and counts them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_memest.cases import Case, build_case, estimate_case, measure_case  # noqa: E402
from lightning_memest.engine.step import StepRunner, true_dtype  # noqa: E402
from tests.test_estimate import CASES as ACCURACY_CASES  # noqa: E402
from tests.test_estimate import case_input as _input  # noqa: E402

# The visible set of the accuracy test, and efficientnet_v2_s (MemTracker's slowest case in NOTES.md).
CASES = [*ACCURACY_CASES, ("torchvision.models:efficientnet_v2_s", 4, "adam", "32-true")]
QUICK = [CASES[0], CASES[7], CASES[8]]


def meta_floor_seconds(case: Case) -> float:
    """Two plain steps on meta tensors: no fake mode, no tracking."""
    model = copy.deepcopy(case.model).to("meta")
    dtype = true_dtype(case.config.precision)
    if dtype is not None:
        model = model.to(dtype)

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        t = t.to("meta")
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    batch = tree_map_only(torch.Tensor, to_meta, case.batch)
    start = time.perf_counter()
    runner = StepRunner(model, case.config)
    runner.device_type = "cpu"  # autocast has no meta device; the CPU one leaves meta tensors alone
    for _ in range(2):
        runner.run(batch)
    return time.perf_counter() - start


def real_step_seconds(case: Case) -> float:
    """Seconds of one real training step (the mean of steps 2 and 3, without any profiler)."""
    model = copy.deepcopy(case.model)
    dtype = true_dtype(case.config.precision)
    if dtype is not None:
        model = model.to(dtype)
    batch = tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t, case.batch
    )
    runner = StepRunner(model, case.config)
    runner.run(batch)
    start = time.perf_counter()
    for _ in range(2):
        runner.run(batch)
    return (time.perf_counter() - start) / 2


def run_case(spec: str, batch_size: int, optimizer: str, precision: str, repeats: int) -> dict[str, Any]:
    case = build_case(spec, _input(spec, batch_size), optimizer=optimizer, precision=precision)
    estimates = [estimate_case(case) for _ in range(repeats)]
    floors = [meta_floor_seconds(case) for _ in range(repeats)]
    calibrated = estimate_case(case, calibrate=True)
    cached = estimate_case(case, calibrate=True)
    measured = measure_case(case)
    est = estimates[0]

    def error(e: Any) -> list[float]:
        return [100.0 * (p.bytes - t) / t for p, t in zip(e.peaks, measured.peak_bytes, strict=True)]

    errors = error(est)
    seconds = statistics.median(e.estimate_seconds for e in estimates)
    floor = statistics.median(floors)
    return {
        "model": spec.split(":")[1],
        "batch": batch_size,
        "optimizer": optimizer,
        "precision": precision,
        "estimate_s": seconds,
        "floor_s": floor,
        "ratio": seconds / floor,
        "estimated": [p.bytes for p in est.peaks],
        "measured": list(measured.peak_bytes),
        "error_pct": errors,
        "calibrated_error_pct": error(calibrated),
        "calibration_s": calibrated.calibration.seconds if calibrated.calibration else None,
        "cached_calibration_s": cached.calibration.seconds if cached.calibration else None,
        "signatures": calibrated.calibration.measured if calibrated.calibration else None,
        "step_s": real_step_seconds(case),
    }


def calibration_cost(spec: str, batch_size: int, optimizer: str, repeats: int) -> dict[str, Any]:
    """Seconds of calibrating a case from nothing (no cache) and of one real step, interleaved (the
    machine is noisy), and of the calibration of a second estimate from the cache."""
    from lightning_memest.accounting import capture_filter
    from lightning_memest.accounting.kernels.calibrate import calibrate
    from lightning_memest.engine.simulate import simulate

    case = build_case(spec, _input(spec, batch_size), optimizer=optimizer)
    capture = capture_filter(flops=False, calibrate=True)
    sim = simulate(case.model, case.estimate_batch, case.config, capture=capture)
    cold: list[float] = []
    steps: list[float] = []
    signatures = 0
    for _ in range(repeats):
        calibration = calibrate(sim, cache_dir=None)
        cold.append(calibration.seconds)
        signatures = calibration.measured
        steps.append(real_step_seconds(case))
    estimate_case(case, calibrate=True)  # fills the benchmark's cache
    cached = estimate_case(case, calibrate=True).calibration
    return {
        "model": spec.split(":")[1],
        "batch": batch_size,
        "optimizer": optimizer,
        "signatures": signatures,
        "calibration_s": statistics.median(cold),
        "cached_s": cached.seconds if cached is not None else None,
        "step_s": statistics.median(steps),
        "ratios": [c / t for c, t in zip(cold, steps, strict=True)],
    }


def flop_overhead(case: Case, repeats: int) -> tuple[float, float]:
    """Seconds of a simulation capturing only what the kernel models need, and of one that also
    captures for FLOPs and counts them (min of ``repeats``, interleaved: the machine is noisy)."""
    from lightning_memest.accounting import capture_filter, flops
    from lightning_memest.engine.simulate import simulate

    kernels_only, with_flops = capture_filter(flops=False), capture_filter(flops=True)
    plain: list[float] = []
    counted: list[float] = []
    for _ in range(repeats):
        plain.append(simulate(case.model, case.batch, case.config, capture=kernels_only).seconds)
        start = time.perf_counter()
        sim = simulate(case.model, case.batch, case.config, capture=with_flops)
        flops.count_flops(sim.events)
        counted.append(time.perf_counter() - start)
    return min(plain), min(counted)


_SEVEN_B = r"""
import json, os, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from tests.models import TinyGPT, lm_loss
from lightning_memest import estimate_step
with torch.device("meta"):
    model = TinyGPT(n_layers=32, d_model=4096, n_heads=32, vocab=32000, seq_len=2048)
tokens = torch.randint(0, 32000, (1, 2048), device="meta")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
start = time.perf_counter()
est = estimate_step(
    model, (tokens, tokens), loss_fn=lm_loss, optimizer=torch.optim.AdamW, precision="bf16-mixed"
)
seconds = time.perf_counter() - start
# VmHWM: this process's own peak resident memory (ru_maxrss would carry the parent's over the fork).
with open("/proc/self/status") as f:
    peak_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "seconds": seconds,
                  "rss_growth": max(0, peak_rss - before), "peak_bytes": [p.bytes for p in est.peaks]}))
"""


def seven_b() -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _SEVEN_B, str(ROOT)], capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="three models and no 7B run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()

    # Calibration starts cold, as on a new machine, and leaves the user's cache alone.
    os.environ["MEMEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="memest-benchmark-")
    torch.manual_seed(0)
    warm = build_case("tests.models:TinyGPT", _input("tests.models:TinyGPT", 2), optimizer="adam")
    estimate_case(warm)  # imports and first dispatches, paid once by any process
    meta_floor_seconds(warm)

    rows = []
    for spec, batch_size, optimizer, precision in QUICK if args.quick else CASES:
        print(f"... {spec} b{batch_size} {optimizer} {precision}", file=sys.stderr, flush=True)
        rows.append(run_case(spec, batch_size, optimizer, precision, args.repeats))
        print(f"    {json.dumps(rows[-1])}", file=sys.stderr, flush=True)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU\n")
    columns = ["model", "batch", "optimizer", "precision", "estimate s", "meta floor s", "ratio"]
    print("| " + " | ".join([*columns, "error step 1", "error steady"]) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e1, e2 = r["error_pct"]
        print(
            f"| {r['model']} | {r['batch']} | {r['optimizer']} | {r['precision']} | {r['estimate_s']:.2f} "
            f"| {r['floor_s']:.2f} | {r['ratio']:.2f}x | {e1:+.3f} % | {e2:+.3f} % |"
        )
    ratios = [r["ratio"] for r in rows]
    worst = max(abs(e) for r in rows for e in r["error_pct"])
    print(f"\nmedian ratio to the meta floor: {statistics.median(ratios):.2f}x; worst |error|: {worst:.3f} %")
    print("\nCalibrated on this machine (a fresh cache):\n")
    print(
        "| model | batch | precision | error step 1 | error steady | signatures | calibration s | "
        "from the cache s | one real step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c1, c2 = r["calibrated_error_pct"]
        print(
            f"| {r['model']} | {r['batch']} | {r['precision']} | {c1:+.3f} % | {c2:+.3f} % "
            f"| {r['signatures']} | {r['calibration_s']:.2f} | {r['cached_calibration_s']:.2f} "
            f"| {r['step_s']:.2f} |"
        )
    worst_cal = max(abs(e) for r in rows for e in r["calibrated_error_pct"])
    print(f"\nworst calibrated |error|: {worst_cal:.3f} %")
    print("\nWhat calibration costs (from nothing; interleaved with real steps, median of 3):\n")
    print("| model | batch | optimizer | signatures | calibration s | one real step s | ratio | cached s |")
    print("|---|---|---|---|---|---|---|---|")
    for optimizer in ("sgd", "adam"):
        c = calibration_cost("torchvision.models:resnet50", 8, optimizer, 3)
        print(
            f"| {c['model']} | {c['batch']} | {c['optimizer']} | {c['signatures']} "
            f"| {c['calibration_s']:.2f} | {c['step_s']:.2f} | {statistics.median(c['ratios']):.2f} "
            f"(each: {', '.join(f'{x:.2f}' for x in c['ratios'])}) | {c['cached_s']:.3f} |",
            flush=True,
        )
    print("\n| model | simulation s | with FLOPs s | FLOP overhead |")
    print("|---|---|---|---|")
    for spec, batch_size, optimizer, precision in (CASES[0], CASES[3], CASES[7]):
        case = build_case(spec, _input(spec, batch_size), optimizer=optimizer, precision=precision)
        plain, counted = flop_overhead(case, max(args.repeats, 5))
        print(
            f"| {spec.split(':')[1]} | {plain:.2f} | {counted:.2f} | {100 * (counted / plain - 1):+.1f} % |"
        )
    if not args.quick:
        big = seven_b()
        print(
            f"\n7B transformer on the meta device ({big['params'] / 1e9:.2f} B parameters, AdamW, "
            f"bf16-mixed, 1 x 2048 tokens): estimated in {big['seconds']:.1f} s, "
            f"peak {gib(max(big['peak_bytes']))}, "
            f"process resident-memory growth {gib(big['rss_growth'])}"
        )
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
