"""The batch-size search, the pre-check and FitBatchSize: against the estimator, the CPU ground truth,
the command line and a real ``Trainer.fit``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import estimate_step
from lightning_memest.batch_size import (
    FitBatchSize,
    case_batch_maker,
    max_batch_size,
    parse_size,
    precheck,
    resize_batch,
    search_batch_size,
)
from lightning_memest.cli import main
from lightning_memest.errors import EstimationError, MemoryBudgetError
from lightning_memest.models import InputSpec, build_case, estimate_case, measure_case

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


# ------------------------------------------------------------------------------------- the search


@pytest.mark.parametrize(
    "peak",
    [
        lambda n: 1000 + 37 * n,  # affine
        lambda n: max(10**6 + 1000 * n, 3 * 10**6 + 500 * n, 3000 * n),  # kinks: the peak moves
        lambda n: 1000 + int(3 * n**1.5),  # curved
        lambda n: 10**6 + 1000 * n + (4096 if n % 7 == 0 else 0),  # not monotone
    ],
)
@pytest.mark.parametrize("budget", [5 * 10**5, 2 * 10**6, 5 * 10**6, 10**8])
def test_search_finds_a_boundary(peak: Any, budget: int) -> None:
    r = search_batch_size(peak, budget)
    n = r.max_batch_size
    assert n == 0 or (peak(n) <= budget and (r.capped or budget < peak(n + 1)))
    assert len(r.probes) == len(dict(r.probes)) <= 30  # each size asked once


def test_search_affine_takes_four_probes_and_caps() -> None:
    r = search_batch_size(lambda n: 1000 + 37 * n, 10_000, start=16)
    assert (r.max_batch_size, len(r.probes)) == (243, 4)
    assert r.to_json() == {
        "max_batch_size": 243,
        "peak_bytes_at_max": 9991,
        "probes": 4,
        "seconds": r.to_json()["seconds"],
    }
    capped = search_batch_size(lambda n: n, 10**9, cap=1000)
    assert (capped.max_batch_size, capped.capped) == (1000, True)
    assert "stops at 1000" in capped.message
    none = search_batch_size(lambda n: 100 * n, 50)
    assert (none.max_batch_size, none.peak_bytes_at_max) == (0, None)
    assert "even batch size 1" in none.message


def test_probe_errors_name_the_batch_size() -> None:
    def peak(n: int) -> int:
        if n > 1:
            raise EstimationError("boom", op="aten.mm")
        return 1

    with pytest.raises(EstimationError, match="at batch size 8: boom") as info:
        search_batch_size(peak, 100)
    assert info.value.op == "aten.mm"


def test_parse_size() -> None:
    assert parse_size("10GiB") == 10 * 2**30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512 mib") == 512 * 2**20
    assert parse_size("123") == 123
    for bad in ("", "GiB", "-1GiB", "1.5XB", "0", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_resize_batch_keeps_other_tensors_and_layout() -> None:
    x = torch.zeros(4, 3, 8, 8).to(memory_format=torch.channels_last)
    out = resize_batch({"x": x, "mask": torch.zeros(7), "k": 3}, 4, 1000)
    assert out["x"].shape == (1000, 3, 8, 8) and out["x"].device.type == "meta"
    assert out["x"].is_contiguous(memory_format=torch.channels_last)
    assert out["mask"].shape == (7,) and out["k"] == 3


# ---------------------------------------------------------------------- exact, and right on CPU


CASES = [
    ("cli_models:TinyConvNet", InputSpec(batch_size=8, shape=(3, 32, 32)), None),
    (
        "models:TinyGPT",
        InputSpec(batch_size=8, tokens=64, vocab=512),
        {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab": 512, "seq_len": 64},
    ),
]


@pytest.mark.parametrize(("spec", "inputs", "kwargs"), CASES, ids=["convnet", "tinygpt"])
def test_max_batch_size_against_estimator_and_ground_truth(
    spec: str, inputs: InputSpec, kwargs: dict[str, Any] | None
) -> None:
    case = build_case(spec, inputs, model_kwargs=kwargs)
    make = case_batch_maker(case)
    cfg = case.config

    def estimate(n: int) -> int:
        return estimate_step(
            case.model, make(n), loss_fn=cfg.loss_fn, optimizer=cfg.optimizer, precision=cfg.precision
        ).peak_bytes

    # A budget halfway between batch sizes 8 and 9: the answer is 8, with half a sample's bytes of slack
    # on either side for the measurement.
    budget = (estimate(8) + estimate(9)) // 2
    r = max_batch_size(case.model, make, budget, loss_fn=cfg.loss_fn, optimizer=cfg.optimizer, start=3)
    assert r.max_batch_size == 8
    assert r.peak_bytes_at_max is not None
    assert estimate(8) == r.peak_bytes_at_max <= budget < estimate(9)  # exact w.r.t. the estimator
    assert len(r.probes) <= 6
    # The meta batch estimates the same as the real one.
    assert estimate_case(build_case(spec, inputs, model_kwargs=kwargs)).peak_bytes == estimate(8)
    # Ground truth: real steps at 8 fit, at 9 do not.
    for n, fits in ((8, True), (9, False)):
        real = build_case(spec, InputSpec(n, inputs.shape, inputs.tokens, inputs.vocab), model_kwargs=kwargs)
        m = measure_case(real)
        assert (max(m.peak_bytes) <= budget) is fits, (n, m.peak_bytes, budget)


# ------------------------------------------------------------------------------------ the CLI


def _cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str
) -> tuple[int, str, str]:
    monkeypatch.chdir(TESTS)
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["max-batch-size", "cli_models:TinyMLP", "--input-shape", "16", "--memory-budget", "1MiB"]
    code, out, err = _cli(capsys, monkeypatch, *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"max_batch_size", "peak_bytes_at_max", "probes", "seconds"}
    assert data["peak_bytes_at_max"] <= 2**20 and data["max_batch_size"] > 8
    assert "batch size 1:" in err  # progress
    code, out, _ = _cli(capsys, monkeypatch, *args)
    assert code == 0 and f"is {data['max_batch_size']} " in out


@pytest.mark.parametrize("size", ["ten", "1.5XB", "0", "-3MiB"])
def test_cli_bad_size_exits_2(
    size: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = _cli(
        capsys,
        monkeypatch,
        "max-batch-size",
        "cli_models:TinyMLP",
        "--input-shape",
        "16",
        f"--memory-budget={size}",
    )
    assert code == 2 and out == ""
    assert err.startswith("memest: error: --memory-budget") and err.count("\n") == 1


def test_cli_nothing_fits(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = _cli(
        capsys, monkeypatch, "max-batch-size", "cli_models:TinyMLP", "--input-shape", "16",
        "--memory-budget", "1KiB", "--json",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out) == {
        "max_batch_size": 0,
        "peak_bytes_at_max": None,
        "probes": 1,
        "seconds": json.loads(out)["seconds"],
    }
    assert "even batch size 1 is over the memory budget" in err


# ------------------------------------------------------------------------------------ the pre-check


def test_precheck_messages() -> None:
    est = estimate_step(nn.Linear(100, 100), torch.randn(64, 100), optimizer=torch.optim.Adam)
    ok = precheck(est, est.peak_bytes, batch_size=64)
    assert ok.fits and "within" in ok.message
    calls: list[int] = []

    def best() -> int:
        calls.append(1)
        return 17

    bad = precheck(est, est.peak_bytes - 1, batch_size=64, max_fit=best)
    assert not bad.fits and bad.max_batch_size == 17 and calls == [1]
    for part in (f"{est.peak_bytes:,} B", f"{est.peak_bytes - 1:,} B", "batch size 64", "fits is 17"):
        assert part in bad.message
    err = bad.error()
    assert isinstance(err, MemoryBudgetError) and str(err) == bad.message
    assert (err.peak_bytes, err.batch_size, err.max_batch_size) == (est.peak_bytes, 64, 17)


# ------------------------------------------------------------------------- FitBatchSize in a real fit


class Net(pl.LightningModule):
    def __init__(self, batch_size: int = 4, *, hparam: bool = False) -> None:
        super().__init__()
        if hparam:
            self.save_hyperparameters()
        else:
            self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g))


class WithLoader(Net):
    def train_dataloader(self) -> DataLoader[Any]:
        size = self.hparams.get("batch_size") or self.batch_size  # hparams, or the attribute
        return DataLoader(_data(), batch_size=size)


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_data(), batch_size=self.batch_size)


class Seen(pl.Callback):
    """The sizes of the real batches (the estimator's fake runs call training_step, not this hook)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.sizes.append(batch[0].shape[0])


def _fit(module: pl.LightningModule, callback: FitBatchSize, datamodule: Any = None) -> list[int]:
    seen = Seen()
    trainer = pl.Trainer(
        callbacks=[callback, seen], max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert trainer.train_dataloader is not None
    return seen.sizes


BUDGET = 2**20  # about 1 MiB: the answer is a few dozen samples


@pytest.mark.parametrize("where", ["attribute", "hparams", "datamodule"])
def test_fit_batch_size_sets_the_dataloader(where: str) -> None:
    callback = FitBatchSize(BUDGET, margin=0.0)
    if where == "datamodule":
        module: Net = Net()
        del module.batch_size
        data: Data | None = Data()
    else:
        module, data = WithLoader(hparam=where == "hparams"), None
    seen = _fit(module, callback, data)
    r = callback.result
    assert r is not None and 4 < r.max_batch_size < 512
    assert seen == [r.max_batch_size]
    holder: Any = data if data is not None else (module.hparams if where == "hparams" else module)
    value = holder["batch_size"] if where == "hparams" else holder.batch_size
    assert value == r.max_batch_size
    # Exact with respect to the Lightning estimator: the next size is over the budget.
    assert dict(r.probes)[r.max_batch_size] <= BUDGET < dict(r.probes)[r.max_batch_size + 1]


def test_fit_batch_size_raises_before_any_step() -> None:
    seen = Seen()
    trainer = pl.Trainer(
        callbacks=[FitBatchSize("16KiB"), seen],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
    )
    with pytest.raises(MemoryBudgetError, match="even batch size 1") as info:
        trainer.fit(WithLoader())
    assert info.value.batch_size == 4 and info.value.max_batch_size == 0
    assert seen.sizes == []


_PARALLEL = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from lightning_memest.batch_size import max_batch_size
from models import TinyGPT
model = TinyGPT(n_layers=2)
r = max_batch_size(
    model, lambda n: torch.empty(n, 128, dtype=torch.long, device="meta"), 300 * 2**20,
    optimizer=torch.optim.AdamW, workers=int(sys.argv[2]),
)
print(json.dumps({"max": r.max_batch_size, "peak": r.peak_bytes_at_max, "probes": [n for n, _ in r.probes]}))
"""


def test_probes_in_a_worker_process_give_the_same_answer() -> None:
    # In a fresh process (as the CLI runs) pairs of probes run at once, one in a forked worker.
    import subprocess
    import sys

    def run(workers: int) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-c", _PARALLEL, str(TESTS), str(workers)],
            capture_output=True,
            text=True,
            check=True,
        )
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    alone, paired = run(1), run(2)
    assert (paired["max"], paired["peak"]) == (alone["max"], alone["peak"])
    assert paired["probes"][:2] == [1, 8] and set(alone["probes"]) <= set(paired["probes"])


def test_a_worker_forked_after_a_simulation_steps_aside() -> None:
    # Autograd cannot run in a child forked after this process ran backward on fake tensors: the
    # worker says so at once and the search runs alone, with the same answer.
    from lightning_memest.batch_size import _Worker

    estimate_step(nn.Linear(8, 8), torch.randn(2, 8), optimizer=torch.optim.SGD)
    worker = _Worker(lambda n: n)
    assert not worker.ready
    worker.close()
    r = search_batch_size(lambda n: 1000 + 37 * n, 10_000, start=16, workers=2)
    assert (r.max_batch_size, len(r.probes)) == (243, 4)


class SeenOnDisk(pl.Callback):
    """Each rank writes the size of its first real batch (spawned workers share no memory with us)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        (self.folder / f"rank{trainer.global_rank}").write_text(str(batch[0].shape[0]))


def test_fit_batch_size_under_ddp_counts_the_buckets(tmp_path: Path) -> None:
    # Two CPU processes (gloo): each rank searches as a DDP rank (its gradient buckets count, one more
    # copy of the parameters), on a fake group of its own (no collective to deadlock on), and all take
    # the smallest answer. The buckets leave less room than a single process has.
    single = FitBatchSize(BUDGET, margin=0.0)
    _fit(WithLoader(), single)
    assert single.result is not None
    trainer = pl.Trainer(
        callbacks=[FitBatchSize(BUDGET, margin=0.0), SeenOnDisk(tmp_path)], max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=2, strategy="ddp_spawn",
    )  # fmt: skip
    trainer.fit(WithLoader())
    sizes = {int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)}
    assert len(sizes) == 1
    (ddp_size,) = sizes
    assert 4 < ddp_size < single.result.max_batch_size
