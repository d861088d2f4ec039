"""What the estimator can know, it knows (issue 44, item 3): a module's own parameters and buffers read as
numbers answer from their real values, follow what the step writes into them, and a read that stays
assumed says whether it could have lowered the estimate. Checked against the CPU allocator's events
(``measure_step``), never against the estimator's own bookkeeping."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import MemEstimate, estimate_step
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step


class RepeatedBlock(nn.Module):
    """A block that applies its layer as often as its buffer says (a per-block depth setting)."""

    repeats: Tensor

    def __init__(self, repeats: int, width: int = 256) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)
        self.register_buffer("repeats", torch.tensor([repeats]))

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(int(self.repeats.item())):
            x = torch.relu(self.layer(x))
        return x


class CountingBlock(nn.Module):
    """A block that counts its calls in a buffer (as batch norm's ``num_batches_tracked`` does) and runs
    its layer once more each call: the second step holds more than the first."""

    calls: Tensor

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros(1, dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        for _ in range(int(self.calls.item())):
            x = torch.relu(self.layer(x))
        return x


class Averaged(nn.Module):
    """A running average of activations kept in a buffer and read back: its value follows the batch, so
    the simulation cannot know it."""

    average: Tensor

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)
        self.register_buffer("average", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer(x)
        with torch.no_grad():
            self.average.mul_(0.9).add_(h.mean() * 0.1)
        if self.average.item() > 1.0:  # a branch a real run may take
            h = torch.relu(self.layer(h))
        return h  # type: ignore[no-any-return]


def _squares(model: nn.Module, batch: Tensor) -> Tensor:
    return model(batch).pow(2).mean()  # type: ignore[no-any-return]


def _estimate_and_measure(model: nn.Module, batch: Tensor) -> tuple[Any, tuple[int, ...]]:
    # The estimate and the measurement each get a copy: the measured step trains its model in place.
    est = estimate_step(copy.deepcopy(model), batch, loss_fn=_squares, optimizer=torch.optim.Adam)
    config = StepConfig(loss_fn=_squares, optimizer=torch.optim.Adam)
    measured = measure_step(copy.deepcopy(model), batch, config)
    return est, tuple(measured.peak_bytes)


def test_a_loop_counted_by_a_buffer_runs_as_often_as_the_buffer_says() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(RepeatedBlock(1), RepeatedBlock(2), RepeatedBlock(3))
    est, measured = _estimate_and_measure(model, torch.randn(2048, 256))
    for peak, real in zip(est.peaks, measured, strict=True):
        assert abs(peak.bytes - real) <= 0.01 * real, (peak.bytes, real)
    reads = est.data_dependent or ()
    assert {r.module for r in reads} == {"0", "1", "2"}
    assert all(r.exact and r.assumed == "its real value" for r in reads), reads
    assert est.assumed_reads == () and est.lowering_reads == ()
    # The model is left as it was: its buffers are the user's tensors, with their values.
    assert [int(b.repeats) for b in model] == [1, 2, 3]  # type: ignore[arg-type]


def test_a_buffer_written_in_place_follows_the_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(CountingBlock(), CountingBlock())
    est, measured = _estimate_and_measure(model, torch.randn(1024, 256))
    assert measured[1] > measured[0], "step 2 runs each layer once more"
    for peak, real in zip(est.peaks, measured, strict=True):
        assert abs(peak.bytes - real) <= 0.01 * real, (peak.bytes, real)
    assert all(r.exact for r in est.data_dependent or ())
    assert [int(b.calls) for b in model] == [0, 0]  # type: ignore[arg-type]


def test_a_value_written_from_activations_stays_assumed_and_says_it_could_lower() -> None:
    est = estimate_step(Averaged(), torch.randn(64, 256), loss_fn=_squares, optimizer=torch.optim.SGD)
    (read,) = est.assumed_reads
    assert read.op == "aten._local_scalar_dense.default" and not read.bound and read.may_lower
    assert est.lowering_reads == (read,)
    assert "could be low" in read.describe()
    assert "2 could have lowered the estimate" in str(est)


def test_a_small_parameter_is_known_until_the_optimizer_writes_it() -> None:
    seen: list[float] = []

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(16, 16)
            self.gate = nn.Parameter(torch.tensor([0.5]))

        def forward(self, x: Tensor) -> Tensor:
            seen.append(float(self.gate.item()))
            return self.layer(x) * self.gate  # type: ignore[no-any-return]

    model = Gated()
    est = estimate_step(model, torch.randn(8, 16), loss_fn=_squares, optimizer=torch.optim.SGD)
    # Step 1 reads the real 0.5; step 2 reads a gate the first update wrote from its gradient: unknown.
    assert seen == [0.5, 0.0]
    assert [(r.exact, r.count) for r in est.data_dependent or ()] == [(True, 1), (False, 1)]
    assert model.gate.item() == 0.5 and model.gate.grad is None


def test_batch_norm_counts_its_batches_and_its_statistics_follow_the_batch() -> None:
    # nn.BatchNorm1d on the CPU updates num_batches_tracked with add_ (known: it follows) and its
    # running statistics inside native_batch_norm, whose schema does not say it writes them.
    seen: list[tuple[int, float]] = []

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(16)

        def forward(self, x: Tensor) -> Tensor:
            out = self.norm(x)
            counted, variance = self.norm.num_batches_tracked, self.norm.running_var
            assert counted is not None and variance is not None
            seen.append((int(counted), float(variance.max())))
            return out  # type: ignore[no-any-return]

    est = estimate_step(Normed(), torch.randn(8, 16), loss_fn=_squares)
    assert seen == [(1, 0.0), (2, 0.0)]  # the variance is read after the batch moved it: assumed
    exact = {r.exact: r.count for r in est.data_dependent or ()}
    assert exact == {True: 2, False: 2}


class PackedTagger(nn.Module):
    """A small embedding table (known, with the batch's tokens: the embedded batch is known too) packed
    by the batch's lengths into an LSTM, whose kernels read the packed batch sizes by data pointer."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(self.embedding(tokens), lengths, batch_first=True, enforce_sorted=False)
        output, _ = self.lstm(packed)
        padded, _ = pad_packed_sequence(output, batch_first=True)
        return padded.pow(2).mean()


def test_known_values_through_a_packed_sequence() -> None:
    torch.manual_seed(0)
    batch = (torch.randint(0, 64, (16, 24)), torch.randint(4, 25, (16,)))

    def loss(model: nn.Module, b: tuple[Tensor, Tensor]) -> Tensor:
        return model(*b)  # type: ignore[no-any-return]

    est = estimate_step(PackedTagger(), batch, loss_fn=loss, optimizer=torch.optim.Adam)
    measured = measure_step(PackedTagger(), batch, StepConfig(loss_fn=loss, optimizer=torch.optim.Adam))
    for peak, real in zip(est.peaks, measured.peak_bytes, strict=True):
        assert abs(peak.bytes - real) <= 0.02 * real, (peak.bytes, real)


def test_a_model_built_on_the_meta_device_has_no_values_to_know() -> None:
    with torch.device("meta"):
        model = nn.Sequential(RepeatedBlock(2))
    est = estimate_step(model, torch.empty(64, 256, device="meta"), loss_fn=_squares)
    assert [(r.exact, r.assumed) for r in est.data_dependent or ()] == [(False, "0")] * 1
    assert est.lowering_reads and "could have lowered the estimate" in str(est)


class Stacked(pl.LightningModule):
    """The blocks of the first test as a user's LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(RepeatedBlock(1, 128), RepeatedBlock(2, 128), RepeatedBlock(3, 128))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        return self.blocks(x).pow(2).mean()  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(2048, 128, generator=g)), batch_size=512)


def test_the_callback_knows_the_buffers_too(tmp_path: Path) -> None:
    memest = MemEstimate()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[memest],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Stacked())
    assert memest.estimate is not None and memest.estimate.assumed_reads == ()
    assert len(memest.measured) == 2
    for step in memest.measured:
        assert abs(step.error_pct) <= 2.0, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_true_precision_converts_the_known_value_too(dtype: torch.dtype) -> None:
    seen: list[float] = []

    class Scaled(nn.Module):
        scale: Tensor

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.register_buffer("scale", torch.tensor([1.5]))

        def forward(self, x: Tensor) -> Tensor:
            seen.append(float(self.scale.item()))
            return self.layer(x) * self.scale  # type: ignore[no-any-return]

    precision = "bf16-true" if dtype is torch.bfloat16 else "32-true"
    estimate_step(Scaled(), torch.randn(4, 8), loss_fn=_squares, precision=precision, steps=1)
    assert seen == [1.5]


class FixedGridODE(nn.Module):
    """An explicit solver over a time grid, checked as torchdiffeq checks it: strictly monotone. The
    grid is made in the step (``linspace``) or kept as a buffer."""

    def __init__(self, grid: Tensor | None = None) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32))
        self.register_buffer("grid", grid)

    def forward(self, x: Tensor) -> Tensor:
        t = torch.linspace(0.0, 1.0, 9) if self.grid is None else self.grid
        diff = t[1:] > t[:-1]
        assert diff.all() or (~diff).all(), "t must be strictly increasing or decreasing"
        for i in range(len(t) - 1):
            x = x + (t[i + 1] - t[i]) * self.f(x)
        return x


def _ode_loss(m: nn.Module, b: Tensor) -> Tensor:
    out: Tensor = m(b)
    return out.square().mean()


def test_a_time_grid_made_in_the_step_or_kept_in_a_buffer_is_known() -> None:
    # Floating-point values the step builds from numbers (linspace) or keeps in a small buffer are
    # known: a monotonicity check reads them, where an unknown value read False both ways.
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    for grid in (None, torch.linspace(0.0, 2.0, 7)):
        est = estimate_step(FixedGridODE(grid), x, loss_fn=_ode_loss)
        reads = [r.assumed for r in est.data_dependent or ()]
        assert reads and all(r == "its real value" for r in reads), reads
        measured = measure_step(FixedGridODE(grid), x, StepConfig(loss_fn=_ode_loss))
        assert abs(est.steady_state.bytes - measured.steady_state) <= 0.01 * measured.steady_state
