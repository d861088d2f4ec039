"""Zoo cases whose libraries check their values (issue 46), written as each library's users write them:
a variational autoencoder and a PPO policy on ``torch.distributions`` with argument validation on (its
default: every distribution built from a network's output checks its parameters), a forecaster that
asserts its loss is neither NaN nor infinite (as pytorch-forecasting's ``BaseModel.step`` does), and an
exact Gaussian process in gpytorch (its debug check, on by default, that it trains on its training
inputs; a Cholesky factor and triangular solves, forward and backward), and a neural ODE solved by
torchdiffeq's adaptive dopri5 (its step count follows from the values: the step is followed on them).
And a classifier trained in Float8 through torchao (issue 47): ``convert_to_float8_training`` in
``configure_model``, as torchao's users write it; its fp8 matrix products run in ``aten._scaled_mm``,
whose CPU kernel the estimate measures on the machine (``accounting/kernels/measured_ops.py``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import Bernoulli, Categorical, Normal, kl_divergence
from torch.utils.data import DataLoader, Dataset, TensorDataset
from zoo import Built, Counting, MLPClassifier, ZooCase

__all__ = ["CHECK_CASES"]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# --- a VAE on torch.distributions -----------------------------------------------------------------------
class VAE(pl.LightningModule):
    """Gaussian encoder, Bernoulli decoder, the ELBO with an analytic KL (validation of every
    distribution's arguments on, as by default)."""

    def __init__(self, dataset: Dataset[Any], latent: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 2 * latent))
        self.decoder = nn.Sequential(nn.Linear(latent, 256), nn.ReLU(), nn.Linear(256, 784))
        self.dataset = dataset

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        loc, raw_scale = self.encoder(x).chunk(2, dim=-1)
        posterior = Normal(loc, F.softplus(raw_scale) + 1e-4)
        z = posterior.rsample()
        likelihood = Bernoulli(logits=self.decoder(z))
        prior = Normal(torch.zeros_like(loc), torch.ones_like(loc))
        elbo = likelihood.log_prob(x).sum(-1) - kl_divergence(posterior, prior).sum(-1)
        loss = -elbo.mean()
        self.log("elbo", -loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=32)


def _vae() -> Built:
    images = (torch.rand(128, 784, generator=_generator()) > 0.5).float()  # binarized, as for MNIST
    data = Counting(TensorDataset(images))
    return Built(VAE(data), data)


# --- a PPO policy on torch.distributions ------------------------------------------------------------------
class ActorCritic(pl.LightningModule):
    """PPO's clipped objective over a rollout buffer: a categorical policy, a value head, an entropy
    bonus."""

    def __init__(self, dataset: Dataset[Any], actions: int = 6, clip: float = 0.2) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh())
        self.actor, self.critic = nn.Linear(128, actions), nn.Linear(128, 1)
        self.clip = clip
        self.dataset = dataset

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        obs, action, old_log_prob, advantage, returns = batch
        h = self.body(obs)
        dist = Categorical(logits=self.actor(h))
        ratio = (dist.log_prob(action) - old_log_prob).exp()
        clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
        policy_loss = -torch.min(ratio * advantage, clipped * advantage).mean()
        value_loss = F.mse_loss(self.critic(h).squeeze(-1), returns)
        loss = policy_loss + 0.5 * value_loss - 0.01 * dist.entropy().mean()
        self.log("policy_loss", policy_loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-4)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=64, shuffle=True)


def _ppo() -> Built:
    g = _generator()
    n = 256
    rollout = TensorDataset(
        torch.randn(n, 64, generator=g),
        torch.randint(0, 6, (n,), generator=g),
        -torch.rand(n, generator=g) * 2,  # old log-probabilities
        torch.randn(n, generator=g),  # advantages
        torch.randn(n, generator=g),  # returns
    )
    data = Counting(rollout)
    return Built(ActorCritic(data), data)


# --- a forecaster that asserts its loss ---------------------------------------------------------------------
class Forecaster(pl.LightningModule):
    """An N-BEATS-style MLP on lookback windows, its loss checked as pytorch-forecasting checks it."""

    def __init__(self, dataset: Dataset[Any], lookback: int = 96, horizon: int = 24) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(lookback, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, horizon)
        )
        self.dataset = dataset

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.l1_loss(self.net(x), y)
        assert not torch.isnan(loss), "Loss should not be nan"  # pytorch_forecasting BaseModel.step
        assert torch.isfinite(loss), "Loss should not be infinite"
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=32)


def _forecaster() -> Built:
    series = torch.sin(torch.arange(2000) / 20) + 0.1 * torch.randn(2000, generator=_generator())
    windows = series.unfold(0, 120, 10)  # (N, 120): 96 to look back, 24 to forecast
    data = Counting(TensorDataset(windows[:, :96].clone(), windows[:, 96:].clone()))
    return Built(Forecaster(data), data)


# --- an exact Gaussian process in gpytorch ---------------------------------------------------------------
class ExactGPRegression(pl.LightningModule):
    """gpytorch's exact GP regression as its tutorials write it: the whole training set one batch, the
    exact marginal log likelihood (a Cholesky factor of the N x N kernel matrix)."""

    def __init__(self, dataset: TensorDataset) -> None:
        import gpytorch

        super().__init__()
        train_x, train_y = dataset.tensors

        class GP(gpytorch.models.ExactGP):  # type: ignore[misc]
            def __init__(self, likelihood: Any) -> None:
                super().__init__(train_x, train_y, likelihood)
                self.mean = gpytorch.means.ConstantMean()
                self.covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3))

            def forward(self, x: Tensor) -> Any:
                return gpytorch.distributions.MultivariateNormal(self.mean(x), self.covar(x))

        self.likelihood = gpytorch.likelihoods.GaussianLikelihood()
        self.gp = GP(self.likelihood)
        self.mll = gpytorch.mlls.ExactMarginalLogLikelihood(self.likelihood, self.gp)
        self.dataset = dataset

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss: Tensor = -self.mll(self.gp(x), y)
        self.log("neg_mll", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        n = len(self.dataset)
        return DataLoader(self.dataset, batch_size=n)  # in order: the GP's own training inputs


def _exact_gp() -> Built:
    g = _generator()
    x = torch.rand(400, 3, generator=g)
    y = torch.sin(6 * x[:, 0]) + x[:, 1] ** 2 + 0.05 * torch.randn(400, generator=g)
    dataset = TensorDataset(x, y)
    module = ExactGPRegression(dataset)
    data = Counting(dataset)
    module.dataset = data  # type: ignore[assignment]
    return Built(module, data)


# --- a neural ODE with an adaptive solver ------------------------------------------------------------------
class ODEFunc(nn.Module):
    """The dynamics, counting its evaluations as torchdiffeq's examples do."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, dim))
        self.nfe = 0

    def forward(self, t: Tensor, y: Tensor) -> Tensor:
        self.nfe += 1
        out: Tensor = self.net(y)
        return out


class NeuralODEClassifier(pl.LightningModule):
    """An ODE block between an encoder and a head, solved by torchdiffeq's adaptive ``dopri5`` and
    backpropagated through the solver's steps: how many it takes (and so what it keeps for backward)
    follows from the values alone."""

    def __init__(self, dataset: Dataset[Any], dim: int = 16) -> None:
        super().__init__()
        self.encoder, self.func, self.head = nn.Linear(2, dim), ODEFunc(dim), nn.Linear(dim, 2)
        self.dataset = dataset

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        from torchdiffeq import odeint

        x, y = batch
        t = torch.linspace(0.0, 1.0, 2)
        z = odeint(self.func, self.encoder(x), t, method="dopri5", rtol=1e-3, atol=1e-4)[-1]
        loss = F.cross_entropy(self.head(z), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=64)


def _neural_ode() -> Built:
    g = _generator()
    angle = torch.rand(512, generator=g) * 3 * torch.pi  # two interleaved spirals
    label = torch.randint(0, 2, (512,), generator=g)
    radius = angle / (3 * torch.pi)
    sign = 1 - 2 * label.float()
    points = sign[:, None] * torch.stack([radius * angle.cos(), radius * angle.sin()], 1)
    data = Counting(TensorDataset(points + 0.02 * torch.randn(512, 2, generator=g), label))
    return Built(NeuralODEClassifier(data), data)


# --- Float8 training through torchao ----------------------------------------------------------------------
class Float8Classifier(MLPClassifier):
    """The zoo's MLP classifier with its hidden linears trained in Float8 (dynamic tensorwise scaling,
    torchao's default), the head left in high precision (its ``module_filter_fn``)."""

    def configure_model(self) -> None:
        from torchao.float8 import convert_to_float8_training

        head = str(len(self.net) - 1)
        convert_to_float8_training(self.net, module_filter_fn=lambda module, fqn: fqn != head)


def _float8() -> Built:
    g = _generator()
    images = torch.randn(256, 3, 32, 32, generator=g)
    data = Counting(TensorDataset(images, torch.randint(0, 10, (256,), generator=g)))
    return Built(Float8Classifier(data, hidden=512), data)


CHECK_CASES: tuple[ZooCase, ...] = (
    ZooCase("dist_vae", _vae, what="a VAE on torch.distributions, argument validation on"),
    ZooCase("ppo_categorical", _ppo, what="PPO's clipped objective, a Categorical policy, validation on"),
    ZooCase("forecast_loss_asserts", _forecaster, what="asserts not isnan(loss), isfinite(loss)"),
    ZooCase("gpytorch_exact_gp", _exact_gp, max_steps=3, what="gpytorch exact GP, its debug checks on"),
    ZooCase("neural_ode_dopri5", _neural_ode, what="torchdiffeq's adaptive dopri5, backprop through it"),
    ZooCase("float8_torchao", _float8, what="torchao's Float8Linear (fp8 matmuls in aten._scaled_mm)"),
)
