"""Small language models the tests and benchmarks share.

* :class:`TinyGPT` -- a decoder-only transformer: token + position embeddings, pre-LayerNorm blocks with
  causal ``F.scaled_dot_product_attention`` and a GELU MLP, a final LayerNorm and an untied head.
* :class:`LSTMLanguageModel` -- ``Embedding -> nn.LSTM (batch_first) -> Linear``.
* :class:`UNet` -- a segmentation UNet as its users write it: double convolutions with batch norm and
  in-place ReLUs, max-pooled down blocks, transposed-convolution up blocks concatenating the skips.

Both take a ``(batch, seq)`` int64 token tensor and return ``(batch, seq, vocab)`` logits;
:func:`lm_loss` is their cross-entropy loss against a batch ``(tokens, targets)``.

Example:
    >>> import torch
    >>> model = TinyGPT(n_layers=1, d_model=32, n_heads=2, vocab=50, seq_len=8)
    >>> tokens, targets = lm_batch(2, 8, vocab=50)
    >>> lm_loss(model, (tokens, targets)).shape
    torch.Size([])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class TinyGPT(nn.Module):
    """A small GPT: 4 layers, d_model 256, 4 heads, vocabulary 1000, context 128 by default."""

    def __init__(
        self, n_layers: int = 4, d_model: int = 256, n_heads: int = 4, vocab: int = 1000, seq_len: int = 128
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


class LSTMLanguageModel(nn.Module):
    """``Embedding(vocab, embed) -> LSTM(embed, hidden, layers, batch_first) -> Linear(hidden, vocab)``."""

    def __init__(self, vocab: int = 1000, embed: int = 256, hidden: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)  # type: ignore[no-any-return]


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class Down(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = DoubleConv(cin, cout)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.max_pool2d(x, 2))  # type: ignore[no-any-return]


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))  # type: ignore[no-any-return]


class UNet(nn.Module):
    """Three down and three up blocks of ``width``, 2 output classes."""

    def __init__(self, width: int = 16, classes: int = 2) -> None:
        super().__init__()
        c = width
        self.inc = DoubleConv(3, c)
        self.downs = nn.ModuleList([Down(c, 2 * c), Down(2 * c, 4 * c), Down(4 * c, 8 * c)])
        self.ups = nn.ModuleList([Up(8 * c, 4 * c), Up(4 * c, 2 * c), Up(2 * c, c)])
        self.outc = nn.Conv2d(c, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)  # type: ignore[no-any-return]


def lm_batch(batch_size: int, seq_len: int = 128, vocab: int = 1000, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random ``(tokens, targets)``, both ``(batch_size, seq_len)`` int64."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    targets = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    return tokens, targets


def lm_loss(model: nn.Module, batch: Any) -> Tensor:
    """Cross-entropy of the next-token logits against the targets (mean over all positions)."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(model: nn.Module, batch: Any) -> Tensor:
    """Cross-entropy of an image classifier's logits against integer targets."""
    images, targets = batch
    return F.cross_entropy(model(images), targets)
