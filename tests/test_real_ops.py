"""Real where fake fails (issue 25, item 1): an op whose fake kernel raises runs for real on stand-ins,
is reported, and is accounted with what its kernel allocated; where it may not run, the error says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import lightning_memest.engine.real_ops as real_ops
from lightning_memest import EstimationError, estimate_step
from lightning_memest.engine.real_ops import NotRunnable, run_for_real
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step


def test_an_op_runs_for_real_on_stand_ins() -> None:
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(16, 8)
        mask = torch.empty(16, dtype=torch.bool)
    out, workspace = run_for_real(mode, torch.ops.aten.mm.default, (x, x.t()), {}, lambda t: None)
    assert type(out).__name__ == "FakeTensor" and tuple(out.shape) == (16, 16) and workspace >= 0
    # Known values are used: a boolean selection gets its real size.
    known = torch.tensor([True, False] * 8)
    rows, _ = run_for_real(
        mode, torch.ops.aten.nonzero.default, (mask,), {}, lambda t: known if t is mask else None
    )
    assert tuple(rows.shape) == (8, 1)
    with pytest.raises(NotRunnable, match="writes its inputs"):
        run_for_real(mode, torch.ops.aten.add_.Tensor, (x, x), {}, lambda t: None)


class GroupedExperts(nn.Module):
    """Four experts' weights in one tensor, tokens grouped by expert (transformers' MoE does this):
    ``aten._grouped_mm``, whose fake kernel wants bfloat16 while the CPU kernel runs float32."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 48, 32) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offsets)


def _squares(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def test_a_fake_kernel_stricter_than_the_real_one() -> None:
    model, batch = GroupedExperts(), torch.randn(64, 32)
    estimate = estimate_step(model, batch, loss_fn=_squares, optimizer=torch.optim.Adam)
    assert estimate.real_ops is not None and estimate.real_ops["aten._grouped_mm.default"] >= 2
    measured = measure_step(model, batch, StepConfig(loss_fn=_squares, optimizer=torch.optim.Adam))
    for peak, real in zip(estimate.peaks, measured.peak_bytes, strict=True):
        assert abs(peak.bytes - real) <= 0.01 * real, (peak.bytes, real)
    assert estimate.to_json()["real_ops"] == estimate.real_ops


def test_an_op_too_large_to_run_for_real_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_ops, "REAL_OP_LIMIT", 1024)
    with pytest.raises(EstimationError, match=r"not run for real: its inputs take .* MiB, more than"):
        estimate_step(GroupedExperts(), torch.randn(64, 32), loss_fn=_squares)
