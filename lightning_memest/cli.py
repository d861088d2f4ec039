"""``memest``: estimate, measure and compare the memory of one training step from the command line.

::

    memest estimate MODEL [--model-kwargs JSON] [--batch-size N]
                    (--input-shape C,H,W | --tokens SEQ --vocab V)
                    [--loss cross_entropy|sum] [--optimizer sgd|adam|adamw|none]
                    [--precision 32-true|16-mixed|bf16-mixed|16-true|bf16-true] [--device cpu|cuda] [--json]
    memest measure  (the same arguments)
    memest compare MODEL [MODEL ...] (the same input, loss, optimizer, precision and device flags) [--json]
    memest max-batch-size MODEL --memory-budget SIZE (the flags of estimate) [--max-batch-size N]

``max-batch-size`` prints the largest batch size whose estimated peak is within SIZE (bytes, or a
number with a unit: ``10GiB``, ``512MiB``, ``1.5GB``, ``8g``; see
:func:`~lightning_memest.batch_size.parse_size`); ``--batch-size`` is the second size it probes. With
``--json``: ``{"max_batch_size": int, "peak_bytes_at_max": int | null, "probes": int, "seconds": float}``
(``max_batch_size`` 0 and ``peak_bytes_at_max`` null when not even one sample fits: still exit 0, with
a note on stderr). Each probe is reported on stderr as it finishes.

``MODEL`` is ``package.module:name`` (the current directory is importable); see
:mod:`lightning_memest.models` for how models, inputs, losses and optimizers are made.

Exit status: 0 on success; 2 on bad input (an unknown model, a bad flag, an input the model rejects)
and when the estimator cannot simulate the step (:class:`~lightning_memest.errors.MemestError`), with
one ``memest: error: ...`` line on stderr; 1 on an unexpected failure (set ``MEMEST_DEBUG=1`` for its
traceback).

Example:
    >>> main(["estimate", "torch.nn:Linear", "--model-kwargs", '{"in_features": 8, "out_features": 4}',
    ...       "--input-shape", "8", "--json"])  # doctest: +SKIP
    {"peak_bytes": {"first_step": ..., "steady_state": ...}, ...}
    0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

import torch

from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.batch_size import DEFAULT_CAP, case_batch_maker, max_batch_size, parse_size
from lightning_memest.engine.distributed import DDP, FSDP, STRATEGIES, Strategy
from lightning_memest.engine.step import PRECISIONS
from lightning_memest.errors import MemestError
from lightning_memest.fx import MODULE_ORDERS, NODE_ORDERS, module_rows, module_table, profile_graph
from lightning_memest.models import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LOSS,
    DEFAULT_OPTIMIZER,
    LOSSES,
    OPTIMIZERS,
    Case,
    InputSpec,
    SpecError,
    build_case,
    estimate_case,
    measure_case,
    parse_shape,
    resolve_model,
)
from lightning_memest.report import ModuleStats, StepEstimate, format_bytes, human_flops

__all__ = ["main"]

PROG = "memest"
DEVICES = ("cpu", "cuda")
#: How many modules the readable estimate lists.
TOP_MODULES = 5


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``memest: error: ...``), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def _add_case_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-kwargs",
        metavar="JSON",
        default=None,
        help="keyword arguments for the model class or factory, as a JSON object",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"batch size (default {DEFAULT_BATCH_SIZE})",
    )
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--input-shape", metavar="C,H,W", help="float input of shape (N, C, H, W) (any number of sizes)"
    )
    inputs.add_argument("--tokens", type=int, metavar="SEQ", help="token-id input of shape (N, SEQ)")
    p.add_argument(
        "--vocab", type=int, metavar="V", help="vocabulary size of --tokens inputs (required with it)"
    )
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default=DEFAULT_LOSS,
        help="cross_entropy against random class ids (the output's last dimension), or the output's sum "
        f"(default {DEFAULT_LOSS})",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=DEFAULT_OPTIMIZER,
        help=f"sgd (lr 0.01, momentum 0.9), adam or adamw (lr 1e-3), or none (default {DEFAULT_OPTIMIZER})",
    )
    p.add_argument(
        "--precision", choices=PRECISIONS, default="32-true", help="Lightning precision (default 32-true)"
    )
    p.add_argument("--device", choices=DEVICES, default="cpu", help="device (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON value instead of a table")


def build_parser() -> argparse.ArgumentParser:
    """The ``memest`` argument parser."""
    parser = _Parser(
        prog=PROG,
        description="Estimate the memory of one PyTorch training step on fake tensors; measure it for real.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{estimate,measure,compare,profile,max-batch-size}"
    )
    model_help = "package.module:name of an nn.Module class or factory (the current directory is importable)"
    for name, help_text in (
        ("estimate", "estimate the peak memory of a training step, without running it"),
        ("measure", "run two real training steps and measure their peak memory"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("model", metavar="MODEL", help=model_help)
        _add_case_flags(p)
        if name == "estimate":
            _add_strategy_flags(p)
            _add_gpu_flags(p, memory=True)
    p = sub.add_parser(
        "compare",
        help="estimate and measure each model, and show the error",
        description="estimate and measure each model, and show the error",
    )
    p.add_argument("models", metavar="MODEL", nargs="+", help=model_help)
    _add_case_flags(p)
    _add_max_batch_size_parser(sub, model_help)
    _add_profile_parser(sub, model_help)
    return parser


def _add_strategy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "data parallelism",
        "simulate one rank (rank 0) of a DDP or FSDP2 job with PyTorch's own code on a fake process group; "
        "every figure is per rank",
    )
    g.add_argument("--strategy", choices=STRATEGIES, default=None, help="ddp or fsdp (FSDP2 fully_shard)")
    g.add_argument(
        "--world-size", type=int, default=None, metavar="N", help="ranks in the job (with --strategy)"
    )
    g.add_argument(
        "--fsdp-units",
        metavar="CLASS,...",
        default=None,
        help="class names of the modules sharded as FSDP units (default: each block of every nn.ModuleList)",
    )
    g.add_argument(
        "--fsdp-param-dtype",
        choices=tuple(_DTYPES),
        default=None,
        help="FSDP's MixedPrecisionPolicy param_dtype: the dtype units are all-gathered and computed in",
    )
    g.add_argument(
        "--fsdp-reduce-dtype",
        choices=tuple(_DTYPES),
        default=None,
        help="FSDP's MixedPrecisionPolicy reduce_dtype: the dtype gradients are reduce-scattered in",
    )
    g.add_argument(
        "--fsdp-keep-unsharded",
        action="store_true",
        help="fully_shard(reshard_after_forward=False): units stay gathered from forward to backward",
    )
    g.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, metavar="MB", help="DDP's bucket size (default 25)"
    )
    g.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="DDP's gradient_as_bucket_view (gradients live in the buckets: no second copy)",
    )


def _add_gpu_flags(p: argparse.ArgumentParser, memory: bool) -> None:
    g = p.add_argument_group("the GPU (with --device cuda)")
    g.add_argument(
        "--cuda-capability",
        metavar="MAJOR.MINOR",
        default=None,
        help="the GPU's compute capability, for a what-if without one (9.0: H100/H200, 8.0: A100); it "
        "picks cuBLAS's workspace size (default: this machine's GPU, else PyTorch's pre-Hopper default)",
    )
    if memory:
        g.add_argument(
            "--gpu-memory",
            metavar="SIZE",
            default=None,
            help="say whether the step fits a GPU with this much memory (reserved peak + CUDA context)",
        )


def _gpu(args: argparse.Namespace) -> CudaDevice | None:
    text = getattr(args, "cuda_capability", None)
    if args.device != "cuda":
        if text is not None or getattr(args, "gpu_memory", None) is not None:
            raise SpecError("--cuda-capability and --gpu-memory go with --device cuda")
        return None
    local = torch.cuda.is_available()
    if text is None:
        return None if local else CudaDevice()
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise SpecError(f"--cuda-capability must look like 9.0; got {text!r}") from None
    if local:
        return dataclasses.replace(CudaDevice.local(torch.device("cuda")), capability=(major, minor))
    return CudaDevice(capability=(major, minor))


def _strategy(args: argparse.Namespace) -> Strategy | None:
    if args.strategy is None:
        if args.world_size is not None:
            raise SpecError("--world-size goes with --strategy ddp|fsdp")
        return None
    if args.world_size is None:
        raise SpecError(f"--strategy {args.strategy} needs --world-size N")
    if args.strategy == "ddp":
        return DDP(
            args.world_size,
            bucket_cap_mb=args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
        )
    units = tuple(u.strip() for u in args.fsdp_units.split(",") if u.strip()) if args.fsdp_units else None
    return FSDP(
        args.world_size,
        units=units,
        reshard_after_forward=False if args.fsdp_keep_unsharded else None,
        param_dtype=_DTYPES.get(args.fsdp_param_dtype or ""),
        reduce_dtype=_DTYPES.get(args.fsdp_reduce_dtype or ""),
    )


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _add_profile_parser(sub: Any, model_help: str) -> None:
    help_text = "what each graph node (or module) saves for backward, allocates and computes in one step"
    p = sub.add_parser("profile", help=help_text, description=help_text)
    p.add_argument("model", metavar="MODEL", help=model_help)
    _add_case_flags(p)
    p.add_argument(
        "--by",
        choices=("node", "module"),
        default="node",
        help="a row per torch.fx graph node (the model must be traceable by symbolic_trace) or per module "
        "(default node)",
    )
    p.add_argument(
        "--sort",
        metavar="FIGURE",
        default=None,
        help=f"sort by a figure, largest first: for nodes {', '.join(NODE_ORDERS[1:])}; for modules "
        f"{', '.join(MODULE_ORDERS[1:])} (default: graph order / module tree order)",
    )
    p.add_argument("--top", type=int, default=None, metavar="N", help="only the first N rows")


def _add_max_batch_size_parser(sub: Any, model_help: str) -> None:
    help_text = "find the largest batch size whose estimated peak is within a memory budget"
    p = sub.add_parser("max-batch-size", help=help_text, description=help_text)
    p.add_argument("model", metavar="MODEL", help=model_help)
    _add_case_flags(p)
    for action in p._actions:  # the same flag, another meaning here
        if action.dest == "batch_size":
            action.help = f"the second batch size probed, after 1 (default {DEFAULT_BATCH_SIZE})"
    p.add_argument(
        "--memory-budget",
        required=True,
        metavar="SIZE",
        help="the memory for the step: bytes, or a number and a unit (10GiB, 512MiB, 1.5GB, 8g)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_CAP,
        metavar="N",
        dest="cap",
        help=f"the largest batch size considered (default {DEFAULT_CAP})",
    )
    _add_strategy_flags(p)


# ------------------------------------------------------------------------------------------ settings


def _input_spec(args: argparse.Namespace) -> InputSpec:
    if args.tokens is not None and args.vocab is None:
        raise SpecError("--tokens needs --vocab")
    if args.vocab is not None and args.tokens is None:
        raise SpecError("--vocab goes with --tokens")
    shape = parse_shape(args.input_shape) if args.input_shape is not None else None
    return InputSpec(batch_size=args.batch_size, shape=shape, tokens=args.tokens, vocab=args.vocab)


def _model_kwargs(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"--model-kwargs is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise SpecError(f"--model-kwargs must be a JSON object; got {type(value).__name__}")
    return value


def _build(spec: str, args: argparse.Namespace, inputs: InputSpec, kwargs: dict[str, Any]) -> Case:
    return build_case(
        spec,
        inputs,
        model_kwargs=kwargs,
        loss=args.loss,
        optimizer=args.optimizer,
        precision=args.precision,
    )


def _settings(args: argparse.Namespace, inputs: InputSpec) -> str:
    text = f"{inputs.describe()}, {args.loss}, {args.optimizer}, {args.precision}, {args.device}"
    if getattr(args, "strategy", None) is not None:
        text += f", {args.strategy} on {args.world_size} ranks, per rank"
    return text


# ------------------------------------------------------------------------------------------ commands


def _estimate(args: argparse.Namespace, out: TextIO) -> None:
    inputs = _input_spec(args)
    case = _build(args.model, args, inputs, _model_kwargs(args.model_kwargs))
    est = estimate_case(case, device=args.device, strategy=_strategy(args), gpu=_gpu(args))
    fits = _fits_gpu(est, args.gpu_memory)
    if args.json:
        data = est.to_json()
        data["gpu_memory"] = fits
        print(json.dumps(data), file=out)
        return
    print(f"estimate of {args.model} ({_settings(args, inputs)})", file=out)
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
    print(f"\n  estimated in {est.estimate_seconds:.2f} s", file=out)


def _saved(m: ModuleStats) -> int:
    return m.saved_bytes


def _measure(args: argparse.Namespace, out: TextIO) -> None:
    inputs = _input_spec(args)
    case = _build(args.model, args, inputs, _model_kwargs(args.model_kwargs))
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
    print(f"measurement of {args.model} ({_settings(args, inputs)}, on {m.device})", file=out)
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


def _compare(args: argparse.Namespace, out: TextIO) -> None:
    inputs = _input_spec(args)
    kwargs = _model_kwargs(args.model_kwargs)
    # Check every spec before the first (slow) run, so a typo in the last model fails at once.
    for spec in args.models:
        resolve_model(spec)
    rows: list[dict[str, Any]] = []
    n = len(args.models)
    for i, spec in enumerate(args.models, 1):
        try:
            print(f"{PROG}: [{i}/{n}] estimating {spec}", file=sys.stderr, flush=True)
            # A fresh, identically seeded model for each run: measuring trains the model in place.
            est = estimate_case(_build(spec, args, inputs, kwargs), device=args.device)
            print(f"{PROG}: [{i}/{n}] measuring {spec}", file=sys.stderr, flush=True)
            m = measure_case(_build(spec, args, inputs, kwargs), device=args.device)
        except MemestError as e:
            raise MemestError(f"{spec}: {e}") from e
        rows.append(compare_row(spec, est, (m.first_step, m.steady_state), m.step_seconds))
    if args.json:
        print(json.dumps(rows), file=out)
        return
    print(f"compare ({_settings(args, inputs)})", file=out)
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


def _profile(args: argparse.Namespace, out: TextIO) -> None:
    if args.top is not None and args.top < 0:
        raise SpecError(f"--top must be at least 0; got {args.top}")
    orders = NODE_ORDERS if args.by == "node" else MODULE_ORDERS
    order = args.sort or orders[0]
    if order not in orders:
        raise SpecError(f"--sort for --by {args.by} must be one of {', '.join(orders)}; got {order!r}")
    inputs = _input_spec(args)
    case = _build(args.model, args, inputs, _model_kwargs(args.model_kwargs))
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
        print(f"node profile of {args.model} ({_settings(args, inputs)}; first step)", file=out)
        print(profile.table(top=args.top, by=order), file=out)
        print(f"\n  profiled in {profile.seconds:.2f} s", file=out)
        return
    est = estimate_case(case, device=args.device, steps=1)
    if args.json:
        print(json.dumps(module_rows(est.modules, order, args.top)), file=out)
        return
    print(f"module profile of {args.model} ({_settings(args, inputs)}; first step)", file=out)
    print(module_table(est.modules, order, args.top), file=out)


def _max_batch_size(args: argparse.Namespace, out: TextIO) -> None:
    try:
        budget = parse_size(args.memory_budget)
    except ValueError as e:
        raise SpecError(f"--memory-budget: {e}") from None
    if args.cap < 1:
        raise SpecError(f"--max-batch-size must be at least 1; got {args.cap}")
    inputs = _input_spec(args)
    strategy = _strategy(args)
    # Built (for real) at --batch-size: small, and it checks the input and makes the target's shape;
    # every probe resizes that batch on the meta device.
    case = _build(args.model, args, inputs, _model_kwargs(args.model_kwargs))

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
        start=inputs.batch_size,
        cap=args.cap,
        progress=progress,
        strategy=strategy,
        gpu=_gpu(args),
    )
    if result.max_batch_size == 0 or result.capped:
        print(f"{PROG}: {result.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_json()), file=out)
        return
    print(f"max batch size of {args.model} ({_settings(args, inputs)})", file=out)
    print(f"  {result.message}", file=out)
    print(f"\n  {len(result.probes)} estimates in {result.seconds:.2f} s", file=out)


_COMMANDS = {
    "estimate": _estimate,
    "measure": _measure,
    "compare": _compare,
    "max-batch-size": _max_batch_size,
    "profile": _profile,
}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memest`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> main(["measure", "torch.nn:Linear", "--model-kwargs", '{"in_features": 8, "out_features": 4}',
        ...       "--input-shape", "8", "--json"])  # doctest: +ELLIPSIS
        {"peak_bytes": {"first_step": ..., "steady_state": ...}, "reserved_bytes": null, "step_seconds": ...}
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help exits 0, usage errors 2; return rather than exit when called in-process
        return e.code if isinstance(e.code, int) else 2
    # `memest estimate mymodel:Net` run from a project directory should find mymodel.py there, as
    # `python -m` would; the console script's sys.path does not hold the current directory.
    # Kineto (the profiler `measure` uses on CPU) writes profiler_start/stop lines, and on machines
    # without a GPU a "gpuGetDeviceCount failed" line, to stderr on every run; stderr is kept for
    # errors and progress. It reads the variable when the profiler starts; a user's own setting wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        _COMMANDS[args.command](args, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`memest ... | head`): nothing left to say, as any Unix tool.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MemestError as e:
        if os.environ.get("MEMEST_DEBUG"):
            raise
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("MEMEST_DEBUG"):
            raise
        print(
            f"{PROG}: error: unexpected {type(e).__name__}: {_one_line(e)}"
            " (set MEMEST_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        # Called in-process (tests, scripts), leave the import path as it was.
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
