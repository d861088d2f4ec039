"""Ground truth measured on real tensors (lightning_memest.measure)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import STEP_LABEL, cpu_step_peaks, measure_step, resident_bytes


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def test_linear_sgd_peak_is_hand_computed() -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 512)
    x = torch.randn(64, 256)
    m = measure_step(model, x, StepConfig(optimizer=_sgd), steps=2)
    resident = 512 * 256 * 4 + 512 * 4 + 64 * 256 * 4  # weight, bias, batch
    # The peak is inside the weight-gradient mm of addmm's backward: the loss (4 B), the gradient of the
    # loss (ones, 4 B), the weight gradient being written (512x256 fp32) and the contiguous copy mm makes
    # of the stride-0 gradient that sum's backward expands to 64x512 fp32. (The forward output was freed
    # when the forward returned: sum's backward does not need it.)
    peak = resident + 4 + 4 + 512 * 256 * 4 + 64 * 512 * 4
    assert m.peak_bytes == (peak, peak)
    assert m.first_step == m.steady_state == peak
    assert m.reserved_bytes is None
    assert m.device == "cpu"
    assert m.step_seconds > 0


def test_measurement_is_deterministic_and_counts_optimizer_state() -> None:
    def measure() -> tuple[int, ...]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        cfg = StepConfig(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        return measure_step(model, torch.randn(16, 32), cfg, steps=3).peak_bytes

    first = measure()
    assert first == measure()
    params = (32 * 64 + 64 + 64 * 8 + 8) * 4
    # The momentum buffers made in the first step stay resident in the later ones.
    assert first[1] - first[0] > 0
    assert first[1] == first[2]
    assert first[1] >= params * 3  # parameters, gradients and momentum buffers


def test_resident_bytes_counts_each_storage_once() -> None:
    w = torch.zeros(10, 10)
    tied = nn.Linear(10, 10, bias=False)
    tied.weight = nn.Parameter(w)
    assert resident_bytes([w, w.t(), tied.weight, w[3:]]) == 400
    assert resident_bytes([torch.empty(4, device="meta")]) == 0


def test_plain_tensor_attributes_are_resident() -> None:
    class WithCache(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4, bias=False)
            self.cache = torch.zeros(1000)  # not a buffer, still resident

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + self.cache[:4]

    plain = measure_step(nn.Linear(4, 4, bias=False), torch.randn(2, 4), StepConfig(optimizer=_sgd), steps=1)
    cached = measure_step(WithCache(), torch.randn(2, 4), StepConfig(optimizer=_sgd), steps=1)
    assert cached.first_step - plain.first_step >= 4000


@dataclass
class _Event:
    label: str
    start: int
    duration: int = 0
    size: int = 0

    def name(self) -> str:
        return self.label

    def start_ns(self) -> int:
        return self.start

    def duration_ns(self) -> int:
        return self.duration

    def nbytes(self) -> int:
        return self.size


def test_step_windows_carry_the_running_sum() -> None:
    events = [
        _Event(f"{STEP_LABEL}0", 10, 10),
        _Event("[memory]", 11, size=100),
        _Event("[memory]", 12, size=50),
        _Event("[memory]", 13, size=-50),
        _Event("[memory]", 25, size=1000),  # between the steps: in no window, carried over
        _Event("[memory]", 26, size=-1000),
        _Event(f"{STEP_LABEL}1", 30, 10),
        _Event("[memory]", 31, size=-100),
        _Event("[memory]", 32, size=20),
    ]
    # step 0: 100 + 50 at its highest; step 1 starts holding 100 (its peak), then drops to 20.
    assert cpu_step_peaks(reversed(events), 2, baseline=7) == (157, 107)


def test_measuring_writes_nothing_to_the_console(capfd: pytest.CaptureFixture[str]) -> None:
    # Kineto writes profiler_start/stop lines (and gpuGetDeviceCount without a GPU) straight to file
    # descriptor 2 at every profile, and the CPU allocator a warning once: none of it gets out.
    for _ in range(2):
        m = measure_step(nn.Linear(8, 4), torch.randn(4, 8), StepConfig(optimizer=torch.optim.Adam))
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert str(m).startswith("measured on cpu: step 1 ") and str(m).endswith(" s per step")


def test_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="steps"):
        measure_step(nn.Linear(2, 2), torch.randn(1, 2), StepConfig(), steps=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_linear_sgd() -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 512).cuda()
    x = torch.randn(64, 256, device="cuda")
    m = measure_step(model, x, StepConfig(optimizer=_sgd), steps=2)
    resident = 512 * 256 * 4 + 512 * 4 + 64 * 256 * 4
    assert m.device.startswith("cuda")
    assert m.reserved_bytes is not None
    assert all(p >= resident + 512 * 256 * 4 for p in m.peak_bytes)
    assert all(r >= p for r, p in zip(m.reserved_bytes, m.peak_bytes, strict=True))
    assert m.peak_bytes[0] == m.peak_bytes[1]
