"""Fault injection: whatever goes wrong in a fit, MemEstimate is never the problem.

A user's exception at every hook the callback is active around reaches the user unchanged (the
traceback, exit status 1 -- no interpreter crash at exit); one rank failing its estimate under DDP is
one warning on every rank and training goes on; an interrupt inside the simulation stops fit as
Lightning stops on Ctrl+C, leaving the module and every random generator as they were. Each fit runs
in a process of its own (``fault_worker.py``), with a time limit: a hang or a crash fails the test,
and what is checked is what the user sees, the process's output and exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import MemEstimate

WORKER = Path(__file__).with_name("fault_worker.py")
USER_ERRORS = [
    "on_fit_start",
    "training_step_1",
    "training_step_2",
    "training_step_3",
    "on_train_batch_end",
    "validation_step",
    "device_stats",
]
OTHERS = [
    "interrupt_first_estimate",
    "interrupt_second_estimate",
    "precheck_helper_fails",
    "ddp_one_rank_fails",
    "fit_batch_size_caps",
    "autograd_threads_plain",
    "autograd_threads_memest",
]
CRASHES = ("Segmentation fault", "Fatal Python error", "terminate called", "core dumped")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str, str]]:
    """Every scenario's (rc, stdout, stderr): one worker that imports once and forks each fit."""
    out = tmp_path_factory.mktemp("faults")
    env = {**os.environ, "FAULT_OUT": str(out), "FAULT_TIMEOUT": "150", "PYTHONFAULTHANDLER": "1"}
    # The slow one (a second process for rank 1) first, so that the others run beside it.
    names = ["ddp_one_rank_fails", *USER_ERRORS, *[n for n in OTHERS if n != "ddp_one_rank_fails"]]
    subprocess.run([sys.executable, str(WORKER), *names], env=env, timeout=900, check=True)

    def read(name: str, suffix: str) -> str:
        path = out / f"{name}.{suffix}"
        return path.read_text(errors="replace") if path.exists() else ""

    return {name: (read(name, "rc"), read(name, "out"), read(name, "err")) for name in names}


def _no_crash(rc: str, err: str) -> None:
    assert rc not in ("timeout", "-11", "-6", "139", "134"), f"rc {rc}:\n{err[-3000:]}"
    assert not any(crash in err for crash in CRASHES), err[-3000:]


@pytest.mark.parametrize("where", USER_ERRORS)
def test_a_users_exception_reaches_the_user_unchanged(
    runs: dict[str, tuple[str, str, str]], where: str
) -> None:
    rc, _, err = runs[where]
    _no_crash(rc, err)
    assert rc == "1", err[-3000:]
    expected = "in DeviceStatsMonitor" if where == "device_stats" else f"in {where}"
    assert f"UserError: the user's own error {expected}" in err.splitlines()[-1]
    assert "MemEstimate:" not in err  # no warning of ours: the failure is the user's


@pytest.mark.parametrize("estimate", ["first", "second"])
def test_an_interrupt_in_the_estimate_stops_fit_and_leaves_everything_as_it_was(
    runs: dict[str, tuple[str, str, str]], estimate: str
) -> None:
    # The second estimate runs while the CPU profiler measures the first batches.
    rc, out, err = runs[f"interrupt_{estimate}_estimate"]
    _no_crash(rc, err)
    assert rc == "1"  # Lightning's graceful shutdown: sys.exit(1)
    assert "Detected KeyboardInterrupt" in out + err
    assert "differences: none" in out  # weights, containers, attributes and the three generators
    assert "gc enabled: True | profiler on: False" in out


def test_a_failing_precheck_helper_is_one_warning(runs: dict[str, tuple[str, str, str]]) -> None:
    # A batch object with no tensor the pre-check can resize: the check cannot run, training goes on.
    rc, out, err = runs["precheck_helper_fails"]
    _no_crash(rc, err)
    assert rc == "0", err[-3000:]
    assert "DONE step 3" in out
    assert err.count("MemEstimate: checking the memory budget failed") == 1, err


def test_one_rank_failing_under_ddp_is_one_warning_on_every_rank(
    runs: dict[str, tuple[str, str, str]],
) -> None:
    # Two processes (gloo): rank 1's estimate fails in the first fit, its measurement in the second.
    rc, out, err = runs["ddp_one_rank_fails"]
    _no_crash(rc, err)
    assert rc == "0", err[-3000:]
    assert "DONE rank 0 step 3" in out and "DONE rank 1 step 3" in out
    assert "DONE measuring rank 0 step 3, 0 measured" in out
    assert "DONE measuring rank 1 step 3, 0 measured" in out
    # One warning on every rank, the same words: which rank failed, and why.
    for what, why in (("estimating", "rank 1 cannot be simulated"), ("measuring", "rank 1 cannot measure")):
        warnings = [line for line in err.splitlines() if f"MemEstimate: {what} failed" in line]
        assert len(warnings) == 2, err[-3000:]
        assert all(why in w and "(on rank 1)" in w for w in warnings)


def test_fit_batch_size_caps_at_the_dataset_length(runs: dict[str, tuple[str, str, str]]) -> None:
    # As Lightning's BatchSizeFinder: 256 samples, a batch size of 4 and room for far more -> 256.
    rc, out, err = runs["fit_batch_size_caps"]
    assert rc == "0", err[-3000:]
    assert "batch_size 256" in out
    assert "batch_size 4 -> 256: capped at the length of the train dataset (256 samples)" in out + err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_the_estimate_starts_no_autograd_threads_the_real_run_does_not(
    runs: dict[str, tuple[str, str, str]],
) -> None:
    # On a machine without CUDA the first backward on fake tensors started 8 idle device threads in
    # each process (and two-process DDP runs then aborted at exit now and then).
    plain, memest = (runs[f"autograd_threads_{kind}"][1] for kind in ("plain", "memest"))
    assert "autograd threads:" in plain and "autograd threads:" in memest
    assert plain.split("autograd threads:")[1].split()[0] == memest.split("autograd threads:")[1].split()[0]


# --- the module's state after the fake runs (in this process) ----------------------------------------------
class Helper:
    def __init__(self) -> None:
        self.count = 0
        self.seen: list[int] = []
        self.nested = {"a": [[0]]}


class Keeping(pl.LightningModule):
    """A module whose step writes to every kind of container it owns, and to a helper object's."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)
        self.history: list[float] = []
        self.by_step: dict[int, float] = {}
        self.recent: deque[int] = deque(maxlen=5)
        self.tags: set[int] = set()
        self.helper = Helper()
        self.pairs = ([], {})  # mutable containers inside an immutable one

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.history.append(loss.item())
        self.by_step[batch_idx] = loss.item()
        self.recent.append(batch_idx)
        self.tags.add(batch_idx)
        self.helper.count += 1
        self.helper.seen.append(batch_idx)
        self.helper.nested["a"][0].append(batch_idx)
        self.helper.late = True  # a new attribute
        self.pairs[0].append(batch_idx)
        self.pairs[1][batch_idx] = batch_idx
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(12, 8, generator=g), torch.randint(0, 2, (12,), generator=g))
        return DataLoader(data, batch_size=4)


def _fit(module: pl.LightningModule, callbacks: list[Any], steps: int = 3) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module)
    return trainer


def test_every_container_the_module_owns_keeps_only_the_real_steps() -> None:
    torch.manual_seed(0)
    memest = MemEstimate()
    module = Keeping()
    _fit(module, [memest])
    assert memest.estimate is not None  # the fake runs did run the step
    torch.manual_seed(0)
    plain = Keeping()
    _fit(plain, [])
    assert module.history == plain.history and len(module.history) == 3  # not [0.0, 0.0, l1, l2, l3]
    assert module.by_step == plain.by_step
    assert list(module.recent) == [0, 1, 2] and module.tags == {0, 1, 2}
    assert vars(module.helper) == vars(plain.helper)
    assert module.helper.nested == {"a": [[0, 0, 1, 2]]}
    assert module.pairs == ([0, 1, 2], {0: 0, 1: 1, 2: 2})


# --- one MemEstimate, several fits ----------------------------------------------------------------------
class Failing(Keeping):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == 1 and not isinstance(batch[0], FakeTensor):  # the real step only
            raise RuntimeError("the user's own error")
        return super().training_step(batch, batch_idx)


@pytest.fixture
def gc_restored() -> Iterator[None]:
    yield
    import gc

    gc.enable()  # in case the test fails with the collector off: the other tests need it


@pytest.mark.usefixtures("gc_restored")
def test_a_second_fit_estimates_and_measures_again() -> None:
    import gc

    memest = MemEstimate()
    with pytest.raises(RuntimeError, match="the user's own error"):
        _fit(Failing(), [memest])  # fails in the second measured batch, the profiler running
    assert gc.isenabled() and not torch._C._autograd._profiler_enabled()
    first_module = Keeping()
    _fit(first_module, [memest])
    first = memest.estimate
    assert first is not None and [m.step for m in memest.measured] == [1, 2]

    class Wider(Keeping):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 64)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.layer(x)[:, :2], y)

    _fit(Wider(), [memest])
    second = memest.estimate
    assert second is not None and second is not first and second.peak_bytes > first.peak_bytes
    # Only the second fit's steps, measured against the second fit's estimate.
    assert [m.step for m in memest.measured] == [1, 2]
    assert [m.estimated_bytes for m in memest.measured] == [p.bytes for p in second.peaks]
    assert all(abs(m.error_pct) <= 2.0 for m in memest.measured)


def test_a_gloo_rank_pauses_at_exit_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A PyTorch race aborts a gloo rank at exit when a worker thread frees a finished collective after
    # the interpreter began to finalize (adapter/gloo_exit.py): ranks of a gloo group, and only they,
    # get one pause at exit, before finalization.
    import torch.distributed as dist

    from lightning_memest.adapter import gloo_exit

    registered: list[tuple[Any, ...]] = []
    monkeypatch.setattr(gloo_exit.atexit, "register", lambda *a: registered.append(a))
    monkeypatch.setattr(gloo_exit, "_registered", False)
    gloo_exit.settle_gloo_workers_at_exit()  # no process group here
    assert registered == []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    gloo_exit.settle_gloo_workers_at_exit()
    assert registered == []
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    gloo_exit.settle_gloo_workers_at_exit()
    gloo_exit.settle_gloo_workers_at_exit()
    assert registered == [(gloo_exit.time.sleep, gloo_exit.EXIT_PAUSE_SECONDS)]
