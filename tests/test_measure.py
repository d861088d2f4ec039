"""Ground truth measured on real tensors (lightning_memest.measure)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memest.allocator_events import AllocatorTimeline, CpuMemoryProfile
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


def test_step_windows_carry_the_running_sum() -> None:
    windows = {f"{STEP_LABEL}0": (10, 20), f"{STEP_LABEL}1": (30, 40)}
    events = (
        (11, 100, 0xA),
        (12, 50, 0xB),
        (13, -50, 0xB),
        (25, 1000, 0xC),  # between the steps: in no window, carried over
        (26, -1000, 0xC),
        (31, -100, 0xA),
        (32, 20, 0xD),
    )
    # step 0: 100 + 50 at its highest; step 1 starts holding 100 (its peak), then drops to 20.
    assert cpu_step_peaks(AllocatorTimeline(events, windows), 2, baseline=7) == (157, 107)


def test_frees_count_only_for_blocks_held() -> None:
    # A block the profile never saw allocated and the caller did not name resident is reported freed
    # with a stale size where an earlier profile saw a block at that address: it counts nothing. A
    # resident block's free counts, at its real size.
    windows = {f"{STEP_LABEL}0": (10, 20)}
    events = ((9, -4, 0xE), (11, 100, 0xA), (12, -64, 0xF), (13, 30, 0xB))
    timeline = AllocatorTimeline(events, windows)
    assert cpu_step_peaks(timeline, 1, baseline=64) == (194,)
    assert cpu_step_peaks(timeline, 1, baseline=64, resident={0xF: 64}) == (164,)


def test_a_stale_free_before_the_steps_counts_nothing() -> None:
    # Other profiled work in the process first (its blocks freed between profiles leave their sizes
    # behind in the CPU allocator), then the hand-computed step: exact every time.
    for _ in range(20):
        with CpuMemoryProfile():
            kept = [torch.ones(1) for _ in range(50)]
        del kept
        model, x = nn.Linear(8, 4), torch.randn(2, 8)
        plain = measure_step(model, x, StepConfig(optimizer=_sgd), steps=1)
        resident = (8 * 4 + 4 + 2 * 8) * 4
        # As in the test above: the loss and its gradient, the weight's gradient being written (4x8)
        # and mm's copy of the expanded output gradient (2x4) at the peak inside backward.
        assert plain.peak_bytes == (resident + 4 + 4 + 4 * 8 * 4 + 2 * 4 * 4,)


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
