"""The flags of each ``memest`` subcommand: which command takes which, their help, choices and
defaults. Their values are checked as they are parsed (``flag_values.py``); flags that only make sense
together are checked together afterwards (``settings.py``).

Torch-free (the choices and defaults come from :mod:`lightning_memest.constants`), so that ``memest
--help`` answers at once.

Example:
    >>> import argparse
    >>> sub = argparse.ArgumentParser(prog="memest").add_subparsers(dest="command")
    >>> add_profile_parser(sub)
    >>> sub.choices["profile"].parse_args(["m:M", "--input-shape", "4", "--top", "3"]).top
    3
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_memest.cli.flag_values import (
    DIM,
    MAX_BUCKET_MB,
    MAX_ROWS,
    MAX_WORLD_SIZE,
    byte_size,
    capability,
    positive_number,
    shape_text,
    whole,
)
from lightning_memest.constants import (
    COMPILE_MODES,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CAP,
    DEFAULT_LOSS,
    DEFAULT_OPTIMIZER,
    LOOPS,
    LOSSES,
    MODULE_ORDERS,
    NODE_ORDERS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    STRATEGIES,
)

__all__ = [
    "DEVICES",
    "add_compare_parser",
    "add_estimate_parsers",
    "add_max_batch_size_parser",
    "add_plan_parser",
    "add_profile_parser",
]

DEVICES = ("cpu", "cuda")

#: --fsdp-param-dtype / --fsdp-reduce-dtype: the names (their torch dtypes: settings._dtype).
_DTYPE_NAMES = ("fp32", "bf16", "fp16")

_MODEL_HELP = (
    "package.module:name of an nn.Module class or factory. MODEL is imported and called: it runs that "
    "code, as python -m does. The current directory is importable, after the installed packages (a "
    "torchvision.py there does not shadow torchvision)"
)


def _add_case_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-kwargs",
        metavar="JSON",
        default=None,
        help="keyword arguments for the model class or factory, as a JSON object",
    )
    p.add_argument(
        "--batch-size",
        type=DIM,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"batch size (default {DEFAULT_BATCH_SIZE})",
    )
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--input-shape",
        type=shape_text,
        metavar="C,H,W",
        help="float input of shape (N, C, H, W) (any number of sizes)",
    )
    inputs.add_argument("--tokens", type=DIM, metavar="SEQ", help="token-id input of shape (N, SEQ)")
    p.add_argument(
        "--vocab", type=DIM, metavar="V", help="vocabulary size of --tokens inputs (required with it)"
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
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=COMPILE_MODES,
        default=None,
        metavar="MODE",
        help="torch.compile the model (mode: default, or max-autotune-no-cudagraphs); the estimate "
        "simulates the compiled step: dynamo, AOTAutograd and inductor compile it, inductor's buffer plan "
        "runs on fake tensors",
    )
    p.add_argument(
        "--activation-memory-budget",
        type=positive_number(1.0, " (a fraction of what the partitioner saves by default)"),
        default=None,
        metavar="F",
        help="with --compile: torch._functorch.config.activation_memory_budget, the compiler's own "
        "recompute under a budget (0 < F <= 1; 1: save what the partitioner saves by default)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON value instead of a table")


def add_estimate_parsers(sub: Any) -> None:
    """``memest estimate`` and ``memest measure``: the same case, the flags of a simulation for the first."""
    for name, help_text in (
        ("estimate", "estimate the peak memory of a training step, without running it"),
        ("measure", "run two real training steps and measure their peak memory"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
        _add_case_flags(p)
        p.add_argument(
            "--loop",
            choices=LOOPS,
            default="train",
            help="what the batch does: train (default: two training steps), validate (one batch in eval "
            "mode: forward and loss under no_grad) or predict (one batch in eval mode: forward only, "
            "under inference_mode)",
        )
        if name == "estimate":
            _add_calibrate_flag(p)
            _add_replay_flag(p)
            _add_strategy_flags(p)
            _add_pipeline_flags(p)
            _add_gpu_flags(p, memory=True)


def _add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "pipeline parallelism (torch.distributed.pipelining; every stage estimated, the worst reported)"
    )
    g.add_argument(
        "--pp",
        type=whole(1, MAX_WORLD_SIZE, " (2**16 ranks)"),
        default=None,
        metavar="N",
        help="pipeline stages on N ranks, cut by --pp-split; the batch cut into --microbatches",
    )
    g.add_argument(
        "--pp-split",
        default=None,
        metavar="MODULE:FUNCTION",
        help="the job's split, called as FUNCTION(model, stage, stages): prunes the model to that stage in "
        "place (returning None or the model) or returns the stage's module",
    )
    g.add_argument(
        "--microbatches",
        type=whole(1, MAX_WORLD_SIZE, " (2**16)"),
        default=None,
        metavar="M",
        help="microbatches a batch is cut into (default: one per stage)",
    )
    g.add_argument(
        "--pp-schedule",
        choices=PIPELINE_SCHEDULES,
        default="1F1B",
        help="the schedule (default 1F1B); the others run --pp-stages-per-rank stages a rank (the V-shaped "
        "ZBVZeroBubble and DualPipeV two)",
    )
    g.add_argument(
        "--pp-stages-per-rank",
        type=whole(2, 64),
        default=2,
        metavar="K",
        help="with a --pp-schedule of several stages a rank: how many (default 2)",
    )


def add_compare_parser(sub: Any) -> None:
    """``memest compare``: several models, the same case flags."""
    p = sub.add_parser(
        "compare",
        help="estimate and measure each model, and show the error",
        description="estimate and measure each model, and show the error",
    )
    p.add_argument("models", metavar="MODEL", nargs="+", help=_MODEL_HELP)
    _add_case_flags(p)
    _add_calibrate_flag(p)


def _add_calibrate_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure what this machine's kernels allocate beyond their outputs: each distinct op of "
        "the step runs once, alone, for real (small; cached per machine in $MEMEST_CACHE_DIR)",
    )


def _add_strategy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "data parallelism",
        "simulate one rank (rank 0) of a DDP, FSDP2 or tensor-parallel job with PyTorch's own code on a fake "
        "process group; every figure is per rank",
    )
    g.add_argument("--strategy", choices=STRATEGIES, default=None, help="ddp or fsdp (FSDP2 fully_shard)")
    g.add_argument(
        "--world-size",
        type=whole(1, MAX_WORLD_SIZE, " (2**16 ranks)"),
        default=None,
        metavar="N",
        help="ranks in the job (with --strategy)",
    )
    g.add_argument(
        "--fsdp-units",
        metavar="CLASS,...",
        default=None,
        help="class names of the modules sharded as FSDP units (default: each block of every nn.ModuleList)",
    )
    g.add_argument(
        "--fsdp-param-dtype",
        choices=_DTYPE_NAMES,
        default=None,
        help="FSDP's MixedPrecisionPolicy param_dtype: the dtype units are all-gathered and computed in",
    )
    g.add_argument(
        "--fsdp-reduce-dtype",
        choices=_DTYPE_NAMES,
        default=None,
        help="FSDP's MixedPrecisionPolicy reduce_dtype: the dtype gradients are reduce-scattered in",
    )
    g.add_argument(
        "--fsdp-keep-unsharded",
        action="store_true",
        help="fully_shard(reshard_after_forward=False): units stay gathered from forward to backward",
    )
    g.add_argument(
        "--fsdp-kept-gathered",
        default=None,
        metavar="PATH,...",
        help="units (their module paths, e.g. blocks.31) given reshard_after_forward=False alone: as large "
        "jobs keep the last block gathered",
    )
    g.add_argument(
        "--tp",
        type=whole(1, MAX_WORLD_SIZE, " (2**16 ranks)"),
        default=None,
        metavar="N",
        help="tensor parallelism over N ranks, by --tp-plan; with --strategy fsdp --world-size W, a 2-D "
        "mesh of W/N data-parallel x N tensor-parallel ranks (Lightning's ModelParallelStrategy)",
    )
    g.add_argument(
        "--tp-plan",
        default=None,
        metavar="MODULE:FUNCTION",
        help="the job's tensor-parallel plan, called as FUNCTION(model, mesh) on a 1-D mesh of --tp ranks "
        "(parallelize_module with its styles, torchtitan's apply_tp)",
    )
    g.add_argument(
        "--bucket-cap-mb",
        type=positive_number(MAX_BUCKET_MB, " (1 TiB)"),
        default=None,
        metavar="MB",
        help="DDP's bucket size (default 25)",
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
        type=capability,
        metavar="MAJOR.MINOR",
        default=None,
        help="the GPU's compute capability, for a what-if without one (9.0: H100/H200, 8.0: A100); it "
        "picks cuBLAS's workspace size (default: this machine's GPU, else PyTorch's pre-Hopper default)",
    )
    g.add_argument(
        "--cuda-context",
        type=byte_size,
        metavar="SIZE",
        default=None,
        help="what the CUDA context and the libraries' kernels take outside the caching allocator, as "
        "nvidia-smi shows it beside reserved (default: measured on this machine's GPU, else assumed "
        "512MiB and said so)",
    )
    if memory:
        g.add_argument(
            "--gpu-memory",
            type=byte_size,
            metavar="SIZE",
            default=None,
            help="say whether the step fits a GPU with this much memory (reserved peak + CUDA context)",
        )


def add_profile_parser(sub: Any) -> None:
    help_text = "what each graph node (or module) saves for backward, allocates and computes in one step"
    p = sub.add_parser("profile", help=help_text, description=help_text)
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
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
    p.add_argument(
        "--top",
        type=whole(0, MAX_ROWS),
        default=None,
        metavar="N",
        help="only the N largest rows (by --sort; saved bytes unless given)",
    )


def _add_replay_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replay-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="simulate a few of each run of six or more alike blocks (a decoder's layers) and "
        "replay their events for the others, where checks find that they repeat: the same "
        "figures, in a time that hardly grows with depth (on by default; training only; "
        "--no-replay-blocks simulates every block)",
    )


def add_max_batch_size_parser(sub: Any) -> None:
    help_text = "find the largest batch size whose estimated peak is within a memory budget"
    p = sub.add_parser("max-batch-size", help=help_text, description=help_text)
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    _add_case_flags(p)
    for action in p._actions:  # the same flag, another meaning here
        if action.dest == "batch_size":
            action.help = (
                "the second batch size probed, after the smallest the model accepts (1, else 2, ...; "
                f"default {DEFAULT_BATCH_SIZE})"
            )
    p.add_argument(
        "--memory-budget",
        type=byte_size,
        required=True,
        metavar="SIZE",
        help="the memory for the step: bytes, or a number and a unit (10GiB, 512MiB, 1.5GB, 8g)",
    )
    p.add_argument(
        "--max-batch-size",
        type=DIM,
        default=DEFAULT_CAP,
        metavar="N",
        dest="cap",
        help=f"the largest batch size considered (default {DEFAULT_CAP}; at most 2**31-1)",
    )
    _add_calibrate_flag(p)  # calibrated at --batch-size and half of it, fitted for the other probes
    _add_replay_flag(p)
    _add_strategy_flags(p)
    _add_gpu_flags(p, memory=False)


def add_plan_parser(sub: Any) -> None:
    help_text = (
        "plan activation checkpointing for a memory budget: the least recompute whose estimated peak "
        "fits, proven by simulating the step with the plan applied"
    )
    p = sub.add_parser("plan", help=help_text, description=help_text)
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    _add_case_flags(p)
    p.add_argument(
        "--budget",
        type=byte_size,
        required=True,
        metavar="SIZE",
        help="the memory for the step: bytes, or a number and a unit (24GiB, 512MiB, 1.5GB, 8g)",
    )
    p.add_argument(
        "--modules",
        metavar="NAME,...",
        default=None,
        help="qualified names of modules to consider besides the model's repeated blocks",
    )
    p.add_argument(
        "--kinds",
        choices=("full,selective", "full", "selective"),
        default="full,selective",
        help="the checkpointing offered: full (the block's forward again in backward), selective (torch's "
        "selective checkpointing, the matrix products saved) or both (default)",
    )
    p.add_argument(
        "--max-batch-size",
        action="store_true",
        dest="search_batch",
        help="also find the largest batch size that fits the budget with the plan",
    )
    _add_calibrate_flag(p)
    _add_replay_flag(p)
    _add_strategy_flags(p)
    _add_gpu_flags(p, memory=False)
