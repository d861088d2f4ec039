"""What gloo's collectives allocate inside a call, measured on a real 2-rank CPU job with the profiler's
allocator events, beside what ``accounting/kernels/cpu_collectives.py`` models for the same call: the
ground truth of ``test_distributed``'s collective test and of ``benchmarks/gloo_collectives.py``.
Spawned by :func:`probe`; kept apart so child processes import only this."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_memest.allocator_events import CpuMemoryProfile
from lightning_memest.engine.events import OpCall, TensorMeta

WORLD = 2


def _cases(n: int) -> dict[str, tuple[Callable[[], Any], OpCall, int]]:
    """Each collective as a job calls it (synchronously, or a functional one waited on), the op call
    the simulation sees for it, and the bytes of the outputs the call returns (a functional
    collective's, allocated by the call and kept)."""
    from torch.distributed import _functional_collectives as funcol

    c10d, functional = torch.ops.c10d, torch.ops._c10d_functional
    x, out, gathered = torch.randn(n), torch.empty(n // WORLD), torch.empty(WORLD * n)
    parts = [torch.empty(n) for _ in range(WORLD)]
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    m = TensorMeta.of

    def call(op: Any, args: tuple[Any, ...], outputs: tuple[Any, ...] = ()) -> OpCall:
        return OpCall(op.default, args, {}, outputs, "cpu")

    halves = [x[: n // WORLD], x[n // WORLD :]]
    return {
        "reduce_scatter_tensor": (
            lambda: dist.reduce_scatter_tensor(out, x),
            call(c10d._reduce_scatter_base_, (m(out), m(x))),
            0,
        ),
        "all_gather_into_tensor": (
            lambda: dist.all_gather_into_tensor(gathered, x),
            call(c10d._allgather_base_, (m(gathered), m(x))),
            0,
        ),
        "all_gather (list)": (
            lambda: dist.all_gather(parts, x),
            call(c10d.allgather_, ([[m(p) for p in parts]], [m(x)])),
            0,
        ),
        "reduce_scatter (list)": (
            lambda: dist.reduce_scatter(out, halves),
            call(c10d.reduce_scatter_, ([m(out)], [[m(h) for h in halves]])),
            0,
        ),
        "all_reduce": (lambda: dist.all_reduce(x), call(c10d.allreduce_, ([m(x)],)), 0),
        "functional all_gather_into_tensor": (
            lambda: funcol.wait_tensor(functional.all_gather_into_tensor(x, WORLD, name)),
            call(functional.all_gather_into_tensor, (m(x), WORLD, name), (m(gathered),)),
            gathered.nbytes,
        ),
        "functional reduce_scatter_tensor": (
            lambda: funcol.wait_tensor(functional.reduce_scatter_tensor(x, "sum", WORLD, name)),
            call(functional.reduce_scatter_tensor, (m(x), "sum", WORLD, name), (m(out),)),
            out.nbytes,
        ),
        "functional all_reduce": (
            lambda: funcol.wait_tensor(functional.all_reduce(x, "sum", name)),
            call(functional.all_reduce, (m(x), "sum", name), (m(x),)),
            x.nbytes,
        ),
    }


def _rank(rank: int, port: int, n: int, out: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from lightning_memest.accounting.kernels import kernel_memory

        rows = {}
        for case, (run, op_call, kept) in _cases(n).items():
            run()  # once before: what a first call sets up is not the collective's
            with CpuMemoryProfile() as prof:
                result = run()
                del result
            level = peak = 0
            for _, nbytes, _ in prof.timeline().events:
                level += nbytes
                peak = max(peak, level)
            modelled = kernel_memory(op_call)
            rows[case] = (peak - kept, modelled.workspace_bytes if modelled is not None else 0)
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def probe(port: int, n: int = 1 << 18) -> dict[str, tuple[int, int]]:
    """Per collective on ``n`` float32 elements: (bytes it held inside the call beyond its returned
    outputs, measured on rank 0; the bytes the kernel model gives the same call)."""
    from tests.dist_worker import spawn_ranks

    rows: dict[str, tuple[int, int]] = spawn_ranks(_rank, WORLD, (port, n), 1)[0]
    return rows
