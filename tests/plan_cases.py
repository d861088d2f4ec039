"""The modules the checkpointing planner is held to (``tests/test_plan.py``, ``benchmarks/plan.py``),
written the way their users write them: a decoder of 12 identical blocks, torchvision's resnet18, a UNet
with skip connections and a transformers Llama from a config, each with its batch and loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from models import TinyGPT, UNet, classification_loss, lm_batch, lm_loss
from torch import Tensor, nn

__all__ = ["CASES"]


def _segmentation_loss(model: nn.Module, batch: Any) -> Tensor:
    images, masks = batch
    return F.cross_entropy(model(images), masks)


def _hf_loss(model: nn.Module, batch: Tensor) -> Tensor:
    return model(input_ids=batch, labels=batch, use_cache=False).loss  # type: ignore[no-any-return]


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=512,
    )
    return LlamaForCausalLM(config)


def _resnet() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Callable[[nn.Module, Any], Tensor]]] = {
    "decoder-12-blocks": (
        lambda: TinyGPT(n_layers=12, d_model=64, n_heads=4, vocab=256, seq_len=32),
        lambda: lm_batch(8, 32, vocab=256),
        lm_loss,
    ),
    "resnet18": (
        _resnet,
        lambda: (torch.randn(16, 3, 96, 96), torch.randint(0, 10, (16,))),
        classification_loss,
    ),
    "unet": (
        lambda: UNet(width=8),
        lambda: (torch.randn(4, 3, 64, 64), torch.randint(0, 2, (4, 64, 64))),
        _segmentation_loss,
    ),
    "transformers-llama": (_llama, lambda: torch.randint(0, 512, (4, 64)), _hf_loss),
}
