"""Compile modes and options on the CPU: the estimate against the measured compiled peak
(docs/compiled.md's "Modes and options" table).

The compiled-step tests' model (``tests/cli_models.py``'s ``Net``: two pre-norm transformer blocks and a
head), batch 8 x 64 x 128, AdamW, under ``torch.compile(mode=..., dynamic=..., fullgraph=...)``; each
configuration in a fresh process with a cache directory of its own (every compile cold):

    python benchmarks/compiled_modes.py [--json]

Per configuration: ``estimate_step`` of the compiled model, then its first two real steps measured by
the CPU profiler's allocator events (``measure_step``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

CONFIGS = (
    ("default", False, False),
    ("default", True, False),
    ("default", False, True),
    ("max-autotune-no-cudagraphs", False, False),
)


def run_config(mode: str, dynamic: bool, fullgraph: bool) -> dict[str, Any]:
    """One configuration, in this process (a fresh one: see ``main``)."""
    import tempfile

    import torch
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from cli_models import Net

    from lightning_memest import estimate_step
    from lightning_memest.engine.step import StepConfig
    from lightning_memest.measure import measure_step

    def loss(m: Any, b: Any) -> Any:
        return m(b).square().mean()

    torch.manual_seed(0)
    net, batch = Net(), torch.randn(8, 64, 128)
    with temporary_cache_dir(tempfile.mkdtemp()):
        compiled: Any = torch.compile(net, mode=mode, dynamic=dynamic, fullgraph=fullgraph)
        est = estimate_step(compiled, batch, loss_fn=loss, optimizer=torch.optim.AdamW)
        measured = measure_step(compiled, batch, StepConfig(loss_fn=loss, optimizer=torch.optim.AdamW))
    return {
        "mode": mode,
        "dynamic": dynamic,
        "fullgraph": fullgraph,
        "estimated": [est.first_step.bytes, est.steady_state.bytes],
        "measured": [measured.first_step, measured.steady_state],
        "compiled_eagerly": est.compiled_eagerly,
        "graphs": len(set(est.compiled_graphs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # mode,dynamic,fullgraph: one configuration
    args = parser.parse_args()
    if args.config:
        mode, dynamic, fullgraph = args.config.split(",")
        print(json.dumps(run_config(mode, dynamic == "1", fullgraph == "1")))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compiled_steps import fresh_process_rows

    configs = [f"{mode},{int(dynamic)},{int(fullgraph)}" for mode, dynamic, fullgraph in CONFIGS]
    rows = fresh_process_rows(__file__, "--config", configs)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| mode | dynamic | fullgraph | measured (step 1 / steady) | estimate error (step 1 / steady) |")
    print("|---|---|---|---|---|")
    for r in rows:
        (e1, e2), (m1, m2) = r["estimated"], r["measured"]
        measured = f"{m1 / 2**20:.2f} MiB / {m2 / 2**20:.2f} MiB"
        error = f"{e1 - m1:+,} B / {e2 - m2:+,} B"
        print(f"| {r['mode']} | {r['dynamic']} | {r['fullgraph']} | {measured} | {error} |")


if __name__ == "__main__":
    main()
