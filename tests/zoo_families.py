"""Zoo cases of families the first zoo did not have (issue 25), written as each library's users write them:
a sparse mixture of experts from transformers' Mixtral config (its grouped experts take
``aten._grouped_mm``, whose fake kernel refuses float32 while the CPU kernel runs it: run for real), a
hand-written top-2 router (its experts' shares of the tokens: ``engine.values.nonzero_bounds``), and
a graph attention network from torch_geometric over mini-batches of graphs (its batch object holds the
tensors; global pooling sizes its output by the graph ids' largest value, which the batch holds), and
a recommender with sparse embeddings and a sparse optimizer (its gradients are sparse tensors, whose
entries the fake kernels lose: ``engine.sparse``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from zoo import Built, Counting, ZooCase

__all__ = ["FAMILY_CASES", "mixtral_config"]


class TokenBlocks(Dataset[Tensor]):
    def __init__(self, n: int = 32, length: int = 32, vocab: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Tensor:
        return self.ids[i]


def mixtral_config() -> Any:
    """A small Mixtral config: 2 layers, 4 experts, top-2 routing (``benchmarks/real_ops.py`` too)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


class MixtralLM(pl.LightningModule):
    """A Mixtral-style sparse MoE decoder (4 experts, top-2 routing) from its config, trained on labels."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        from transformers import MixtralForCausalLM

        super().__init__()
        self.model = MixtralForCausalLM(mixtral_config())
        self.dataset = dataset

    def training_step(self, ids: Tensor, batch_idx: int) -> Tensor:
        out = self.model(input_ids=ids, labels=ids)
        self.log("train_loss", out.loss)
        return out.loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=4)


def _graphs(n: int = 64) -> list[Any]:
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(0)
    graphs = []
    for k in range(n):
        nodes = 10 + k % 7
        edges = torch.randint(0, nodes, (2, 3 * nodes), generator=g)
        graphs.append(Data(x=torch.randn(nodes, 16, generator=g), edge_index=edges, y=torch.tensor([k % 3])))
    return graphs


class GraphClassifier(pl.LightningModule):
    """Two ``GATConv`` layers, ``global_mean_pool`` per graph, a linear head: graph classification."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        from torch_geometric.nn import GATConv

        super().__init__()
        self.conv1 = GATConv(16, 32, heads=2)
        self.conv2 = GATConv(64, 32, heads=1)
        self.head = nn.Linear(32, 3)
        self.dataset = dataset

    def training_step(self, data: Any, batch_idx: int) -> Tensor:
        from torch_geometric.nn import global_mean_pool

        x = F.elu(self.conv1(data.x, data.edge_index))
        x = F.elu(self.conv2(x, data.edge_index))
        loss = F.cross_entropy(self.head(global_mean_pool(x, data.batch)), data.y)
        self.log("train_loss", loss, batch_size=data.num_graphs)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        from torch_geometric.loader import DataLoader as GraphLoader

        return GraphLoader(self.dataset, batch_size=8, shuffle=True)


class TopKMoE(nn.Module):
    """A hand-written top-2 mixture of experts, as tutorials write one: a linear router, softmax, top-k,
    then a loop over the experts, each taking the tokens routed to it (``torch.where(ids == e)``)."""

    def __init__(self, dim: int, experts: int = 8, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(experts)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(-1)
        weights, ids = probs.topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        # the load-balancing loss of Switch Transformers: routed share times mean probability
        share = F.one_hot(ids[:, 0], probs.shape[-1]).float().mean(0)
        return out.view(shape), probs.shape[-1] * (share * probs.mean(0)).sum()


class MoELM(pl.LightningModule):
    """A small language model of two pre-norm blocks, attention and a hand-written top-2 MoE each."""

    def __init__(self, dataset: Dataset[Any], vocab: int = 512, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(dim),
                    "attn": nn.MultiheadAttention(dim, 4, batch_first=True),
                    "norm2": nn.LayerNorm(dim),
                    "moe": TopKMoE(dim),
                }
            )
            for _ in range(2)
        )
        self.head = nn.Linear(dim, vocab)
        self.dataset = dataset

    def training_step(self, ids: Tensor, batch_idx: int) -> Tensor:
        x = self.embed(ids[:, :-1])
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        aux = x.new_zeros(())
        for block in self.blocks:
            h = block["norm1"](x)
            x = x + block["attn"](h, h, h, attn_mask=causal, need_weights=False)[0]
            y, balance = block["moe"](block["norm2"](x))
            x, aux = x + y, aux + balance
        loss = F.cross_entropy(self.head(x).flatten(0, 1), ids[:, 1:].flatten()) + 0.01 * aux
        self.log("train_loss", loss)
        self.log("balance", aux.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=8, shuffle=True)


def _topk_moe() -> Built:
    data = Counting(TokenBlocks(n=64, length=65))
    return Built(MoELM(data), data)


class Clicks(Dataset[tuple[Tensor, Tensor, Tensor, Tensor]]):
    """Click logs: a user id, 12 item ids of the user's history, 8 dense features and a click label."""

    def __init__(self, n: int = 512, users: int = 5000, items: int = 20000) -> None:
        g = torch.Generator().manual_seed(7)
        self.users = torch.randint(0, users, (n,), generator=g)
        self.items = torch.randint(0, items, (n, 12), generator=g)
        self.dense = torch.randn(n, 8, generator=g)
        self.clicks = torch.randint(0, 2, (n,), generator=g).float()

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.users[i], self.items[i], self.dense[i], self.clicks[i]


class Recommender(pl.LightningModule):
    """A DLRM-style click model: sparse user embeddings and a sparse bag of item embeddings
    (``sparse=True``), an MLP over them and the dense features; ``SparseAdam`` for the embeddings and
    ``Adam`` for the rest, stepped by hand (two optimizers: manual optimization)."""

    def __init__(self, dataset: Dataset[Any], users: int = 5000, items: int = 20000, dim: int = 32) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.users = nn.Embedding(users, dim, sparse=True)
        self.items = nn.EmbeddingBag(items, dim, mode="mean", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(2 * dim + 8, 64), nn.ReLU(), nn.Linear(64, 1))
        self.dataset = dataset

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor, Tensor], batch_idx: int) -> None:
        users, items, dense, clicks = batch
        sparse_opt, dense_opt = self.optimizers()  # type: ignore[misc]
        x = torch.cat([self.users(users), self.items(items), dense], 1)
        loss = F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), clicks)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        self.manual_backward(loss)
        sparse_opt.step()
        dense_opt.step()
        self.log("train_loss", loss)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        embeddings = [*self.users.parameters(), *self.items.parameters()]
        return [torch.optim.SparseAdam(embeddings, lr=1e-3), torch.optim.Adam(self.mlp.parameters(), lr=1e-3)]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=64, shuffle=True)


def _recommender() -> Built:
    data = Counting(Clicks())
    return Built(Recommender(data), data)


def _mixtral() -> Built:
    data = Counting(TokenBlocks())
    return Built(MixtralLM(data), data)


def _gat() -> Built:
    data = Counting(_graphs())
    return Built(GraphClassifier(data), data)


FAMILY_CASES: tuple[ZooCase, ...] = (
    ZooCase("hf_mixtral_moe", _mixtral, what="transformers Mixtral MoE (grouped experts, run for real)"),
    ZooCase("pyg_gat_graphs", _gat, what="torch_geometric GATConv over graph mini-batches, mean pool"),
    ZooCase("topk_moe_lm", _topk_moe, what="a hand-written top-2 MoE (a loop over experts, torch.where)"),
    ZooCase(
        "sparse_recommender",
        _recommender,
        max_steps=4,
        what="DLRM-style: Embedding/EmbeddingBag(sparse=True), SparseAdam + Adam by hand",
    ),
)
