"""The batch-size search (search.py): against hand-made peak models, the estimator, the CPU ground truth
and the command line, alone and with its worker process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_memest import estimate_step
from lightning_memest.cases import InputSpec, build_case, case_batch_maker, estimate_case, measure_case
from lightning_memest.cli import main
from lightning_memest.errors import EstimationError
from lightning_memest.search import max_batch_size, search_batch_size

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


# ------------------------------------------------------------------------------------- the search


@pytest.mark.parametrize(
    "peak",
    [
        lambda n: 1000 + 37 * n,  # affine
        lambda n: max(10**6 + 1000 * n, 3 * 10**6 + 500 * n, 3000 * n),  # kinks: the peak moves
        lambda n: 1000 + int(3 * n**1.5),  # curved
        lambda n: 10**6 + 1000 * n + (4096 if n % 7 == 0 else 0),  # not monotone
    ],
)
@pytest.mark.parametrize("budget", [5 * 10**5, 2 * 10**6, 5 * 10**6, 10**8])
def test_search_finds_a_boundary(peak: Any, budget: int) -> None:
    r = search_batch_size(peak, budget)
    n = r.max_batch_size
    assert n == 0 or (peak(n) <= budget and (r.capped or budget < peak(n + 1)))
    assert len(r.probes) == len(dict(r.probes)) <= 30  # each size asked once


def test_search_affine_takes_four_probes_and_caps() -> None:
    r = search_batch_size(lambda n: 1000 + 37 * n, 10_000, start=16)
    assert (r.max_batch_size, len(r.probes)) == (243, 4)
    assert r.to_json() == {
        "max_batch_size": 243,
        "peak_bytes_at_max": 9991,
        "probes": 4,
        "seconds": r.to_json()["seconds"],
        "smallest": 1,
        "approximate": False,
    }
    capped = search_batch_size(lambda n: n, 10**9, cap=1000)
    assert (capped.max_batch_size, capped.capped) == (1000, True)
    assert "stops at 1000" in capped.message
    none = search_batch_size(lambda n: 100 * n, 50)
    assert (none.max_batch_size, none.peak_bytes_at_max) == (0, None)
    assert "even batch size 1" in none.message


def test_probe_errors_name_the_batch_size() -> None:
    def peak(n: int) -> int:
        if n > 1:
            raise EstimationError("boom", op="aten.mm")
        return 1

    with pytest.raises(EstimationError, match="at batch size 8: boom") as info:
        search_batch_size(peak, 100)
    assert info.value.op == "aten.mm"


def test_the_search_starts_at_the_smallest_batch_the_step_accepts() -> None:
    def peak(n: int) -> int:  # fails below 4 (a model that needs a few samples per statistic)
        if n < 4:
            raise EstimationError(f"Expected more than {n} values")
        return 1000 + 37 * n

    r = search_batch_size(peak, 10_000, start=16, workers=1)
    assert (r.max_batch_size, r.smallest) == (243, 4)
    assert r.rejection == "Expected more than 1 values"
    assert "the step fails below batch size 4: Expected more than 1 values" in r.message
    assert str(r) == r.message
    with pytest.raises(EstimationError, match="at batch size 1: Expected more than 1 values"):
        search_batch_size(peak, 10_000, start=3, workers=1)  # fails at every size up to the second


# ---------------------------------------------------------------------- exact, and right on CPU


CASES = [
    ("cli_models:TinyConvNet", InputSpec(batch_size=8, shape=(3, 32, 32)), None),
    (
        "models:TinyGPT",
        InputSpec(batch_size=8, tokens=64, vocab=512),
        {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab": 512, "seq_len": 64},
    ),
]


@pytest.mark.parametrize(("spec", "inputs", "kwargs"), CASES, ids=["convnet", "tinygpt"])
def test_max_batch_size_against_estimator_and_ground_truth(
    spec: str, inputs: InputSpec, kwargs: dict[str, Any] | None
) -> None:
    case = build_case(spec, inputs, model_kwargs=kwargs)
    make = case_batch_maker(case)
    cfg = case.config

    def estimate(n: int) -> int:
        return estimate_step(
            case.model, make(n), loss_fn=cfg.loss_fn, optimizer=cfg.optimizer, precision=cfg.precision
        ).peak_bytes

    # A budget halfway between batch sizes 8 and 9: the answer is 8, with half a sample's bytes of slack
    # on either side for the measurement.
    budget = (estimate(8) + estimate(9)) // 2
    r = max_batch_size(case.model, make, budget, loss_fn=cfg.loss_fn, optimizer=cfg.optimizer, start=3)
    assert r.max_batch_size == 8
    assert r.peak_bytes_at_max is not None
    assert estimate(8) == r.peak_bytes_at_max <= budget < estimate(9)  # exact w.r.t. the estimator
    assert len(r.probes) <= 6
    # The meta batch estimates the same as the real one.
    assert estimate_case(build_case(spec, inputs, model_kwargs=kwargs)).peak_bytes == estimate(8)
    # Ground truth: real steps at 8 fit, at 9 do not.
    for n, fits in ((8, True), (9, False)):
        real = build_case(spec, InputSpec(n, inputs.shape, inputs.tokens, inputs.vocab), model_kwargs=kwargs)
        m = measure_case(real)
        assert (max(m.peak_bytes) <= budget) is fits, (n, m.peak_bytes, budget)


# ------------------------------------------------------------------------------------ the CLI


def _cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str
) -> tuple[int, str, str]:
    monkeypatch.chdir(TESTS)
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["max-batch-size", "cli_models:TinyMLP", "--input-shape", "16", "--memory-budget", "1MiB"]
    code, out, err = _cli(capsys, monkeypatch, *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    keys = {"max_batch_size", "peak_bytes_at_max", "probes", "seconds", "smallest", "approximate"}
    assert set(data) == keys
    assert data["peak_bytes_at_max"] <= 2**20 and data["max_batch_size"] > 8
    assert err == ""  # progress only on a terminal (tests/test_progress.py)
    code, out, _ = _cli(capsys, monkeypatch, *args)
    assert code == 0 and f"is {data['max_batch_size']} " in out


@pytest.mark.parametrize("size", ["ten", "1.5XB", "0", "-3MiB"])
def test_cli_bad_size_exits_2(
    size: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = _cli(
        capsys,
        monkeypatch,
        "max-batch-size",
        "cli_models:TinyMLP",
        "--input-shape",
        "16",
        f"--memory-budget={size}",
    )
    assert code == 2 and out == ""
    assert err.startswith("memest: error: argument --memory-budget: ") and err.count("\n") == 1


def test_cli_nothing_fits(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = _cli(
        capsys, monkeypatch, "max-batch-size", "cli_models:TinyMLP", "--input-shape", "16",
        "--memory-budget", "1KiB", "--json",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out) == {
        "max_batch_size": 0,
        "peak_bytes_at_max": None,
        "probes": 1,
        "seconds": json.loads(out)["seconds"],
        "smallest": 1,
        "approximate": False,
    }
    assert "even batch size 1 is over the memory budget" in err


_PARALLEL = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from lightning_memest.search import max_batch_size
from models import TinyGPT
model = TinyGPT(n_layers=2)
r = max_batch_size(
    model, lambda n: torch.empty(n, 128, dtype=torch.long, device="meta"), 300 * 2**20,
    optimizer=torch.optim.AdamW, workers=int(sys.argv[2]),
)
print(json.dumps({"max": r.max_batch_size, "peak": r.peak_bytes_at_max, "probes": [n for n, _ in r.probes]}))
"""


def test_probes_in_a_worker_process_give_the_same_answer() -> None:
    # In a fresh process (as the CLI runs) pairs of probes run at once, one in a forked worker.
    def run(workers: int) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-c", _PARALLEL, str(TESTS), str(workers)],
            capture_output=True,
            text=True,
            check=True,
        )
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    alone, paired = run(1), run(2)
    assert (paired["max"], paired["peak"]) == (alone["max"], alone["peak"])
    assert paired["probes"][:2] == [1, 8] and set(alone["probes"]) <= set(paired["probes"])


_FORKED_AFTER = """
import json, torch
from torch import nn
from lightning_memest import estimate_step
from lightning_memest.search import max_batch_size
from lightning_memest.search.worker import Worker
estimate_step(nn.Linear(8, 8), torch.randn(2, 8), optimizer=torch.optim.SGD)
worker = Worker(lambda n: n)
ready = worker.ready
worker.close()
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
batch = lambda n: torch.empty(n, 3, 16, 16, device="meta")
paired = max_batch_size(model, batch, 50 * 2**20, workers=2)
alone = max_batch_size(model, batch, 50 * 2**20, workers=1)
print(json.dumps([ready, [paired.max_batch_size, paired.peak_bytes_at_max],
                  [alone.max_batch_size, alone.peak_bytes_at_max]]))
"""


def test_a_worker_forked_after_a_simulation_runs_backward() -> None:
    # The engine settles autograd's device threads with a real CPU backward before the first fake one
    # (engine/autograd_threads.py), so a child forked after a simulation can run backward too: the
    # worker is ready, and probes in pairs give the answer of probes alone. In a fresh process: what
    # ran before in this one decides it.
    done = subprocess.run([sys.executable, "-c", _FORKED_AFTER], capture_output=True, text=True, check=True)
    ready, paired, alone = json.loads(done.stdout.strip().splitlines()[-1])
    assert ready
    assert paired == alone


def test_replayed_probes_give_the_same_search() -> None:
    # Each probe replays the decoder's repeated blocks: the same peaks, so the same probes and answer.
    import torch

    from tests.models import TinyGPT, lm_loss

    with torch.device("meta"):
        model = TinyGPT(n_layers=8, d_model=64, n_heads=4, vocab=100, seq_len=16)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.zeros(n, 16, dtype=torch.long, device="meta") for _ in range(2))  # type: ignore[return-value]

    import lightning_memest.search.batch_size as searching

    replays: list[object] = []
    simulate = searching.simulate

    def recorded(*args: object, **kwargs: object) -> object:
        sim = simulate(*args, **kwargs)  # type: ignore[arg-type]
        replays.append(sim.replayed_blocks)
        return sim

    kw: dict[str, object] = {"loss_fn": lm_loss, "optimizer": torch.optim.AdamW, "workers": 1}
    plain = max_batch_size(model, make, 8 * 2**20, **kw)  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(searching, "simulate", recorded)
        replayed = max_batch_size(model, make, 8 * 2**20, replay_blocks=True, **kw)  # type: ignore[arg-type]
    assert replays and all(r == (("blocks", 3),) for r in replays)
    assert plain.max_batch_size > 1
    assert (replayed.max_batch_size, replayed.probes) == (plain.max_batch_size, plain.probes)
