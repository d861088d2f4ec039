"""Replay of repeated blocks (``engine.block_replay``): the replayed estimate equals the full
simulation's to the byte -- peaks and breakdowns, per-module figures, FLOPs, the timeline, phase
marks, the CUDA allocator's figures -- for every kind of model it applies to; where the blocks do not
repeat, it is off, and said so."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_memest import estimate_step
from lightning_memest.engine.blocks import repeated_blocks
from lightning_memest.report import StepEstimate
from tests.models import TinyGPT, lm_batch, lm_loss


def _same(replayed: StepEstimate, full: StepEstimate) -> None:
    """Every figure equal but the seconds and the replay's own note."""
    assert full.replayed_blocks is None
    a = dataclasses.replace(replayed, estimate_seconds=0.0, replayed_blocks=None)
    b = dataclasses.replace(full, estimate_seconds=0.0)
    assert a.peaks == b.peaks  # first: the clearest message
    assert a.modules == b.modules
    assert a.flops == b.flops
    assert a.timeline == b.timeline
    assert a == b


def _compare(model: nn.Module, batch: Any, expected: dict[str, int], **kwargs: Any) -> None:
    replayed = estimate_step(model, batch, replay_blocks=True, **kwargs)
    assert replayed.replayed_blocks == expected
    _same(replayed, estimate_step(model, batch, **kwargs))


def _hf_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def test_tiny_gpt_adamw() -> None:
    model = TinyGPT(n_layers=8, d_model=64, n_heads=4, vocab=100, seq_len=16)
    _compare(model, lm_batch(2, 16, vocab=100), {"blocks": 3}, loss_fn=lm_loss, optimizer=torch.optim.AdamW)


def test_tiny_gpt_cuda_what_if_bf16_mixed() -> None:
    """Through the CUDA caching allocator model (block rounding, segments): the same blocks too."""
    model = TinyGPT(n_layers=7, d_model=64, n_heads=4, vocab=100, seq_len=16)
    batch = lm_batch(2, 16, vocab=100)
    kwargs: dict[str, Any] = {"loss_fn": lm_loss, "optimizer": torch.optim.AdamW, "device": "cuda"}
    _compare(model, batch, {"blocks": 2}, precision="bf16-mixed", **kwargs)


def test_llama_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    _compare(model, ids, {"model.layers": 3}, loss_fn=_hf_loss, optimizer=torch.optim.AdamW)


def test_gpt2_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=6, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    _compare(model, ids, {"transformer.h": 1}, loss_fn=_hf_loss, optimizer=torch.optim.SGD)


def test_vit_encoder() -> None:
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    model = vision_transformer.VisionTransformer(
        image_size=32, patch_size=8, num_layers=7, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    _compare(model, torch.randn(2, 3, 32, 32), {"encoder.layers": 2}, optimizer=torch.optim.Adam)


def test_resnet_stage() -> None:
    """In-place ReLUs saving their outputs, batch norm's running statistics (buffers), a stage whose
    first block differs (its downsampling): the run of alike blocks starts after it."""
    resnet = pytest.importorskip("torchvision.models.resnet")
    model = resnet.ResNet(resnet.BasicBlock, [1, 1, 7, 1], num_classes=10)
    _compare(model, torch.randn(2, 3, 32, 32), {"layer3": 1}, optimizer=torch.optim.SGD)


class _Scaled(nn.Module):
    """A block whose events depend on a flag no parameter shows."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.twice = twice

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.fc(x))
        return y * 2 if self.twice else y


def _stack(make: Callable[[int], nn.Module], n: int = 8) -> nn.Sequential:
    return nn.Sequential(*(make(i) for i in range(n)))


def test_off_by_default_and_without_repeats() -> None:
    batch = torch.randn(4, 16)
    assert estimate_step(_stack(lambda i: _Scaled()), batch).replayed_blocks is None
    # Blocks 1 and 2 differ: no block is replayed, nothing run twice.
    model = _stack(lambda i: _Scaled(twice=i == 2))
    est = estimate_step(model, batch, replay_blocks=True)
    assert est.replayed_blocks is None
    _same(est, estimate_step(model, batch))


def test_a_mismatch_after_replay_simulates_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block N-2 (the backward's template, run after the stand-ins' forwards) differs: the replayed
    run is thrown away and the step simulated without replay."""
    import lightning_memest.estimate as estimate_module

    runs: list[bool] = []
    simulate = estimate_module.simulate

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(kwargs["replay_blocks"])
        return simulate(*args, **kwargs)

    monkeypatch.setattr(estimate_module, "simulate", counted)
    model = _stack(lambda i: _Scaled(twice=i == 6))
    est = estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD, replay_blocks=True)
    assert runs == [True, False]
    assert est.replayed_blocks is None
    _same(est, estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD))


def test_groups_need_alike_blocks_without_hooks() -> None:
    assert [len(g.members) for g in repeated_blocks(_stack(lambda i: _Scaled()))] == [8]
    assert repeated_blocks(_stack(lambda i: _Scaled(), n=5)) == []  # too few to replay one
    shared = _Scaled()
    assert repeated_blocks(nn.Sequential(*([shared] * 8))) == []  # one module eight times
    hooked = _stack(lambda i: _Scaled())
    hooked[3].fc.register_forward_hook(lambda *_: None)  # the user's hook on a child: it must run
    assert repeated_blocks(hooked) == []  # 0-2 and 4-7 alike, too few on either side
    widths = nn.Sequential(*(nn.Linear(8 + i, 8 + i + 1) for i in range(8)))
    assert repeated_blocks(widths) == []
