"""How fast ``max_batch_size`` finds the largest batch size within a budget, per model.

Run: ``python benchmarks/batch_size.py [--budget 8GiB] [--json] [--workers N]``. For each model it prints
the max batch size, the estimated peak there, the number of probes (estimator runs of two steps each)
and the seconds. Each model is searched in a fresh process, as ``memest max-batch-size`` runs (a worker
for parallel probes can only be forked before the process first runs backward on fake tensors). The
search is exact with respect to the estimator; the check column confirms it from the probes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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


def search(index: int, budget: int, workers: int | None) -> dict[str, Any]:
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
    )
    peaks = dict(r.probes)
    exact = r.capped or peaks[r.max_batch_size] <= budget < peaks[r.max_batch_size + 1]
    return {"model": spec, **r.to_json(), "exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workers", type=int, default=None, help="probes at once (default: 2 on 2 cores)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child's model
    args = parser.parse_args()
    budget = parse_size(args.budget)
    if args.one is not None:
        print(json.dumps(search(args.one, budget, args.workers)))
        return
    rows = []
    for index, (spec, _, _) in enumerate(MODELS):
        command = [sys.executable, __file__, "--one", str(index), "--budget", args.budget]
        if args.workers is not None:
            command += ["--workers", str(args.workers)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        r = BatchSizeRow(**row)
        rows.append(row)
        if not args.json:
            print(
                f"{spec:<34} max {r.max_batch_size:>6}  peak {format_bytes(r.peak_bytes_at_max or 0):>10}"
                f"  {r.probes:>2} probes  {r.seconds:6.2f} s  exact {r.exact}",
                flush=True,
            )
    if args.json:
        print(json.dumps({"budget_bytes": budget, "rows": rows}))


if __name__ == "__main__":
    main()
