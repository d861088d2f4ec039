"""CUDA's code paths, measured on a GPU: the CPU-only what-if against the GPU's own peaks where a composite
op branches on the device (``engine.cuda_paths``): dropout's bool mask, and the SDP backend under the
user's flags.

Run on a machine with a CUDA device (it exits with a message otherwise):

    python benchmarks/cuda_paths_check.py [--json]

For each case: the what-if (``MEMEST_CUDA_WHAT_IF=1``: fake CPU tensors, CUDA's paths and accounting, as
on a machine without a GPU), the estimate on fake CUDA tensors (the GPU's own dispatch) and the measured
``max_memory_allocated`` of each step (``measure_step``), with the what-if's error against the
measurement. Cases: an MLP with ``nn.Dropout(0.1)`` in float32; transformers' GPT-2 (4 layers, eager
attention, dropout 0.1); an attention block in float16 with the default flags, with flash turned off,
and with only math; four attention blocks under selective checkpointing whose policy saves CUDA's
attention ops (the what-if shows the policy the op this card's dispatcher picks). Then the phase marks
(``StepEstimate.phase_marks``): ``memory_allocated()`` after
the forward, the backward and the optimizer step of a real first step of the MLP, against the marks'
``allocated_bytes`` of the GPU estimate and of the what-if.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memest import estimate_step
from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *(m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.GELU(), nn.Dropout(0.1)))
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim: int = 512, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class CheckpointedAttention(nn.Module):
    """Four attention blocks, each under selective checkpointing with a policy written for CUDA: it saves
    CUDA's attention ops (flash, efficient, cuDNN), as torchtitan's does, and recomputes the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention() for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        from functools import partial

        from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

        aten = torch.ops.aten
        save = {
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
        }

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        for block in self.blocks:
            contexts = partial(create_selective_checkpoint_contexts, policy)
            x = x + checkpoint(block, x, use_reentrant=False, context_fn=contexts)
        return x


@contextmanager
def sdp(**enabled: bool) -> Iterator[None]:
    cuda = torch.backends.cuda
    setters = {
        "flash": cuda.enable_flash_sdp,
        "efficient": cuda.enable_mem_efficient_sdp,
        "cudnn": cuda.enable_cudnn_sdp,
    }
    before = {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled()}
    before["cudnn"] = cuda.cudnn_sdp_enabled()
    for name, on in enabled.items():
        setters[name](on)
    try:
        yield
    finally:
        for name, on in before.items():
            setters[name](on)


def gpt2() -> tuple[nn.Module, Tensor, Callable[[nn.Module, Any], Tensor]]:
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=512)
    config._attn_implementation = "eager"
    ids = torch.randint(0, 8192, (4, 512))

    def loss(m: nn.Module, b: Tensor) -> Tensor:
        return m(input_ids=b, labels=b).loss  # type: ignore[no-any-return]

    return transformers.GPT2LMHeadModel(config), ids, loss


def cases() -> Iterator[tuple[str, Callable[[], Any], dict[str, bool]]]:
    def plain(m: nn.Module, b: Tensor) -> Tensor:
        return m(b).float().pow(2).mean()

    yield "mlp_dropout_fp32", lambda: (DropoutMLP(), torch.randn(256, 1024), plain), {}
    yield "gpt2_eager_dropout", gpt2, {}
    attention = lambda: (Attention().half(), torch.randn(8, 1024, 512).half(), plain)  # noqa: E731
    yield "attention_fp16_default", attention, {}
    yield "attention_fp16_flash_off", attention, {"flash": False}
    yield "attention_fp16_math_only", attention, {"flash": False, "efficient": False, "cudnn": False}
    sac = lambda: (CheckpointedAttention().half(), torch.randn(8, 1024, 512).half(), plain)  # noqa: E731
    yield "attention_fp16_sac_cuda_policy", sac, {}


def run(name: str, build: Callable[[], Any], flags: dict[str, bool]) -> dict[str, Any]:
    torch.manual_seed(0)
    model, batch, loss = build()
    config = StepConfig(loss_fn=loss, optimizer=torch.optim.AdamW)
    this_gpu = CudaDevice.local(torch.device("cuda"))  # the what-if for this card (its SDP backend)
    with sdp(**flags):
        os.environ["MEMEST_CUDA_WHAT_IF"] = "1"
        try:
            what_if = estimate_step(
                model, batch, loss_fn=loss, optimizer=torch.optim.AdamW, device="cuda", gpu=this_gpu
            )
        finally:
            del os.environ["MEMEST_CUDA_WHAT_IF"]
        gpu = estimate_step(model, batch, loss_fn=loss, optimizer=torch.optim.AdamW, device="cuda")
        real = measure_step(copy.deepcopy(model).cuda(), batch.cuda(), config)
    measured = [real.first_step, real.steady_state]

    def error(est: int, meas: int) -> float:
        return round(100.0 * (est - meas) / meas, 3)

    return {
        "case": name,
        "flags": flags,
        "measured": measured,
        "what_if": [p.bytes for p in what_if.peaks],
        "gpu_estimate": [p.bytes for p in gpu.peaks],
        "what_if_error_pct": [error(p.bytes, m) for p, m in zip(what_if.peaks, measured, strict=True)],
        "gpu_estimate_error_pct": [error(p.bytes, m) for p, m in zip(gpu.peaks, measured, strict=True)],
    }


def phase_marks() -> dict[str, Any]:
    """The MLP's first step run by hand on the GPU, ``memory_allocated()`` between its phases."""
    torch.manual_seed(0)
    model, batch = DropoutMLP(), torch.randn(256, 1024)

    def loss_fn(m: nn.Module, b: Tensor) -> Tensor:
        return m(b).pow(2).mean()

    os.environ["MEMEST_CUDA_WHAT_IF"] = "1"
    try:
        what_if = estimate_step(
            model, batch, loss_fn=loss_fn, optimizer=torch.optim.AdamW, device="cuda", steps=1
        )
    finally:
        del os.environ["MEMEST_CUDA_WHAT_IF"]
    gpu = estimate_step(model, batch, loss_fn=loss_fn, optimizer=torch.optim.AdamW, device="cuda", steps=1)
    real_model, real_batch = copy.deepcopy(model).cuda(), batch.cuda()
    opt = torch.optim.AdamW(real_model.parameters())
    measured = []
    loss = loss_fn(real_model, real_batch)
    measured.append(torch.cuda.memory_allocated())
    loss.backward()
    measured.append(torch.cuda.memory_allocated())
    opt.step()
    measured.append(torch.cuda.memory_allocated())
    return {
        "case": "phase_marks_mlp",
        "measured": measured,
        "what_if": [m.allocated_bytes for m in what_if.phase_marks],
        "gpu_estimate": [m.allocated_bytes for m in gpu.phase_marks],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_paths_check.py measures on a GPU; this machine has none", file=sys.stderr)
        return 1
    print(f"GPU: {torch.cuda.get_device_name()} {torch.cuda.get_device_capability()}")
    if not args.json:
        print("| case | measured (B) | what-if error % | GPU estimate error % |\n|---|---|---|---|")
    for name, build, flags in cases():
        try:
            row = run(name, build, flags)
        except Exception as e:  # a case that fails says so, and the others still run
            row = {"case": name, "error": f"{type(e).__name__}: {e}"}
        if args.json:
            print(json.dumps(row), flush=True)
        elif "error" in row:
            print(f"| {name} | {row['error']} | | |", flush=True)
        else:
            print(
                f"| {name} | {row['measured']} | {row['what_if_error_pct']} "
                f"| {row['gpu_estimate_error_pct']} |",
                flush=True,
            )
    try:
        marks = phase_marks()
    except Exception as e:
        marks = {"case": "phase_marks_mlp", "error": f"{type(e).__name__}: {e}"}
    print(
        json.dumps(marks)
        if args.json
        else f"\nphase marks (allocated after forward, backward, optimizer): {marks}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
