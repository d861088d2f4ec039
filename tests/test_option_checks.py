"""Options checked where they are given (issue 44, item 6): a wrong type or value at a public entry is
one sentence naming the option -- a ``TypeError`` for the type, a ``ValueError`` for the value -- raised
before anything is simulated (the simulator is replaced by one that fails the test), never a
``KeyError`` or an ``AttributeError`` from deep inside, nor a truthy string taken as ``True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import lightning_memest.estimate
import lightning_memest.plan.planner
import lightning_memest.search.batch_size
from lightning_memest import DDP, FitBatchSize, MemEstimate, estimate_step, max_batch_size, plan_checkpointing
from lightning_memest.engine.step import StepConfig
from lightning_memest.errors import MemestError
from lightning_memest.estimate import estimate


def _net() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(2)])


NET = _net()
BATCH = torch.randn(2, 4)


def _make(n: int) -> torch.Tensor:
    return torch.empty(n, 4, device="meta")


@pytest.fixture
def no_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each entry's simulator fails the test: a bad option must be refused before the first step."""

    def simulated(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("simulated before the options were checked")

    for module in (
        lightning_memest.estimate,
        lightning_memest.plan.planner,
        lightning_memest.search.batch_size,
    ):
        monkeypatch.setattr(module, "simulate", simulated)
        monkeypatch.setattr(module, "simulate_replaying", simulated)


def _entries() -> dict[str, Callable[..., Any]]:
    return {
        "estimate_step": lambda **kw: estimate_step(kw.pop("model", NET), BATCH, **kw),
        "max_batch_size": lambda **kw: max_batch_size(kw.pop("model", NET), _make, 2**20, **kw),
        "plan_checkpointing": lambda **kw: plan_checkpointing(kw.pop("model", NET), BATCH, 2**20, **kw),
    }


def _refused(call: Callable[[], Any], error: type[Exception], option: str) -> str:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert type(info.value) is error, f"{type(info.value).__name__}: {message}"
    assert option in message and "\n" not in message, message
    return message


# The options estimate_step, max_batch_size and plan_checkpointing share, each refused by all three.
SHARED = [
    ({"model": None}, TypeError, "model"),
    ({"model": "resnet18"}, TypeError, "model"),
    ({"steps": "2"}, TypeError, "steps"),
    ({"steps": 1.5}, TypeError, "steps"),
    ({"steps": True}, TypeError, "steps"),
    ({"steps": 0}, ValueError, "steps"),
    ({"strategy": "ddp"}, TypeError, "strategy"),
    ({"strategy": "fsdp"}, TypeError, "strategy"),
    ({"strategy": 2}, TypeError, "strategy"),
    ({"replay_blocks": "no"}, TypeError, "replay_blocks"),
    ({"replay_blocks": None}, TypeError, "replay_blocks"),
    ({"replay_blocks": 1}, TypeError, "replay_blocks"),
    ({"calibrate": "yes"}, TypeError, "calibrate"),
    ({"calibrate": None}, TypeError, "calibrate"),
    ({"device": "tpu"}, ValueError, "device"),
    ({"device": "meta"}, ValueError, "device"),
    ({"device": 0}, TypeError, "device"),
    ({"gpu": "H100"}, TypeError, "gpu"),
    ({"precision": "bf16"}, ValueError, "precision"),
    ({"loss_fn": "mse"}, TypeError, "loss_fn"),
]


@pytest.mark.parametrize("entry", list(_entries()))
@pytest.mark.parametrize(("kwargs", "error", "option"), SHARED)
@pytest.mark.usefixtures("no_simulation")
def test_a_shared_option_is_refused_by_every_entry(
    entry: str, kwargs: dict[str, Any], error: type[Exception], option: str
) -> None:
    _refused(lambda: _entries()[entry](**kwargs), error, option)


def test_a_strategy_given_by_name_says_what_to_pass() -> None:
    assert "pass strategy=DDP(world_size=N)" in _refused(lambda: estimate_step(NET, BATCH, strategy="ddp"),
                                                          TypeError, "strategy")  # fmt: skip
    assert "pass strategy=FSDP(world_size=N)" in _refused(lambda: estimate_step(NET, BATCH, strategy="FSDP"),
                                                           TypeError, "strategy")  # fmt: skip


PLAN = [
    ({"kinds": []}, ValueError, "kinds"),
    ({"kinds": ()}, ValueError, "kinds"),
    ({"kinds": "full"}, TypeError, "kinds"),
    ({"kinds": ["fulll"]}, ValueError, "kinds"),
    ({"kinds": [1]}, TypeError, "kinds"),
    ({"kinds": None}, TypeError, "kinds"),
    ({"modules": "0"}, TypeError, "modules"),
    ({"modules": "blocks.0"}, TypeError, "modules"),
    ({"modules": [""]}, ValueError, "modules"),
    ({"modules": [0]}, TypeError, "modules"),
    ({"modules": None}, TypeError, "modules"),
    ({"modules": ["blocks.0"]}, MemestError, "modules"),  # no such module: said before simulating
    ({"max_batch_size": "yes"}, TypeError, "max_batch_size"),
    ({"max_batch_size": 8}, TypeError, "max_batch_size"),
    ({"budget": "80%"}, ValueError, "budget"),
    ({"budget": "lots"}, ValueError, "budget"),
    ({"budget": 0}, ValueError, "budget"),
    ({"budget": None}, TypeError, "budget"),
    ({"budget": 1.5}, TypeError, "budget"),
]


@pytest.mark.parametrize(("kwargs", "error", "option"), PLAN)
@pytest.mark.usefixtures("no_simulation")
def test_plan_checkpointing_refuses_a_bad_plan_option(
    kwargs: dict[str, Any], error: type[Exception], option: str
) -> None:
    budget = kwargs.pop("budget", 2**20)
    _refused(lambda: plan_checkpointing(NET, BATCH, budget, **kwargs), error, option)


def test_a_bare_string_is_refused_with_the_spelling_meant() -> None:
    message = _refused(lambda: plan_checkpointing(NET, BATCH, 2**20, kinds="full"), TypeError, "kinds")
    assert "kinds=('full',)" in message
    message = _refused(lambda: plan_checkpointing(NET, BATCH, 2**20, modules="0"), TypeError, "modules")
    assert "modules=('0',)" in message


SEARCH = [
    ({"budget_bytes": "1GiB"}, TypeError, "budget_bytes"),
    ({"budget_bytes": 0}, ValueError, "budget_bytes"),
    ({"start": 0}, ValueError, "start"),
    ({"start": "8"}, TypeError, "start"),
    ({"cap": 0}, ValueError, "cap"),
    ({"cap": 2.0**20}, TypeError, "cap"),
    ({"workers": 0}, ValueError, "workers"),
    ({"workers": "2"}, TypeError, "workers"),
    ({"make_batch": None}, TypeError, "make_batch"),
    ({"progress": "tqdm"}, TypeError, "progress"),
]


@pytest.mark.parametrize(("kwargs", "error", "option"), SEARCH)
@pytest.mark.usefixtures("no_simulation")
def test_max_batch_size_refuses_a_bad_search_option(
    kwargs: dict[str, Any], error: type[Exception], option: str
) -> None:
    make = kwargs.pop("make_batch", _make)
    budget = kwargs.pop("budget_bytes", 2**20)
    _refused(lambda: max_batch_size(NET, make, budget, **kwargs), error, option)


ESTIMATE = [
    ({"loop": "eval"}, ValueError, "loop"),
    ({"loop": None}, TypeError, "loop"),
    ({"next_batches": BATCH}, TypeError, "next_batches"),
    ({"next_batches": "batches"}, TypeError, "next_batches"),
]


@pytest.mark.parametrize(("kwargs", "error", "option"), ESTIMATE)
@pytest.mark.usefixtures("no_simulation")
def test_estimate_step_refuses_a_bad_option(
    kwargs: dict[str, Any], error: type[Exception], option: str
) -> None:
    _refused(lambda: estimate_step(NET, BATCH, **kwargs), error, option)


@pytest.mark.usefixtures("no_simulation")
def test_estimate_checks_its_config_and_the_strategy_in_it() -> None:
    _refused(lambda: estimate(NET, BATCH, "32-true"), TypeError, "config")  # type: ignore[arg-type]
    _refused(lambda: StepConfig(strategy="ddp"), TypeError, "strategy")  # type: ignore[arg-type]
    _refused(lambda: estimate(NET, BATCH, StepConfig(), replay_blocks="no"), TypeError, "replay_blocks")


FIT_BATCH_SIZE = [
    ({"max_batch_size": 0}, ValueError, "max_batch_size"),
    ({"max_batch_size": -1}, ValueError, "max_batch_size"),
    ({"max_batch_size": "8"}, TypeError, "max_batch_size"),
    ({"max_batch_size": 1.5}, TypeError, "max_batch_size"),
    ({"max_batch_size": True}, TypeError, "max_batch_size"),
    ({"max_batch_size": None}, TypeError, "max_batch_size"),
    ({"margin": "0.1"}, TypeError, "margin"),
    ({"margin": True}, TypeError, "margin"),
    ({"margin": None}, TypeError, "margin"),
    ({"margin": 1}, ValueError, "margin"),
    ({"margin": -0.1}, ValueError, "margin"),
    ({"margin": math.nan}, ValueError, "margin"),
    ({"raise_if_none_fits": "no"}, TypeError, "raise_if_none_fits"),
    ({"raise_if_none_fits": None}, TypeError, "raise_if_none_fits"),
    ({"budget": "lots"}, ValueError, "budget"),
    ({"budget": "150%"}, ValueError, "budget"),
    ({"budget": 0}, ValueError, "budget"),
    ({"budget": [1]}, TypeError, "budget"),
    ({"attr_name": None}, TypeError, "attr_name"),
    ({"attr_name": ""}, ValueError, "attr_name"),
]


@pytest.mark.parametrize(("kwargs", "error", "option"), FIT_BATCH_SIZE)
def test_fit_batch_size_refuses_a_bad_argument(
    kwargs: dict[str, Any], error: type[Exception], option: str
) -> None:
    budget = kwargs.pop("budget", None)
    _refused(lambda: FitBatchSize(budget, **kwargs), error, option)


MEM_ESTIMATE = [
    ({"max_depth": 1.5}, TypeError, "max_depth"),
    ({"max_depth": "1"}, TypeError, "max_depth"),
    ({"max_depth": -2}, ValueError, "max_depth"),
    ({"check": None}, TypeError, "check"),
    ({"replay_blocks": "no"}, TypeError, "replay_blocks"),
    ({"memory_check": 1}, TypeError, "memory_check"),
    ({"memory_check": "loud"}, ValueError, "memory_check"),
    ({"checkpointing": True}, TypeError, "checkpointing"),
    ({"checkpointing": "on"}, ValueError, "checkpointing"),
    ({"memory_margin_bytes": -1}, ValueError, "memory_margin_bytes"),
    ({"memory_margin_bytes": "1GiB"}, TypeError, "memory_margin_bytes"),
    ({"memory_margin_bytes": 0.5}, TypeError, "memory_margin_bytes"),
    ({"memory_budget": "lots"}, ValueError, "memory_budget"),
    ({"memory_budget": 1.5}, TypeError, "memory_budget"),
]


@pytest.mark.parametrize(("kwargs", "error", "option"), MEM_ESTIMATE)
def test_mem_estimate_refuses_a_bad_argument(
    kwargs: dict[str, Any], error: type[Exception], option: str
) -> None:
    _refused(lambda: MemEstimate(**kwargs), error, option)


# ---------------------------------------------------------------------- valid calls still work (tiny)


def test_good_arguments_are_taken_as_given() -> None:
    fit = FitBatchSize("1GiB", margin=0, max_batch_size=8, raise_if_none_fits=False)
    assert (fit.margin, fit.max_batch_size, fit.raise_if_none_fits) == (0.0, 8, False)
    assert fit.budget is not None and fit.budget.bytes == 2**30
    assert MemEstimate(max_depth=-1, memory_margin_bytes=0, memory_budget="50%").memory_budget is not None


@pytest.fixture(scope="module")
def plan() -> Iterator[Any]:
    yield plan_checkpointing(NET, BATCH, 2**40, kinds={"full"}, modules=("0",), steps=1, replay_blocks=False)


def test_a_valid_plan_still_runs_and_apply_checks_its_model(plan: Any) -> None:
    assert plan.fits and plan.modules == {}  # it fits as it is: nothing to checkpoint
    assert [c.path for c in plan.candidates] == ["0", "1"]
    _refused(lambda: plan.apply("model"), TypeError, "model")
    assert plan.apply(_net()) is not None


def test_valid_calls_still_estimate_and_search() -> None:
    est = estimate_step(NET, BATCH, steps=1, strategy=None, replay_blocks=False, next_batches=[BATCH])
    assert est.peak_bytes > 0
    kinds = (k for k in ("full", "full"))  # any iterable of kinds, each once
    plan = plan_checkpointing(NET, BATCH, 2**40, kinds=kinds, steps=1)
    assert plan.fits
    found = max_batch_size(nn.Linear(4, 4), _make, 2**16, start=2, cap=4, workers=1, strategy=None)
    assert found.max_batch_size == 4 and found.capped
    assert DDP(2).world_size == 2  # a strategy object is what strategy= takes


@pytest.mark.parametrize(
    ("make", "error", "option"),
    [
        (lambda: DDP("2"), TypeError, "world_size"),  # type: ignore[arg-type]
        (lambda: DDP(2.5), TypeError, "world_size"),  # type: ignore[arg-type]
        (lambda: DDP(True), TypeError, "world_size"),
        (lambda: DDP(0), ValueError, "world_size"),
        (lambda: DDP(2, rank="0"), TypeError, "rank"),  # type: ignore[arg-type]
    ],
    ids=["ddp-str", "ddp-float", "ddp-bool", "ddp-0", "rank-str"],
)
def test_a_strategy_checks_its_ranks(make: Callable[[], object], error: type[Exception], option: str) -> None:
    _refused(make, error, option)
