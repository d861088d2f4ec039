"""Block replay across model families: does every figure equal the full simulation's?

For each family (built from configs, no downloads, the way each library's users build it), the same
step is estimated twice -- ``replay_blocks=False`` and ``True`` -- and every figure is compared: the
JSON form (peaks, reserved, breakdown, FLOPs, phase marks, reads, kernels run for real), the peaks,
the per-module tree and the timeline. Prints one Markdown row per family: the groups replayed (blocks
per step), whether all figures are equal (else the JSON keys that differ), and both estimates' seconds.

    python benchmarks/replay_families.py               # every family
    python benchmarks/replay_families.py --only bert   # some (repeatable)

Families where no group is replayed (a check failed, a stack too short) must still give equal figures:
replay then runs nothing differently.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_memest import estimate_step  # noqa: E402

Case = tuple[torch.nn.Module, Any, dict[str, Any]]


def _lm(config: str, model: str, **settings: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    cfg = getattr(transformers, config)(**settings)
    return getattr(transformers, model)(cfg), torch.randint(0, cfg.vocab_size, (2, 32))


def _lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]


_SMALL = {"vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
          "intermediate_size": 128}  # fmt: skip
_GQA = {**_SMALL, "num_key_value_heads": 2}


def _hf(config: str, model: str, **extra: Any) -> Callable[[], Case]:
    def build() -> Case:
        m, ids = _lm(config, model, **extra)
        return m, ids, {"loss_fn": _lm_loss, "optimizer": torch.optim.AdamW}

    return build


def _llama(**options: Any) -> Case:
    m, ids = _lm("LlamaConfig", "LlamaForCausalLM", **_GQA)
    return m, ids, {"loss_fn": _lm_loss, "optimizer": torch.optim.AdamW, **options}


def _llama_checkpointed() -> Case:
    m, ids, kw = _llama()
    m.gradient_checkpointing_enable()  # type: ignore[operator]
    return m, ids, kw


def _llama_lora() -> Case:
    import peft

    m, ids, kw = _llama()
    return peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])), ids, kw


def _gpt2(optimizer: Callable[..., torch.optim.Optimizer]) -> Callable[[], Case]:
    def build() -> Case:
        m, ids = _lm("GPT2Config", "GPT2LMHeadModel", vocab_size=500, n_embd=64, n_layer=8, n_head=4)
        return m, ids, {"loss_fn": _lm_loss, "optimizer": optimizer}

    return build


def _t5() -> Case:
    m, ids = _lm(
        "T5Config", "T5ForConditionalGeneration", vocab_size=500, d_model=64, d_kv=16, d_ff=128,
        num_layers=8, num_decoder_layers=8, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return m, ids, {"loss_fn": _lm_loss, "optimizer": torch.optim.AdamW}


def _vision(name: str, optimizer: Callable[..., torch.optim.Optimizer], **kw: Any) -> Callable[[], Case]:
    def build() -> Case:
        if name.startswith("timm:"):
            import timm

            model = timm.create_model(name[5:], pretrained=False, **kw)
        else:
            import torchvision

            model = getattr(torchvision.models, name)(weights=None)
        return model, torch.randn(2, 3, 64, 64), {"optimizer": optimizer}

    return build


def _encoder() -> Case:
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 8), torch.randn(2, 16, 64), {"optimizer": torch.optim.Adam}


def _mlp() -> Case:
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(10)))
    return model, torch.randn(4, 32), {"optimizer": torch.optim.RMSprop}


FAMILIES: dict[str, Callable[[], Case]] = {
    "bert": _hf("BertConfig", "BertForMaskedLM", **_SMALL),
    "mistral (sliding window)": _hf("MistralConfig", "MistralForCausalLM", **_GQA, sliding_window=16),
    "qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", **_GQA),
    "gpt-neox": _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **_SMALL),
    "gemma2 (alternating layers, 12)": _hf(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        **{**_GQA, "num_hidden_layers": 12},
        head_dim=16,
        sliding_window=16,
    ),
    "gemma3 (5 sliding : 1 global, 48 layers)": _hf(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        **{**_GQA, "num_hidden_layers": 48},
        head_dim=16,
        sliding_window=16,
    ),
    "llama4 (MoE every 2nd, NoPE every 4th, 32)": _hf(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        **{**_GQA, "num_hidden_layers": 32},
        head_dim=16,
        interleave_moe_layer_step=2,
        num_local_experts=4,
        intermediate_size_mlp=128,
    ),
    "gpt-oss (alternating sliding, MoE, 12)": _hf(
        "GptOssConfig",
        "GptOssForCausalLM",
        **{**_GQA, "num_hidden_layers": 12},
        head_dim=16,
        sliding_window=16,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "mixtral (MoE)": _hf(
        "MixtralConfig", "MixtralForCausalLM", **_GQA, num_local_experts=4, num_experts_per_tok=2
    ),
    "t5 (encoder-decoder, 8 + 8 layers)": _t5,
    "llama": _llama,
    "llama, gradient checkpointing": _llama_checkpointed,
    "llama, bf16-mixed": lambda: _llama(precision="bf16-mixed"),
    "llama, CUDA what-if": lambda: _llama(precision="bf16-mixed", device="cuda"),
    "llama, LoRA (peft)": _llama_lora,
    "gpt-2, SGD momentum": _gpt2(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "gpt-2, Adam foreach": _gpt2(lambda p: torch.optim.Adam(p, foreach=True)),
    "gpt-2, Adagrad": _gpt2(torch.optim.Adagrad),
    "timm vit_tiny": _vision("timm:vit_tiny_patch16_224", torch.optim.AdamW, img_size=64, depth=8),
    "timm convnext_atto": _vision("timm:convnext_atto", torch.optim.SGD),
    "torchvision swin_t": _vision("swin_t", torch.optim.AdamW),
    "torchvision resnet50": _vision("resnet50", torch.optim.SGD),
    "torchvision mobilenet_v2": _vision("mobilenet_v2", torch.optim.Adam),
    "nn.TransformerEncoder": _encoder,
    "10 x nn.Linear, RMSprop": _mlp,
}


def compare(build: Callable[[], Case]) -> str:
    model, batch, kw = build()
    full = estimate_step(model, batch, replay_blocks=False, **kw)
    replay = estimate_step(model, batch, replay_blocks=True, **kw)
    a, b = full.to_json(), replay.to_json()
    for d in (a, b):
        del d["estimate_seconds"], d["replayed_blocks"], d["replay_note"]
    differ = [k for k in a if a[k] != b[k]]
    if full.peaks != replay.peaks:
        differ.append("peaks")
    if full.modules != replay.modules:
        differ.append("modules")
    if full.timeline != replay.timeline:
        differ.append("timeline")
    groups = ", ".join(f"{path or '(root)'} {n}" for path, n in (replay.replayed_blocks or {}).items())
    equal = "yes" if not differ else "no: " + ", ".join(differ)
    return f"{groups or 'none'} | {equal} | {full.estimate_seconds:.2f} | {replay.estimate_seconds:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="families whose name contains this (repeatable)")
    args = parser.parse_args()
    chosen = {n: b for n, b in FAMILIES.items() if not args.only or any(o in n for o in args.only)}
    print("| family | replayed (blocks a step) | every figure equal | full s | replay s |")
    print("|---|---|---|---|---|")
    for name, build in chosen.items():
        try:
            row = compare(build)
        except Exception as e:  # reported in the table; the others go on
            row = f"failed: {type(e).__name__}: {str(e)[:100]} | | |"
        print(f"| {name} | {row} |", flush=True)


if __name__ == "__main__":
    main()
