"""What a replayed layer costs against a simulated one, counted in instructions (valgrind's callgrind)
rather than seconds: a count that a shared machine's drifting speed does not move, for comparing two
versions of the replay. The simulation alone is counted (``estimate_step`` with its accounting left
out: ``StepEstimate.estimate_seconds`` times the same part), on the minimal GPT of
``benchmarks/replay.py`` (d_model 4096, seq 2048, AdamW, two steps).

Each depth runs once to warm up, then once counted (the counters zeroed before it and dumped after, by
``callgrind_control``); the per-layer figure is the difference of two depths over their difference.
Under callgrind Python runs some 50 times slower: the default run takes about 15 minutes on a 2-core
machine (two processes, one per core).

    python benchmarks/replay_instructions.py                    # replayed 8-64, simulated 8-32
    python benchmarks/replay_instructions.py --replay 8 32 --full 8 16

It needs ``valgrind`` (and its ``callgrind_control``) on the PATH, and says so if they are not.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(depths: list[int], replay: bool) -> None:
    """Inside callgrind: each depth's simulation once to warm up, then once between a zeroing of the
    counters and a dump of them (``callgrind_control``, which signals this process)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from replay import build

    import lightning_memest.estimate as estimate_module
    from lightning_memest import estimate_step
    from tests.models import lm_loss

    estimate_module.account = lambda sim, *a, **k: sim  # type: ignore[assignment]  # the simulation alone
    models = {n: build(n, 4096, 2048, 32000) for n in depths}

    def run(n: int) -> None:
        model, batch = models[n]
        estimate_step(model, batch, loss_fn=lm_loss, optimizer=torch.optim.AdamW, replay_blocks=replay)

    estimate_step(torch.nn.Linear(4, 4), torch.randn(2, 4), replay_blocks=True)
    for n in depths:
        run(n)
    pid = str(os.getpid())
    for n in depths:
        gc.collect()
        subprocess.run(["callgrind_control", "-z", pid], capture_output=True, check=True)
        run(n)
        subprocess.run(["callgrind_control", "-d", f"depth{n}", pid], capture_output=True, check=True)


def _total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary line in {path}")


def _start(depths: list[int], replay: bool, out: Path) -> subprocess.Popen[bytes]:
    mode = "replay" if replay else "full"
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out / mode}.%p.out",
        sys.executable,
        __file__,
        "--worker",
        mode,
        *map(str, depths),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _per_layer(out: Path, mode: str, depths: list[int]) -> float:
    """Instructions a layer: the two counted runs' totals (dumps 1 and 2), their difference over the
    depths'."""
    dumps = sorted(out.glob(f"{mode}.*.out.*"), key=lambda p: int(p.suffix[1:]))
    if len(dumps) != 2:
        raise RuntimeError(f"{mode}: {len(dumps)} dumps, expected 2")
    return (_total(dumps[1]) - _total(dumps[0])) / (depths[1] - depths[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replay", type=int, nargs=2, default=[8, 64], help="depths with replay")
    parser.add_argument("--full", type=int, nargs=2, default=[8, 32], help="depths without replay")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker([int(d) for d in args.worker[1:]], args.worker[0] == "replay")
        return
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"replay_instructions.py needs {' and '.join(missing)} on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        runs = [_start(args.replay, True, out), _start(args.full, False, out)]
        for run in runs:
            _, err = run.communicate()
            if run.returncode != 0:
                sys.exit(err.decode(errors="replace")[-3000:])
        replayed = _per_layer(out, "replay", args.replay)
        full = _per_layer(out, "full", args.full)
    print(
        f"a replayed layer {replayed / 1e6:.1f} M instructions (depths {args.replay[0]}-{args.replay[1]}), "
        f"a simulated layer {full / 1e6:.1f} M (depths {args.full[0]}-{args.full[1]}): "
        f"{100 * replayed / full:.1f} %"
    )


if __name__ == "__main__":
    main()
