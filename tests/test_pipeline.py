"""Per-rank estimates under pipeline parallelism: PyTorch's own ``PipelineStage`` and schedules on a
fake process group, checked against real two-process CPU jobs (gloo) measured per rank with the
profiler's allocator events (``tests/dist_worker.py``), and against what the schedules are defined to
keep in flight.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_memest import EstimationError, Pipeline, estimate_step
from tests import dist_worker
from tests.models import lm_batch
from tests.pipeline_models import PipeDecoder, split_decoder, token_loss

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

#: The real jobs: the decoder's 4 layers on 2 ranks, 4 microbatches of 2 sequences; interleaved and as
#: a V (zero-bubble: backward split into input and weight gradients), two stages (a layer each) a
#: rank; and 1F1B with each stage sharded over 2 ranks (FSDP2: 4 processes). The other schedules'
#: jobs are in benchmarks/distributed.py.
JOBS = {
    "1F1B": dist_worker.pipeline("1F1B"),
    "Interleaved1F1B": dist_worker.pipeline("Interleaved1F1B"),
    "ZBVZeroBubble": dist_worker.pipeline("ZBVZeroBubble"),
    "1F1B x FSDP": dist_worker.pipeline("1F1B", data_parallel=2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def measured() -> Iterator[dict[str, dict[int, tuple[int, ...]]]]:
    yield {name: dist_worker.run_ranks(job, _free_port()) for name, job in JOBS.items()}


@pytest.mark.parametrize(
    ("job", "rank"),
    [
        ("1F1B", 0),
        ("1F1B", 1),
        ("Interleaved1F1B", 0),
        ("Interleaved1F1B", 1),
        ("ZBVZeroBubble", 0),
        ("1F1B x FSDP", 1),
        ("1F1B x FSDP", 2),
    ],
)
def test_each_stage_matches_its_rank_of_a_real_pipeline(
    measured: dict[str, dict[int, tuple[int, ...]]], job: str, rank: int
) -> None:
    # The first stage holds the activations of as many microbatches as 1F1B keeps in flight there,
    # the activations it sent until the send's work is dropped, and adds the gradient it received out
    # of place (the stage keeps that buffer); the last stage holds the head and the losses. Sharded,
    # a stage's rank holds its shards and gathers each layer's weights around its use.
    est = estimate_step(
        dist_worker.build_pipe(),
        dist_worker.pipe_batch(),
        optimizer=dist_worker.optimizer,
        strategy=dataclasses.replace(JOBS[job], rank=rank),
        calibrate=True,  # this machine's kernels: holds on any CPU
    )
    truth = measured[job][rank]
    for e, m in zip(est.peaks, truth, strict=True):
        assert abs(e.bytes - m) / m <= 0.01, (job, rank, [p.bytes for p in est.peaks], truth)


def test_stages_sharded_on_a_3d_mesh_from_meta_hold_their_share_of_the_weights() -> None:
    # Pipeline x FSDP2 x tensor parallelism (2 x 2 x 2, torchtitan's layout): each stage's MLPs split
    # by columns then rows over the tensor-parallel ranks, its layers and itself sharded over the
    # data-parallel ones; built on meta (only the shards ever exist), simulated as a CUDA what-if.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def plan(stage: nn.Module, mesh: object) -> None:
        styles = {}
        for name in stage.layers:  # type: ignore[union-attr]
            styles[f"layers.{name}.mlp.0"] = ColwiseParallel()
            styles[f"layers.{name}.mlp.2"] = RowwiseParallel()
        parallelize_module(stage, mesh["tensor_parallel"], styles)  # type: ignore[index]
        for layer in stage.layers.values():  # type: ignore[union-attr, operator]
            fully_shard(layer, mesh=mesh["data_parallel"])  # type: ignore[index]
        fully_shard(stage, mesh=mesh["data_parallel"])  # type: ignore[index]

    d = 64
    with torch.device("meta"):
        model = PipeDecoder(n_layers=4, d_model=d, n_heads=2, vocab=128, seq_len=32)
    batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    for rank, stage in ((0, 0), (7, 1)):  # a rank of each stage
        strategy = Pipeline(
            2, split=split_decoder, microbatches=2, loss=token_loss, rank=rank,
            data_parallel=2, tensor_parallel=2, plan=plan,
        )  # fmt: skip
        est = estimate_step(model, batch, optimizer=torch.optim.AdamW, device="cuda", strategy=strategy)
        held = split_decoder(PipeDecoder(n_layers=4, d_model=d, n_heads=2, vocab=128, seq_len=32), stage, 2)
        # Split over both dimensions: the colwise weight and bias, the rowwise weight; the rowwise
        # bias is replicated over the tensor-parallel ranks, so it is sharded over FSDP's alone.
        named = held.named_parameters()
        split = sum(p.numel() for n, p in named if ".mlp." in n and not n.endswith("mlp.2.bias"))
        rest = sum(p.numel() for p in held.parameters()) - split
        assert est.steady_state.breakdown.parameters == 4 * (split // 4 + rest // 2), rank


def _stage_estimate(schedule: str, rank: int) -> object:
    return estimate_step(
        PipeDecoder(n_layers=4, d_model=128, n_heads=2, vocab=200, seq_len=64),
        lm_batch(8, 64, vocab=200),
        optimizer=torch.optim.SGD,
        strategy=Pipeline(
            2, split=split_decoder, microbatches=4, schedule=schedule, loss=token_loss, rank=rank
        ),
    )


def test_gpipe_keeps_every_microbatch_in_flight_and_1f1b_as_many_as_the_stages() -> None:
    # The first stage's saved activations at their height: GPipe runs all 4 forwards before any
    # backward; 1F1B on 2 stages keeps 2 in flight. A layer's activations of one microbatch are the
    # same under both, so GPipe's height is twice 1F1B's, within what the stage's ends add.
    gpipe = _stage_estimate("GPipe", 0)
    one_f_one_b = _stage_estimate("1F1B", 0)
    g = max(p.breakdown.activations for p in gpipe.peaks)  # type: ignore[attr-defined]
    f = max(p.breakdown.activations for p in one_f_one_b.peaks)  # type: ignore[attr-defined]
    assert g == pytest.approx(2 * f, rel=0.15), (g, f)


def test_the_model_is_left_whole_and_stages_hold_their_share() -> None:
    model = PipeDecoder(n_layers=4, d_model=64, n_heads=2, vocab=100, seq_len=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = lm_batch(4, 16, vocab=100)
    params = {
        rank: estimate_step(
            model,
            batch,
            optimizer=torch.optim.SGD,
            strategy=Pipeline(2, split=split_decoder, microbatches=2, loss=token_loss, rank=rank),
        ).steady_state.breakdown.parameters
        for rank in (0, 1)
    }
    assert sorted(model.layers) == ["0", "1", "2", "3"] and model.tok is not None and model.head is not None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.distributed.is_initialized()
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert params[0] + params[1] == whole  # each parameter on exactly one stage


def test_a_pipeline_says_what_it_cannot_run() -> None:
    model, batch = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), torch.randn(6, 8)

    def halves(model: nn.Module, stage: int, stages: int) -> nn.Module:
        return model[stage : stage + 1]

    with pytest.raises(EstimationError, match="a batch of 6 does not cut into 4 equal microbatches"):
        estimate_step(model, batch, strategy=Pipeline(2, split=halves, microbatches=4))
    with pytest.raises(EstimationError, match=r"the batch is \(inputs, target\)"):
        estimate_step(model, batch, strategy=Pipeline(2, split=halves, microbatches=2, loss=token_loss))
    with pytest.raises(EstimationError, match=r"a batch of \(\(8, 8\),\) needs a pipeline of its own"):
        two = Pipeline(2, split=halves, microbatches=2)
        estimate_step(model, torch.randn(4, 8), strategy=two, next_batches=[torch.randn(8, 8)])
    with pytest.raises(EstimationError, match="simulated for training steps"):
        estimate_step(model, batch, strategy=Pipeline(2, split=halves, microbatches=2), loop="validate")
    with pytest.raises(EstimationError, match="split failed for stage 1 of 2: IndexError"):
        estimate_step(
            model, batch, strategy=Pipeline(2, split=lambda m, s, n: [m][s], microbatches=2, rank=1)
        )
    with pytest.raises(ValueError, match="DualPipeV run several stages a rank"):
        Pipeline(2, split=halves, microbatches=2, schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match="ZBVZeroBubble runs two stages a rank"):
        Pipeline(2, split=halves, microbatches=2, schedule="ZBVZeroBubble", stages_per_rank=3)
    with pytest.raises(ValueError, match="schedule must be one of GPipe, 1F1B, Interleaved1F1B, Interl"):
        Pipeline(2, split=halves, microbatches=2, schedule="ZeroBubble")


def test_memest_estimate_pp_reports_every_rank_and_the_worst_as_measured(
    measured: dict[str, dict[int, tuple[int, ...]]],
) -> None:
    # The CLI in a subprocess, as a user runs it: each pipeline rank estimated, the worst reported,
    # and that figure is the real job's worst rank's peak.
    import json

    from tests.test_cli import assert_usage_error, memest

    args = ["estimate", "tests.pipeline_models:PipeDecoder", "--batch-size", "8", "--tokens", "128"]
    args += ["--vocab", "1000", "--optimizer", "adamw", "--calibrate"]
    pp = ["--pp", "2", "--pp-split", "tests.pipeline_models:split_decoder", "--microbatches", "4"]
    proc = memest(*args, *pp, "--json", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    ranks = {r["rank"]: r["peak_bytes"] for r in data["pipeline"]["ranks"]}
    worst = max(ranks, key=ranks.__getitem__)
    real = {rank: max(peaks) for rank, peaks in measured["1F1B"].items()}
    assert data["pipeline"]["worst_rank"] == worst and real[worst] == max(real.values())
    assert abs(ranks[worst] - real[worst]) <= 0.01 * real[worst], (ranks, real)
    assert data["peak_bytes"]["steady_state"] == ranks[worst]
    text = memest(*args, *pp, cwd=ROOT).stdout
    assert f"the worst, rank {worst}, is reported below" in text and "pipeline on 2 ranks (1F1B" in text
    # Each stage sharded over 2 ranks (4 in all): a rank of each stage, the worst as the real job's.
    sharded = ["--strategy", "fsdp", "--world-size", "4", "--fsdp-units", "Block", "--json"]
    proc = memest(*args, *pp, *sharded, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    ranks = {r["rank"]: r["peak_bytes"] for r in data["pipeline"]["ranks"]}
    real = {rank: max(peaks) for rank, peaks in measured["1F1B x FSDP"].items()}
    # (the ranks of a stage hold the same: the real job's worst is the worst stage's)
    assert sorted(ranks) == [0, 2] and real[data["pipeline"]["worst_rank"]] == max(real.values())
    for rank, peak in ranks.items():
        assert abs(peak - real[rank]) <= 0.01 * real[rank], (ranks, real)
    for wrong, said in [
        (["--pp", "2"], "--pp N needs --pp-split"),
        ([*pp, "--strategy", "ddp", "--world-size", "2"], "not with --strategy ddp"),
        ([*pp, "--strategy", "fsdp", "--world-size", "3"], "not a multiple of --pp 2 x --tp 1"),
        (["--microbatches", "4"], "--microbatches goes with --pp N"),
        ([*pp[:4], "--microbatches", "3"], "does not cut into 3 equal microbatches"),
    ]:
        assert_usage_error(memest(*args, *wrong, cwd=ROOT), said)
