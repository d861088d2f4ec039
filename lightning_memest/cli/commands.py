"""The ``memest`` commands: estimate, measure, compare, profile, max-batch-size -- each reads its
checked settings (``cli/settings.py``), runs the library, and prints a table or one JSON value.

Every JSON value says whether its figures are ``approximate`` (a CUDA what-if on a machine without a
GPU; a measurement never is). Long work shows its progress on stderr where a person watches
(``cli/progress.py``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from lightning_memest.cases import case_batch_maker, estimate_case, measure_case, resolve_model
from lightning_memest.cli.parser import PROG
from lightning_memest.cli.progress import Progress, watched
from lightning_memest.cli.settings import Settings
from lightning_memest.engine.parallel.distributed import Strategy
from lightning_memest.engine.parallel.pipeline import Pipeline
from lightning_memest.errors import MemestError, SpecError, one_line
from lightning_memest.fx import NODE_ORDERS, profile_graph
from lightning_memest.report import (
    CUDNN_WORKSPACE_ASSUMED,
    ModuleStats,
    StepEstimate,
    format_bytes,
    human_flops,
)
from lightning_memest.report.tables import MODULE_ORDERS, module_rows, module_table
from lightning_memest.search import max_batch_size

if TYPE_CHECKING:
    from lightning_memest.cases import Case
    from lightning_memest.plan import CompiledBudget

__all__ = ["COMMANDS", "compare_row"]

#: How many modules the readable estimate lists.
TOP_MODULES = 5


def _progress(settings: Settings, **kwargs: Any) -> Progress:
    return Progress(watched(settings.args.json), **kwargs)


def _estimate(settings: Settings, out: TextIO) -> None:
    args = settings.args
    with _progress(settings) as progress:
        progress.update(f"building {args.model}")
        case = settings.build(args.model)
        # A pipeline's stages differ (the first keeps the most microbatches in flight, the last holds
        # the head): a rank of each stage (its first) is estimated, and the worst is the estimate.
        strategies: list[Strategy | None] = [settings.strategy]
        staged = isinstance(settings.strategy, Pipeline)
        if isinstance(settings.strategy, Pipeline):
            pipeline = settings.strategy
            inner = pipeline.data_parallel * pipeline.tensor_parallel
            strategies = [dataclasses.replace(pipeline, rank=s * inner) for s in range(pipeline.stages)]
        stages: list[tuple[int, StepEstimate]] = []
        for strategy in strategies:
            what = f"simulating {_what(args.loop)} on fake tensors"
            if staged and strategy is not None:
                what = f"pipeline rank {strategy.rank}, stage {len(stages) + 1} of {len(strategies)}"
            progress.update(f"estimating {args.model}: {what}")
            est = estimate_case(
                case,
                device=args.device,
                strategy=strategy,
                gpu=settings.gpu,
                calibrate=args.calibrate,
                loop=args.loop,
                replay_blocks=args.replay_blocks,
            )
            stages.append((strategy.rank if strategy is not None else 0, est))
        worst, est = max(stages, key=lambda s: max(p.bytes for p in s[1].peaks))
    fits = _fits_gpu(est, args.gpu_memory)
    if args.json:
        data = _estimate_json(est)
        data["gpu_memory"] = fits
        if staged:
            data["pipeline"] = {
                "worst_rank": worst,
                "ranks": [{"rank": r, "peak_bytes": max(p.bytes for p in e.peaks)} for r, e in stages],
            }
        print(json.dumps(data), file=out)
        return
    print(f"estimate of {args.model} ({settings.describe()}{_loop_note(args.loop)})", file=out)
    if staged:
        peaks = ", ".join(f"rank {r} {format_bytes(max(p.bytes for p in e.peaks))}" for r, e in stages)
        print(f"  pipeline ranks' peaks: {peaks}; the worst, rank {worst}, is reported below", file=out)
    if est.approximate:
        print(
            "  APPROXIMATE: no GPU here; simulated on the CPU and accounted as CUDA (caching allocator,"
            " cuBLAS workspace, foreach optimizers, attention backend, autocast lists; not cuDNN)",
            file=out,
        )
    if est.compiled_note is not None:
        print(f"  {est.compiled_note}", file=out)
    if est.replayed_blocks:
        groups = ", ".join(f"{n} of {path or 'the model'}" for path, n in est.replayed_blocks.items())
        print(f"  replayed blocks per step: {groups} (from the events of alike blocks)", file=out)
    if est.replay_note:
        print(f"  alike blocks not replayed (every block simulated): {est.replay_note}", file=out)
    _print_estimate(est, out)
    if fits is not None:
        verdict = "fits" if fits["fits"] else "does NOT fit"
        print(
            f"\n  on a GPU with {format_bytes(fits['budget_bytes'])}: {verdict} (reserved peak + CUDA "
            f"context = {format_bytes(fits['device_bytes'])})",
            file=out,
        )
        if est.out_of_memory:
            print(f"  DOES NOT FIT: {est.out_of_memory}", file=out)


def _fits_gpu(est: StepEstimate, budget: int | None) -> dict[str, Any] | None:
    """``--gpu-memory``: the verdict, from the reserved peak plus the CUDA context."""
    if budget is None:
        return None
    device = est.device_bytes
    assert device is not None  # --gpu-memory needs --device cuda (checked in _gpu)
    fits = device <= budget and est.out_of_memory is None
    return {"budget_bytes": budget, "device_bytes": device, "fits": fits, "out_of_memory": est.out_of_memory}


def _what(loop: str) -> str:
    return "two training steps" if loop == "train" else f"one {loop} batch"


def _loop_note(loop: str) -> str:
    """How the title says a batch outside training (the model in eval mode, no gradients)."""
    if loop == "train":
        return ""
    return f"; one {loop} batch in eval mode, under {'no_grad' if loop == 'validate' else 'inference_mode'}"


def _peak_rows(loop: str, peaks: Sequence[int], reserved: Sequence[int] | None) -> list[tuple[str, int]]:
    """The peak rows of a table: the first step and the steady state, or one batch of another loop."""
    if loop != "train":
        return [("peak", peaks[-1])] + ([("reserved", reserved[-1])] if reserved is not None else [])
    rows = [("peak, first step", peaks[0]), ("peak, steady state", peaks[-1])]
    if reserved is not None:
        rows += [("reserved, first step", reserved[0]), ("reserved, steady state", reserved[-1])]
    return rows


def _print_estimate(est: StepEstimate, out: TextIO) -> None:
    rows = _peak_rows(est.loop, [p.bytes for p in est.peaks], est.reserved_bytes)
    if est.cuda_context_bytes is not None and est.device_bytes is not None:
        context = "CUDA context (assumed)" if est.cuda_context_assumed else "CUDA context"
        rows += [(context, est.cuda_context_bytes), ("device (reserved+context)", est.device_bytes)]
    if est.smallest_workspace_peaks is not None:
        rows.append(("peak, smallest workspaces", est.runnable_peak_bytes))
    for label, n in rows:
        print(f"  {label:<26}{format_bytes(n):>12}  ({n:,} B)", file=out)
    if est.cuda_context_assumed:
        print("  (no GPU measured the context here: --cuda-context SIZE sets it)", file=out)
    if est.cudnn_workspace_assumed:
        print(f"  ({CUDNN_WORKSPACE_ASSUMED})", file=out)
    peak = est.steady_state
    where = f"{peak.op} in {peak.module or '(root)'}, {peak.phase.value}"
    print(f"\n  at the {'steady-state ' if est.loop == 'train' else ''}peak ({where}):", file=out)
    for name, n in peak.breakdown.items():
        print(f"    {_words(name):<22}{format_bytes(n):>12}", file=out)
    top = _top_saved(est)
    if top:
        print(f"\n  modules saving the most for backward (first step, top {TOP_MODULES}):", file=out)
        for m in top:
            print(f"    {m.path + ' (' + m.type_name + ')':<40}{format_bytes(m.saved_bytes):>12}", file=out)
    exact = [r for r in est.data_dependent or () if r.exact]
    if exact:
        print("\n  the step read tensor values the simulation knows (exact):", file=out)
        for read in exact:
            print(f"    {read.describe()}", file=out)
    if est.assumed_reads:
        # Fake tensors have no values: a branch on one takes the path the assumed value leads to.
        print(
            "\n  the step read tensor values, which the simulation assumed (code that branches on them"
            "\n  followed the assumed value; memory of the other branch is not in the estimate):",
            file=out,
        )
        for read in est.assumed_reads:
            print(f"    {read.describe()}", file=out)
    if est.flops is not None:
        f = est.flops
        print("\n  FLOPs of one step (2 x MACs of matmuls, convolutions, attention):", file=out)
        print(f"    {'forward':<22}{human_flops(f.forward):>12}", file=out)
        print(f"    {'backward':<22}{human_flops(f.backward or 0):>12}", file=out)
        print(f"    {'other (elementwise)':<22}{human_flops(f.other_total):>12}", file=out)
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


def _words(role: str) -> str:
    """A breakdown role as the model summary says it (``optimizer_state`` -> ``optimizer state``); the
    JSON keeps the field names."""
    return role.replace("_", " ")


def _top_saved(est: StepEstimate) -> list[ModuleStats]:
    """The leaf modules saving the most for backward in the first step, the most first."""
    leaves = [m for m in est.modules.walk() if not m.children and m.path and m.saved_bytes > 0]
    return sorted(leaves, key=_saved, reverse=True)[:TOP_MODULES]


def _estimate_json(est: StepEstimate) -> dict[str, Any]:
    """``StepEstimate.to_json()`` with the other figures the table prints: where the steady-state peak
    is, and the modules saving the most for backward."""
    peak = est.steady_state
    return {
        **est.to_json(),
        "peak_at": {"op": peak.op, "module": peak.module, "phase": peak.phase.value},
        "top_saved_modules": [
            {"module": m.path, "type": m.type_name, "saved_bytes": m.saved_bytes} for m in _top_saved(est)
        ],
    }


def _measure(settings: Settings, out: TextIO) -> None:
    args = settings.args
    with _progress(settings) as progress:
        progress.update(f"building {args.model}")
        case = settings.build(args.model)
        progress.update(f"measuring {args.model}: {_what(args.loop)}, for real")
        m = measure_case(case, device=args.device, loop=args.loop)
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
            "loop": args.loop,
            "approximate": False,  # measured for real
        }
        print(json.dumps(data), file=out)
        return
    note = _loop_note(args.loop)
    print(f"measurement of {args.model} ({settings.describe()}{note}, on {m.device})", file=out)
    for label, n in _peak_rows(args.loop, m.peak_bytes, m.reserved_bytes):
        print(f"  {label:<24}{format_bytes(n):>12}  ({n:,} B)", file=out)
    print(f"\n  one {'step' if args.loop == 'train' else 'batch'} took {m.step_seconds:.3f} s", file=out)


def _error_percent(estimated: int, measured: int) -> float | None:
    return None if measured == 0 else round(100.0 * (estimated - measured) / measured, 3)


_KEYS = ("first_step", "steady_state")


def compare_row(
    spec: str,
    est: StepEstimate | None,
    measured: tuple[int, int] | None,
    step_seconds: float | None,
    error: str | None = None,
) -> dict[str, Any]:
    """One model's row of ``memest compare --json``; what failed is ``None``, and ``error`` says why."""
    estimated = None if est is None else (est.first_step.bytes, est.steady_state.bytes)
    errors = None
    if estimated is not None and measured is not None:
        errors = {k: _error_percent(e, m) for k, e, m in zip(_KEYS, estimated, measured, strict=True)}
    return {
        "model": spec,
        "estimated_bytes": None if estimated is None else dict(zip(_KEYS, estimated, strict=True)),
        "measured_bytes": None if measured is None else dict(zip(_KEYS, measured, strict=True)),
        "error_percent": errors,
        "estimate_seconds": None if est is None else round(est.estimate_seconds, 4),
        "step_seconds": None if step_seconds is None else round(step_seconds, 4),
        "data_dependent": None if est is None else est.data_dependent_json(),
        "approximate": False if est is None else est.approximate,
        "error": error,
    }


def _compare_one(settings: Settings, spec: str, progress: Progress, done: int) -> dict[str, Any]:
    """One model's row: what it got to, and where it failed (a failing model costs the others
    nothing)."""
    args = settings.args
    est, stage = None, "estimating"
    try:
        progress.update(f"estimating {spec}", done)
        # A fresh, identically seeded model for each run: measuring trains the model in place.
        est = estimate_case(settings.build(spec), device=args.device, calibrate=args.calibrate)
        stage = "measuring"
        progress.update(f"measuring {spec}", done)
        m = measure_case(settings.build(spec), device=args.device)
    except Exception as e:  # one model's failure, whatever it is, is its row's
        kind = "" if isinstance(e, MemestError) else f"unexpected {type(e).__name__}: "
        return compare_row(spec, est, None, None, f"{stage} failed: {kind}{one_line(e)}")
    return compare_row(spec, est, (m.first_step, m.steady_state), m.step_seconds)


def _compare(settings: Settings, out: TextIO) -> None:
    args = settings.args
    # Check every spec before the first (slow) run, so a typo in the last model fails at once.
    for spec in args.models:
        resolve_model(spec)
    with _progress(settings, total=len(args.models)) as progress:
        rows = [_compare_one(settings, spec, progress, i) for i, spec in enumerate(args.models)]
    if args.json:
        print(json.dumps(rows), file=out)
    else:
        _print_compare(settings, rows, out)
    if all(row["error"] is not None for row in rows):
        raise MemestError("every model failed (see each row)" if len(rows) > 1 else rows[0]["error"])


def _print_compare(settings: Settings, rows: list[dict[str, Any]], out: TextIO) -> None:
    print(f"compare ({settings.describe()})", file=out)
    header = f"{'model':<36}{'peak':<14}{'estimated':>12}{'measured':>12}{'error':>10}{'estimate s':>12}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        estimated, measured = row["estimated_bytes"], row["measured_bytes"]
        if estimated is not None:
            for key, label in (("first_step", "step 1"), ("steady_state", "steady")):
                first = key == "first_step"
                err = None if row["error_percent"] is None else row["error_percent"][key]
                err_text = "n/a" if err is None else f"{err:+.2f} %"
                seconds = f"{row['estimate_seconds']:.2f}" if first else ""
                measured_text = "-" if measured is None else format_bytes(measured[key])
                line = (
                    f"{row['model'] if first else '':<36}{label:<14}{format_bytes(estimated[key]):>12}"
                    f"{measured_text:>12}{err_text:>10}{seconds:>12}"
                )
                print(line.rstrip(), file=out)
        if row["error"] is not None:
            print(f"{row['model'] if estimated is None else '':<36}{row['error']}", file=out)
    for row in rows:
        # A branch on a value fake tensors lack followed the assumed value: the likeliest cause of a
        # large error, so say it where the error is read (reads of known values were exact).
        reads = sum(r["count"] for r in row["data_dependent"] or () if not r["exact"])
        if reads:
            print(
                f"note: {row['model']} read tensor values {reads} time(s); fake tensors have none, so"
                "\n      branches on them followed assumed values (memest estimate lists them)",
                file=out,
            )


def _profile(settings: Settings, out: TextIO) -> None:
    args = settings.args
    orders = NODE_ORDERS if args.by == "node" else MODULE_ORDERS
    # --top N: the N largest (by saved bytes unless --sort says), not the first N in graph/tree order.
    order = args.sort or (orders[1] if args.top is not None else orders[0])
    if order not in orders:
        raise SpecError(f"--sort for --by {args.by} must be one of {', '.join(orders)}; got {order!r}")
    with _progress(settings) as progress:
        progress.update(f"building {args.model}")
        case = settings.build(args.model)
        progress.update(f"profiling {args.model}: one step on fake tensors")
        if args.by == "node":
            profile = profile_graph(
                case.model,
                case.estimate_batch,
                loss_fn=case.config.loss_fn,
                precision=case.config.precision,
                device=args.device,
            )
        else:
            est = estimate_case(case, device=args.device, steps=1)
    if args.by == "node":
        if args.json:
            print(json.dumps(profile.to_json(order, args.top)), file=out)
            return
        print(f"node profile of {args.model} ({settings.describe()}; first step)", file=out)
        print(profile.table(top=args.top, by=order), file=out)
        print(f"\n  profiled in {profile.seconds:.2f} s", file=out)
        return
    if args.json:
        data = {
            "modules": module_rows(est.modules, order, args.top),
            "device": est.device,
            "precision": est.precision,
            "approximate": est.approximate,
        }
        print(json.dumps(data), file=out)
        return
    print(f"module profile of {args.model} ({settings.describe()}; first step)", file=out)
    print(module_table(est.modules, order, args.top), file=out)


def _max_batch_size(settings: Settings, out: TextIO) -> None:
    args = settings.args
    budget = args.memory_budget
    # The search forks a worker for pairs of probes, which needs a process without other threads: the
    # progress line changes at each probe instead of from a thread of its own.
    with _progress(settings, threads=False) as progress:
        progress.update(f"building {args.model}")
        # Nothing of the batch is real: every probe resizes its shapes on the meta device.
        case = settings.build(args.model)
        progress.update(f"searching: the smallest batch size {args.model} accepts")

        def probed(n: int, peak: int) -> None:
            verdict = "fits" if peak <= budget else "over"
            progress.update(f"searching: batch size {n} needs {format_bytes(peak)} ({verdict})")

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
            progress=probed,
            strategy=settings.strategy,
            gpu=settings.gpu,
            calibrate=args.calibrate,
            replay_blocks=args.replay_blocks,
        )
    if result.max_batch_size == 0 or result.capped:
        print(f"{PROG}: {result.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()), file=out)
        return
    # The batch size of --batch-size is only where the search starts: the heading names the input.
    searched = settings.describe().replace(settings.inputs.describe(), _per_row(settings), 1)
    print(f"max batch size of {args.model} ({searched})", file=out)
    if result.approximate:
        print("  APPROXIMATE: no GPU here; simulated on the CPU and accounted as CUDA", file=out)
    print(f"  {result.message}", file=out)
    print(f"\n  {len(result.probes)} estimates in {result.seconds:.2f} s", file=out)
    if (c := result.calibration) is not None and c.anchors is not None:
        print(
            f"  kernels calibrated at batch sizes {c.anchors[0]} and {c.anchors[1]}, fitted for the other "
            f"probes ({c.refined} of their op signatures measured; {c.measured} now, in {c.seconds:.2f} s)",
            file=out,
        )


def _per_row(settings: Settings) -> str:
    """The input of one row of the batch, without a batch size: ``'rows of 3x224x224'``."""
    i = settings.inputs
    if i.shape is not None:
        return f"rows of {'x'.join(map(str, i.shape))}"
    return f"rows of {i.tokens} tokens < {i.vocab}"


def _plan(settings: Settings, out: TextIO) -> None:
    from lightning_memest.plan import plan_checkpointing

    args = settings.args
    with _progress(settings) as progress:
        progress.update(f"building {args.model}")
        case = settings.build(args.model)
        progress.update(f"planning {args.model}: estimating, solving, simulating the plan")
        plan = plan_checkpointing(
            case.model,
            case.batch,
            args.budget,
            modules=[m.strip() for m in args.modules.split(",") if m.strip()] if args.modules else (),
            kinds=tuple(args.kinds.split(",")),
            max_batch_size=args.search_batch,
            **_step_args(settings, case),
        )
        compiled = _compiled_budget(settings, case, progress) if args.compile is not None else None
    if not plan.fits:
        print(f"{PROG}: no checkpointing of these modules fits: {plan.describe()}", file=sys.stderr)
    if args.json:
        extra = {} if compiled is None else {"compiled_budget": compiled.to_json()}
        print(json.dumps({**plan.to_json(), "approximate": plan.estimate.approximate, **extra}), file=out)
        return
    print(f"checkpointing plan for {args.model} ({settings.describe()})", file=out)
    if plan.estimate.approximate:
        print("  APPROXIMATE: no GPU here; simulated on the CPU and accounted as CUDA", file=out)
    print(f"  {plan}".replace("\n", "\n  "), file=out)
    before, after = format_bytes(plan.baseline.peak_bytes), format_bytes(plan.peak_bytes)
    print(
        f"\n  peak before {before}, with the plan {after} (re-simulated); {plan.simulations} simulations "
        f"in {plan.seconds:.2f} s",
        file=out,
    )
    if compiled is not None:
        print(f"\n  or the compiler's own recompute: {_describe_compiled(compiled)}", file=out)


def _compiled_budget(settings: Settings, case: Case, progress: Progress) -> CompiledBudget:
    """``plan --compile``: the highest activation_memory_budget that fits, each value re-simulated."""
    from lightning_memest.plan import plan_compiled_budget

    args = settings.args

    def recompiling(value: float) -> None:
        progress.update(f"simulating the step under activation_memory_budget {value:g} (a recompile)")

    return plan_compiled_budget(
        case.model, case.batch, args.budget, on_value=recompiling, **_step_args(settings, case)
    )


def _step_args(settings: Settings, case: Case) -> dict[str, Any]:
    """The planners' ``estimate_step`` arguments for ``case`` under these settings."""
    args = settings.args
    return {
        "loss_fn": case.config.loss_fn,
        "optimizer": case.config.optimizer,
        "precision": case.config.precision,
        "device": args.device,
        "strategy": settings.strategy,
        "gpu": settings.gpu,
        "calibrate": args.calibrate,
        "replay_blocks": args.replay_blocks,
    }


def _describe_compiled(found: CompiledBudget) -> str:
    if found.fits_as_it_is:
        return f"the step fits as it is, at activation_memory_budget {found.baseline_value:g}"
    if found.value is None or found.peak_bytes is None:
        return f"no activation_memory_budget tried fits ({found.describe()})"
    return (
        f"torch._functorch.config.activation_memory_budget = {found.value:g}: peak "
        f"{format_bytes(found.peak_bytes)} (re-simulated), {found.cost}"
    )


#: The command functions, by name: ``COMMANDS[name](settings, out)``.
COMMANDS: dict[str, Callable[[Settings, TextIO], None]] = {
    "estimate": _estimate,
    "measure": _measure,
    "compare": _compare,
    "max-batch-size": _max_batch_size,
    "profile": _profile,
    "plan": _plan,
}
