"""How long ``memest --help`` and ``memest --version`` take, against ``python -c "import torch"``.

Run: ``python benchmarks/cli_startup.py [--runs N] [--json]``. Each command runs N times (default 5), each
time in a fresh process, and the table gives the best and the median wall time and the best as a multiple
of importing torch. ``memest`` answers these without importing torch (its parser is torch-free, the
commands import the library when they run), so they should take a fraction of ``import torch``; the
target is 0.5 s for ``--help`` on a 2-core CI machine. ``memest`` is the console script beside this
interpreter (``python -m lightning_memest.cli`` where none is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path


def memest_command() -> list[str]:
    """The installed console script (this interpreter's, not some other ``memest`` on PATH), else the
    module."""
    for scripts in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        if (scripts / "memest").is_file():
            return [str(scripts / "memest")]
    found = shutil.which("memest")
    return [found] if found else [sys.executable, "-m", "lightning_memest.cli"]


def wall_times(command: list[str], runs: int) -> list[float]:
    """Seconds of each of ``runs`` fresh runs of ``command`` (which must exit 0)."""
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - began)
    return times


@dataclass(frozen=True)
class Row:
    command: str
    best_s: float
    median_s: float
    of_import_torch: float  # best_s over the best of `import torch`


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, metavar="N", help="runs of each command (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON value instead of a table")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    memest = memest_command()
    commands = {
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "memest --help": [*memest, "--help"],
        "memest --version": [*memest, "--version"],
    }
    times = {label: wall_times(command, args.runs) for label, command in commands.items()}
    torch_s = min(times['python -c "import torch"'])
    rows = [Row(label, min(t), statistics.median(t), min(t) / torch_s) for label, t in times.items()]
    if args.json:
        data = {
            "runs": args.runs,
            "cpus": os.cpu_count(),
            "memest": memest,
            "rows": [asdict(r) for r in rows],
        }
        print(json.dumps(data))
        return
    where = " ".join(memest)
    print(f"startup: best and median of {args.runs} fresh runs ({os.cpu_count()} CPUs; memest is {where})")
    print(f"{'command':<28}{'best s':>9}{'median s':>10}{'x import torch':>16}")
    for r in rows:
        print(f"{r.command:<28}{r.best_s:>9.3f}{r.median_s:>10.3f}{r.of_import_torch:>16.2f}")


if __name__ == "__main__":
    main()
