"""Checkpointing plans against the real step (issue 24): the plan's estimate is the re-simulated step, and
the real step with the plan applied (torch's ``checkpoint_wrapper`` on a copy of the model, two real
training steps, peaks from the CPU allocator's events) stays within the budget and within 1 % of it.

On a decoder of 12 identical blocks, a ResNet, a UNet with skip connections and a transformers Llama
from a config, for budgets between the step's peak without checkpointing and its floor (every candidate
checkpointed in full). Then the solver against exhaustive search over every choice, each simulated;
and what a plan does to a model (nothing until applied; state-dict keys unchanged when applied; the
policy Lightning's FSDPStrategy takes).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import TinyGPT, lm_batch, lm_loss
from plan_cases import CASES
from torch import nn

from lightning_memest import estimate_step, plan_checkpointing
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step
from lightning_memest.plan.checkpointing import checkpointed

TOLERANCE_PCT = 1.0


def _measured(make: Callable[[], nn.Module], model: nn.Module, batch: Any, loss: Any, plan: Any) -> int:
    real = make()
    real.load_state_dict(model.state_dict())
    plan.apply(real)
    return max(measure_step(real, batch, StepConfig(loss_fn=loss, optimizer=torch.optim.AdamW)).peak_bytes)


@pytest.mark.parametrize("name", list(CASES))
def test_every_plan_fits_measured_and_matches_its_estimate(name: str) -> None:
    make, batch_of, loss = CASES[name]
    torch.manual_seed(0)
    model, batch = make(), batch_of()
    settings: dict[str, Any] = {"loss_fn": loss, "optimizer": torch.optim.AdamW, "calibrate": True}
    before = plan_checkpointing(model, batch, 2**50, **settings)
    assert before.modules == {} and before.peak_bytes == before.baseline.peak_bytes
    floor = plan_checkpointing(model, batch, 1, **settings)
    assert not floor.fits and floor.floor_bytes is not None
    assert floor.floor_bytes < before.peak_bytes, f"checkpointing {name} frees nothing"
    for share in (0.4,):  # (benchmarks/plan.py: three budgets a case)
        budget = int(floor.floor_bytes + (before.peak_bytes - floor.floor_bytes) * share)
        plan = plan_checkpointing(model, batch, budget, **settings)
        assert plan.fits and plan.modules, plan
        measured = _measured(make, model, batch, loss, plan)
        assert measured <= budget, (share, str(plan), measured)
        assert abs(100 * (plan.peak_bytes - measured) / measured) <= TOLERANCE_PCT, (
            plan.peak_bytes,
            measured,
        )
        assert 0 < plan.recompute_share < 1


def test_the_plan_is_within_five_percent_of_the_cheapest_choice() -> None:
    """Every choice of no, selective or full checkpointing for each block of a small decoder, simulated:
    for budgets between the step's peak and its floor, the cheapest choice that fits against the
    plan's recompute FLOPs."""
    torch.manual_seed(0)
    model = TinyGPT(n_layers=3, d_model=64, n_heads=4, vocab=256, seq_len=32)
    batch = lm_batch(4, 32, vocab=256)
    settings: dict[str, Any] = {"loss_fn": lm_loss, "optimizer": torch.optim.AdamW}
    reference = plan_checkpointing(model, batch, 2**50, **settings)
    costs = {c.path: c.recompute_flops for c in reference.candidates}
    paths = list(costs)
    assert len(paths) == 3  # 27 choices
    outcomes: list[tuple[int, int]] = []  # (peak, FLOPs) of every choice
    for picks in itertools.product([None, "full", "selective"], repeat=len(paths)):
        choice = {p: k for p, k in zip(paths, picks, strict=True) if k is not None}
        with checkpointed(model, choice):
            peak = estimate_step(model, batch, **settings).peak_bytes
        outcomes.append((peak, sum(costs[p][k] for p, k in choice.items())))
    top = reference.peak_bytes
    bottom = min(peak for peak, _ in outcomes)
    for share in (0.15, 0.5, 0.85):
        budget = int(bottom + (top - bottom) * share)
        cheapest = min(flops for peak, flops in outcomes if peak <= budget)
        plan = plan_checkpointing(model, batch, budget, **settings)
        assert plan.fits, plan
        assert plan.recompute_flops <= 1.05 * cheapest, (share, plan.recompute_flops, cheapest, str(plan))


def test_a_plan_leaves_the_model_alone_until_applied() -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layers=6, d_model=64, n_heads=4, vocab=256, seq_len=32)
    batch = lm_batch(8, 32, vocab=256)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tree = [(name, type(m)) for name, m in model.named_modules()]
    settings: dict[str, Any] = {"loss_fn": lm_loss, "optimizer": torch.optim.AdamW}
    before = plan_checkpointing(model, batch, 2**50, **settings).peak_bytes
    plan = plan_checkpointing(model, batch, before - before // 8, kinds=("full",), **settings)
    assert plan.fits and plan.modules
    assert [(name, type(m)) for name, m in model.named_modules()] == tree
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # Applied: the planned modules wrapped, the state dict's keys and values as they were.
    applied = copy.deepcopy(model)
    plan.apply(applied)
    assert list(applied.state_dict()) == list(state)
    wrapped = {name for name, m in applied.named_modules() if type(m).__name__ == "CheckpointWrapper"}
    assert wrapped == set(plan.modules)
    # The policy, as Lightning's FSDPStrategy applies it: the same modules.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, auto_wrap_policy=plan.policy)
    wrapped = {name for name, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper"}
    assert wrapped == set(plan.modules)
    assert "transformers" not in str(plan) and "checkpointing" in str(plan)
    assert plan.to_json()["modules"] == [{"path": p, "kind": "full"} for p in plan.modules]


def test_a_cuda_what_if_plan_is_for_the_gpu_given() -> None:
    # On an H100-class GPU cuBLAS keeps a 32 MiB workspace (8 MiB before Hopper): the plan's estimates
    # are for the GPU named, as estimate_step's are.
    from lightning_memest.accounting.cuda_device import CudaDevice

    torch.manual_seed(0)
    model = TinyGPT(n_layers=2, d_model=64, n_heads=4, vocab=256, seq_len=32)
    batch = lm_batch(4, 32, vocab=256)
    settings: dict[str, Any] = {"loss_fn": lm_loss, "optimizer": torch.optim.AdamW, "device": "cuda"}
    for gpu in (CudaDevice((8, 0)), CudaDevice((9, 0))):
        plan = plan_checkpointing(model, batch, 2**50, gpu=gpu, **settings)
        assert plan.baseline.peak_bytes == estimate_step(model, batch, gpu=gpu, **settings).peak_bytes, gpu
    hopper = plan_checkpointing(model, batch, 2**50, gpu=CudaDevice((9, 0)), **settings).baseline.peak_bytes
    ampere = plan_checkpointing(model, batch, 2**50, gpu=CudaDevice((8, 0)), **settings).baseline.peak_bytes
    assert hopper > ampere
