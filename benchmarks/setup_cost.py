"""What ``MemEstimate`` adds to fit start on the README's main example, against the simulation's own time.

Run: ``python benchmarks/setup_cost.py [--runs N] [--json]``. Each run is ``python
examples/train_classifier.py`` in a fresh process (resnet18, batch 16 of 3x128x128, CPU), whose
``describe()`` line says what the first estimate added to fit start and what that went to; the table
gives, per run, the total, the simulation (simulating and calibrating the kernels: the estimator's own
work), the scan for other live tensors and the rest, and the total as a multiple of the simulation.
The target is at most 1.3x. The first run calibrates the kernels (the cache starts in a fresh
directory); the later ones find them cached, as every fit after the first on a machine does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_WORDS = (
    r"the estimate added (?P<total>[\d.]+) s to fit start: (?P<simulating>[\d.]+) s simulating, "
    r"(?P<calibrating>[\d.]+) s calibrating kernels, (?P<scanning>[\d.]+) s finding other live tensors"
)
_LINE = re.compile(_WORDS.replace(" ", r"\s+"))  # describe() wraps its lines at 80 columns


@dataclass(frozen=True)
class Run:
    total_s: float
    simulating_s: float
    calibrating_s: float
    scanning_s: float

    @property
    def ratio(self) -> float:
        return self.total_s / max(self.simulating_s + self.calibrating_s, 1e-9)


def one_run(cache: str) -> Run:
    env = {**os.environ, "MEMEST_CACHE_DIR": cache, "KINETO_LOG_LEVEL": "6"}
    with tempfile.TemporaryDirectory() as logs:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "train_classifier.py")],
            cwd=logs,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    match = _LINE.search(done.stdout + done.stderr)
    if match is None:
        raise SystemExit(f"no setup line in the example's output:\n{done.stdout[-2000:]}")
    figures = {k: float(v) for k, v in match.groupdict().items()}
    return Run(figures["total"], figures["simulating"], figures["calibrating"], figures["scanning"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, metavar="N", help="runs of the example (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON value instead of a table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memest-cache-") as cache:
        runs = [one_run(cache) for _ in range(args.runs)]
    if args.json:
        print(json.dumps([{**asdict(r), "ratio": round(r.ratio, 3)} for r in runs]))
        return
    print("| run | added to fit start s | simulating + calibrating s | scanning s | rest s | ratio |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(runs, 1):
        own = r.simulating_s + r.calibrating_s
        rest = r.total_s - own - r.scanning_s
        print(f"| {i} | {r.total_s:.2f} | {own:.2f} | {r.scanning_s:.2f} | {rest:.2f} | {r.ratio:.2f}x |")


if __name__ == "__main__":
    main()
