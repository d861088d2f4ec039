"""MemEstimate through real ``Trainer.fit`` runs on CPU, with a TensorBoardLogger."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_memest import MemEstimate


class RandomImages(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class Classifier(pl.LightningModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 16 * 16, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(RandomImages(), batch_size=self.batch_size, shuffle=True)


def fit(module: pl.LightningModule, tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("max_steps", 3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=TensorBoardLogger(tmp_path, name="tb", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )
    trainer.fit(module)
    return trainer


def scalars(tmp_path: Path, run: str = "") -> dict[str, list[float]]:
    """The run's scalars as TensorBoard reads them (``run``: one of its series' runs, ``memest/measured``)."""
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0" / run))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_estimate_logged_and_within_two_percent_of_measured(tmp_path: Path) -> None:
    memest = MemEstimate()
    module = Classifier()
    fit(module, tmp_path, [memest])
    assert memest.estimate is not None and memest.estimate.flops is not None
    # MFU for ThroughputMonitor: forward + backward FLOPs of one batch
    assert module.flops_per_batch == memest.estimate.flops.forward + (memest.estimate.flops.backward or 0)
    assert len(memest.measured) == 2
    for step in memest.measured:
        assert abs(step.error_pct) <= 2.0, step
    logged = scalars(tmp_path)
    assert logged["memest/error_pct"] == pytest.approx([m.error_pct for m in memest.measured])
    assert min(logged["memest/GFLOP_per_batch/forward"] + logged["memest/GFLOP_per_batch/backward"]) > 0
    measured_run = scalars(tmp_path, "memest/measured")
    measured = measured_run["memest/first_step/peak_MiB"] + measured_run["memest/peak_MiB"]
    assert measured == pytest.approx([m.peak_bytes / 2**20 for m in memest.measured])
    estimated = scalars(tmp_path, "memest/simulated")["memest/peak_MiB"]
    assert estimated[-1] == pytest.approx(memest.measured[1].estimated_bytes / 2**20)
    assert gc.isenabled()  # the collector was paused for the two measured steps only
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    acc.Reload()
    tags = acc.Tags()
    assert "memest/timeline" in tags["images"]
    assert {
        "custom_scalars__config__",
        "memest/breakdown/text_summary",
        "memest/top_modules/text_summary",
    } <= set(tags["tensors"])


# The summary as a user sees it (with and without rich, one table): tests/test_summary.py.


def test_training_is_bitwise_identical_with_the_callback(tmp_path: Path) -> None:
    def final_weights(callbacks: list[Any]) -> dict[str, Tensor]:
        pl.seed_everything(7)
        module = Classifier()
        fit(module, tmp_path / str(len(callbacks)), callbacks, max_steps=4)
        return {k: v.clone() for k, v in module.state_dict().items()}

    without = final_weights([])
    with_callback = final_weights([MemEstimate()])
    assert without.keys() == with_callback.keys()
    for key, value in without.items():
        assert torch.equal(value, with_callback[key]), key


class CachingModule(Classifier):
    """Caches a tensor on itself in forward, reads values, masks by value, and uses nonzero."""

    def forward(self, x: Tensor) -> Tensor:
        if getattr(self, "scale", None) is None:
            self.scale = torch.ones(1)
        h = self.net(x) * self.scale
        keep = h[h > 0]  # data-dependent shape
        return h + keep.sum() * 0 + torch.nonzero(h > 0).shape[0] * 0  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:  # a value read
            raise RuntimeError("unreachable")
        return loss


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad  # type: ignore[no-any-return]


class CustomFunctionModule(Classifier):
    def forward(self, x: Tensor) -> Tensor:
        return self.net(Square.apply(x))  # type: ignore[no-any-return]


class CompiledModule(Classifier):
    """A torch.compile'd submodule (inductor): the simulation compiles it as the fit will and runs
    inductor's buffer plan on fake tensors; the fit's compile finds the graphs in the caches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net)  # type: ignore[assignment]


class ManualModule(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        opt = self.optimizers()
        assert not isinstance(opt, list)  # one optimizer
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class ToggledManualModule(ManualModule):
    """Manual optimization as Lightning's docs write it, with the ``LightningOptimizer``'s own API: an
    ``isinstance`` check, ``toggle_model``, a closure given to ``step``, ``.optimizer``."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        opt = self.optimizers()
        assert isinstance(opt, LightningOptimizer) and isinstance(opt, torch.optim.AdamW)
        x, y = batch

        def closure() -> Tensor:
            loss = F.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        with opt.toggle_model():
            loss = opt.step(closure=closure)
        self.log("lr", opt.optimizer.param_groups[0]["lr"])
        return loss  # type: ignore[no-any-return]


class OverriddenStepModule(Classifier):
    """Automatic optimization with ``optimizer_step`` overridden as Lightning's docs show it: a
    learning-rate warm-up set by hand, and here the first batch's update skipped (its forward and
    backward run: the closure is called), so the optimizer's state is made one batch later."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
        if batch_idx == 0:
            optimizer_closure()
            return
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * min(1.0, (self.trainer.global_step + 1) / 10)


class DictBatchModule(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.cross_entropy(self(batch["image"]), batch["label"])

    def train_dataloader(self) -> DataLoader[Any]:
        data = RandomImages()
        items = [{"image": data.x[i], "label": data.y[i]} for i in range(len(data))]
        return DataLoader(items, batch_size=self.batch_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("module_cls", "trainer_kwargs"),
    [
        (CachingModule, {}),
        (CustomFunctionModule, {}),
        (CompiledModule, {}),
        (ManualModule, {}),
        (DictBatchModule, {}),
        (Classifier, {"accumulate_grad_batches": 4, "max_steps": 2}),
        (Classifier, {"gradient_clip_val": 0.5}),
        (ManualModule, {"precision": "16-mixed"}),
        (ToggledManualModule, {}),
        (ToggledManualModule, {"precision": "16-mixed"}),
        (OverriddenStepModule, {}),
        (OverriddenStepModule, {"accumulate_grad_batches": 2, "max_steps": 2}),
    ],
    ids=[
        "caching-item-mask-nonzero",
        "autograd-function",
        "compiled",
        "manual",
        "dict-batch",
        "accumulate-4",
        "clip",
        "manual-16-mixed",
        "manual-toggle-closure",
        "manual-toggle-closure-16-mixed",
        "optimizer-step-overridden",
        "optimizer-step-overridden-accumulate-2",
    ],
)
def test_hostile_modules_train_with_at_most_a_warning(
    tmp_path: Path, module_cls: type[Classifier], trainer_kwargs: dict[str, Any]
) -> None:
    memest = MemEstimate()
    module = module_cls()
    fit(module, tmp_path, [memest], **trainer_kwargs)
    assert memest.estimate is not None, "the estimate should succeed for this module"
    assert len(memest.measured) == 2
    if module_cls is CompiledModule:
        # It stays compiled (tests/test_step_as_run.py) and is simulated compiled: the check compares
        # inductor's step with inductor's step.
        assert memest.estimate.compiled == ("net",) and memest.estimate.compiled_eagerly is None
        assert memest.estimate.compiled_graphs
    for step in memest.measured:
        assert abs(step.error_pct) <= 2.0, step
    if module_cls is CachingModule:
        assert type(module.scale) is Tensor  # the real cache, not a fake one
        assert memest.estimate.data_dependent is not None


def test_an_optimizer_step_that_never_runs_its_closure_is_named(tmp_path: Path) -> None:
    # Lightning's fit stops at such a step; the estimate says why before it does, in one warning.
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    class NoClosure(Classifier):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
            optimizer.zero_grad()

    with (
        pytest.warns(UserWarning, match="did not call its optimizer_closure") as record,
        pytest.raises(MisconfigurationException, match="closure hasn't been executed"),
    ):
        fit(NoClosure(), tmp_path, [MemEstimate()])
    assert sum("MemEstimate" in str(w.message) for w in record) == 1


def test_empty_init_module(tmp_path: Path) -> None:
    memest = MemEstimate()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[memest], logger=False, enable_checkpointing=False
    )
    with trainer.init_module(empty_init=True):
        module = Classifier()
    trainer.fit(module)
    assert memest.estimate is not None and len(memest.measured) == 2


@torch.library.custom_op("memest_test_callback::positives", mutates_args=())
def positives(x: Tensor) -> Tensor:
    """A user's op whose output size depends on values, and for which the estimator has no policy."""
    return x[x > 0].clone()


@positives.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(torch.library.get_ctx().new_dynamic_size())


def test_a_failing_estimate_is_one_warning_and_training_goes_on(tmp_path: Path) -> None:
    class Unsimulatable(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss + positives(batch[0]).sum() * 0  # type: ignore[no-any-return]

    memest = MemEstimate()
    with pytest.warns(UserWarning, match="MemEstimate: estimating failed") as record:
        trainer = fit(Unsimulatable(), tmp_path, [memest])
    assert sum("MemEstimate" in str(w.message) for w in record) == 1
    message = next(str(w.message) for w in record if "MemEstimate" in str(w.message))
    assert "at op" in message and "what you can do:" in message  # the op, and the next step
    assert memest.estimate is None and memest.measured == []
    assert trainer.global_step == 3


def test_memory_precheck_raises_before_any_step(tmp_path: Path) -> None:
    from lightning_memest import MemoryBudgetError

    class Counting(Classifier):
        steps_run = 0  # real batches only: the simulation calls training_step, not this hook

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            Counting.steps_run += 1

    budget = _halfway_budget(tmp_path)
    memest = MemEstimate(memory_check="raise", memory_budget=budget)
    with pytest.raises(MemoryBudgetError) as info:
        fit(Counting(), tmp_path, [memest])
    assert Counting.steps_run == 0
    message = str(info.value)
    assert "batch size 16" in message and f"({budget:,} B)" in message
    assert "largest batch size that fits" in message
    assert info.value.max_batch_size is not None and 0 < info.value.max_batch_size < 16


def test_memory_precheck_warns_with_the_batch_size_that_fits(tmp_path: Path) -> None:
    budget = _halfway_budget(tmp_path)
    with pytest.warns(UserWarning, match="largest batch size that fits is"):
        fit(Classifier(), tmp_path, [MemEstimate(memory_budget=budget)], max_steps=1)


def _halfway_budget(tmp_path: Path) -> int:
    """A budget halfway between what any batch size needs (weights, gradients, optimizer state, the
    dataset and whatever else lives in this process) and the peak at the classifier's batch size."""
    first = MemEstimate(memory_check="off")
    fit(Classifier(), tmp_path / "first", [first], max_steps=1)
    assert first.estimate is not None
    held = first.estimate.steady_state.breakdown
    fixed = held.parameters + held.gradients + held.optimizer_state + held.other_tensors
    return (fixed + first.estimate.peak_bytes) // 2


def test_ddp_each_rank_estimates_and_rank_zero_logs(tmp_path: Path) -> None:
    # Two CPU processes (gloo): each rank simulates itself under DDP (its gradient buckets included),
    # measures its own steps, the peaks are max-reduced, rank 0 logs, training completes.
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=3,
        callbacks=[MemEstimate()],
        logger=TensorBoardLogger(tmp_path, name="tb", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Classifier())  # the workers train; this process's trainer stays at step 0
    errors = scalars(tmp_path)["memest/error_pct"]
    measured_run = scalars(tmp_path, "memest/measured")
    # rank 0 only, once a step (the first step's peak a series of its own)
    assert len(measured_run["memest/first_step/peak_MiB"]) == len(measured_run["memest/peak_MiB"]) == 1
    assert len(errors) == 2 and all(abs(e) <= 2.0 for e in errors)


def test_options_are_checked_when_the_callback_is_made() -> None:
    """A typo or an impossible value is one clear error at construction, not a silent default."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'memory_budjet'.*memory_budget"):
        MemEstimate(memory_budjet="1KiB")  # type: ignore[call-arg]
    for budget in (-1, -5, 0, "0B", "150%", "ten gigs"):
        with pytest.raises(ValueError, match="memory_budget"):
            MemEstimate(memory_budget=budget)
    for bad in ({"memory_check": "loud"}, {"max_depth": -2}, {"memory_margin_bytes": -1}):
        with pytest.raises(ValueError):
            MemEstimate(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="calibrate must be True or False"):
        MemEstimate(calibrate="yes")  # type: ignore[arg-type]
    assert MemEstimate(memory_budget="80%").memory_budget is not None
    assert MemEstimate(header_style="bold").memory_budget is None  # RichModelSummary's keyword


def test_a_share_of_the_device_is_a_budget(tmp_path: Path) -> None:
    """``memory_budget="0.0001%"``: a sliver of the machine's memory, checked at the first batch."""
    from lightning_memest import MemoryBudgetError

    with pytest.raises(MemoryBudgetError, match="over the memory budget"):
        fit(Classifier(), tmp_path, [MemEstimate(memory_check="raise", memory_budget="0.0001%")])
