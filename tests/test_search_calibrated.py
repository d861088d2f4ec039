"""The batch-size search with the kernels calibrated on this machine (search/calibration.py and
accounting/kernels/batch_fit.py): the fit on hand-made calibrations, the search's protocol with a peak
model that prepares and shares, and the answer against the CPU allocator's ground truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_memest.accounting import PeakProfile
from lightning_memest.accounting.kernels.batch_fit import Anchor, BatchFit
from lightning_memest.accounting.kernels.model import KernelMemory
from lightning_memest.cases import InputSpec, build_case, case_batch_maker, estimate_case, measure_case
from lightning_memest.cli import main
from lightning_memest.search import max_batch_size, search_batch_size
from lightning_memest.search.calibration import anchor_sizes

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


class DilatedConvNet(nn.Module):
    """Convolutions whose CPU kernels hold workspaces of their own (strided, dilated, 1x1), batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=4, dilation=4),
            nn.ReLU(),
            nn.Conv2d(64, 128, 1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


# ------------------------------------------------------------------------------------------ the fit


def _conv(n: int) -> str:
    return f"aten.convolution_backward.default|cpu|no_grad|T({n}, 64, 8, 8)({64 * 64}, 64, 8, 1)float32;[64]"


_WEIGHT = "aten.addmm.default|cpu|T(10)(1,)float32;T(64, 10)(10, 1)float32"


def test_fit_follows_each_signature_on_its_line() -> None:
    a = Anchor(4, (_conv(4), _WEIGHT), {_conv(4): KernelMemory(1000 + 4 * 256), _WEIGHT: KernelMemory(77)})
    b = Anchor(8, (_conv(8), _WEIGHT), {_conv(8): KernelMemory(1000 + 8 * 256), _WEIGHT: KernelMemory(77)})
    fit = BatchFit.of(a, b)
    assert fit.at(_WEIGHT, 100) == (True, KernelMemory(77))  # the same signature at every size
    assert fit.at(_conv(100), 100) == (True, KernelMemory(1000 + 100 * 256))  # on the line
    assert fit.at(_conv(100), 99) == (False, None)  # the numbers of batch 100 are not batch 99's
    assert fit.at(_conv(100).replace("float32", "bfloat16"), 100) == (False, None)  # another skeleton
    # Beyond the anchors a workspace may bend upwards: the bound allows it; at an anchor it is exact.
    bound = fit.workspace_bound(_conv(100), 100, per_sample=64 * 64 * 4)
    assert bound == 1000 + 8 * 256 + (100 - 8) * 64 * 64 * 4  # from batch 8, a sample's bytes a sample
    assert fit.workspace_bound(_conv(8), 8) is None
    # A measurement at a probe's size is a point of the line: next door is fitted from it, and
    # between two measurements the chord is the figure (and its bound).
    fit.add(_conv(100), 100, KernelMemory(60_000))
    assert fit.at(_conv(100), 100) == (True, KernelMemory(60_000))
    assert fit.at(_conv(101), 101) == (True, KernelMemory(round(60_000 + (60_000 - 3048) / 92)))
    chord = round(3048 + (60_000 - 3048) * 42 / 92)
    assert fit.at(_conv(50), 50) == (True, KernelMemory(chord))
    assert fit.workspace_bound(_conv(50), 50) == chord


def test_fit_pairs_the_calls_of_two_steps_in_order() -> None:
    # One step runs an op the other does not (a data-dependent branch): the rest still pair up.
    extra = "aten.nonzero_static.default|cpu|T(3)(1,)int64"
    a = Anchor(2, (_conv(2), _WEIGHT), {_conv(2): KernelMemory(512), _WEIGHT: None})
    b = Anchor(4, (extra, _conv(4), _WEIGHT), {extra: None, _conv(4): KernelMemory(1024), _WEIGHT: None})
    fit = BatchFit.of(a, b)
    assert fit.at(_conv(6), 6) == (True, KernelMemory(1536))
    assert fit.at(_WEIGHT, 6) == (True, None)
    with pytest.raises(ValueError, match="different batch sizes"):
        BatchFit.of(a, a)


def test_anchor_sizes_avoid_a_batch_of_one() -> None:
    assert [anchor_sizes(n) for n in (1, 2, 3, 8, 64)] == [(2, 4), (2, 4), (2, 3), (4, 8), (32, 64)]


# ----------------------------------------------------------------------------- the search's protocol


class _Prepared:
    """A peak model that knows two sizes before the search probes anything."""

    def __init__(self, peak: Any) -> None:
        self.peak = peak
        self.asked: list[int] = []

    def __call__(self, n: int) -> int:
        self.asked.append(n)
        return int(self.peak(n))

    def prepare(self) -> tuple[dict[int, PeakProfile], bool]:
        return {n: PeakProfile(self.peak(n), ()) for n in (4, 8)}, True

    def share(self) -> object:
        return None

    def receive(self, shared: Any) -> None:
        pass

    def finish(self, answer: int | PeakProfile) -> int | PeakProfile:
        return answer


def test_search_starts_from_the_prepared_sizes() -> None:
    model = _Prepared(lambda n: 1000 + 37 * n)
    r = search_batch_size(model, 10_000, start=8, low=4)
    assert (r.max_batch_size, r.smallest, r.rejection) == (243, 4, None)
    assert [n for n, _ in r.probes] == [4, 8, 243, 244] and model.asked == [243, 244]
    # The lower prepared size is over the budget: the search looks below it, from 1.
    small = _Prepared(lambda n: 1000 + 3000 * n)
    r = search_batch_size(small, 10_000, start=8, low=4)
    assert r.max_batch_size == 3 and 1 in dict(r.probes)


_SHARING = r"""
import json
from lightning_memest.search import search_batch_size

class Sharing:
    # The worker's answers are off by one until finish() corrects them here, and it answers only with
    # what share() sent it.
    def __init__(self):
        self.token, self.finished, self.in_worker = None, 0, False
    def __call__(self, n):
        if self.in_worker and self.token != "fit":
            raise RuntimeError("nothing shared")
        return 1000 + 37 * n + (1 if self.in_worker else 0)
    def prepare(self):
        return {}, True
    def share(self):
        return "fit"
    def receive(self, shared):
        self.token, self.in_worker = shared, True
    def finish(self, answer):
        self.finished += 1
        return answer - 1

for workers in (2, 1):  # a worker first: nothing here runs backward, so it can always be forked
    model = Sharing()
    r = search_batch_size(model, 10_000, workers=workers)
    print(json.dumps({"max": r.max_batch_size, "peaks": sorted(r.probes), "finished": model.finished}))
"""


def test_worker_gets_what_is_shared_and_its_answers_are_finished_here() -> None:
    done = subprocess.run([sys.executable, "-c", _SHARING], capture_output=True, text=True, check=True)
    paired, alone = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert alone["finished"] == 0 and paired["finished"] >= 1
    assert (paired["max"], paired["peaks"]) == (alone["max"], alone["peaks"])


# ------------------------------------------------------------------------ against the ground truth


_SPEC = "test_search_calibrated:DilatedConvNet"
_INPUT = InputSpec(batch_size=8, shape=(3, 32, 32))

_SEARCH = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from lightning_memest.cases import InputSpec, build_case, case_batch_maker
from lightning_memest.search import max_batch_size
case = build_case("test_search_calibrated:DilatedConvNet", InputSpec(8, shape=(3, 32, 32)), optimizer="adam")
r = max_batch_size(case.model, case_batch_maker(case), int(sys.argv[2]), loss_fn=case.config.loss_fn,
                   optimizer=case.config.optimizer, calibrate=True, workers=2)
print(json.dumps({"max": r.max_batch_size, "peak": r.peak_bytes_at_max, "probes": len(r.probes)}))
"""


def test_calibrated_search_is_right_at_its_answer() -> None:
    # The budget sits between batch sizes 40 and 41 as calibration measures them in full: far beyond
    # the calibrated sizes (4 and 8), where the search's kernels are fitted, and measured where the
    # fit could move the peak.
    case = build_case(_SPEC, _INPUT, optimizer="adam")
    cfg = case.config

    def calibrated(n: int) -> int:
        return estimate_case(
            build_case(_SPEC, InputSpec(n, _INPUT.shape), optimizer="adam"), calibrate=True
        ).peak_bytes

    budget = (calibrated(40) + calibrated(41)) // 2
    r = max_batch_size(
        case.model, case_batch_maker(case), budget, loss_fn=cfg.loss_fn, optimizer=cfg.optimizer,
        calibrate=True, workers=1,
    )  # fmt: skip
    assert r.calibration is not None and r.calibration.anchors == (4, 8)
    n, peak = r.max_batch_size, r.peak_bytes_at_max
    assert n > 8 and peak is not None and [m for m, _ in r.probes][:2] == [4, 8]
    # Ground truth: real steps at the answer, measured by the CPU allocator's events.
    measured = max(measure_case(build_case(_SPEC, InputSpec(n, _INPUT.shape), optimizer="adam")).peak_bytes)
    assert abs(peak - measured) <= measured / 1000, (n, peak, measured)
    # In a fresh process the probes go in pairs, the worker's fitted and finished here: the same answer.
    done = subprocess.run(
        [sys.executable, "-c", _SEARCH, str(TESTS), str(budget)], capture_output=True, text=True, check=True
    )
    paired = json.loads(done.stdout.strip().splitlines()[-1])
    assert (paired["max"], paired["peak"]) == (n, peak)


def test_cli_calibrate(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(TESTS)
    args = [
        "max-batch-size",
        "cli_models:TinyConvNet",
        "--input-shape",
        "3,32,32",
        "--memory-budget",
        "20MiB",
    ]
    assert main([*args, "--calibrate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["calibration"]["anchors"] == [4, 8] and data["max_batch_size"] > 8
    assert main([*args, "--calibrate"]) == 0
    assert "kernels calibrated at batch sizes 4 and 8" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA what-if needs a machine without a GPU")
def test_a_what_if_has_nothing_to_calibrate() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    r = max_batch_size(
        model, lambda n: torch.empty(n, 64, device="meta"), 2**24, device="cuda", calibrate=True, workers=1
    )
    assert r.approximate and r.calibration is not None and r.calibration.anchors is None
    assert r.calibration.measured == 0 and r.max_batch_size > 8
