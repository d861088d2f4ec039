"""The ``memest`` commands: estimate, measure, compare, profile, max-batch-size -- each reads its
checked settings (``cli/parser.py``), runs the library, and prints a table or one JSON value."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from lightning_memest.budget import parse_size
from lightning_memest.cases import case_batch_maker, estimate_case, measure_case, resolve_model
from lightning_memest.cli.parser import PROG, Settings
from lightning_memest.errors import MemestError, SpecError
from lightning_memest.fx import NODE_ORDERS, profile_graph
from lightning_memest.report import ModuleStats, StepEstimate, format_bytes, human_flops
from lightning_memest.search import max_batch_size
from lightning_memest.tables import MODULE_ORDERS, module_rows, module_table

__all__ = ["COMMANDS", "compare_row"]

#: How many modules the readable estimate lists.
TOP_MODULES = 5


def _estimate(settings: Settings, out: TextIO) -> None:
    args = settings.args
    case = settings.build(args.model)
    est = estimate_case(
        case, device=args.device, strategy=settings.strategy, gpu=settings.gpu, calibrate=args.calibrate
    )
    fits = _fits_gpu(est, args.gpu_memory)
    if args.json:
        data = est.to_json()
        data["gpu_memory"] = fits
        print(json.dumps(data), file=out)
        return
    print(f"estimate of {args.model} ({settings.describe()})", file=out)
    if est.approximate:
        print(
            "  APPROXIMATE: no GPU here; simulated on the CPU and accounted as CUDA (caching allocator,"
            " cuBLAS workspace, foreach optimizers, attention backend, autocast lists; not cuDNN)",
            file=out,
        )
    _print_estimate(est, out)
    if fits is not None:
        verdict = "fits" if fits["fits"] else "does NOT fit"
        print(
            f"\n  on a GPU with {format_bytes(fits['budget_bytes'])}: {verdict} (reserved peak + CUDA "
            f"context = {format_bytes(fits['device_bytes'])})",
            file=out,
        )


def _fits_gpu(est: StepEstimate, size: str | None) -> dict[str, Any] | None:
    """``--gpu-memory``: the verdict, from the reserved peak plus the CUDA context."""
    if size is None:
        return None
    try:
        budget = parse_size(size)
    except ValueError as e:
        raise SpecError(f"--gpu-memory: {e}") from None
    device = est.device_bytes
    assert device is not None  # --gpu-memory needs --device cuda (checked in _gpu)
    return {"budget_bytes": budget, "device_bytes": device, "fits": device <= budget}


def _print_estimate(est: StepEstimate, out: TextIO) -> None:
    rows = [("peak, first step", est.first_step.bytes), ("peak, steady state", est.steady_state.bytes)]
    if est.reserved_bytes is not None:
        rows += [
            ("reserved, first step", est.reserved_bytes[0]),
            ("reserved, steady state", est.reserved_bytes[-1]),
        ]
    if est.cuda_context_bytes is not None and est.device_bytes is not None:
        rows += [("CUDA context", est.cuda_context_bytes), ("device (reserved+context)", est.device_bytes)]
    for label, n in rows:
        print(f"  {label:<26}{format_bytes(n):>12}  ({n:,} B)", file=out)
    peak = est.steady_state
    where = f"{peak.op} in {peak.module or '(root)'}, {peak.phase.value}"
    print(f"\n  at the steady-state peak ({where}):", file=out)
    for name, n in peak.breakdown.items():
        print(f"    {name:<22}{format_bytes(n):>12}", file=out)
    leaves = [m for m in est.modules.walk() if not m.children and m.path and m.saved_bytes > 0]
    if leaves:
        print(f"\n  modules saving the most for backward (first step, top {TOP_MODULES}):", file=out)
        for m in sorted(leaves, key=_saved, reverse=True)[:TOP_MODULES]:
            print(f"    {m.path + ' (' + m.type_name + ')':<40}{format_bytes(m.saved_bytes):>12}", file=out)
    if est.data_dependent:
        # Fake tensors have no values: a branch on one takes the path the assumed value leads to.
        print(
            "\n  the step read tensor values, which the simulation assumed (code that branches on them"
            "\n  followed the assumed value; memory of the other branch is not in the estimate):",
            file=out,
        )
        for read in est.data_dependent:
            print(f"    {read.describe()}", file=out)
    if est.flops is not None:
        f = est.flops
        print("\n  FLOPs of one step (2 x MACs of matmuls, convolutions, attention):", file=out)
        print(f"    {'forward':<22}{human_flops(f.forward):>12}", file=out)
        print(f"    {'backward':<22}{human_flops(f.backward or 0):>12}", file=out)
        print(f"    {'other (elementwise...)':<22}{human_flops(f.other_total):>12}", file=out)
    if est.calibration is not None:
        c = est.calibration
        note = f"; not measurable, their hand models held: {', '.join(c.failed)}" if c.failed else ""
        print(
            f"\n  kernels calibrated on this machine: {c.measured} op signatures measured in"
            f" {c.seconds:.2f} s, {c.cached} from the cache{note}",
            file=out,
        )
    print(f"\n  estimated in {est.estimate_seconds:.2f} s", file=out)


def _saved(m: ModuleStats) -> int:
    return m.saved_bytes


def _measure(settings: Settings, out: TextIO) -> None:
    args = settings.args
    case = settings.build(args.model)
    m = measure_case(case, device=args.device)
    if args.json:
        reserved = (
            None
            if m.reserved_bytes is None
            else {"first_step": m.reserved_bytes[0], "steady_state": m.reserved_bytes[-1]}
        )
        data = {
            "peak_bytes": {"first_step": m.first_step, "steady_state": m.steady_state},
            "reserved_bytes": reserved,
            "step_seconds": round(m.step_seconds, 4),
        }
        print(json.dumps(data), file=out)
        return
    print(f"measurement of {args.model} ({settings.describe()}, on {m.device})", file=out)
    rows = [("peak, first step", m.first_step), ("peak, steady state", m.steady_state)]
    if m.reserved_bytes is not None:
        rows += [
            ("reserved, first step", m.reserved_bytes[0]),
            ("reserved, steady state", m.reserved_bytes[-1]),
        ]
    for label, n in rows:
        print(f"  {label:<24}{format_bytes(n):>12}  ({n:,} B)", file=out)
    print(f"\n  one step took {m.step_seconds:.3f} s", file=out)


def _error_percent(estimated: int, measured: int) -> float | None:
    return None if measured == 0 else round(100.0 * (estimated - measured) / measured, 3)


def compare_row(
    spec: str, est: StepEstimate, measured: tuple[int, int], step_seconds: float
) -> dict[str, Any]:
    """One model's row of ``memest compare --json``."""
    estimated = (est.first_step.bytes, est.steady_state.bytes)
    keys = ("first_step", "steady_state")
    return {
        "model": spec,
        "estimated_bytes": dict(zip(keys, estimated, strict=True)),
        "measured_bytes": dict(zip(keys, measured, strict=True)),
        "error_percent": {k: _error_percent(e, m) for k, e, m in zip(keys, estimated, measured, strict=True)},
        "estimate_seconds": round(est.estimate_seconds, 4),
        "step_seconds": round(step_seconds, 4),
        "data_dependent": est.data_dependent_json(),
    }


def _compare(settings: Settings, out: TextIO) -> None:
    args = settings.args
    # Check every spec before the first (slow) run, so a typo in the last model fails at once.
    for spec in args.models:
        resolve_model(spec)
    rows: list[dict[str, Any]] = []
    n = len(args.models)
    for i, spec in enumerate(args.models, 1):
        try:
            print(f"{PROG}: [{i}/{n}] estimating {spec}", file=sys.stderr, flush=True)
            # A fresh, identically seeded model for each run: measuring trains the model in place.
            est = estimate_case(settings.build(spec), device=args.device, calibrate=args.calibrate)
            print(f"{PROG}: [{i}/{n}] measuring {spec}", file=sys.stderr, flush=True)
            m = measure_case(settings.build(spec), device=args.device)
        except MemestError as e:
            raise MemestError(f"{spec}: {e}") from e
        rows.append(compare_row(spec, est, (m.first_step, m.steady_state), m.step_seconds))
    if args.json:
        print(json.dumps(rows), file=out)
        return
    print(f"compare ({settings.describe()})", file=out)
    header = f"{'model':<36}{'peak':<14}{'estimated':>12}{'measured':>12}{'error':>10}{'estimate s':>12}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        for key, label in (("first_step", "step 1"), ("steady_state", "steady")):
            first = key == "first_step"
            err = row["error_percent"][key]
            err_text = "n/a" if err is None else f"{err:+.2f} %"
            seconds = f"{row['estimate_seconds']:.2f}" if first else ""
            estimated, measured = row["estimated_bytes"][key], row["measured_bytes"][key]
            line = (
                f"{row['model'] if first else '':<36}{label:<14}{format_bytes(estimated):>12}"
                f"{format_bytes(measured):>12}{err_text:>10}{seconds:>12}"
            )
            print(line.rstrip(), file=out)
    for row in rows:
        if row["data_dependent"] is not None:
            # A branch on a value fake tensors lack followed the assumed value: the likeliest cause of
            # a large error, so say it where the error is read.
            reads = sum(r["count"] for r in row["data_dependent"])
            print(
                f"note: {row['model']} read tensor values {reads} time(s); fake tensors have none, so"
                "\n      branches on them followed assumed values (memest estimate lists them)",
                file=out,
            )


def _profile(settings: Settings, out: TextIO) -> None:
    args = settings.args
    if args.top is not None and args.top < 0:
        raise SpecError(f"--top must be at least 0; got {args.top}")
    orders = NODE_ORDERS if args.by == "node" else MODULE_ORDERS
    order = args.sort or orders[0]
    if order not in orders:
        raise SpecError(f"--sort for --by {args.by} must be one of {', '.join(orders)}; got {order!r}")
    case = settings.build(args.model)
    if args.by == "node":
        profile = profile_graph(
            case.model,
            case.batch,
            loss_fn=case.config.loss_fn,
            precision=case.config.precision,
            device=args.device,
        )
        if args.json:
            print(json.dumps(profile.to_json(order, args.top)), file=out)
            return
        print(f"node profile of {args.model} ({settings.describe()}; first step)", file=out)
        print(profile.table(top=args.top, by=order), file=out)
        print(f"\n  profiled in {profile.seconds:.2f} s", file=out)
        return
    est = estimate_case(case, device=args.device, steps=1)
    if args.json:
        print(json.dumps(module_rows(est.modules, order, args.top)), file=out)
        return
    print(f"module profile of {args.model} ({settings.describe()}; first step)", file=out)
    print(module_table(est.modules, order, args.top), file=out)


def _max_batch_size(settings: Settings, out: TextIO) -> None:
    args = settings.args
    try:
        budget = parse_size(args.memory_budget)
    except ValueError as e:
        raise SpecError(f"--memory-budget: {e}") from None
    if args.cap < 1:
        raise SpecError(f"--max-batch-size must be at least 1; got {args.cap}")
    # Built (for real) at --batch-size: small, and it checks the input and makes the target's shape;
    # every probe resizes that batch on the meta device.
    case = settings.build(args.model)

    def progress(n: int, peak: int) -> None:
        verdict = "fits" if peak <= budget else "over"
        print(f"{PROG}: batch size {n}: {format_bytes(peak)} ({verdict})", file=sys.stderr, flush=True)

    result = max_batch_size(
        case.model,
        case_batch_maker(case),
        budget,
        loss_fn=case.config.loss_fn,
        optimizer=case.config.optimizer,
        precision=case.config.precision,
        device=args.device,
        start=settings.inputs.batch_size,
        cap=args.cap,
        progress=progress,
        strategy=settings.strategy,
        gpu=settings.gpu,
    )
    if result.max_batch_size == 0 or result.capped:
        print(f"{PROG}: {result.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()), file=out)
        return
    print(f"max batch size of {args.model} ({settings.describe()})", file=out)
    print(f"  {result.message}", file=out)
    print(f"\n  {len(result.probes)} estimates in {result.seconds:.2f} s", file=out)


#: The command functions, by name: ``COMMANDS[name](settings, out)``.
COMMANDS: dict[str, Callable[[Settings, TextIO], None]] = {
    "estimate": _estimate,
    "measure": _measure,
    "compare": _compare,
    "max-batch-size": _max_batch_size,
    "profile": _profile,
}
