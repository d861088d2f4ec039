"""Estimate vs measurement over every torchvision classification and video model, on CPU.

Each model runs in its own process, one at a time: batch 2, Adam, 32-true, 3x224x224 images
(inception_v3 3x299x299; video models 3x8x112x112 clips, or the smallest their weights accept: s3d
3x14x224x224), built with ``weights=None``, estimated and
then measured in real steps (peaks from the CPU allocator's events), as ``memest compare`` does. With
``--calibrate`` the same measurement also checks an estimate with the kernels calibrated on this machine
(from an empty calibration cache: each model pays for its own calibration, as on a new machine), beside
the one with the hand-written kernel models. Models above ``--max-params`` are skipped. Prints a markdown
table, the models outside 1 % (hand models) and outside 0.1 % (calibrated) with the op at each
estimate's peak, the ops calibration could not measure, and the calibration's cost against a real
step (measured under the profiler, so a little slow); about 50 minutes on 2 cores (70 with
``--calibrate``).

    python benchmarks/torchvision_sweep.py [--max-params 150e6] [--only resnet18,r3d_18] [--calibrate]
                                           [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torchvision

from lightning_memest.accounting.kernels.cpu import isa as cpu_isa
from lightning_memest.machine import cpu_model

#: Targets: the hand models within 1 %, calibrated kernels within 0.1 %.
HAND_TARGET, CALIBRATED_TARGET = 1.0, 0.1
#: The environment that caps the CPU's kernels (to run as a CPU of another kind would).
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MEMEST_CPU_ISA")


def models(max_params: float, only: set[str] | None) -> list[tuple[str, str]]:
    """(spec, input shape) of every model to run, smallest first."""
    found = []
    for module, shape in ((torchvision.models, "3,224,224"), (torchvision.models.video, "3,8,112,112")):
        for name in torchvision.models.list_models(module=module):
            if only is not None and name not in only:
                continue
            params = _parameters(name)
            if params <= max_params:
                size = "3,299,299" if name == "inception_v3" else _at_least_minimum(name, shape)
                found.append((params, f"{module.__name__}:{name}", size))
    return [(spec, size) for _, spec, size in sorted(found)]


def _at_least_minimum(name: str, shape: str) -> str:
    """``shape``, grown to the smallest input the model's published weights accept (s3d: 14 frames of
    224x224; with a smaller clip its last pooling has nothing to pool)."""
    weights = next(iter(torchvision.models.get_model_weights(name)), None)
    meta = weights.meta if weights is not None else {}
    dims = [int(d) for d in shape.split(",")]
    height = max(dims[-1], *meta.get("min_size", (0, 0)))
    dims[-2:] = [height, height]
    if len(dims) == 4:
        dims[1] = max(dims[1], meta.get("min_temporal_size") or 0)
    return ",".join(str(d) for d in dims)


def _parameters(name: str) -> int:
    try:  # on the meta device: no memory, no init time
        with torch.device("meta"):
            model = torchvision.models.get_model(name, weights=None)
    except NotImplementedError:  # builders that read a tensor's values (regnet's block widths)
        model = torchvision.models.get_model(name, weights=None)
    return sum(p.numel() for p in model.parameters())


def _errors(est: Any, measured: tuple[int, ...]) -> dict[str, float]:
    keys = ("first_step", "steady_state")
    return {k: 100.0 * (p.bytes - m) / m for k, p, m in zip(keys, est.peaks, measured, strict=True)}


def _peak(est: Any) -> str:
    p = max(est.peaks, key=lambda p: p.bytes)
    return f"{p.op} ({p.phase.value}, {p.module or 'top'}, step {p.step})"


def one(spec: str, shape: str, calibrate: bool) -> dict[str, Any]:
    """One model, in this process: the estimates, then the measurement (a fresh, identically seeded
    model for each run: measuring trains the model in place)."""
    from lightning_memest.cases import InputSpec, build_case, estimate_case, measure_case, parse_shape

    def build() -> Any:
        return build_case(spec, InputSpec(2, shape=parse_shape(shape)), optimizer="adam")

    hand = estimate_case(build())
    calibrated = estimate_case(build(), calibrate=True) if calibrate else None
    m = measure_case(build())
    measured = (m.first_step, m.steady_state)
    row: dict[str, Any] = {
        "model": spec,
        "error_percent": _errors(hand, measured),
        "estimate_seconds": hand.estimate_seconds,
        "step_seconds": m.step_seconds,
        "peak": _peak(hand),
    }
    if calibrated is not None and calibrated.calibration is not None:
        c = calibrated.calibration
        uncovered = [s.op for s in calibrated.kernel_sources or () if s.uncovered]
        row.update(
            calibrated_error_percent=_errors(calibrated, measured),
            calibrated_peak=_peak(calibrated),
            calibration_seconds=c.seconds,
            signatures=c.measured,
            not_measured=list(c.failed),  # ops calibration could not run (not "failed": the run's error)
            uncovered=uncovered,
        )
    return row


def run(spec: str, shape: str, calibrate: bool, timeout: float, cache: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", spec, "--shape", shape]
    command += ["--calibrate"] if calibrate else []
    env = {**os.environ, "MEMEST_CACHE_DIR": cache}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model": spec, "failed": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        return {"model": spec, "failed": lines[-1][:200]}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    row["wall_seconds"] = time.perf_counter() - start
    return row


def _worst(errors: dict[str, float]) -> float:
    return max(abs(v) for v in errors.values())


def report(rows: list[dict[str, Any]], calibrate: bool) -> None:
    # The kernels the models were run with: the CPU, what torch dispatches to (ATEN_CPU_CAPABILITY caps
    # it) and the instruction set the kernel models key (ONEDNN_MAX_CPU_ISA caps oneDNN).
    print(
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, CPU: {cpu_model() or 'unknown'}, "
        f"{torch.get_num_threads()} threads, torch capability {torch.backends.cpu.get_cpu_capability()}, "
        f"kernel models' ISA {cpu_isa()}"
        + "".join(f", {k}={os.environ[k]}" for k in CAPS if k in os.environ)
        + "\n"
    )
    if calibrate:
        columns = ["error step 1", "error steady", "calibrated step 1", "calibrated steady"]
        print("| model | " + " | ".join(columns) + " | calibration s | profiled step s |")
        print("|---|---|---|---|---|---|---|")
    else:
        print("| model | error step 1 | error steady | estimate s |\n|---|---|---|---|")
    for r in rows:
        name = r["model"].split(":")[1]
        if "failed" in r:
            print(f"| {name} | failed: {r['failed']} |" + " |" * (5 if calibrate else 2))
            continue
        e = r["error_percent"]
        cells = [f"{e['first_step']:+.2f} %", f"{e['steady_state']:+.2f} %"]
        if calibrate and "calibrated_error_percent" in r:
            c = r["calibrated_error_percent"]
            cells += [f"{c['first_step']:+.3f} %", f"{c['steady_state']:+.3f} %"]
            cells += [f"{r['calibration_seconds']:.1f}", f"{r['step_seconds']:.1f}"]
        else:
            cells += [f"{r['estimate_seconds']:.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ok = [r for r in rows if "failed" not in r]
    outside = [r for r in ok if _worst(r["error_percent"]) > HAND_TARGET]
    print(f"\n{len(ok)} of {len(rows)} ran; hand models: {len(ok) - len(outside)} within {HAND_TARGET:g} %")
    for r in outside:
        print(f"  {r['model']}: {_rounded(r['error_percent'])}, peak at {r['peak']}")
    if not calibrate:
        return
    checked = [r for r in ok if "calibrated_error_percent" in r]
    off = [r for r in checked if _worst(r["calibrated_error_percent"]) > CALIBRATED_TARGET]
    worst = max((_worst(r["calibrated_error_percent"]) for r in checked), default=0.0)
    within = len(checked) - len(off)
    print(f"calibrated: {within} of {len(checked)} within {CALIBRATED_TARGET:g} % (worst {worst:.3f} %)")
    for r in off:
        print(
            f"  {r['model']}: {_rounded(r['calibrated_error_percent'])}, peak at {r['calibrated_peak']}; "
            f"not measured: {r['not_measured'] or 'none'}; uncovered: {r['uncovered'] or 'none'}"
        )
    ratios = [r["calibration_seconds"] / r["step_seconds"] for r in checked if r["step_seconds"]]
    if ratios:
        print(
            f"calibration / one profiled real step: median {statistics.median(ratios):.2f}, "
            f"max {max(ratios):.2f} (signatures measured: {sum(r['signatures'] for r in checked)})"
        )


def _rounded(errors: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in errors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-params", type=float, default=150e6)
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--calibrate", action="store_true", help="also estimate with calibrated kernels")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child's model
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.shape, args.calibrate)))
        return
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for spec, shape in models(args.max_params, only):
        print(f"... {spec}", file=sys.stderr, flush=True)
        # Each model calibrates from nothing, as on a new machine.
        with tempfile.TemporaryDirectory(prefix="memest-sweep-") as cache:
            rows.append(run(spec, shape, args.calibrate, args.timeout, cache))
        print(f"    {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    report(rows, args.calibrate)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
