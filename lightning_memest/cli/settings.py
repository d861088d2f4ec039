"""What the flags of a ``memest`` command ask for, checked together once: a bad combination (``--vocab``
without ``--tokens``, ``--bucket-cap-mb`` without ``--strategy ddp``) is one :class:`SpecError` before
any model is built. :func:`settings` imports torch when it runs, not when this module is imported.

Example:
    >>> import argparse
    >>> _model_kwargs('{"in_features": 8}')
    {'in_features': 8}
    >>> _strategy(argparse.Namespace(strategy=None, world_size=4))
    Traceback (most recent call last):
    ...
    lightning_memest.errors.SpecError: --world-size goes with --strategy ddp|fsdp
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_memest.errors import SpecError

if TYPE_CHECKING:
    import torch

    from lightning_memest.accounting.cuda_device import CudaDevice
    from lightning_memest.cases import Case, InputSpec
    from lightning_memest.engine.parallel.distributed import FSDP, Strategy
    from lightning_memest.engine.parallel.pipeline import Pipeline

__all__ = ["MAX_JSON_DEPTH", "Settings", "settings"]

#: How deep --model-kwargs may nest arrays and objects: far beyond any model's keyword arguments, well
#: within Python's recursion limit (which the JSON parser, and code walking the values, run into).
MAX_JSON_DEPTH = 100


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

        if getattr(args, "activation_memory_budget", None) is not None:
            # The compiler's own setting, read when it partitions each graph: for this command's compiles.
            import torch._functorch.config

            torch._functorch.config.activation_memory_budget = args.activation_memory_budget
        return build_case(
            spec,
            self.inputs,
            model_kwargs=self.model_kwargs,
            loss=args.loss,
            optimizer=args.optimizer,
            precision=args.precision,
            compile_mode=getattr(args, "compile", None),
        )

    def describe(self) -> str:
        """The settings in one line, for the heading of a command's output."""
        args = self.args
        text = f"{self.inputs.describe()}, {args.loss}, {args.optimizer}, {args.precision}, {args.device}"
        if getattr(args, "compile", None) is not None:
            text += f", compiled ({args.compile})"
            if args.activation_memory_budget is not None:
                text += f", activation memory budget {args.activation_memory_budget:g}"
        if self.strategy is not None:
            tp = getattr(args, "tp", None)
            if getattr(args, "pp", None) is not None:
                microbatches = getattr(self.strategy, "microbatches", None)
                text += f", pipeline on {args.pp} ranks ({args.pp_schedule}, {microbatches} microbatches)"
                if args.strategy is not None or tp is not None:
                    data = getattr(self.strategy, "data_parallel", 1)
                    text += f" x {args.strategy or 'data parallel'} {data} x tensor parallel {tp or 1}"
                    text += f" on {self.strategy.world_size} ranks"
            elif args.strategy is None:
                text += f", tensor parallel on {tp} ranks, per rank"
            elif tp is not None:
                text += f", {args.strategy} x tensor parallel {tp} on {args.world_size} ranks, per rank"
            else:
                text += f", {args.strategy} on {args.world_size} ranks, per rank"
        return text


def settings(args: argparse.Namespace) -> Settings:
    """Check the flags of ``args`` together; a :class:`SpecError` names what is wrong."""
    import torch

    if getattr(args, "activation_memory_budget", None) is not None and getattr(args, "compile", None) is None:
        raise SpecError("--activation-memory-budget is the compiler's: it needs --compile")
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
    memory = getattr(args, "gpu_memory", None)
    if capability is None and context is None and memory is None:
        return None if local else CudaDevice()
    gpu = CudaDevice.local(torch.device("cuda")) if local else CudaDevice()
    if capability is not None:
        gpu = dataclasses.replace(gpu, capability=capability)
    if context is not None:
        gpu = dataclasses.replace(gpu, context_bytes=context, context_given=True)
    if memory is not None:  # the device the allocator runs out of (its cache released first)
        gpu = dataclasses.replace(gpu, total_bytes=memory)
    return gpu


#: The flags of one strategy only: given with another (or none), they would be ignored.
_STRATEGY_FLAGS = {
    "ddp": (("bucket_cap_mb", "--bucket-cap-mb"), ("gradient_as_bucket_view", "--gradient-as-bucket-view")),
    "fsdp": (
        ("fsdp_units", "--fsdp-units"),
        ("fsdp_param_dtype", "--fsdp-param-dtype"),
        ("fsdp_reduce_dtype", "--fsdp-reduce-dtype"),
        ("fsdp_keep_unsharded", "--fsdp-keep-unsharded"),
        ("fsdp_kept_gathered", "--fsdp-kept-gathered"),
    ),
}


def _strategy(args: argparse.Namespace) -> Strategy | None:
    chosen = getattr(args, "strategy", None)
    for strategy, flags in _STRATEGY_FLAGS.items():
        for dest, flag in flags:
            if strategy != chosen and getattr(args, dest, None) not in (None, False):
                raise SpecError(f"{flag} goes with --strategy {strategy}")
    tp, plan = getattr(args, "tp", None), getattr(args, "tp_plan", None)
    if (tp is None) != (plan is None):
        raise SpecError("--tp N and --tp-plan MODULE:FUNCTION go together (the plan says how N ranks split)")
    pipeline = _pipeline(args)
    if pipeline is not None:
        return pipeline
    if chosen is None:
        if getattr(args, "world_size", None) is not None:
            raise SpecError("--world-size goes with --strategy ddp|fsdp")
        if tp is None or plan is None:
            return None
        from lightning_memest.engine.parallel.distributed import TP

        return TP(tp, plan=_tp_plan(plan))
    if args.world_size is None:
        raise SpecError(f"--strategy {args.strategy} needs --world-size N")
    from lightning_memest.engine.parallel.distributed import DDP, ModelParallel
    from lightning_memest.engine.parallel.plans import TensorThenShard

    if tp is not None and plan is not None:
        if args.strategy != "fsdp":
            raise SpecError("--tp goes alone or with --strategy fsdp (a 2-D mesh); not with --strategy ddp")
        if args.world_size % tp:
            raise SpecError(f"--world-size {args.world_size} is not a multiple of --tp {tp}")
        fsdp = _fsdp(args, args.world_size // tp)
        return ModelParallel(args.world_size // tp, tp, plan=TensorThenShard(_tp_plan(plan), fsdp))
    if args.strategy == "ddp":
        return DDP(
            args.world_size,
            bucket_cap_mb=25.0 if args.bucket_cap_mb is None else args.bucket_cap_mb,
            gradient_as_bucket_view=args.gradient_as_bucket_view,
        )
    return _fsdp(args, args.world_size)


def _pipeline(args: argparse.Namespace) -> Pipeline | None:
    """``--pp N --pp-split MODULE:FUNCTION``: rank 0's stage (the command estimates every stage); with
    ``--strategy fsdp --world-size W`` and/or ``--tp T``, each stage sharded over W / (N x T) ranks
    and/or split over T on a 3-D mesh."""
    pp, split = getattr(args, "pp", None), getattr(args, "pp_split", None)
    if pp is None:
        for dest, flag in (("pp_split", "--pp-split"), ("microbatches", "--microbatches")):
            if getattr(args, dest, None) is not None:
                raise SpecError(f"{flag} goes with --pp N")
        return None
    if split is None:
        raise SpecError("--pp N needs --pp-split MODULE:FUNCTION (the job's split of the model into stages)")
    chosen, tp, tp_plan = (
        getattr(args, "strategy", None),
        getattr(args, "tp", None),
        getattr(args, "tp_plan", None),
    )
    if chosen == "ddp":
        raise SpecError(
            "--pp goes alone, with --strategy fsdp (each stage sharded) or --tp; not with --strategy ddp"
        )
    tensor = 1 if tp is None else tp
    data = 1
    if chosen == "fsdp":
        if args.world_size is None:
            raise SpecError("--strategy fsdp needs --world-size N")
        if args.world_size % (pp * tensor):
            raise SpecError(f"--world-size {args.world_size} is not a multiple of --pp {pp} x --tp {tensor}")
        data = args.world_size // (pp * tensor)
    elif getattr(args, "world_size", None) is not None:
        raise SpecError("--world-size goes with --strategy ddp|fsdp")
    if args.loop != "train":
        raise SpecError("--pp simulates training steps (a schedule runs forward and backward together)")
    from lightning_memest.cases import resolve_object, stage_cross_entropy
    from lightning_memest.engine.parallel.pipeline import Pipeline

    function = resolve_object(split, "--pp-split")
    if not callable(function):
        raise SpecError(f"--pp-split {split!r} is not a function (it is a {type(function).__name__!r})")
    from lightning_memest.engine.parallel.plans import TensorThenShard

    plan = None
    if data * tensor > 1:
        fsdp = _fsdp(args, data) if chosen == "fsdp" else None
        plan = TensorThenShard(_tp_plan(tp_plan) if tp_plan is not None else None, fsdp)
    several = args.pp_schedule not in ("GPipe", "1F1B")  # the others run several stages a rank
    try:
        return Pipeline(
            pp,
            split=function,
            microbatches=pp if args.microbatches is None else args.microbatches,
            schedule=args.pp_schedule,
            loss=stage_cross_entropy if args.loss == "cross_entropy" else None,
            stages_per_rank=args.pp_stages_per_rank if several else 1,
            data_parallel=data,
            tensor_parallel=tensor,
            plan=plan,
        )
    except ValueError as e:
        raise SpecError(str(e)) from None


def _fsdp(args: argparse.Namespace, world_size: int) -> FSDP:
    from lightning_memest.engine.parallel.distributed import FSDP

    units = tuple(u.strip() for u in args.fsdp_units.split(",") if u.strip()) if args.fsdp_units else None
    kept = args.fsdp_kept_gathered
    return FSDP(
        world_size,
        units=units,
        reshard_after_forward=False if args.fsdp_keep_unsharded else None,
        param_dtype=_dtype(args.fsdp_param_dtype),
        reduce_dtype=_dtype(args.fsdp_reduce_dtype),
        kept_gathered=tuple(p.strip() for p in kept.split(",") if p.strip()) if kept else (),
    )


def _tp_plan(spec: str) -> Any:
    from lightning_memest.cases import resolve_object

    plan = resolve_object(spec, "--tp-plan")
    if not callable(plan):
        raise SpecError(f"--tp-plan {spec!r} is not a function (it is a {type(plan).__name__!r})")
    return plan


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return None if name is None else dtypes[name]
