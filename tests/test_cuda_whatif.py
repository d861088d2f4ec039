"""``device="cuda"`` on a machine without a GPU: the what-if, simulated on the CPU, accounted as CUDA."""

from __future__ import annotations

import re

import pytest
import torch
import torchvision
from torch import nn

from lightning_memest import estimate_step
from lightning_memest.accounting.cuda_device import (
    DEFAULT_CONTEXT_BYTES,
    CudaDevice,
    cublas_workspace_bytes,
    library_workspace,
)
from lightning_memest.cli import main

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
    assert cuda.first_step.bytes >= cublas_workspace_bytes(None, None)
    assert cuda.first_step.bytes > cpu.first_step.bytes
    # and the CPU run afterwards is untouched by the what-if's optimizer defaults
    assert not any(
        p.op.startswith("aten._foreach")
        for p in estimate_step(model, batch, optimizer=torch.optim.Adam).timeline
    )


def test_cublas_workspace_follows_pytorch_defaults_and_config() -> None:
    # CublasHandlePool.cpp: ":4096:2:16:8" by default, 32 MiB on compute capability 9.x/10.x/12.x.
    assert cublas_workspace_bytes(None, None) == 2 * 4096 * 1024 + 8 * 16 * 1024 == 8_519_680
    assert cublas_workspace_bytes((8, 0), None) == 8_519_680
    assert cublas_workspace_bytes((8, 9), None) == 8_519_680
    for major in (9, 10, 12):
        assert cublas_workspace_bytes((major, 0), None) == 32 * 2**20
    assert cublas_workspace_bytes((9, 0), ":16:8") == 8 * 16 * 1024
    assert cublas_workspace_bytes((9, 0), "garbage") == 32 * 2**20  # unparsable: the default


def test_cublaslt_shares_the_cublas_workspace_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert library_workspace("aten.addmm.default", (9, 0)) == [("cublas", 32 * 2**20)]
    assert library_workspace("aten.mm.default", None) == [("cublas", 8_519_680)]
    assert library_workspace("aten.convolution.default", None) == []
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    assert library_workspace("aten.addmm.default", (9, 0)) == [("cublas", 32 * 2**20), ("cublaslt", 2**22)]
    assert library_workspace("aten.mm.default", (9, 0)) == [("cublas", 32 * 2**20)]


def test_what_if_for_hopper_holds_the_larger_cublas_workspace() -> None:
    model, batch = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), torch.randn(32, 256)
    older = estimate_step(model, batch, optimizer=torch.optim.Adam, device="cuda")
    hopper = estimate_step(model, batch, optimizer=torch.optim.Adam, device="cuda", gpu=CudaDevice((9, 0)))
    for a, b in zip(older.peaks, hopper.peaks, strict=True):
        assert b.bytes - a.bytes == 32 * 2**20 - 8_519_680  # kept from the first matmul on
    assert hopper.cuda_context_bytes == older.cuda_context_bytes == DEFAULT_CONTEXT_BYTES
    assert hopper.reserved_bytes is not None
    assert hopper.device_bytes == max(hopper.reserved_bytes) + DEFAULT_CONTEXT_BYTES
    assert estimate_step(model, batch).cuda_context_bytes is None  # CPU: no context


def test_cli_answers_whether_a_gpu_is_big_enough(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    args = ["estimate", "tests.models:TinyGPT", "--tokens", "64", "--vocab", "1000", "--device", "cuda"]
    assert main([*args, "--gpu-memory", "80GiB", "--cuda-capability", "9.0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu_memory"]["fits"] is True
    assert data["gpu_memory"]["device_bytes"] == max(data["reserved_bytes"].values()) + DEFAULT_CONTEXT_BYTES
    assert data["cuda_context_bytes"] == DEFAULT_CONTEXT_BYTES
    assert main([*args, "--gpu-memory", "600MiB"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "CUDA context" in out
    # 600 MiB less the 512 MiB context leaves the allocator too little even with its cache released:
    # where the real step would raise torch.OutOfMemoryError, named as such
    assert re.search(
        r"DOES NOT FIT: CUDA out of memory in step \d at aten\.\S+ in \S+ \((forward|backward|optimizer)\)",
        out,
    ), out
    assert main([*args, "--gpu-memory", "600MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu_memory"]["fits"] is False and data["out_of_memory"].startswith("CUDA out of memory")
    assert (
        main(["estimate", "tests.models:TinyGPT", "--tokens", "64", "--vocab", "1000", "--gpu-memory", "8g"])
        == 2
    )
    assert "--device cuda" in capsys.readouterr().err


def test_what_if_accounts_for_the_attention_backend_cuda_would_pick() -> None:
    # TinyGPT's causal SDPA (4 heads, head dim 64, 128 tokens) under bf16: an A100 runs flash (the
    # CPU kernel's logsumexp plus 24 B of RNG state), a T4 (sm75, no bf16 in the fused kernels) the math
    # path, which saves fp32 copies of q, k, v and the softmax (accounting/attention.py).
    from tests.models import TinyGPT

    model, tokens = TinyGPT(n_layers=2), torch.randint(0, 1000, (4, 128))
    flash = estimate_step(model, tokens, precision="bf16-true", device="cuda", gpu=CudaDevice((8, 0)))
    math_path = estimate_step(model, tokens, precision="bf16-true", device="cuda", gpu=CudaDevice((7, 5)))
    b, h, length, d = 4, 4, 128, 64
    extra_per_layer = (
        2 * b * h * length * d + b * h * length * length + b * h * length * d
    ) * 4 - b * h * length * 4
    assert math_path.first_step.bytes - flash.first_step.bytes >= 2 * extra_per_layer * 0.9


def test_what_if_follows_cuda_autocast_lists() -> None:
    # Under bf16 autocast CUDA runs layer_norm and softmax in float32 (PyTorch's AMP op reference),
    # the CPU in bfloat16: the what-if saves their float32 outputs, as a CUDA run would.
    import torch.nn.functional as F

    from lightning_memest.engine.cuda_autocast import cuda_autocast_lists

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu = [
            F.linear(x, w).softmax(-1).dtype,
            F.layer_norm(F.linear(x, w), (8,)).dtype,
            F.linear(x, w).sum().dtype,
        ]
        with cuda_autocast_lists():
            h = F.linear(x, w)
            cuda = [h.softmax(-1).dtype, F.layer_norm(h, (8,)).dtype, h.sum().dtype]
            assert torch.mv(w, x[0]).dtype == torch.bfloat16  # CUDA's extra lower-precision op
            assert h.sum(dtype=torch.float16).dtype == torch.float16  # an explicit dtype= is not autocast
    assert cpu == [torch.bfloat16] * 3
    assert cuda == [torch.float32] * 3

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.norm(self.a(x)).softmax(-1))  # type: ignore[no-any-return]

    model, batch = Net(), torch.randn(512, 256)
    on_cpu = estimate_step(model, batch, optimizer=torch.optim.SGD, precision="bf16-mixed")
    what_if = estimate_step(model, batch, optimizer=torch.optim.SGD, precision="bf16-mixed", device="cuda")
    # layer_norm's and softmax's outputs, saved for backward: 2 x 512 x 256 x 2 B more in float32
    # (what the model saves, not the peak's breakdown: the two peaks are at different ops, the CPU's
    # in a matmul whose oneDNN workspace a CUDA what-if does not have)
    extra = what_if.modules.saved_bytes - on_cpu.modules.saved_bytes
    assert extra >= 2 * 512 * 256 * 2
