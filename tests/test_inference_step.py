"""One batch outside training (engine/inference_step.py): validation and predict batches of plain models,
estimated against ``measure_step`` (the CPU allocator's events in ``torch.profiler``), calibrated so that
it holds on any CPU."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_memest import estimate_step
from lightning_memest.engine.inference_step import InferenceRunner, loop_runner
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step


class Segmenter(nn.Module):
    """Convolutions, batch norm, dropout, and a bilinear upsampling to the input's size: under
    ``inference_mode`` ``conv2d`` and ``upsample_bilinear2d.vec`` reach the simulation whole (no autograd
    key decomposes them), where the real run takes their C++ composites."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Conv2d(16, 8, 3, padding=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = nn.functional.interpolate(self.body(x), size=x.shape[-2:], mode="bilinear")
        return out


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("loop", ["validate", "predict"])
def test_a_batch_outside_training_within_1_percent(loop: str) -> None:
    torch.manual_seed(0)
    model = Segmenter()
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 8, (8, 64, 64))
    batch = (x, y) if loop == "validate" else x
    config = StepConfig(loss_fn=_loss) if loop == "validate" else StepConfig()
    est = estimate_step(
        model,
        batch,
        loss_fn=config.loss_fn,
        optimizer=torch.optim.Adam,
        calibrate=True,
        loop=loop,  # type: ignore[arg-type]
    )
    real = measure_step(model, batch, config, steps=1, loop=loop)  # type: ignore[arg-type]
    assert est.loop == loop and len(est.peaks) == 1
    assert abs(est.peak_bytes - real.peak_bytes[0]) <= 0.01 * real.peak_bytes[0], (est.peak_bytes, real)
    breakdown = est.steady_state.breakdown
    assert breakdown.gradients == breakdown.optimizer_state == breakdown.activations == 0
    assert est.flops is not None and est.flops.forward > 0 and not est.flops.backward  # conv2d counted
    assert model.training  # the model is left as it was


def test_the_runner_runs_in_eval_mode_and_restores_the_flags() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.BatchNorm1d(4))
    model[2].eval()  # a submodule the user froze stays frozen
    seen: list[bool] = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(m.training))
    out = InferenceRunner(model, StepConfig(), loop="predict").run(torch.ones(2, 4))
    assert seen == [False] and isinstance(out, Tensor) and out.is_inference()
    assert [m.training for m in model] == [True, True, False]
    loss = InferenceRunner(model, StepConfig(), loop="validate").run(torch.ones(2, 4))
    assert isinstance(loss, Tensor) and not loss.requires_grad and not loss.is_inference()


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="loop must be one of train, validate, predict; got 'test'"):
        loop_runner("test")  # type: ignore[arg-type]
