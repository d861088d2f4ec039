"""A step whose control flow is arithmetic on activations (an adaptive ODE solver) fails on assumed reads;
it is simulated again on its batch's values and weights (``engine.values.followed_values``), and the
figures are checked against the profiler's measurement of the real step."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_memest import EstimationError, estimate_step
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step

torchdiffeq = pytest.importorskip("torchdiffeq")


class Dynamics(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, dim))
        self.nfe = 0  # counted as torchdiffeq's examples count it

    def forward(self, t: Tensor, y: Tensor) -> Tensor:
        self.nfe += 1
        out: Tensor = self.net(y)
        return out


class ODEBlock(nn.Module):
    """dopri5 over [0, 1], backpropagated through its steps: the step count follows from the values."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.func, self.head = Dynamics(dim), nn.Linear(dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        t = torch.linspace(0.0, 1.0, 3)
        ys = torchdiffeq.odeint(self.func, x, t, method="dopri5", rtol=1e-4, atol=1e-5)
        out: Tensor = self.head(ys[-1])
        return out


def _loss(model: nn.Module, batch: Tensor) -> Tensor:
    return model(batch).pow(2).mean()


def test_an_adaptive_solver_is_followed_on_its_values_and_measured_within_one_percent() -> None:
    torch.manual_seed(0)
    model, x = ODEBlock(), torch.randn(64, 16) * 3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    est = estimate_step(model, x, loss_fn=_loss)
    assert est.followed_note is not None and "underflow in dt" in est.followed_note
    # the model is left as it was: weights, and the attribute its dynamics count with
    assert model.func.nfe == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # the solver's loop is listed by its line with its trip count, as reads that could lower the estimate
    loop = [r for r in est.data_dependent or () if "rk_common.py" in r.assumed and "(_advance)" in r.assumed]
    assert loop and all(r.may_lower and not r.exact for r in loop), est.data_dependent
    torch.manual_seed(0)
    real = measure_step(ODEBlock(), x, StepConfig(loss_fn=_loss))  # the profiler's allocator events
    for e, m in ((est.first_step.bytes, real.first_step), (est.steady_state.bytes, real.steady_state)):
        assert abs(e - m) <= 0.01 * m, (e, m)


class CheckedWide(nn.Module):
    """A check of an activation's value (answered by assumption) in a model too large to follow."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(2048, 1024)  # 2,097,152 weights: over FOLLOW_LIMIT

    def forward(self, x: Tensor) -> Tensor:
        h = self.wide(x)
        assert h.abs().amax() > 0, "dead layer"
        return h.sum()


def test_a_failed_step_too_large_to_follow_says_why() -> None:
    why = r"(?s)dead layer.*not simulated again.*'wide.weight' has 2,097,152"
    with pytest.raises(EstimationError, match=why):
        estimate_step(CheckedWide(), torch.randn(4, 2048), loss_fn=lambda m, b: m(b))
