"""Estimate vs measurement on a real GPU: allocated and reserved peaks, per model (issue 6's check).

Run on a machine with a CUDA device (it exits with a message otherwise):

    python benchmarks/cuda_validation.py [--quick] [--json] [--rows rows.jsonl]
    python benchmarks/cuda_validation.py --from-rows rows.jsonl     # the tables again, anywhere

For each case of the visible set (tests/test_estimate.py), ``estimate_case(device="cuda")`` (fake CUDA
tensors; the caching allocator model gives allocated and reserved) against ``measure_case(device=
"cuda")`` (``torch.cuda.max_memory_allocated``/``max_memory_reserved``, reset before each step). Also
the CPU-only what-if of the same case (``MEMEST_CUDA_WHAT_IF=1``: simulated on fake CPU tensors and
accounted as CUDA, as on a machine without a GPU) against the same measurement, and the device memory
the estimate gives (reserved + CUDA context) against what the device reports used (``mem_get_info``)
after the measured steps. Prints markdown tables with the GPU's name and the date, for the README.

``--rows FILE`` appends each case's numbers to FILE as one JSON line the moment it is measured, so a
run cut short by a time limit still leaves every finished case behind; ``--from-rows FILE`` prints the
tables from such a file on any machine (no GPU needed). A case that fails is recorded with its error
and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_memest.cases import build_case, estimate_case, measure_case  # noqa: E402
from tests.test_estimate import CASES, case_input  # noqa: E402


def pair(errors: list[float]) -> str:
    """First step / steady state."""
    return f"{errors[0]:+.2f} % / {errors[1]:+.2f} %"


def error(estimated: int, measured: int) -> float:
    return 100.0 * (estimated - measured) / measured


def run(spec: str, batch_size: int, optimizer: str, precision: str) -> dict[str, Any]:
    """One case: the real-GPU estimate, the CPU-only what-if, and the measurement."""
    case = build_case(spec, case_input(spec, batch_size), optimizer=optimizer, precision=precision)
    est = estimate_case(case, device="cuda")
    # Calibrated (as the callback estimates): cuDNN's workspaces measured, and the smallest-workspace
    # peaks beside the typical ones (accounting/kernels/cudnn_workspace.py).
    calibrated = estimate_case(case, device="cuda", calibrate=True)
    os.environ["MEMEST_CUDA_WHAT_IF"] = "1"
    try:
        what_if = estimate_case(case, device="cuda")
    finally:
        del os.environ["MEMEST_CUDA_WHAT_IF"]
    torch.cuda.empty_cache()
    real = measure_case(case, device="cuda")
    free, total = torch.cuda.mem_get_info()
    del case
    torch.cuda.empty_cache()
    assert est.reserved_bytes is not None and real.reserved_bytes is not None
    assert what_if.approximate and what_if.reserved_bytes is not None
    return {
        "model": spec.split(":")[1],
        "batch": batch_size,
        "optimizer": optimizer,
        "precision": precision,
        "allocated_error_pct": [error(p.bytes, m) for p, m in zip(est.peaks, real.peak_bytes, strict=True)],
        "reserved_error_pct": [
            error(e, m) for e, m in zip(est.reserved_bytes, real.reserved_bytes, strict=True)
        ],
        "estimated": [p.bytes for p in est.peaks],
        "measured": list(real.peak_bytes),
        "estimated_reserved": list(est.reserved_bytes),
        "measured_reserved": list(real.reserved_bytes),
        "estimate_seconds": est.estimate_seconds,
        "calibrated_allocated_error_pct": [
            error(p.bytes, m) for p, m in zip(calibrated.peaks, real.peak_bytes, strict=True)
        ],
        "calibrated_reserved_error_pct": [
            error(e, m) for e, m in zip(calibrated.reserved_bytes or (), real.reserved_bytes, strict=False)
        ],
        "smallest_workspace_peaks": calibrated.smallest_workspace_peaks,
        "workspace_bytes": [p.breakdown.workspaces for p in calibrated.peaks],
        "what_if_allocated_error_pct": [
            error(p.bytes, m) for p, m in zip(what_if.peaks, real.peak_bytes, strict=True)
        ],
        "what_if_reserved_error_pct": [
            error(e, m) for e, m in zip(what_if.reserved_bytes, real.reserved_bytes, strict=True)
        ],
        "device_bytes_estimated": est.device_bytes,
        "device_bytes_used": total - free,
        "cuda_context_bytes": est.cuda_context_bytes,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def run_safely(spec: str, batch_size: int, optimizer: str, precision: str) -> dict[str, Any]:
    """``run``, or the case with its error: one failing case must not cost the others their numbers."""
    try:
        return run(spec, batch_size, optimizer, precision)
    except Exception as e:  # reported in the table; the run goes on
        torch.cuda.empty_cache()
        return {
            "model": spec.split(":")[1],
            "batch": batch_size,
            "optimizer": optimizer,
            "precision": precision,
            "error": f"{type(e).__name__}: {e}"[:500],
        }


def print_tables(rows: list[dict[str, Any]]) -> None:
    """The README's tables: errors per case, the what-if, device memory, and the medians."""
    done = [r for r in rows if "error" not in r]
    if done:
        print(f"{done[0]['gpu']}, torch {done[0]['torch']}, {done[0]['date']}\n")
    headers = ["model", "batch", "optimizer", "precision", "allocated error 1 / 2", "reserved error 1 / 2"]
    print("| " + " | ".join(headers) + " |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = (
            f"{pair(r['allocated_error_pct'])} | {pair(r['reserved_error_pct'])}"
            if "error" not in r
            else f"failed: {r['error'][:120]} |"
        )
        print(f"| {r['model']} | {r['batch']} | {r['optimizer']} | {r['precision']} | {cells} |")
    if not done:
        return
    print("\nThe CPU-only what-if (MEMEST_CUDA_WHAT_IF=1) against the same measurements; device memory:\n")
    print("| model | what-if allocated 1 / 2 | what-if reserved 1 / 2 | device est. / used (mem_get_info) |")
    print("|---|---|---|---|")
    for r in done:
        device = f"{r['device_bytes_estimated'] / 2**20:.0f} / {r['device_bytes_used'] / 2**20:.0f} MiB"
        print(
            f"| {r['model']} | {pair(r['what_if_allocated_error_pct'])} "
            f"| {pair(r['what_if_reserved_error_pct'])} | {device} |"
        )
    calibrated = [r for r in done if "calibrated_allocated_error_pct" in r]
    if calibrated:
        print("\nCalibrated (as the callback estimates: cuDNN's workspaces measured on this GPU):\n")
        print("| model | allocated 1 / 2 | reserved 1 / 2 | workspace at peak | smallest-workspace peak |")
        print("|---|---|---|---|---|")
        for r in calibrated:
            least = r["smallest_workspace_peaks"]
            print(
                f"| {r['model']} | {pair(r['calibrated_allocated_error_pct'])} "
                f"| {pair(r['calibrated_reserved_error_pct'])} "
                f"| {max(r['workspace_bytes']) / 2**20:.1f} MiB "
                f"| {'-' if least is None else f'{max(least) / 2**20:.0f} MiB'} |"
            )
    for key, name in [
        ("allocated_error_pct", "allocated"),
        ("reserved_error_pct", "reserved"),
        ("what_if_allocated_error_pct", "what-if allocated"),
        ("what_if_reserved_error_pct", "what-if reserved"),
    ]:
        errors = [abs(e) for r in done for e in r[key]]
        print(f"{name} |error| median {statistics.median(errors):.2f} %, max {max(errors):.2f} %")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the first four cases only")
    parser.add_argument("--json", action="store_true", help="also print every row as JSON")
    parser.add_argument("--rows", type=Path, help="append each case's row to this JSON-lines file")
    parser.add_argument("--from-rows", type=Path, help="print the tables of a JSON-lines file and exit")
    args = parser.parse_args()
    if args.from_rows is not None:
        print_tables([json.loads(line) for line in args.from_rows.read_text().splitlines() if line])
        return
    if not torch.cuda.is_available():
        sys.exit("cuda_validation: no CUDA device here; run it on a machine with a GPU")
    rows = []
    for spec, batch_size, optimizer, precision in CASES[:4] if args.quick else CASES:
        print(f"... {spec} b{batch_size} {optimizer} {precision}", file=sys.stderr, flush=True)
        row = run_safely(spec, batch_size, optimizer, precision)
        rows.append(row)
        if args.rows is not None:
            with args.rows.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print_tables(rows)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
