"""A decoder written for pipeline parallelism the way PyTorch's pipelining tutorial and torchtitan
write one: the layers in an ``nn.ModuleDict`` keyed by their index, and the embeddings, final norm and
head allowed to be ``None``, so that a stage is the model with what it does not run deleted
(:func:`split_decoder`, in place). Module-level functions: spawned ranks unpickle them.

Example:
    >>> import torch
    >>> model = split_decoder(PipeDecoder(n_layers=4, d_model=32, n_heads=2, vocab=50, seq_len=8), 1, 2)
    >>> sorted(model.layers), model.tok is None, model.head is not None
    (['2', '3'], True, True)
    >>> model(torch.randn(2, 8, 32)).shape
    torch.Size([2, 8, 50])
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tests.models import Block


class PipeDecoder(nn.Module):
    """A GPT decoder (:class:`tests.models.Block` layers) whose parts a pipeline stage may delete."""

    def __init__(
        self, n_layers: int = 4, d_model: int = 256, n_heads: int = 4, vocab: int = 1000, seq_len: int = 128
    ) -> None:
        super().__init__()
        self.tok: nn.Embedding | None = nn.Embedding(vocab, d_model)
        self.pos: nn.Embedding | None = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleDict({str(i): Block(d_model, n_heads) for i in range(n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.head: nn.Linear | None = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.tok is not None and self.pos is not None:  # the first stage: tokens in
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None and self.head is not None:  # the last stage: logits out
            x = self.head(self.norm(x))
        return x


def split_decoder(model: PipeDecoder, stage: int, stages: int) -> PipeDecoder:
    """Stage ``stage`` of ``stages``: its share of the layers (``n * stage // stages`` up to the next
    stage's first); the embeddings on the first stage, the norm and head on the last; the rest deleted."""
    n = len(model.layers)
    first, end = n * stage // stages, n * (stage + 1) // stages
    for name in list(model.layers):
        if not first <= int(name) < end:
            del model.layers[name]
    if stage > 0:
        model.tok = model.pos = None
    if stage < stages - 1:
        model.norm = model.head = None
    return model


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The next-token cross-entropy of one microbatch (the schedule's ``loss_fn``)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
