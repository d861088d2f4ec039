"""Per-rank estimates under DDP, FSDP2, tensor and pipeline parallelism: accuracy against real runs,
and a 7B answer's speed.

1. TinyGPT (4 layers, d_model 256, batch 8 x 128, AdamW) as a real two-process CPU job (gloo backend)
   under DDP, FSDP2 and tensor parallelism of each block's MLP (``parallelize_module``), and the same
   decoder written for pipelines (``tests/pipeline_models.py``) in 2 stages, 4 microbatches, under
   PyTorch's GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble, ZBV and DualPipeV schedules,
   each rank measured with the profiler's allocator events (``tests/dist_worker.py``), against the
   estimate of that rank (PyTorch's DDP / fully_shard on a fake process group). "settled" runs pause
   2 ms after each collective's wait so that gloo's worker thread has dropped its references first and
   the collective's tensors die on the main thread, where the profiler records the free. Unsettled
   runs show the instrument's error when the last reference dies on gloo's thread instead: the free
   goes unrecorded and the running sum stays high (a measurement artifact, not memory the rank holds).
2. The same job with its blocks compiled (``block.compile()``), measured and estimated per rank.
3. A 7B decoder (32 layers, d_model 4096, sequence 2048) built on the meta device: FSDP2 on 8 GPUs
   (bf16 parameters, fp32 reduction, AdamW), rank 0, as a CUDA what-if on this CPU-only machine.
4. A 405B-shaped decoder on 512 GPUs, pipeline 8 x FSDP2 8 x tensor parallel 8: one rank per stage,
   each a CUDA what-if, and how long each takes.

Run: ``python benchmarks/distributed.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_memest import DDP, FSDP, TP, ModelParallel, Pipeline, estimate_step  # noqa: E402
from tests import dist_worker  # noqa: E402
from tests.models import TinyGPT, lm_loss  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _tp(world_size: int, rank: int = 0) -> TP:
    return TP(world_size, rank=rank, plan=dist_worker.tp_plan)  # each block's MLP, colwise then rowwise


def _tp_fsdp(world_size: int, rank: int = 0) -> ModelParallel:
    # 2 x 2 (world_size 4): the MLPs split over the tensor-parallel dimension, the blocks sharded over
    # the data-parallel one, as a ModelParallelStrategy configure_model does
    return ModelParallel(world_size // 2, 2, plan=dist_worker.tp_fsdp_plan, rank=rank)


def _pipeline(schedule: str, data_parallel: int = 1) -> Callable[..., Pipeline]:
    # the pipeline decoder's 4 layers on 2 stages, 4 microbatches (the multi-stage schedules: 2 stages
    # a rank), each stage sharded over `data_parallel` ranks
    def make(world_size: int, rank: int = 0) -> Pipeline:
        stages = world_size // data_parallel
        return dist_worker.pipeline(schedule, rank=rank, stages=stages, data_parallel=data_parallel)

    return make


#: (name, world size, the strategy for (world size, rank=...)).
STRATEGIES: tuple[tuple[str, int, Callable[..., Any]], ...] = (
    ("DDP", 2, DDP),
    ("FSDP", 2, FSDP),
    ("TP", 2, _tp),
    ("TP x FSDP", 4, _tp_fsdp),
    ("PP 1F1B", 2, _pipeline("1F1B")),
    ("PP GPipe", 2, _pipeline("GPipe")),
    ("PP Interleaved1F1B", 2, _pipeline("Interleaved1F1B")),
    ("PP InterleavedZeroBubble", 2, _pipeline("InterleavedZeroBubble")),
    ("PP ZBVZeroBubble", 2, _pipeline("ZBVZeroBubble")),
    ("PP DualPipeV", 2, _pipeline("DualPipeV")),
    ("PP 1F1B x FSDP", 4, _pipeline("1F1B", data_parallel=2)),
)


def accuracy(unsettled_repeats: int = 3) -> None:
    print(
        "| strategy | rank | step | estimate | measured (settled) | error "
        "| unsettled runs (frees on gloo's thread unrecorded) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, world, make in STRATEGIES:
        settled = dist_worker.run_ranks(make(world), _port())
        loose = [dist_worker.run_ranks(make(world), _port(), settle=False) for _ in range(unsettled_repeats)]
        for rank in range(world):
            strategy = make(world, rank=rank)
            staged = isinstance(strategy, Pipeline)  # the pipeline decoder, on (tokens, targets)
            est = estimate_step(
                dist_worker.build_pipe() if staged else dist_worker.build(),
                dist_worker.pipe_batch() if staged else dist_worker.batch(),
                optimizer=dist_worker.optimizer,
                strategy=strategy,
            )
            for step, label in enumerate(("first", "steady")):
                e, m = est.peaks[step].bytes, settled[rank][step]
                others = ", ".join(f"{100 * (run[rank][step] - e) / e:+.1f} %" for run in loose)
                print(
                    f"| {name} | {rank} | {label} | {mib(e)} | {mib(m)} | {100 * (e - m) / m:+.3f} % "
                    f"| {others} |"
                )


def compiled_blocks() -> None:
    """The same job with each block compiled in place (``block.compile()``, the blockwise recipe of
    large jobs), every rank a fresh process; the estimate of each rank in a fresh process too, as each
    rank of a job makes its own."""
    import json
    import subprocess

    print("\n| strategy, blocks compiled | rank | step | estimate | measured (settled) | error |")
    print("|---|---|---|---|---|---|")
    for name, make in (("DDP", DDP), ("FSDP", FSDP)):
        measured = dist_worker.run_ranks(make(2), _port(), compiled=True)
        for rank in (0, 1):
            code = (
                "import json, sys, torch; sys.path.insert(0, sys.argv[1]); torch.set_num_threads(1)\n"
                "from lightning_memest import DDP, FSDP, estimate_step\n"
                "from tests import dist_worker\n"
                f"est = estimate_step(dist_worker.build_compiled(), dist_worker.batch(), "
                f"optimizer=dist_worker.optimizer, strategy={name}(2, rank={rank}))\n"
                "print(json.dumps([p.bytes for p in est.peaks]))"
            )
            done = subprocess.run(
                [sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, check=True
            )
            peaks = json.loads(done.stdout.strip().splitlines()[-1])
            for step, label in enumerate(("first", "steady")):
                e, m = peaks[step], measured[rank][step]
                print(f"| {name} | {rank} | {label} | {mib(e)} | {mib(m)} | {100 * (e - m) / m:+.3f} % |")


def seven_b() -> None:
    with torch.device("meta"):
        model = TinyGPT(n_layers=32, d_model=4096, n_heads=32, vocab=32000, seq_len=2048)
    tokens = torch.randint(0, 32000, (1, 2048), device="meta")
    strategy = FSDP(8, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    start = time.perf_counter()
    est = estimate_step(
        model,
        (tokens, tokens),
        loss_fn=lm_loss,
        optimizer=torch.optim.AdamW,
        device="cuda",
        strategy=strategy,
    )
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    b = est.steady_state.breakdown
    reserved = est.reserved_bytes[-1] if est.reserved_bytes is not None else 0
    print(
        f"\n7B ({params / 1e9:.2f} B parameters) FSDP2 on 8 GPUs, bf16 params / fp32 reduce, AdamW,"
        f" batch 1 x 2048, rank 0{' (CUDA what-if: approximate)' if est.approximate else ''}:"
    )
    print(f"  answered in {seconds:.1f} s")
    print(
        f"  per-rank peak: first step {est.first_step.bytes / 2**30:.2f} GiB, steady state "
        f"{est.steady_state.bytes / 2**30:.2f} GiB allocated, {reserved / 2**30:.2f} GiB reserved"
    )
    print("  at the steady-state peak: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in b.items() if v))


def _llama_405b_plan(stage: torch.nn.Module, mesh: Any) -> None:
    """A stage of the 405B job as torchtitan parallelises one: each layer's MLP colwise then rowwise
    over the tensor-parallel ranks (the decoder's fused attention projection stays whole), each layer
    checkpointed whole, then FSDP2 (bf16 parameters, fp32 reduction) on each layer and the stage over
    the data-parallel ranks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = stage.layers  # type: ignore[union-attr]
    styles: dict[str, Any] = {}
    for name in layers:
        styles[f"layers.{name}.mlp.0"] = ColwiseParallel()
        styles[f"layers.{name}.mlp.2"] = RowwiseParallel()
    parallelize_module(stage, mesh["tensor_parallel"], styles)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name in list(layers):
        layers[name] = checkpoint_wrapper(layers[name])
        fully_shard(layers[name], mesh=mesh["data_parallel"], mp_policy=policy)
    fully_shard(stage, mesh=mesh["data_parallel"], mp_policy=policy)


def pipeline_405b() -> None:
    """A 405B-shaped decoder (126 layers, d_model 16384, 128 heads, vocabulary 128256, sequence 8192)
    built on meta, on 512 GPUs: pipeline 8 (1F1B, 8 microbatches of 1 sequence) x FSDP2 8 x tensor
    parallel 8, AdamW; one rank per stage, as CUDA what-ifs on this CPU-only machine."""
    from tests.pipeline_models import PipeDecoder, split_decoder, token_loss

    with torch.device("meta"):
        model = PipeDecoder(n_layers=126, d_model=16384, n_heads=128, vocab=128256, seq_len=8192)
    tokens = torch.randint(0, 128256, (8, 8192), device="meta")
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n405B shape ({params / 1e9:.0f} B parameters), pipeline 8 x FSDP2 8 x TP 8 on 512 GPUs "
        "(1F1B, 8 microbatches, layers checkpointed, bf16 parameters / fp32 reduce, AdamW):"
    )
    print("\n| stage | rank | layers | steady-state peak | reserved | answered in |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for stage in range(8):
        strategy = Pipeline(
            8,
            split=split_decoder,
            microbatches=8,
            loss=token_loss,
            rank=stage * 64,
            data_parallel=8,
            tensor_parallel=8,
            plan=_llama_405b_plan,
        )
        start = time.perf_counter()
        est = estimate_step(
            model, (tokens, tokens), optimizer=torch.optim.AdamW, device="cuda", strategy=strategy
        )
        seconds = time.perf_counter() - start
        total += seconds
        reserved = est.reserved_bytes[-1] if est.reserved_bytes is not None else 0
        first, end = 126 * stage // 8, 126 * (stage + 1) // 8
        print(
            f"| {stage} | {stage * 64} | {first}-{end - 1} | {est.steady_state.bytes / 2**30:.2f} GiB "
            f"| {reserved / 2**30:.2f} GiB | {seconds:.1f} s |"
        )
    print(f"\nall 8 stages in {total:.0f} s")


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    accuracy()
    compiled_blocks()
    seven_b()
    pipeline_405b()
