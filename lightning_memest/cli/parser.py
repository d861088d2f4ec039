"""The ``memest`` argument parser, and the settings it yields: the flags of every command, checked
together once (a bad combination is one usage error before any model is built).

Building and running the parser imports no torch (its choices and defaults come from
:mod:`lightning_memest.constants`): ``memest --help``, ``--version`` and a usage error answer at once.
:func:`settings` and the commands import the library when they run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from lightning_memest.constants import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_CAP,
    DEFAULT_LOSS,
    DEFAULT_OPTIMIZER,
    LOOPS,
    LOSSES,
    MODULE_ORDERS,
    NODE_ORDERS,
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
)
from lightning_memest.errors import SpecError
from lightning_memest.sizes import SizeTooLarge, parse_size

if TYPE_CHECKING:
    import torch

    from lightning_memest.accounting.cuda_device import CudaDevice
    from lightning_memest.cases import Case, InputSpec
    from lightning_memest.engine.distributed import Strategy

__all__ = ["DEVICES", "PROG", "Settings", "build_parser", "settings", "version"]

PROG = "memest"
DEVICES = ("cpu", "cuda")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``memest: error: ...``), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def version() -> str:
    """``memest --version``: this package's release and the releases it runs with (for bug reports),
    read from the installed packages' metadata: importing torch and Lightning would take seconds."""
    import platform

    import lightning_memest

    return (
        f"{PROG} {lightning_memest.__version__} (torch {_torch_release()}, lightning "
        f"{_installed('lightning')}, Python {platform.python_version()})"
    )


def _installed(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_release() -> str:
    """torch's release as ``torch.__version__`` gives it (``2.14.1+cu130``: the metadata drops the
    build's ``+cu130``), read from ``torch/version.py`` without importing torch."""
    import importlib.metadata
    import re
    from pathlib import Path

    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    try:
        text = Path(str(dist.locate_file("torch/version.py"))).read_text()
    except OSError:
        text = ""
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else dist.version


class _Version(argparse.Action):
    """``--version``: its text is made only when asked for (it reads the installed packages' metadata)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "show the releases in use and exit")
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        print(version())
        parser.exit()


# Every number a flag takes is checked as it is parsed: a bad one is a usage error (exit 2) before
# any model is built. Each has an upper bound too: a number past what torch can hold (2**63) failed deep
# inside it, as an unexpected error.

#: One dimension of a tensor (--batch-size, --max-batch-size, --tokens, --vocab, each size of
#: --input-shape): the largest int32, what many kernels' 32-bit indexing allows. Far beyond any real step,
#: yet an estimate beyond the machine still answers (its batch is never made: a test runs 10**7).
MAX_DIM = 2**31 - 1
#: Ranks (--world-size): beyond the shard groups of the largest jobs. The fake process group's work grows
#: with them (FSDP at 65,536 ranks: about 100 s for a two-layer MLP).
MAX_WORLD_SIZE = 2**16
#: Rows shown (--top): more than any profile has.
MAX_ROWS = 2**31 - 1
#: DDP's bucket (--bucket-cap-mb): 1 TiB, more than any model's gradients (1e308 overflowed DDP's bytes).
MAX_BUCKET_MB = 2.0**20
#: Memory sizes (--memory-budget, --gpu-memory): 1024 TiB (2**60 bytes), beyond any machine.
MAX_SIZE = 2**60
#: MAJOR and MINOR of --cuda-capability (GPUs so far: up to 12.x).
MAX_CAPABILITY = 99
#: How deep --model-kwargs may nest arrays and objects: far beyond any model's keyword arguments, well
#: within Python's recursion limit (which the JSON parser, and code walking the values, run into).
MAX_JSON_DEPTH = 100


def _shown(text: str) -> str:
    """``text`` for an error message: a pasted megabyte of digits is not repeated in full."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def _whole(minimum: int, maximum: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also past Python's 4300 digits
            raise argparse.ArgumentTypeError(f"invalid int value: {_shown(text)}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}; got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}{why}; got {_shown(text.strip())}")
        return value

    return parse


def _positive_number(maximum: float, why: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {_shown(text)}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a number more than 0; got {_shown(text)}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:.15g}{why}; got {_shown(text)}")
        return value

    return parse


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except SizeTooLarge:
        value = MAX_SIZE + 1  # too large for any machine: said with the flag's own limit below
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most 1024TiB ({MAX_SIZE} bytes); got {_shown(text)}")
    return value


def _capability(text: str) -> tuple[int, int]:
    major, dot, minor = text.partition(".")
    if not (dot and major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"must look like 9.0 (MAJOR.MINOR); got {_shown(text)}")
    if int(major) > MAX_CAPABILITY or int(minor) > MAX_CAPABILITY:
        raise argparse.ArgumentTypeError(
            f"MAJOR and MINOR must be at most {MAX_CAPABILITY} (like 9.0); got {_shown(text)}"
        )
    return int(major), int(minor)


def _shape_text(text: str) -> str:
    """``--input-shape``: each size bounded as a dimension (``cases.parse_shape`` reads the rest)."""
    for part in text.split(","):
        try:
            size = int(part)
        except ValueError:
            continue  # not a number: settings() says what a shape looks like
        if size > MAX_DIM:
            raise argparse.ArgumentTypeError(
                f"each size must be at most {MAX_DIM} (2**31-1, a tensor dimension); "
                f"got {_shown(part.strip())}"
            )
    return text


_DIM = _whole(1, MAX_DIM, " (2**31-1, a tensor dimension)")

#: --fsdp-param-dtype / --fsdp-reduce-dtype: the names (their torch dtypes: _dtype).
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
        type=_DIM,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"batch size (default {DEFAULT_BATCH_SIZE})",
    )
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--input-shape",
        type=_shape_text,
        metavar="C,H,W",
        help="float input of shape (N, C, H, W) (any number of sizes)",
    )
    inputs.add_argument("--tokens", type=_DIM, metavar="SEQ", help="token-id input of shape (N, SEQ)")
    p.add_argument(
        "--vocab", type=_DIM, metavar="V", help="vocabulary size of --tokens inputs (required with it)"
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
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{estimate,measure,compare,profile,max-batch-size,plan}"
    )
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
            _add_gpu_flags(p, memory=True)
    p = sub.add_parser(
        "compare",
        help="estimate and measure each model, and show the error",
        description="estimate and measure each model, and show the error",
    )
    p.add_argument("models", metavar="MODEL", nargs="+", help=_MODEL_HELP)
    _add_case_flags(p)
    _add_calibrate_flag(p)
    _add_max_batch_size_parser(sub)
    _add_profile_parser(sub)
    _add_plan_parser(sub)
    return parser


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
        "simulate one rank (rank 0) of a DDP or FSDP2 job with PyTorch's own code on a fake process group; "
        "every figure is per rank",
    )
    g.add_argument("--strategy", choices=STRATEGIES, default=None, help="ddp or fsdp (FSDP2 fully_shard)")
    g.add_argument(
        "--world-size",
        type=_whole(1, MAX_WORLD_SIZE, " (2**16 ranks)"),
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
        "--bucket-cap-mb",
        type=_positive_number(MAX_BUCKET_MB, " (1 TiB)"),
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
        type=_capability,
        metavar="MAJOR.MINOR",
        default=None,
        help="the GPU's compute capability, for a what-if without one (9.0: H100/H200, 8.0: A100); it "
        "picks cuBLAS's workspace size (default: this machine's GPU, else PyTorch's pre-Hopper default)",
    )
    g.add_argument(
        "--cuda-context",
        type=_size,
        metavar="SIZE",
        default=None,
        help="what the CUDA context and the libraries' kernels take outside the caching allocator, as "
        "nvidia-smi shows it beside reserved (default: measured on this machine's GPU, else assumed "
        "512MiB and said so)",
    )
    if memory:
        g.add_argument(
            "--gpu-memory",
            type=_size,
            metavar="SIZE",
            default=None,
            help="say whether the step fits a GPU with this much memory (reserved peak + CUDA context)",
        )


def _gpu(args: argparse.Namespace) -> CudaDevice | None:
    capability = getattr(args, "cuda_capability", None)
    context = getattr(args, "cuda_context", None)
    if args.device != "cuda":
        if capability is not None or context is not None or getattr(args, "gpu_memory", None) is not None:
            raise SpecError("--cuda-capability, --cuda-context and --gpu-memory go with --device cuda")
        return None
    import dataclasses

    import torch

    from lightning_memest.accounting.cuda_device import CudaDevice

    local = torch.cuda.is_available()
    if capability is None and context is None:
        return None if local else CudaDevice()
    gpu = CudaDevice.local(torch.device("cuda")) if local else CudaDevice()
    if capability is not None:
        gpu = dataclasses.replace(gpu, capability=capability)
    if context is not None:
        gpu = dataclasses.replace(gpu, context_bytes=context, context_given=True)
    return gpu


#: The flags of one strategy only: given with another (or none), they would be ignored.
_STRATEGY_FLAGS = {
    "ddp": (("bucket_cap_mb", "--bucket-cap-mb"), ("gradient_as_bucket_view", "--gradient-as-bucket-view")),
    "fsdp": (
        ("fsdp_units", "--fsdp-units"),
        ("fsdp_param_dtype", "--fsdp-param-dtype"),
        ("fsdp_reduce_dtype", "--fsdp-reduce-dtype"),
        ("fsdp_keep_unsharded", "--fsdp-keep-unsharded"),
    ),
}


def _strategy(args: argparse.Namespace) -> Strategy | None:
    chosen = getattr(args, "strategy", None)
    for strategy, flags in _STRATEGY_FLAGS.items():
        for dest, flag in flags:
            if strategy != chosen and getattr(args, dest, None) not in (None, False):
                raise SpecError(f"{flag} goes with --strategy {strategy}")
    if chosen is None:
        if getattr(args, "world_size", None) is not None:
            raise SpecError("--world-size goes with --strategy ddp|fsdp")
        return None
    if args.world_size is None:
        raise SpecError(f"--strategy {args.strategy} needs --world-size N")
    from lightning_memest.engine.distributed import DDP, FSDP

    if args.strategy == "ddp":
        return DDP(
            args.world_size,
            bucket_cap_mb=25.0 if args.bucket_cap_mb is None else args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
        )
    units = tuple(u.strip() for u in args.fsdp_units.split(",") if u.strip()) if args.fsdp_units else None
    return FSDP(
        args.world_size,
        units=units,
        reshard_after_forward=False if args.fsdp_keep_unsharded else None,
        param_dtype=_dtype(args.fsdp_param_dtype),
        reduce_dtype=_dtype(args.fsdp_reduce_dtype),
    )


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return None if name is None else dtypes[name]


def _add_profile_parser(sub: Any) -> None:
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
        type=_whole(0, MAX_ROWS),
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


def _add_max_batch_size_parser(sub: Any) -> None:
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
        type=_size,
        required=True,
        metavar="SIZE",
        help="the memory for the step: bytes, or a number and a unit (10GiB, 512MiB, 1.5GB, 8g)",
    )
    p.add_argument(
        "--max-batch-size",
        type=_DIM,
        default=DEFAULT_CAP,
        metavar="N",
        dest="cap",
        help=f"the largest batch size considered (default {DEFAULT_CAP}; at most 2**31-1)",
    )
    _add_calibrate_flag(p)  # calibrated at --batch-size and half of it, fitted for the other probes
    _add_replay_flag(p)
    _add_strategy_flags(p)
    _add_gpu_flags(p, memory=False)


def _add_plan_parser(sub: Any) -> None:
    help_text = (
        "plan activation checkpointing for a memory budget: the least recompute whose estimated peak "
        "fits, proven by simulating the step with the plan applied"
    )
    p = sub.add_parser("plan", help=help_text, description=help_text)
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    _add_case_flags(p)
    p.add_argument(
        "--budget",
        type=_size,
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


# ------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Settings:
    """What the flags of a command ask for, checked: the input, the model's keyword arguments, the
    strategy and the GPU (``None`` where not asked for)."""

    args: argparse.Namespace
    inputs: InputSpec
    model_kwargs: dict[str, Any]
    strategy: Strategy | None
    gpu: CudaDevice | None

    def build(self, spec: str) -> Case:
        """The case of model ``spec`` with these settings (a new, identically seeded model each time)."""
        args = self.args
        from lightning_memest.cases import build_case

        return build_case(
            spec,
            self.inputs,
            model_kwargs=self.model_kwargs,
            loss=args.loss,
            optimizer=args.optimizer,
            precision=args.precision,
        )

    def describe(self) -> str:
        """The settings in one line, for the heading of a command's output."""
        args = self.args
        text = f"{self.inputs.describe()}, {args.loss}, {args.optimizer}, {args.precision}, {args.device}"
        if self.strategy is not None:
            text += f", {args.strategy} on {args.world_size} ranks, per rank"
        return text


def settings(args: argparse.Namespace) -> Settings:
    """Check the flags of ``args`` together; a :class:`SpecError` names what is wrong."""
    import torch

    if getattr(args, "calibrate", False) and args.device == "cuda" and not torch.cuda.is_available():
        raise SpecError("--calibrate measures this machine's kernels: there is no GPU here for --device cuda")
    return Settings(args, _input_spec(args), _model_kwargs(args.model_kwargs), _strategy(args), _gpu(args))


def _input_spec(args: argparse.Namespace) -> InputSpec:
    if args.tokens is not None and args.vocab is None:
        raise SpecError("--tokens needs --vocab")
    if args.vocab is not None and args.tokens is None:
        raise SpecError("--vocab goes with --tokens")
    from lightning_memest.cases import InputSpec, parse_shape

    shape = parse_shape(args.input_shape) if args.input_shape is not None else None
    return InputSpec(batch_size=args.batch_size, shape=shape, tokens=args.tokens, vocab=args.vocab)


def _model_kwargs(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    too_deep = SpecError(
        f"--model-kwargs is nested too deep: at most {MAX_JSON_DEPTH} levels of arrays and objects"
    )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"--model-kwargs is not valid JSON ({e})") from None
    except RecursionError:  # the parser's own limit (about 1000 levels)
        raise too_deep from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    if not isinstance(value, dict):
        raise SpecError(f"--model-kwargs must be a JSON object; got {type(value).__name__}")
    return value


def _depth(value: Any) -> int:
    """How deep ``value`` nests lists and dicts (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest
