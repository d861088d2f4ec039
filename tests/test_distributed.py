"""Per-rank estimates under DDP and FSDP2: PyTorch's own classes on a fake process group.

Checked against what the strategies are defined to do (FSDP shards the model states by the world size;
DDP adds its gradient buckets) and against real two-process CPU runs with the gloo backend, measured
per rank with the profiler's allocator events (``tests/dist_worker.py``).
"""

from __future__ import annotations

import json
import math
import re
import socket
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_memest import DDP, FSDP, TP, EstimationError, ModelParallel, estimate_step, max_batch_size
from lightning_memest.cli import main
from lightning_memest.engine.parallel.distributed import fsdp_units
from tests import dist_worker
from tests.models import TinyGPT, lm_batch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    # Odd first dimensions: FSDP pads each shard to ceil(rows / N) rows.
    return nn.Sequential(nn.Linear(300, 1001), nn.ReLU(), nn.Linear(1001, 257), nn.ReLU(), nn.Linear(257, 10))


def _states(est_breakdown: object) -> tuple[int, int, int]:
    b = est_breakdown
    return b.parameters, b.gradients, b.optimizer_state  # type: ignore[attr-defined]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_divides_parameters_gradients_and_optimizer_state_by_the_world_size(world: int) -> None:
    model, x = _mlp(), torch.randn(16, 300)
    plain = estimate_step(model, x, optimizer=torch.optim.Adam)
    sharded = estimate_step(model, x, optimizer=torch.optim.Adam, strategy=FSDP(world, units=("Linear",)))
    params = list(model.parameters())
    # Rank 0's shard of each parameter: ceil(rows / N) rows, padded to that on every rank.
    shard = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * 4 for p in params)
    assert sharded.steady_state.breakdown.parameters == shard
    whole = plain.steady_state.breakdown
    assert shard - whole.parameters / world <= sum(p.numel() // p.shape[0] * 4 for p in params)
    # Adam's moments follow the parameters' shards; the step counters (4 B each) are not sharded.
    counters = 4 * len(params)
    assert sharded.steady_state.breakdown.optimizer_state == pytest.approx(
        (whole.optimizer_state - counters) / world + counters, rel=0.01
    )
    # Every gradient is sharded: the largest gradient bytes of any moment is at most one shard set.
    grads = max(p.breakdown.gradients for p in sharded.peaks)
    assert 0 < grads <= shard
    assert all(p.bytes < q.bytes for p, q in zip(sharded.peaks, plain.peaks, strict=True))


def test_ddp_adds_one_bucket_copy_of_the_gradients_unless_they_are_bucket_views() -> None:
    model, x = _mlp(), torch.randn(16, 300)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    plain = estimate_step(model, x, optimizer=torch.optim.SGD)
    ddp = estimate_step(model, x, optimizer=torch.optim.SGD, strategy=DDP(2))
    views = estimate_step(model, x, optimizer=torch.optim.SGD, strategy=DDP(2, gradient_as_bucket_view=True))
    for a, b in zip(plain.peaks, ddp.peaks, strict=True):
        assert b.bytes - a.bytes == param_bytes
    assert ddp.steady_state.breakdown.communication == param_bytes
    # With bucket views the gradients are the buckets: one copy, alive across steps (zero_grad's
    # set_to_none drops the views, not the buckets).
    assert views.steady_state.breakdown.gradients == param_bytes
    assert views.steady_state.breakdown.communication == 0
    assert all(v.bytes < d.bytes for v, d in zip(views.peaks, ddp.peaks, strict=True))


def test_the_model_is_left_as_it_was_and_can_be_estimated_again() -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    x = torch.randn(4, 300)
    first = estimate_step(model, x, optimizer=torch.optim.Adam, strategy=FSDP(2, units=("Linear",)))
    again = estimate_step(model, x, optimizer=torch.optim.Adam, strategy=FSDP(2, units=("Linear",)))
    estimate_step(model, x, optimizer=torch.optim.Adam, strategy=DDP(2))
    assert [p.bytes for p in first.peaks] == [p.bytes for p in again.peaks]
    assert [type(m) for m in model.modules()] == classes
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == hooks
    assert all(type(p) is nn.Parameter and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.distributed.is_initialized()
    model(x).sum().backward()  # and it still trains


def test_inside_a_running_job_strategies_are_simulated_on_groups_of_their_own() -> None:
    # A real (gloo, one-rank) job: the simulation must not create a registered group, which is a
    # collective every rank would have to join; any world size can be simulated.
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, x = _mlp(), torch.randn(16, 300)
        plain = estimate_step(model, x, optimizer=torch.optim.SGD)
        ddp = estimate_step(model, x, optimizer=torch.optim.SGD, strategy=DDP(8, rank=5))
        assert ddp.first_step.bytes - plain.first_step.bytes == sum(p.numel() * 4 for p in model.parameters())
        assert dist.get_world_size() == 1
        # FSDP's mesh needs a registered group: one is entered by hand (no collective), for this rank
        # of this job only.
        inside = estimate_step(model, x, optimizer=torch.optim.SGD, strategy=FSDP(1, units=("Linear",)))
        with pytest.raises(EstimationError, match="only for this rank of this job"):
            estimate_step(model, x, optimizer=torch.optim.SGD, strategy=FSDP(2))
        assert dist.get_world_size() == 1 and len(dist.distributed_c10d._world.pg_map) == 1
    finally:
        dist.destroy_process_group()
    outside = estimate_step(model, x, optimizer=torch.optim.SGD, strategy=FSDP(1, units=("Linear",)))
    assert [p.bytes for p in inside.peaks] == [p.bytes for p in outside.peaks]


def test_default_fsdp_units_are_the_blocks_of_module_lists() -> None:
    model = TinyGPT(n_layers=3)
    assert fsdp_units(model, None) == list(reversed(list(model.blocks)))
    with pytest.raises(EstimationError, match="no module of class Conv2d"):
        fsdp_units(model, ("Conv2d",))


@pytest.fixture(scope="module")
def measured() -> Iterator[dict[str, dict[int, tuple[int, ...]]]]:
    results = {}
    for name, strategy in REAL_RUNS.items():
        results[name] = dist_worker.run_ranks(strategy, _free_port())
    yield results


REAL_RUNS: dict[str, DDP | FSDP | TP | ModelParallel] = {
    "ddp": DDP(2),
    "fsdp": FSDP(2),
    # FSDP's mixed-precision policy (bf16 all-gathered parameters, fp32 reduction) and no resharding.
    "fsdp_bf16": FSDP(2, param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    # Units left gathered alone: the last block (the recipe of large jobs: backward needs it first) and
    # the first (kept from its forward to its backward: +3.2 MB in the estimate).
    "fsdp_last": FSDP(2, kept_gathered=("blocks.0", "blocks.3")),
    # Tensor parallelism of each block's MLP (colwise, then rowwise: its output all-reduced).
    "tp": TP(2, plan=dist_worker.tp_plan),
    # Lightning's ModelParallelStrategy on 4 ranks: the MLPs split over a tensor-parallel dimension of 2,
    # the blocks sharded over a data-parallel one of 2 (a 2-D mesh).
    "tp_fsdp": ModelParallel(2, 2, plan=dist_worker.tp_fsdp_plan),
}


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("ddp", DDP(2)),
        ("ddp-rank1", DDP(2, rank=1)),
        ("fsdp", FSDP(2)),
        ("fsdp-rank1", FSDP(2, rank=1)),
        ("fsdp_bf16", REAL_RUNS["fsdp_bf16"]),
        ("fsdp_last", REAL_RUNS["fsdp_last"]),
        ("tp", REAL_RUNS["tp"]),
        ("tp-rank1", TP(2, rank=1, plan=dist_worker.tp_plan)),
        ("tp_fsdp", REAL_RUNS["tp_fsdp"]),
        ("tp_fsdp-rank3", ModelParallel(2, 2, plan=dist_worker.tp_fsdp_plan, rank=3)),
    ],
)
def test_per_rank_estimate_matches_a_real_two_process_gloo_run(
    measured: dict[str, dict[int, tuple[int, ...]]], name: str, strategy: DDP | FSDP | TP | ModelParallel
) -> None:
    est = estimate_step(
        dist_worker.build(),
        dist_worker.batch(),
        optimizer=dist_worker.optimizer,
        strategy=strategy,
        calibrate=True,  # this machine's kernels: holds on any CPU
    )
    truth = measured[name.split("-")[0]][strategy.rank]
    for e, m in zip(est.peaks, truth, strict=True):
        assert abs(e.bytes - m) / m <= 0.01, (name, [p.bytes for p in est.peaks], truth)


@pytest.mark.parametrize("mode", ["tp", "tp_fsdp"])
def test_memestimate_under_model_parallel_strategy_estimates_each_rank(mode: str) -> None:
    # Lightning's ModelParallelStrategy: configure_model applies tensor parallelism (tp) or that and
    # fully_shard on a 2 x 2 mesh (tp_fsdp: each block its own FSDP root, the first step's peak inside
    # gloo's reduce-scatter), so the module arrives parallelised at fit start; the callback
    # does it again on fake tensors (the same units, policy and lazily decided roots; each parameter's
    # placements and the styles' own hooks on a fake mesh) and checks itself against each rank's real
    # steps -- and training goes on on the real mesh afterwards.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("model_parallel_fit.py")
    out = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=600)
    # Both ranks print to one pipe: a line of one can land inside the other's (seen), so find the
    # reports rather than split lines.
    reports = [json.loads(found) for found in re.findall(r"MEMEST (\{[^{}]*\})", out.stdout)]
    ranks = 4 if mode == "tp_fsdp" else 2
    assert sorted(r["rank"] for r in reports) == list(range(ranks)), out.stderr[-3000:]
    for r in reports:
        assert r["estimated"] is not None and len(r["measured"]) == 2
        for e, m in zip(r["estimated"], r["measured"], strict=True):
            assert abs(e - m) / m <= 0.01, r


def test_max_batch_size_per_rank_grows_with_fsdp() -> None:
    model = TinyGPT(n_layers=2)
    tokens = lm_batch(4)[0]

    def make(n: int) -> torch.Tensor:
        return torch.empty(n, tokens.shape[1], dtype=tokens.dtype, device="meta")

    budget = 120 * 2**20
    plain = max_batch_size(model, make, budget, optimizer=torch.optim.AdamW)
    sharded = max_batch_size(model, make, budget, optimizer=torch.optim.AdamW, strategy=FSDP(4))
    assert sharded.max_batch_size > plain.max_batch_size > 0
    at_max = estimate_step(model, make(sharded.max_batch_size), optimizer=torch.optim.AdamW, strategy=FSDP(4))
    over = estimate_step(
        model, make(sharded.max_batch_size + 1), optimizer=torch.optim.AdamW, strategy=FSDP(4)
    )
    assert at_max.peak_bytes <= budget < over.peak_bytes


def test_cli_estimates_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "tests.models:TinyGPT", "--tokens", "128", "--vocab", "1000", "--batch-size", "4"]
    assert main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--strategy", "fsdp", "--world-size", "4", "--json"]) == 0
    fsdp = json.loads(capsys.readouterr().out)
    assert fsdp.keys() == plain.keys()
    assert fsdp["peak_bytes"]["steady_state"] < plain["peak_bytes"]["steady_state"]
    assert (
        main([*args, "--strategy", "fsdp", "--world-size", "4", "--fsdp-param-dtype", "bf16", "--json"]) == 0
    )
    bf16 = json.loads(capsys.readouterr().out)  # half-size gathered units and activations
    assert bf16["peak_bytes"]["steady_state"] < fsdp["peak_bytes"]["steady_state"]
    kept = ["--strategy", "fsdp", "--world-size", "4", "--fsdp-kept-gathered", "blocks.0", "--json"]
    assert main([*args, *kept]) == 0
    first_kept = json.loads(capsys.readouterr().out)  # the first block gathered from forward to backward
    assert first_kept["peak_bytes"]["steady_state"] > fsdp["peak_bytes"]["steady_state"]
    tp = ["--tp", "2", "--tp-plan", "tests.dist_worker:tp_plan"]
    assert main([*args, *tp, "--json"]) == 0
    tensor = json.loads(capsys.readouterr().out)  # the MLPs' weights split in two
    assert tensor["peak_bytes"]["steady_state"] < plain["peak_bytes"]["steady_state"]
    assert main([*args, *tp, "--strategy", "fsdp", "--world-size", "8", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)  # and everything sharded over 4 data-parallel ranks
    assert both["peak_bytes"]["steady_state"] < tensor["peak_bytes"]["steady_state"]
    assert both["peak_bytes"]["steady_state"] < fsdp["peak_bytes"]["steady_state"]
    for wrong, said in [
        (["--tp", "2"], "--tp-plan"),
        ([*tp, "--strategy", "fsdp", "--world-size", "3"], "not a multiple of --tp 2"),
        ([*tp, "--strategy", "ddp", "--world-size", "4"], "not with --strategy ddp"),
        (["--tp", "2", "--tp-plan", "tests.dist_worker:nothing"], "no attribute 'nothing'"),
    ]:
        assert main([*args, *wrong]) == 2
        assert said in capsys.readouterr().err
    assert main([*args, "--strategy", "ddp", "--world-size", "8"]) == 0
    assert "ddp on 8 ranks, per rank" in capsys.readouterr().out
    assert main([*args, "--strategy", "ddp"]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_a_unit_kept_gathered_must_be_one_of_the_models_units() -> None:
    with pytest.raises(
        EstimationError, match=r"'blocks.9' is not a unit of the model \(its units: 'blocks.3'"
    ):
        estimate_step(dist_worker.build(), dist_worker.batch(), strategy=FSDP(2, kept_gathered=("blocks.9",)))


def test_a_module_that_arrived_tensor_parallel_is_estimated_as_the_same_plan_from_scratch() -> None:
    # A job whose configure_model already ran parallelize_module (in a process with a fake world of 2,
    # this rank 0): the strategy read back from the module -- each parameter's placements, the styles'
    # hooks -- gives what the plan gives on the whole model, and the module is left as it was.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_memest.engine.parallel.arrived import arrived_model_parallel, mesh_hooks

    x = dist_worker.batch()
    planned = estimate_step(
        dist_worker.build(), x, optimizer=dist_worker.optimizer, strategy=TP(2, plan=dist_worker.tp_plan)
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        model, tensor_mesh = dist_worker.build(), mesh["tensor_parallel"]
        dist_worker.tp_plan(model, tensor_mesh)
        hooks = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
        params = dict(model.named_parameters())
        strategy = arrived_model_parallel(model, 1, 2, rank=0)
        assert isinstance(strategy, ModelParallel) and len(mesh_hooks(model)) == 4 * dist_worker.LAYERS
        arrived = estimate_step(model, x, optimizer=dist_worker.optimizer, strategy=strategy)
        assert [p.bytes for p in arrived.peaks] == [p.bytes for p in planned.peaks]
        assert all(
            dict(m._forward_pre_hooks) == pre and dict(m._forward_hooks) == post for m, pre, post in hooks
        )
        assert all(p is params[name] for name, p in model.named_parameters())
        assert model.blocks[0].mlp[0].weight.device_mesh is tensor_mesh  # type: ignore[index]
        model(x).sum().backward()  # and it still runs on its own mesh
    finally:
        dist.destroy_process_group()


def test_gloos_collectives_allocate_what_the_cpu_kernel_models_say() -> None:
    # A CPU job's collectives are gloo's, which work on copies and gathering buffers the fake group
    # does not make: each call's measured bytes beyond its outputs, against the kernel model's.
    from tests import collective_probe

    rows = collective_probe.probe(_free_port())
    assert rows["reduce_scatter_tensor"][0] > 0 and rows["all_reduce"][0] == 0  # the probe sees them
    for case, (measured, modelled) in rows.items():
        assert modelled == measured, (case, rows)
