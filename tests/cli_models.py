"""Small models for the CLI tests, named on the command line as ``cli_models:NAME``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TinyMLP(nn.Module):
    """Takes ``(N, 16)`` (or anything that flattens to 16 features); returns ``(N, classes)``."""

    def __init__(self, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class TinyConvNet(nn.Module):
    """Takes ``(N, 3, H, W)``; returns a dict with ``logits`` ``(N, 10)`` (exercises ``first_output``)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2)
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"logits": self.head(self.features(x).flatten(1))}


class TinyLM(nn.Module):
    """Token ids ``(N, SEQ)`` below ``vocab`` -> logits ``(N, SEQ, vocab)``."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.relu(self.embed(ids)))  # type: ignore[no-any-return]


class CachingMLP(TinyMLP):
    """Sets a tensor attribute on its first forward, as positional-encoding caches do."""

    def forward(self, x: Tensor) -> Tensor:
        if getattr(self, "cache", None) is None:
            self.cache = torch.ones(16)
        return super().forward(x * self.cache)


def make_mlp(hidden: int = 64) -> TinyMLP:
    """A factory, called with ``--model-kwargs``."""
    return TinyMLP(hidden=hidden)


def not_a_model() -> int:
    return 3


NOT_CALLABLE = 3
AN_INSTANCE = TinyMLP()


def pretrained_by_default(weights: str | None = "DEFAULT") -> TinyMLP:
    """A factory that would download weights unless told ``weights=None`` (as torchvision's may)."""
    if weights is not None:
        raise RuntimeError(f"would download {weights} weights")
    return TinyMLP()


class BranchesOnValue(nn.Module):
    """``(N, 16)`` -> ``(N, 10)``; runs its big middle layer only when the mean activation is positive
    (always, for real data after a ReLU; never on fake tensors, which read as 0.0)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(16, 512), nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.inp(x))
        if h.mean().item() > 0:
            h = torch.relu(self.mid(h))
        return self.out(h)  # type: ignore[no-any-return]


class PositionalLM(TinyLM):
    """``TinyLM`` with a learned position table of ``max_len`` rows, indexed by ``arange(SEQ)``: a
    sequence longer than ``max_len`` fails in the real step (IndexError)."""

    def __init__(self, vocab: int = 50, dim: int = 32, max_len: int = 16) -> None:
        super().__init__(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.out(torch.relu(self.embed(ids) + self.pos(positions)))  # type: ignore[no-any-return]


class BatchNormMLP(nn.Module):
    """``(N, 16)`` -> ``(N, 10)`` with a BatchNorm1d: in training it rejects a batch of one sample
    ("Expected more than 1 value per channel"), as resnets do on small images."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class Block(nn.Module):
    """A pre-norm transformer block, attention written out (as many research codebases do)."""

    def __init__(self, d: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class Net(nn.Module):
    """Two such blocks and a head: the compiled-step tests' model (tests/test_compiled_steps.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.blocks(x)).mean(1)
        return out
