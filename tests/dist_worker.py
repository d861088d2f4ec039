"""One rank of a real multi-process CPU run (gloo), measured with the profiler: the ground truth of
``test_distributed``. Spawned by ``run_ranks``; kept apart so child processes import only this."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_memest.engine.parallel.distributed import Strategy
from lightning_memest.engine.parallel.pipeline import Pipeline
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step
from tests.models import TinyGPT, lm_batch
from tests.pipeline_models import PipeDecoder, split_decoder, token_loss

BATCH = 8
LAYERS = 4


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(n_layers=LAYERS)


def build_compiled() -> torch.nn.Module:
    """The model with each block compiled in place (the blockwise recipe of large jobs)."""
    model = build()
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile()
    return model


def batch() -> torch.Tensor:
    return lm_batch(BATCH)[0]


def build_pipe() -> torch.nn.Module:
    """The pipeline job's decoder (its stages delete what they do not run)."""
    torch.manual_seed(0)
    return PipeDecoder(n_layers=LAYERS)


def pipe_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline job's ``(tokens, targets)``: the first stage takes the tokens, the last the targets."""
    return lm_batch(BATCH)


def pipeline(schedule: str = "1F1B", rank: int = 0, stages: int = 2, data_parallel: int = 1) -> Pipeline:
    """The decoder on ``stages`` ranks, 4 microbatches of 2 sequences, next-token loss; interleaved,
    two stages a rank (a layer each); with ``data_parallel``, each stage sharded over that many ranks
    (:func:`pipe_fsdp_plan`)."""
    per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    return Pipeline(
        stages,
        split=split_decoder,
        microbatches=4,
        schedule=schedule,
        loss=token_loss,
        rank=rank,
        stages_per_rank=per_rank,
        data_parallel=data_parallel,
        plan=pipe_fsdp_plan if data_parallel > 1 else None,
    )


def pipe_fsdp_plan(stage: torch.nn.Module, mesh: Any) -> None:
    """A pipeline stage sharded as torchtitan shards one: each layer, then the stage, ``fully_shard``
    over the mesh's data-parallel dimension."""
    from torch.distributed.fsdp import fully_shard

    for layer in stage.layers.values():  # type: ignore[union-attr, operator]
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(stage, mesh=mesh["data_parallel"])


def tp_plan(model: torch.nn.Module, mesh: Any) -> None:
    """Megatron-style tensor parallelism of each block's MLP: the first linear split by columns, the
    second by rows (its output all-reduced), as ``parallelize_module`` users write it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles: dict[str, Any] = {}
    for i in range(LAYERS):
        styles[f"blocks.{i}.mlp.0"] = ColwiseParallel()
        styles[f"blocks.{i}.mlp.2"] = RowwiseParallel()
    parallelize_module(model, mesh, styles)


def tp_fsdp_plan(model: torch.nn.Module, mesh: Any) -> None:
    """A ``configure_model`` of Lightning's ModelParallelStrategy: :func:`tp_plan` on the mesh's
    tensor-parallel dimension, then each block and the root sharded with ``fully_shard`` over its
    data-parallel one (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard

    tp_plan(model, mesh["tensor_parallel"])
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def settle_collectives() -> None:
    """Keep the frees of collectives' tensors where the profiler records them.

    ``Work.wait()`` returns when a collective is complete, but gloo's worker thread drops its own
    reference to the work -- and with it the collective's tensors -- a moment later. When the main
    thread has let go first, the last reference dies on the worker thread, and the profiler, which
    records memory events of the threads it profiles, never sees that free: the running sum stays
    high for the rest of the run. Seen on FSDP: the same run read 0-10 % higher from one repetition
    to the next. A short pause after each wait lets the worker let go first, so the last reference
    dies on the main thread (program order, as on a real rank and in the estimate).

    The same happens to the flat buffer of DDP's initial broadcast of the weights (freed inside C++,
    no Python wait to pause after): the models are built with the same seed on every rank, so the
    broadcast is skipped (``_sync_module_states``; it happens before any step).
    """
    from torch.nn.parallel import distributed as ddp_module

    ddp_module._sync_module_states = lambda *args, **kwargs: None
    work = torch._C._distributed_c10d.Work
    if getattr(work, "_memest_settled", False):
        return
    wait = work.wait

    def settled(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = wait(self, *args, **kwargs)
        # 2 ms was too short on a loaded machine once (FSDP step 2 read +2.7 %, a free unseen): about
        # 16 waits a rank per run, so 20 ms each costs a third of a second.
        time.sleep(0.02)
        return result

    work.wait = settled
    work._memest_settled = True
    # Functional collectives (DTensor's redistributions under tensor parallelism) wait in C++, through
    # wait_tensor: the same pause after it.
    from torch.distributed import _functional_collectives as funcol

    wait_tensor = funcol.wait_tensor

    def settled_tensor(tensor: torch.Tensor) -> torch.Tensor:
        result = wait_tensor(tensor)
        time.sleep(0.02)
        return result

    funcol.wait_tensor = settled_tensor


def _rank(
    rank: int, world: int, port: int, strategy: Strategy, settle: bool, compiled: bool, out: Any
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if settle:
        settle_collectives()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if isinstance(strategy, Pipeline):
            model, data = build_pipe, pipe_batch()
        else:
            model, data = build_compiled if compiled else build, batch()
        m = measure_step(model, data, StepConfig(optimizer=optimizer, strategy=strategy), steps=2)
        out.put((rank, m.peak_bytes))
    finally:
        dist.destroy_process_group()


def run_ranks(
    strategy: Strategy, port: int, settle: bool = True, compiled: bool = False
) -> dict[int, tuple[int, ...]]:
    """Each rank's measured peaks (first step, steady state) of a real ``strategy.world_size`` run
    (``settle``: frees in program order, see :func:`settle_collectives`; ``compiled``: the blocks
    compiled, :func:`build_compiled`)."""
    world = strategy.world_size
    return dict(spawn_ranks(_rank, world, (world, port, strategy, settle, compiled), world))


def spawn_ranks(target: Any, world: int, args: tuple[Any, ...], results: int) -> list[Any]:
    """``target(rank, *args, queue)`` in ``world`` spawned processes; the ``results`` items they put on
    the queue. A rank that fails fails the run."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"a rank failed (exit codes {failed})")
    return [out.get(timeout=10) for _ in range(results)]
