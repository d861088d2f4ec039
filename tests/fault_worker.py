"""The fits of ``test_faults``, each in a process of its own, as a user's script runs them.

``python tests/fault_worker.py NAME [NAME ...]`` imports torch and Lightning once, then forks one child
per scenario: the child runs the fit and ends the way the user's script would (an uncaught exception:
its traceback on stderr, exit status 1, the interpreter's full shutdown), its stdout and stderr in
``$FAULT_OUT/NAME.out``/``.err``, its exit status (or ``-signal``) in ``NAME.rc``. A child that hangs is
killed after ``FAULT_TIMEOUT`` seconds (rc ``timeout``). Kept apart so that the children import only
this file. Under ``strategy="ddp"`` Lightning starts rank 1 by running this file again, with
``LOCAL_RANK`` set: that process runs the one scenario directly.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_memest import FitBatchSize, MemEstimate
from lightning_memest.measure import StepProbe

USER_ERROR = "the user's own error"


class UserError(RuntimeError):
    """The user's exception: it must reach the user unchanged."""


class Helper:
    """A plain object the module holds: its attributes are the module's state too."""

    def __init__(self) -> None:
        self.count = 0
        self.seen: list[int] = []


class Net(pl.LightningModule):
    """A tiny classifier that fails where the scenario says, and keeps a history in containers."""

    def __init__(self, fail: str = "", samples: int = 32, batch_size: int = 4) -> None:
        super().__init__()
        self.fail = fail
        self.samples = samples
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
        self.history: list[float] = []
        self.counts: dict[str, list[int]] = {"steps": []}
        self.recent: deque[int] = deque(maxlen=3)
        self.tags: set[int] = set()
        self.helper = Helper()
        self.real_steps = 0

    def _raise_at(self, where: str) -> None:
        if self.fail == where:
            raise UserError(f"{USER_ERROR} in {where}")

    def on_fit_start(self) -> None:
        self._raise_at("on_fit_start")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        # Step code that draws from every generator and writes to the module's containers.
        self.history.append(random.random() + float(np.random.rand()))
        if not isinstance(x, FakeTensor):
            self.real_steps += 1
            self._raise_at(f"training_step_{self.real_steps}")
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.counts["steps"].append(batch_idx)
        self.recent.append(batch_idx)
        self.tags.add(batch_idx)
        self.helper.count += 1
        self.helper.seen.append(batch_idx)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self._raise_at("on_train_batch_end")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch[0], FakeTensor):  # the real batch, measured by MemEstimate (profiler open)
            self._raise_at("validation_step")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _data(self) -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        return TensorDataset(
            torch.randn(self.samples, 8, generator=g), torch.randint(0, 2, (self.samples,), generator=g)
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self._data(), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self._data(), batch_size=self.batch_size)


class FailingStats(DeviceStatsMonitor):
    """A device-stats callback that fails at the second measured batch."""

    def _get_and_log_device_stats(self, trainer: pl.Trainer, key: str) -> None:
        if trainer.global_step == 1:
            raise UserError(f"{USER_ERROR} in DeviceStatsMonitor")


def interrupt_at(n: int) -> Any:
    """A forward pre-hook that raises ``KeyboardInterrupt`` inside the ``n``-th estimate (on fake inputs
    only): Ctrl+C while the estimator simulates. Its count lives in a closure: an object the module
    holds (a hook object's attributes) is put back after each simulation like the rest of the module."""
    estimates = 0
    after_real = True

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        nonlocal estimates, after_real
        fake = isinstance(args[0], FakeTensor)
        if fake and after_real:  # the first fake forward after a real one: the next estimate
            estimates += 1
            if estimates == n:
                raise KeyboardInterrupt
        after_real = not fake

    return hook


class Snapshot(Callback):
    """What the module and the generators are when a training batch starts, before MemEstimate runs
    (this callback comes first): at the batch that the interrupt stops."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.before: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch:
            self.before = state_of(pl_module)


def state_of(module: Any) -> dict[str, Any]:
    return {
        "weights": {k: v.clone() for k, v in module.state_dict().items()},
        "containers": repr((module.history, module.counts, module.recent, module.tags, vars(module.helper))),
        "attributes": sorted(vars(module)),
        "torch rng": torch.get_rng_state().clone(),
        "numpy rng": repr(np.random.get_state()),
        "python rng": random.getstate(),
    }


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for key in before:
        a, b = before[key], after[key]
        if key == "weights":
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        elif isinstance(a, Tensor):
            same = torch.equal(a, b)
        else:
            same = a == b
        if not same:
            out.append(key)
    return out


def trainer(**kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "limit_val_batches": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(kwargs)
    return pl.Trainer(**settings)


def user_error(where: str, **kwargs: Any) -> None:
    torch.manual_seed(0)
    trainer(callbacks=[MemEstimate()], **kwargs).fit(Net(fail=where))


def interrupted(estimate: int) -> None:
    # The second estimate comes with the second batch where it differs: 6 samples in batches of 4.
    module = Net(samples=6)
    module.net[0].register_forward_pre_hook(interrupt_at(estimate))
    snapshot = Snapshot(batch=estimate - 1)
    try:
        trainer(callbacks=[snapshot, MemEstimate()], max_steps=2).fit(module)
    finally:
        assert snapshot.before is not None
        print("differences:", differences(snapshot.before, state_of(module)) or "none")
        print("gc enabled:", gc.isenabled(), "| profiler on:", torch._C._autograd._profiler_enabled())


class NoBatchDimension:
    """A batch object the pre-check cannot resize (its tensors are attributes of a plain object)."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y


class OpaqueBatches(Dataset[Any]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        return i


class Opaque(Net):
    def train_dataloader(self) -> DataLoader[Any]:
        def collate(items: list[int]) -> NoBatchDimension:
            return NoBatchDimension(torch.randn(len(items), 8), torch.randint(0, 2, (len(items),)))

        return DataLoader(OpaqueBatches(), batch_size=4, collate_fn=collate)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self.net(batch.x), batch.y)


def precheck_helper_fails() -> None:
    t = trainer(callbacks=[MemEstimate(memory_budget="1GiB")], max_steps=3)
    t.fit(Opaque())
    print(f"DONE step {t.global_step}")


class RankOneCannotSimulate(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if isinstance(batch[0], FakeTensor) and self.global_rank == 1:
            raise UserError("rank 1 cannot be simulated")
        return super().training_step(batch, batch_idx)


def ddp_one_rank_fails() -> None:
    t = trainer(callbacks=[MemEstimate()], devices=2, strategy="ddp", max_steps=3)
    t.fit(RankOneCannotSimulate())
    print(f"DONE rank {t.global_rank} step {t.global_step}")
    # Then, in the same job, a fit whose measurement fails on rank 1 only.
    if t.global_rank == 1:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise UserError("rank 1 cannot measure")

        StepProbe.start = broken  # type: ignore[method-assign]
    memest = MemEstimate()
    t = trainer(callbacks=[memest], devices=2, strategy="ddp", max_steps=3)
    t.fit(Net())
    print(f"DONE measuring rank {t.global_rank} step {t.global_step}, {len(memest.measured)} measured")


def fit_batch_size_caps() -> None:
    module = Net(samples=256)
    trainer(callbacks=[FitBatchSize("1GiB")], max_steps=1).fit(module)
    print(f"batch_size {module.batch_size}")


def autograd_threads(memest: bool) -> None:
    trainer(callbacks=[MemEstimate()] if memest else [], max_steps=2).fit(Net())
    tasks = Path("/proc/self/task")
    names = [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]
    print(f"autograd threads: {sum(name.startswith('pt_autograd') for name in names)}")


SCENARIOS: dict[str, Any] = {
    "on_fit_start": lambda: user_error("on_fit_start"),
    "training_step_1": lambda: user_error("training_step_1"),  # the estimated and first measured batch
    "training_step_2": lambda: user_error("training_step_2"),  # the second measured batch
    "training_step_3": lambda: user_error("training_step_3"),  # after the measurement
    "on_train_batch_end": lambda: user_error("on_train_batch_end"),  # between the measured batches
    "validation_step": lambda: user_error(  # validation between the measured batches
        "validation_step", limit_val_batches=1, val_check_interval=1, num_sanity_val_steps=0
    ),
    "device_stats": lambda: trainer(
        callbacks=[MemEstimate(), FailingStats()],
        logger=CSVLogger(os.environ["FAULT_OUT"]),
        log_every_n_steps=1,
    ).fit(Net()),
    "interrupt_first_estimate": lambda: interrupted(1),
    "interrupt_second_estimate": lambda: interrupted(2),  # the CPU profiler is measuring then
    "precheck_helper_fails": precheck_helper_fails,
    "ddp_one_rank_fails": ddp_one_rank_fails,
    "fit_batch_size_caps": fit_batch_size_caps,
    "autograd_threads_plain": lambda: autograd_threads(memest=False),
    "autograd_threads_memest": lambda: autograd_threads(memest=True),
}


def _child(name: str, out: Path) -> None:
    """In the forked child: output to files, then the scenario; an exception ends the process as it
    ends a user's script."""
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(out / f"{name}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.environ["FAULT_SCENARIO"] = name  # for rank 1 under DDP
    SCENARIOS[name]()


def _reap(running: dict[int, tuple[str, float]], out: Path) -> None:
    """Wait until one of the running children ends (or is killed at its deadline); record its rc."""
    while True:
        for pid, (name, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = str(os.waitstatus_to_exitcode(status))
            elif time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)  # the child and whatever it started (rank 1)
                os.waitpid(pid, 0)
                rc = "timeout"
            else:
                continue
            (out / f"{name}.rc").write_text(rc)
            del running[pid]
            return
        time.sleep(0.05)


def main(names: list[str]) -> None:
    if os.environ.get("LOCAL_RANK", "0") != "0":  # rank 1 of a DDP scenario, started by Lightning
        SCENARIOS[os.environ["FAULT_SCENARIO"]]()
        return
    out = Path(os.environ["FAULT_OUT"])
    timeout = float(os.environ.get("FAULT_TIMEOUT", "120"))
    jobs = int(os.environ.get("FAULT_JOBS", "2"))
    running: dict[int, tuple[str, float]] = {}
    for name in names:
        while len(running) >= jobs:
            _reap(running, out)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            _child(name, out)  # returns only without an exception: the child ends at the script's end
            return
        running[pid] = (name, time.monotonic() + timeout)
    while running:
        _reap(running, out)


if __name__ == "__main__":
    main(sys.argv[1:])
