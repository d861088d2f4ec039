"""Estimate vs measurement over every torchvision classification and video model, on CPU.

Each model runs ``memest compare`` (the estimate against real steps, peaks from the CPU allocator's
events) in its own process, one at a time: batch 2, Adam, 32-true, 3x224x224 images (inception_v3
3x299x299; video models 3x8x112x112 clips), built with ``weights=None``. Models above ``--max-params``
are skipped. Prints a markdown table and the models outside 1 %; about 50 minutes on 2 cores.

    python benchmarks/torchvision_sweep.py [--max-params 150e6] [--only resnet18,r3d_18] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch
import torchvision


def models(max_params: float, only: set[str] | None) -> list[tuple[str, str]]:
    """(spec, input shape) of every model to run, smallest first."""
    found = []
    for module, shape in ((torchvision.models, "3,224,224"), (torchvision.models.video, "3,8,112,112")):
        for name in torchvision.models.list_models(module=module):
            if only is not None and name not in only:
                continue
            with torch.device("meta"):
                params = sum(p.numel() for p in torchvision.models.get_model(name, weights=None).parameters())
            if params <= max_params:
                size = "3,299,299" if name == "inception_v3" else shape
                found.append((params, f"{module.__name__}:{name}", size))
    return [(spec, size) for _, spec, size in sorted(found)]


def compare(spec: str, shape: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lightning_memest.cli", "compare", spec, "--batch-size", "2"]
    cmd += ["--input-shape", shape, "--optimizer", "adam", "--json"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": spec, "failed": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"model": spec, "failed": done.stderr.strip().splitlines()[-1][:200]}
    row: dict[str, Any] = json.loads(done.stdout)[0]
    row["wall_seconds"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-params", type=float, default=150e6)
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for spec, shape in models(args.max_params, only):
        print(f"... {spec}", file=sys.stderr, flush=True)
        rows.append(compare(spec, shape, args.timeout))
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, CPU\n")
    print("| model | error step 1 | error steady | estimate s |\n|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['model'].split(':')[1]} | failed: {r['failed']} | | |")
            continue
        e, name = r["error_percent"], r["model"].split(":")[1]
        first, steady = e["first_step"], e["steady_state"]
        print(f"| {name} | {first:+.2f} % | {steady:+.2f} % | {r['estimate_seconds']:.1f} |")
    ok = [r for r in rows if "failed" not in r]
    outside = [r for r in ok if max(abs(v) for v in r["error_percent"].values()) > 1.0]
    print(
        f"\n{len(ok)} of {len(rows)} ran; {len(ok) - len(outside)} within 1 %"
        + "".join(f"; {r['model'].split(':')[1]} {r['error_percent']}" for r in outside)
    )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
