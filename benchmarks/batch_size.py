"""How fast ``max_batch_size`` finds the largest batch size within a budget, per model.

Run: ``python benchmarks/batch_size.py [--budget 8GiB] [--json] [--workers N] [--modes hand,cold,warm]``.
For each model it prints the max batch size, the estimated peak there, the number of probes (estimator
runs of two steps each) and the seconds, in three modes: with the hand-written kernel models
(``hand``), and with the kernels calibrated on this machine (``calibrate=True``) from an empty
calibration cache (``cold``, as on a new machine) and again from the cache that run left (``warm``,
as after an estimate or an earlier search of the model). Each search runs in a fresh process, as
``memest max-batch-size`` does (a worker for parallel probes can only be forked before the process
first runs backward on fake tensors). The search is exact with respect to the estimator; the check
column confirms it from the probes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # models:TinyGPT

from lightning_memest.budget import parse_size
from lightning_memest.cases import InputSpec, build_case, case_batch_maker
from lightning_memest.report import format_bytes
from lightning_memest.search import max_batch_size

MODELS: list[tuple[str, InputSpec, dict[str, Any] | None]] = [
    ("torchvision.models:resnet18", InputSpec(8, shape=(3, 224, 224)), None),
    ("torchvision.models:resnet50", InputSpec(8, shape=(3, 224, 224)), None),
    ("torchvision.models:mobilenet_v2", InputSpec(8, shape=(3, 224, 224)), None),
    ("models:TinyGPT", InputSpec(8, tokens=128, vocab=1000), None),
]


@dataclass(frozen=True)
class BatchSizeRow:
    model: str
    max_batch_size: int
    peak_bytes_at_max: int | None
    probes: int
    seconds: float
    exact: bool


def search(index: int, budget: int, workers: int | None, calibrate: bool) -> dict[str, Any]:
    spec, inputs, kwargs = MODELS[index]
    case = build_case(spec, inputs, model_kwargs=kwargs)
    cfg = case.config
    r = max_batch_size(
        case.model,
        case_batch_maker(case),
        budget,
        loss_fn=cfg.loss_fn,
        optimizer=cfg.optimizer,
        workers=workers,
        calibrate=calibrate,
    )
    peaks = dict(r.probes)
    exact = r.capped or peaks[r.max_batch_size] <= budget < peaks[r.max_batch_size + 1]
    return {"model": spec, **r.to_json(), "exact": exact}


def run_child(index: int, args: argparse.Namespace, mode: str, cache: str) -> dict[str, Any]:
    """One search in a fresh process; ``cache`` is its calibration cache directory."""
    command = [sys.executable, __file__, "--one", str(index), "--budget", args.budget]
    if args.workers is not None:
        command += ["--workers", str(args.workers)]
    if mode != "hand":
        command += ["--calibrate"]
    env = {**os.environ, "MEMEST_CACHE_DIR": cache}
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    row: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workers", type=int, default=None, help="probes at once (default: 2 on 2 cores)")
    parser.add_argument("--modes", default="hand,cold,warm", help="hand, cold and/or warm (see above)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child's model
    parser.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args()
    budget = parse_size(args.budget)
    if args.one is not None:
        print(json.dumps(search(args.one, budget, args.workers, args.calibrate)))
        return
    modes = args.modes.split(",")
    rows = []
    for index, (spec, _, _) in enumerate(MODELS):
        cache = tempfile.mkdtemp(prefix="memest-batch-size-")  # cold for this model, warm after
        for mode in modes:
            row = {"mode": mode, **run_child(index, args, mode, cache)}
            rows.append(row)
            if not args.json:
                r = BatchSizeRow(**{k: row[k] for k in BatchSizeRow.__dataclass_fields__})
                calibration = row.get("calibration")
                note = (
                    f"  calibration {calibration['seconds']:.2f} s, {calibration['measured']} measured, "
                    f"{calibration['refined']} at probe sizes"
                    if calibration
                    else ""
                )
                print(
                    f"{spec:<34} {mode:<5} max {r.max_batch_size:>6}  "
                    f"peak {format_bytes(r.peak_bytes_at_max or 0):>10}  {r.probes:>2} probes  "
                    f"{r.seconds:6.2f} s  exact {r.exact}{note}",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"budget_bytes": budget, "rows": rows}))


if __name__ == "__main__":
    main()
