"""What gloo's collectives allocate inside a call on a real 2-rank CPU job (the profiler's allocator
events), beside what the CPU kernel models of ``accounting/kernels/cpu_collectives.py`` give the same
call. Prints a Markdown table (docs/distributed.md).

    python benchmarks/gloo_collectives.py
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: tests.*
from tests.collective_probe import probe


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    n = 1 << 18
    print(f"| collective ({n * 4 // 2**20} MiB float32 input, 2 ranks) | held in the call | modelled |")
    print("|---|---|---|")
    for case, (measured, modelled) in probe(_port(), n).items():
        print(f"| {case} | {measured / 2**20:.2f} MiB | {modelled / 2**20:.2f} MiB |")


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
