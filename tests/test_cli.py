"""The ``memest`` command line: errors, output shapes, and estimate against measurement on tiny models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_memest.cases as cases
import lightning_memest.cli.commands as commands
from lightning_memest.cases import InputSpec, build_case, build_model
from lightning_memest.cli import main
from lightning_memest.errors import EstimationError, SpecError

TESTS = Path(__file__).resolve().parent
MLP = ["cli_models:TinyMLP", "--input-shape", "16"]
CONV = ["cli_models:TinyConvNet", "--input-shape", "3,16,16"]
LM = ["cli_models:TinyLM", "--tokens", "12", "--vocab", "50"]
BREAKDOWN_KEYS = {
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "communication",
    "activations",
    "inputs",
    "temporaries",
    "other_tensors",
}


@pytest.fixture(autouse=True)
def _in_tests_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI imports MODEL from the current directory, as a user's `memest estimate mymodels:Net` would.
    monkeypatch.chdir(TESTS)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", "cli_modelz:Net", "--input-shape", "16"], "cannot import module 'cli_modelz'"),
        (["estimate", "cli_models:Nope", "--input-shape", "16"], "no attribute 'Nope'"),
        (["estimate", "cli_models", "--input-shape", "16"], "package.module:name"),
        (["estimate", "cli_models:NOT_CALLABLE", "--input-shape", "16"], "not an nn.Module class"),
        (["measure", "cli_models:not_a_model", "--input-shape", "16"], "did not build an nn.Module"),
        (["estimate", "cli_models:AN_INSTANCE", "--input-shape", "16"], "is a module instance"),
        (["estimate", "cli_models:TinyMLP", "--input-shape", "3,4,4"], "rejected an input of shape (8, 3,"),
        # Fake tensors have no values, so only the real step finds the token ids out of range.
        (["measure", "cli_models:TinyLM", "--tokens", "4", "--vocab", "500"], "index out of range"),
        (["estimate", *MLP, "--model-kwargs", '{"hidden": 3'], "--model-kwargs is not valid JSON"),
        (["estimate", *MLP, "--model-kwargs", "[3]"], "must be a JSON object"),
        (["estimate", *MLP, "--model-kwargs", '{"hiden": 3}'], "unexpected keyword argument 'hiden'"),
        (["estimate", *MLP, "--tokens", "4", "--vocab", "5"], "not allowed with argument --input-shape"),
        (["estimate", "cli_models:TinyMLP"], "one of the arguments --input-shape --tokens is required"),
        (["estimate", "cli_models:TinyLM", "--tokens", "4"], "--tokens needs --vocab"),
        (["estimate", *MLP, "--vocab", "4"], "--vocab goes with --tokens"),
        (["estimate", "cli_models:TinyMLP", "--input-shape", "4,x"], "comma-separated sizes"),
        (["estimate", "cli_models:TinyMLP", "--input-shape", "0"], "positive sizes"),
        (["estimate", *MLP, "--batch-size", "0"], "batch size must be at least 1"),
        (["estimate", *MLP, "--batch-size", "two"], "invalid int value"),
        (["estimate", *MLP, "--precision", "64-true"], "invalid choice: '64-true'"),
        (["estimate", *MLP, "--optimizer", "lion"], "invalid choice: 'lion'"),
        (["estimate", *MLP, "--device", "tpu"], "invalid choice: 'tpu'"),
        (["estimate", *MLP, "--loss", "mse"], "invalid choice: 'mse'"),
        (["compare", "cli_models:TinyMLP", "cli_models:Nope", "--input-shape", "16"], "no attribute 'Nope'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("memest: error: ")
    assert message in lines[0]
    assert "Traceback" not in err


def test_cross_entropy_needs_a_class_dimension(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "estimate", "torch.nn:Flatten", "--model-kwargs", '{"start_dim": 0}',
                       "--input-shape", "4")  # fmt: skip
    assert code == 2
    assert "--loss sum" in err and len(err.splitlines()) == 1


def test_estimation_error_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise EstimationError("no fake kernel", op="aten.frobnicate.default", module="net.1")

    monkeypatch.setattr(commands, "estimate_case", fail)
    code, _, err = run(capsys, "estimate", *MLP)
    assert code == 2
    assert err == "memest: error: no fake kernel (at op aten.frobnicate.default, module 'net.1')\n"


def test_unexpected_errors_are_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.delenv("MEMEST_DEBUG", raising=False)
    monkeypatch.setattr(commands, "measure_case", fail)
    code, _, err = run(capsys, "measure", *MLP)
    assert code == 1
    assert err.splitlines() == [
        "memest: error: unexpected RuntimeError: boom second line (set MEMEST_DEBUG=1 for the traceback)"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "measure", *MLP, "--device", "cuda")
    assert code == 2
    assert err.startswith("memest: error: ") and "CUDA" in err and len(err.splitlines()) == 1


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--help")
    assert code == 0
    assert "--input-shape" in out and "--model-kwargs" in out


# ------------------------------------------------------------------------------------------ outputs


def test_estimate_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "estimate", *CONV)
    assert set(data) == {
        "peak_bytes",
        "reserved_bytes",
        "cuda_context_bytes",
        "breakdown_bytes",
        "flops",
        "estimate_seconds",
        "gpu_memory",
        "data_dependent",
        "calibration",
        "approximate",
    }
    assert data["calibration"] is None and data["approximate"] is False  # not asked; CPU is not a what-if
    assert set(data["peak_bytes"]) == {"first_step", "steady_state"}
    assert all(type(v) is int and v > 0 for v in data["peak_bytes"].values())
    assert data["reserved_bytes"] is None  # CPU: no caching allocator
    assert set(data["breakdown_bytes"]) == BREAKDOWN_KEYS
    assert all(type(v) is int and v >= 0 for v in data["breakdown_bytes"].values())
    assert set(data["flops"]) == {"forward", "backward", "optimizer"}
    assert data["flops"]["forward"] > 0 and data["flops"]["backward"] > 0
    assert isinstance(data["estimate_seconds"], float)
    assert data["data_dependent"] is None  # the step read no tensor values


def test_measure_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "measure", *LM)
    assert set(data) == {"peak_bytes", "reserved_bytes", "step_seconds"}
    assert set(data["peak_bytes"]) == {"first_step", "steady_state"}
    assert all(type(v) is int and v > 0 for v in data["peak_bytes"].values())
    assert data["reserved_bytes"] is None
    assert isinstance(data["step_seconds"], float)


def test_readable_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "estimate", *CONV, "--optimizer", "sgd")
    assert code == 0, err
    assert "peak, first step" in out and "peak, steady state" in out
    assert "activations" in out and "KiB" in out
    assert "features.1 (BatchNorm2d)" in out  # the module that saves the most
    code, out, err = run(capsys, "measure", *CONV, "--optimizer", "sgd")
    assert code == 0, err
    assert "peak, steady state" in out and "one step took" in out


@pytest.mark.parametrize(
    "argv",
    [
        MLP,
        [*CONV, "--optimizer", "sgd", "--batch-size", "4"],
        [*LM, "--optimizer", "adamw"],
        [*MLP, "--loss", "sum", "--optimizer", "none"],
        [*MLP, "--precision", "bf16-mixed"],
        [*MLP, "--precision", "bf16-true"],
        [*MLP, "--precision", "16-true"],
        ["cli_models:make_mlp", "--model-kwargs", '{"hidden": 40}', "--input-shape", "4,4"],
    ],
    ids=[
        "mlp-adam",
        "conv-sgd",
        "lm-adamw",
        "mlp-sum-none",
        "mlp-bf16-mixed",
        "mlp-bf16-true",
        "mlp-16-true",
        "factory",
    ],
)
def test_estimate_matches_measurement_within_1_percent(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    # Calibrated: the kernels of this machine, so that it holds on any CPU (with native bf16 or not).
    est = run_json(capsys, "estimate", *argv, "--calibrate")["peak_bytes"]
    real = run_json(capsys, "measure", *argv)["peak_bytes"]
    for key in ("first_step", "steady_state"):
        assert est[key] == pytest.approx(real[key], rel=0.01), (key, est, real)


def test_compare_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "compare", *MLP[:1], "cli_models:make_mlp", *MLP[1:], "--optimizer", "sgd")
    assert code == 0, err
    assert "[1/2] estimating cli_models:TinyMLP" in err and "[2/2] measuring cli_models:make_mlp" in err
    assert "cli_models:TinyMLP" in out and "steady" in out and "%" in out
    rows = run_json(capsys, "compare", *MLP, "--optimizer", "sgd")
    assert [row["model"] for row in rows] == ["cli_models:TinyMLP"]
    row = rows[0]
    assert set(row) == {
        "model",
        "estimated_bytes",
        "measured_bytes",
        "error_percent",
        "estimate_seconds",
        "step_seconds",
        "data_dependent",
    }
    assert row["data_dependent"] is None
    for key in ("first_step", "steady_state"):
        expected = (
            100 * (row["estimated_bytes"][key] - row["measured_bytes"][key]) / row["measured_bytes"][key]
        )
        assert row["error_percent"][key] == pytest.approx(expected, abs=1e-3)


def test_compare_says_when_the_step_branched_on_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    # Fake tensors have no values: `if h.mean().item() > 0` takes the assumed (0.0) branch, skipping a
    # layer the real step runs -- the estimate is far off, and compare must say why where it is read.
    # (Once per simulated step: two.)
    args = ["compare", "cli_models:BranchesOnValue", "--input-shape", "16", "--batch-size", "4"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "note: cli_models:BranchesOnValue read tensor values 2 time(s)" in out
    row = run_json(capsys, *args)[0]
    assert row["data_dependent"] == [
        {"op": "aten._local_scalar_dense.default", "module": "", "assumed": "0.0", "count": 2}
    ]
    assert row["error_percent"]["first_step"] < -10  # the skipped layer's memory is missing


def _console_script() -> str | None:
    found = shutil.which("memest")
    if found:
        return found
    # Where pip puts scripts: next to the interpreter, the scheme's scripts dir, or the user scheme's
    # (a user install, when site-packages is not writable), which need not be on PATH.
    dirs = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    dirs.append(Path(sysconfig.get_path("scripts", f"{os.name}_user")))
    for scripts in dirs:
        if (scripts / "memest").is_file():
            return str(scripts / "memest")
    return None


def test_console_script_runs() -> None:
    script = _console_script()
    if script is None:
        pytest.skip("the memest console script is not installed (pip install -e .)")
    # A fresh process from the tests directory: the installed entry point, cwd on the import path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [script, "compare", *MLP, "--json"], cwd=TESTS, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows[0]["model"] == "cli_models:TinyMLP"
    assert all(abs(v) < 1 for v in rows[0]["error_percent"].values())
    # Progress lines only: the profiler's own logging is silenced.
    assert all(line.startswith("memest: [1/1] ") for line in proc.stderr.splitlines()), proc.stderr


# ------------------------------------------------------------------------------------------ cases.py


def test_weights_none_is_passed_to_factories_that_take_weights() -> None:
    assert type(build_model("cli_models:pretrained_by_default")).__name__ == "TinyMLP"
    with pytest.raises(SpecError, match="would download"):
        build_model("cli_models:pretrained_by_default", {"weights": "IMAGENET"})


def test_torchvision_spec() -> None:
    model = build_model("torchvision.models:resnet18")
    assert type(model).__name__ == "ResNet"


def test_building_a_case_leaves_the_model_as_it_was() -> None:
    # The output-shape probe runs a forward: caches it sets and buffers it updates are undone.
    conv = build_case("cli_models:TinyConvNet", InputSpec(batch_size=2, shape=(3, 8, 8)))
    buffers = dict(conv.model.named_buffers())
    assert int(buffers["features.1.num_batches_tracked"]) == 0
    assert torch.equal(buffers["features.1.running_mean"], torch.zeros(8))
    caching = build_case("cli_models:CachingMLP", InputSpec(batch_size=2, shape=(16,)))
    assert "cache" not in vars(caching.model)


def test_cases_are_seeded() -> None:
    a = build_case("cli_models:TinyLM", InputSpec(batch_size=2, tokens=5, vocab=50))
    b = build_case("cli_models:TinyLM", InputSpec(batch_size=2, tokens=5, vocab=50))
    assert all(torch.equal(x, y) for x, y in zip(a.batch, b.batch, strict=True))
    assert torch.equal(a.model.get_parameter("embed.weight"), b.model.get_parameter("embed.weight"))
    assert a.batch[1].shape == (2, 5) and int(a.batch[1].max()) < 50


def test_a_forward_that_reads_values_falls_back_to_a_real_probe() -> None:
    # `.item()` cannot be answered on fake tensors; the shape comes from a real two-row forward.
    class ReadsValues(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = 1.0 if x.sum().item() > -1e9 else 2.0
            return super().forward(x) * scale

    model = ReadsValues(4, 3)
    assert cases.output_shape(model, torch.randn(6, 4)) == (6, 3)


# ------------------------------------------------------------------------------------------- profile


def test_profile_by_node_and_by_module(capsys: pytest.CaptureFixture[str]) -> None:
    profile = run_json(capsys, "profile", *MLP)
    assert {"fwd_in", "fwd_tmp", "fwd_out", "bwd_tmp", "bwd_out", "fwd_flops", "bwd_flops"} <= set(
        profile["nodes"][0]
    )
    modules = run_json(capsys, "profile", *MLP, "--by", "module", "--sort", "saved", "--top", "2")
    assert len(modules) == 2 and modules[0]["saved_bytes"] >= modules[1]["saved_bytes"]
    code, out, err = run(capsys, "profile", *MLP, "--top", "3")
    assert code == 0 and "fwd_in" in out and "bwd FLOPs" in out
    code, out, err = run(capsys, "profile", *MLP, "--sort", "nope")
    assert code == 2 and err.startswith("memest: error: --sort") and len(err.strip().splitlines()) == 1
