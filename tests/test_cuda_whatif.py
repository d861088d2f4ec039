"""``device="cuda"`` on a machine without a GPU: the what-if, simulated on the CPU, accounted as CUDA."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from lightning_memest import estimate_step
from lightning_memest.accounting.kernels import cublas_workspace_bytes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real CUDA simulation")


@pytest.mark.parametrize(
    "build", [lambda: torchvision.models.resnet18(weights=None), lambda: nn.Linear(512, 512)]
)
def test_what_if_reports_reserved_at_least_allocated(build: object) -> None:
    model = build()  # type: ignore[operator]
    batch = (
        torch.randn(4, 3, 64, 64) if isinstance(model, torchvision.models.ResNet) else torch.randn(64, 512)
    )
    est = estimate_step(model, batch, optimizer=torch.optim.Adam, device="cuda")
    assert est.approximate and est.device == "cuda"
    assert est.reserved_bytes is not None
    for peak, reserved in zip(est.peaks, est.reserved_bytes, strict=True):
        assert reserved >= peak.bytes > 0
    assert est.to_json()["reserved_bytes"] is not None


def test_what_if_uses_cuda_optimizer_defaults_and_cublas_workspace() -> None:
    model, batch = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), torch.randn(32, 256)
    cpu = estimate_step(model, batch, optimizer=torch.optim.Adam)
    cuda = estimate_step(model, batch, optimizer=torch.optim.Adam, device="cuda")
    assert not cpu.approximate and cpu.reserved_bytes is None
    # torch.optim's CUDA default is the foreach implementation
    assert any(p.op.startswith("aten._foreach") for p in cuda.timeline)
    assert not any(p.op.startswith("aten._foreach") for p in cpu.timeline)
    # cuBLAS keeps its workspace from the first matmul on
    assert cuda.first_step.bytes >= cublas_workspace_bytes()
    assert cuda.first_step.bytes > cpu.first_step.bytes
    # and the CPU run afterwards is untouched by the what-if's optimizer defaults
    assert not any(
        p.op.startswith("aten._foreach")
        for p in estimate_step(model, batch, optimizer=torch.optim.Adam).timeline
    )
