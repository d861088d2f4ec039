"""Kernel workspaces as their own role, and cuDNN's elastic convolution workspaces.

What a CPU-only machine can check: the breakdown's ``workspaces`` role (the running kernel's scratch,
apart from the step's temporaries), what a CUDA what-if says of cuDNN's workspaces (assumed, in every
output), the smallest-workspace peaks computed by the same caching-allocator replay as the typical
ones, and the pre-check's decision on them. On a GPU, the last test runs a real convolution step with
the device capped at the estimate's smallest-workspace figure: cuDNN's fallback must let it run.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from lightning_memest import estimate_step
from lightning_memest.accounting import capture_filter
from lightning_memest.accounting.cuda_alloc_conf import environment_alloc_conf
from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.accounting.kernels import KernelMemory, kernel_fn
from lightning_memest.accounting.kernels.cudnn_workspace import ELASTIC_OPS, smallest_workspaces
from lightning_memest.accounting.replay import CachingAllocatorReplay, walk
from lightning_memest.budget import precheck
from lightning_memest.cli import main
from lightning_memest.engine.events import OpCall
from lightning_memest.engine.simulate import simulate
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step
from lightning_memest.report import CUDNN_WORKSPACE_ASSUMED

MiB = 2**20


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.Flatten(),
        nn.Linear(16 * 16 * 16, 10),
    )


def test_breakdown_holds_the_kernel_workspace_apart_and_sums_to_the_peak() -> None:
    # A sum's gradient reaches the weight-gradient matmul as a stride-0 tensor, which CPU BLAS copies
    # first: a workspace of batch x features float32 that the mm frees before it returns. The peak
    # is there, and equals the allocator's (measured by the profiler, not by the estimator).
    model, batch = nn.Linear(512, 512, bias=False), torch.randn(1024, 512)
    est = estimate_step(model, batch, optimizer=torch.optim.SGD)
    real = measure_step(copy.deepcopy(model), batch, StepConfig(optimizer=torch.optim.SGD))
    assert (est.first_step.bytes, est.steady_state.bytes) == (real.first_step, real.steady_state)
    for peak in est.peaks:
        assert peak.op == "aten.mm.default" and peak.breakdown.total == peak.bytes
        assert peak.breakdown.workspaces == 1024 * 512 * 4
        assert peak.breakdown.temporaries < 1024  # the copy is no longer counted there


def test_cuda_what_if_says_its_cudnn_workspaces_are_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    est = estimate_step(convnet(), torch.randn(8, 3, 16, 16), device="cuda")
    assert est.cudnn_workspace_assumed is True
    assert est.smallest_workspace_peaks is None and est.runnable_peak_bytes == est.peak_bytes
    # The live bytes of a what-if follow CUDA's kernel models: no oneDNN reorder buffers in them.
    assert all(p.breakdown.workspaces == 0 for p in est.peaks)
    assert CUDNN_WORKSPACE_ASSUMED in str(est)
    data = est.to_json()
    assert data["workspace_bytes_assumed"] is True and data["smallest_workspace_peak_bytes"] is None
    # Without convolutions there is nothing to assume; on the CPU, never.
    assert estimate_step(nn.Linear(8, 8), torch.randn(4, 8), device="cuda").cudnn_workspace_assumed is None
    assert estimate_step(convnet(), torch.randn(8, 3, 16, 16)).cudnn_workspace_assumed is None


def test_cli_prints_the_workspace_assumption(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parent)
    argv = ["estimate", "cli_models:TinyConvNet", "--input-shape", "3,16,16", "--device", "cuda"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert CUDNN_WORKSPACE_ASSUMED in out and "workspaces" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workspace_bytes_assumed"] is True


def _peaks(sim: object, kernels: object) -> tuple[int, ...]:
    replay = CachingAllocatorReplay(
        CudaCachingAllocator.from_alloc_conf(environment_alloc_conf()), 2, kernels
    )  # type: ignore[arg-type]
    walk(sim.events, replay)  # type: ignore[attr-defined]
    return replay.peaks.allocated


def test_smallest_workspaces_take_the_convolutions_workspace_out_of_the_same_replay() -> None:
    # The what-if's convolutions stand in for cuDNN's, given a 64 MiB workspace each (as a GPU's
    # calibration would measure): the typical peak holds one at a time, the smallest none.
    sim = simulate(
        convnet(), torch.randn(8, 3, 16, 16), StepConfig(), capture=capture_filter(flops=False), device="cuda"
    )
    base = kernel_fn("cuda", what_if=True)

    def conv(call: OpCall) -> bool:
        return str(call.op) in ELASTIC_OPS

    def typical(call: OpCall) -> KernelMemory | None:
        return KernelMemory(workspace_bytes=64 * MiB) if conv(call) else base(call)

    plain, with_ws, smallest = (
        _peaks(sim, base),
        _peaks(sim, typical),
        _peaks(sim, smallest_workspaces(typical, conv)),
    )
    assert smallest == plain
    assert all(t - s >= 64 * MiB for t, s in zip(with_ws, smallest, strict=True))


def test_precheck_lets_a_step_run_in_its_smallest_workspaces_and_says_so() -> None:
    est = estimate_step(convnet(), torch.randn(8, 3, 16, 16), device="cuda")
    least = est.peak_bytes
    est = dataclasses.replace(
        est,
        peaks=tuple(dataclasses.replace(p, bytes=p.bytes + 64 * MiB) for p in est.peaks),
        smallest_workspace_peaks=(least, least),
    )
    between = precheck(est, least + 32 * MiB)
    assert between.fits and "fall back to convolution plans with smaller workspaces" in between.message
    below = precheck(est, least - 1, max_fit=lambda: 4)
    assert not below.fits and below.peak_bytes == least
    assert "with cuDNN's smallest convolution workspaces" in below.message
    assert precheck(est, least + 128 * MiB).message.endswith(")")  # fits either way: nothing more said


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_conv_step_runs_capped_at_its_smallest_workspace_peak() -> None:
    import torchvision

    model = torchvision.models.resnet18(weights=None).cuda()
    batch = torch.randn(32, 3, 224, 224, device="cuda")
    est = estimate_step(model, batch, optimizer=torch.optim.SGD, calibrate=True)
    assert est.cudnn_workspace_assumed is False
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    # Cap this process at what it reserves now, plus the step's least figure beyond the resident state
    # (already allocated), with a fifth more for the caching allocator's segments and rounding.
    resident = torch.cuda.memory_allocated()
    room = int((est.runnable_peak_bytes - resident) * 1.2) + torch.cuda.memory_reserved() + 128 * MiB
    torch.cuda.set_per_process_memory_fraction(min(1.0, room / total))
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # (it ran: over the cap it would have raised OOM)


def test_workspaces_are_measured_only_where_every_convolution_was_calibrated() -> None:
    # A GPU's calibration that measured some convolution signatures but not all (one failed, or the
    # step's shapes changed): the estimate must still say its workspaces are assumed.
    from lightning_memest.accounting.kernels import CalibratedKernels, Calibration
    from lightning_memest.accounting.kernels.calibrate import signature
    from lightning_memest.accounting.kernels.cudnn_workspace import convolutions, workspaces_assumed

    sim = simulate(
        convnet(), torch.randn(8, 3, 16, 16), StepConfig(), capture=capture_filter(flops=False), device="cuda"
    )
    convs = convolutions(sim.events)
    keys = sorted({signature(e.call) for e in convs if e.call is not None})
    assert len(keys) >= 2
    base = kernel_fn("cuda", what_if=True)

    def kernels(measured: list[str]) -> CalibratedKernels:
        entries = {k: KernelMemory(workspace_bytes=MiB) for k in measured}
        return CalibratedKernels(Calibration(entries, "cuda", 0.0, len(entries), 0), base, base)  # type: ignore[arg-type]

    assert workspaces_assumed(convs, base) is True
    assert workspaces_assumed(convs, kernels(keys[:-1])) is True
    assert workspaces_assumed(convs, kernels(keys)) is False
