"""The ``memest`` command line: errors, output shapes, and estimate against measurement on tiny models."""

from __future__ import annotations

import json
import os
import re
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
import lightning_memest.cli.parser as parser_module
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
    "workspaces",
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
        # Token ids beyond the vocabulary, positions beyond the position table: rejected before any
        # run, with the real step's reason (estimate and measure alike).
        (["measure", "cli_models:TinyLM", "--tokens", "4", "--vocab", "500"], "index out of range"),
        (["estimate", "cli_models:TinyLM", "--tokens", "4", "--vocab", "500"],
         "the token ids (0 .. 499) index embed.weight (aten.embedding), which has 50 rows: the real step "
         "fails with IndexError: index out of range in self"),
        (["estimate", "cli_models:PositionalLM", "--tokens", "17", "--vocab", "50"],
         "torch.arange (0 .. 16) index pos.weight (aten.embedding), which has 16 rows"),
        (["estimate", *MLP, "--model-kwargs", '{"hidden": 3'], "--model-kwargs is not valid JSON"),
        (["estimate", *MLP, "--model-kwargs", "[3]"], "must be a JSON object"),
        (["estimate", *MLP, "--model-kwargs", '{"hiden": 3}'], "unexpected keyword argument 'hiden'"),
        (["estimate", *MLP, "--tokens", "4", "--vocab", "5"], "not allowed with argument --input-shape"),
        (["estimate", "cli_models:TinyMLP"], "one of the arguments --input-shape --tokens is required"),
        (["estimate", "cli_models:TinyLM", "--tokens", "4"], "--tokens needs --vocab"),
        (["estimate", *MLP, "--vocab", "4"], "--vocab goes with --tokens"),
        (["estimate", "cli_models:TinyMLP", "--input-shape", "4,x"], "comma-separated sizes"),
        (["estimate", "cli_models:TinyMLP", "--input-shape", "0"], "positive sizes"),
        # Every number a flag takes is checked as it is parsed.
        (["estimate", *MLP, "--batch-size", "0"], "argument --batch-size: must be at least 1; got 0"),
        (["estimate", *MLP, "--batch-size", "-3"], "argument --batch-size: must be at least 1"),
        (["estimate", "cli_models:TinyLM", "--tokens", "0", "--vocab", "5"], "argument --tokens: must be"),
        (["estimate", "cli_models:TinyLM", "--tokens", "3", "--vocab", "0"], "argument --vocab: must be"),
        (["estimate", *MLP, "--strategy", "ddp", "--world-size", "0"], "argument --world-size: must be"),
        (["estimate", *MLP, "--strategy", "ddp", "--world-size", "-2"], "argument --world-size: must be"),
        (["estimate", *MLP, "--strategy", "ddp", "--world-size", "2", "--bucket-cap-mb", "-5"],
         "argument --bucket-cap-mb: must be a number more than 0"),
        (["estimate", *MLP, "--strategy", "ddp", "--world-size", "2", "--bucket-cap-mb", "nan"],
         "argument --bucket-cap-mb: must be a number more than 0"),
        (["estimate", *MLP, "--bucket-cap-mb", "5"], "--bucket-cap-mb goes with --strategy ddp"),
        (["estimate", *MLP, "--strategy", "ddp", "--world-size", "2", "--fsdp-keep-unsharded"],
         "--fsdp-keep-unsharded goes with --strategy fsdp"),
        (["estimate", *MLP, "--device", "cuda", "--cuda-capability", "9"], "must look like 9.0"),
        (["estimate", *MLP, "--device", "cuda", "--gpu-memory", "5x"], "argument --gpu-memory: a size"),
        (["max-batch-size", *MLP, "--memory-budget", "-1"], "argument --memory-budget: a size"),
        (["max-batch-size", *MLP, "--memory-budget", "1GiB", "--max-batch-size", "0"],
         "argument --max-batch-size: must be at least 1"),
        (["profile", *MLP, "--top", "-1"], "argument --top: must be at least 0"),
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
    # MODEL is code that runs: the help says so.
    assert "MODEL is imported and called: it runs that code" in " ".join(out.split())


# ------------------------------------------------------- hostile input, through the real command


def memest(*argv: str, cwd: Path = TESTS, script: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_memest.cli ARGV`` (or the console ``script``) in a fresh process, from
    ``cwd``, as a user runs it."""
    command = [script] if script else [sys.executable, "-m", "lightning_memest.cli"]
    env = {k: v for k, v in os.environ.items() if k != "MEMEST_DEBUG"}
    return subprocess.run([*command, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_usage_error(proc: subprocess.CompletedProcess[str], message: str) -> None:
    """What a user sees of a bad input: exit 2, nothing on stdout, one short line on stderr."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("memest: error: ") and message in lines[0], lines[0]
    assert len(lines[0]) < 300  # a pasted number is not repeated in full


HUGE = "1" + "0" * 25  # past int64: torch failed on it with "unexpected TypeError ... Overflow" (exit 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", *MLP, "--batch-size", HUGE],
         "argument --batch-size: must be at most 2147483647 (2**31-1, a tensor dimension)"),
        (["max-batch-size", *MLP, "--memory-budget", "1GiB", "--batch-size", HUGE],
         "argument --batch-size: must be at most 2147483647"),
        (["max-batch-size", *MLP, "--memory-budget", "1GiB", "--max-batch-size", HUGE],
         "argument --max-batch-size: must be at most 2147483647"),
        (["estimate", "cli_models:TinyLM", "--tokens", HUGE, "--vocab", "50"],
         "argument --tokens: must be at most 2147483647 (2**31-1, a tensor dimension)"),
        (["estimate", "cli_models:TinyLM", "--tokens", "4", "--vocab", HUGE],
         "argument --vocab: must be at most"),
        (["estimate", "cli_models:TinyMLP", "--input-shape", f"4,{HUGE}"],
         "argument --input-shape: each size must be at most 2147483647"),
        (["estimate", *MLP, "--strategy", "fsdp", "--world-size", HUGE],
         "argument --world-size: must be at most 65536 (2**16 ranks)"),
        (["profile", *MLP, "--top", HUGE], "argument --top: must be at most 2147483647"),
        (["estimate", *MLP, "--strategy", "ddp", "--world-size", "2", "--bucket-cap-mb", "1e308"],
         "argument --bucket-cap-mb: must be at most 1048576 (1 TiB)"),
        (["estimate", *MLP, "--device", "cuda", "--cuda-capability", f"{HUGE}.0"],
         "argument --cuda-capability: MAJOR and MINOR must be at most 99"),
        (["estimate", *MLP, "--device", "cuda", "--gpu-memory", "1e30"],
         "argument --gpu-memory: must be at most 1024TiB (1152921504606846976 bytes)"),
        (["max-batch-size", *MLP, "--memory-budget", "1e300"],
         "argument --memory-budget: must be at most 1024TiB"),
        # Past Python's 4300 digits int() refuses; the message does not repeat the 5000.
        (["estimate", *MLP, "--batch-size", "9" * 5000], "argument --batch-size: invalid int value: '9999"),
    ],
)  # fmt: skip
def test_huge_numbers_are_usage_errors(argv: list[str], message: str) -> None:
    assert_usage_error(memest(*argv), message)


@pytest.mark.parametrize(
    ("argv", "limit"),
    [
        (["estimate", "m:M", "--input-shape", "4", "--batch-size", "{}"], 2**31 - 1),
        (["estimate", "m:M", "--vocab", "5", "--tokens", "{}"], 2**31 - 1),
        (["estimate", "m:M", "--tokens", "4", "--vocab", "{}"], 2**31 - 1),
        (["estimate", "m:M", "--input-shape", "3,{}"], 2**31 - 1),
        (["estimate", "m:M", "--input-shape", "4", "--strategy", "ddp", "--world-size", "{}"], 2**16),
        (["max-batch-size", "m:M", "--input-shape", "4", "--memory-budget", "1", "--max-batch-size", "{}"],
         2**31 - 1),
        (["profile", "m:M", "--input-shape", "4", "--top", "{}"], 2**31 - 1),
    ],
)  # fmt: skip
def test_each_limit_is_the_largest_value_taken(
    capsys: pytest.CaptureFixture[str], argv: list[str], limit: int
) -> None:
    parser = parser_module.build_parser()
    parser.parse_args([a.format(limit) for a in argv])
    with pytest.raises(SystemExit):
        parser.parse_args([a.format(limit + 1) for a in argv])
    assert f"must be at most {limit}" in capsys.readouterr().err


def test_deeply_nested_model_kwargs_are_a_spec_error(capsys: pytest.CaptureFixture[str]) -> None:
    too_deep = "--model-kwargs is nested too deep: at most 100 levels of arrays and objects"
    # Through the command (one argument holds at most 128 KiB on Linux): past the JSON parser's
    # recursion limit, the RecursionError was "unexpected" (exit 1).
    assert_usage_error(memest("estimate", *MLP, "--model-kwargs", "[" * 60_000 + "]" * 60_000), too_deep)
    assert_usage_error(memest("estimate", *MLP, "--model-kwargs", '{"a":' * 20_000 + "1" + "}" * 20_000),
                       too_deep)  # fmt: skip
    # In-process, 10**5 deep; and at the limit (parsed, then rejected by the model) and one past it.
    for text, message in [
        ('{"a":' * 100_000 + "1" + "}" * 100_000, too_deep),
        ('{"a":' * 101 + "1" + "}" * 101, too_deep),
        ('{"a":' * 100 + "1" + "}" * 100, "unexpected keyword argument 'a'"),
    ]:
        code, out, err = run(capsys, "estimate", *MLP, "--model-kwargs", text)
        assert (code, out) == (2, "") and len(err.splitlines()) == 1 and message in err, err[:300]


def test_the_current_directory_never_shadows_an_installed_package(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    # A project directory with a torchvision.py of its own (that must not be imported) beside the model.
    (tmp_path / "torchvision.py").write_text(
        "raise ImportError('the torchvision.py of the cwd was imported')\n"
    )
    (tmp_path / "mymodel.py").write_text(
        "import torchvision\n"
        "from torchvision.ops import MLP\n\n"
        "assert torchvision.__file__.endswith('__init__.py'), torchvision.__file__\n\n"
        "def Net():\n"
        "    return MLP(4, [8, 2])\n"
    )
    argv = ["estimate", "mymodel:Net", "--input-shape", "4", "--json"]
    procs = [memest(*argv, cwd=tmp_path)]  # python -m put the directory first: moved last
    script = _console_script()
    if script is not None:
        procs.append(memest(*argv, cwd=tmp_path, script=script))  # memest: the directory appended
    for proc in procs:
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["peak_bytes"]["first_step"] > 0


# ------------------------------------------------------------------------------------------ outputs


def test_estimate_replay_blocks_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Replay on by default, the blocks replayed said; --no-replay-blocks: the same figures, every block
    simulated."""
    gpt = ["models:TinyGPT", "--tokens", "12", "--vocab", "50"]
    gpt += [
        "--model-kwargs",
        json.dumps({"n_layers": 7, "d_model": 32, "n_heads": 2, "vocab": 50, "seq_len": 12}),
    ]
    plain = run_json(capsys, "estimate", *gpt, "--no-replay-blocks")
    replayed = run_json(capsys, "estimate", *gpt)
    assert run_json(capsys, "estimate", *gpt, "--replay-blocks")["replayed_blocks"] == {"blocks": 2}
    assert plain["replayed_blocks"] is None
    assert replayed["replayed_blocks"] == {"blocks": 2}
    for data in (plain, replayed):
        del data["estimate_seconds"], data["replayed_blocks"], data["replay_note"]
    assert replayed == plain
    code, out, err = run(capsys, "estimate", *gpt)
    assert code == 0, err
    assert "replayed blocks per step: 2 of blocks" in out


def test_estimate_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "estimate", *CONV)
    assert {
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
    } <= set(data)
    assert data["calibration"] is None and data["approximate"] is False  # not asked; CPU is not a what-if
    assert set(data["peak_bytes"]) == {"first_step", "steady_state"}
    assert all(type(v) is int and v > 0 for v in data["peak_bytes"].values())
    assert data["reserved_bytes"] is None  # CPU: no caching allocator
    assert set(data["breakdown_bytes"]) == BREAKDOWN_KEYS
    assert all(type(v) is int and v >= 0 for v in data["breakdown_bytes"].values())
    assert set(data["flops"]) == {"forward", "backward", "optimizer", "other"}
    assert data["flops"]["forward"] > 0 and data["flops"]["backward"] > 0 and data["flops"]["other"] > 0
    assert isinstance(data["estimate_seconds"], float)
    assert data["data_dependent"] is None  # the step read no tensor values


def test_the_json_holds_every_figure_the_table_prints(capsys: pytest.CaptureFixture[str]) -> None:
    # Each figure of the readable estimate, found in the JSON of the same estimate: the peaks, the
    # breakdown (in the summary's words on the table, field names in the JSON), where the peak is, the
    # modules saving the most, and every FLOP figure (elementwise included).
    from lightning_memest.report import format_bytes, human_flops

    code, out, err = run(capsys, "estimate", *CONV)
    assert code == 0, err
    data = run_json(capsys, "estimate", *CONV)
    assert "optimizer state" in out and "other tensors" in out and "optimizer_state" not in out
    for role, n in data["breakdown_bytes"].items():
        assert re.search(rf"^    {role.replace('_', ' ')} +{re.escape(format_bytes(n))}$", out, re.M), role
    at = data["peak_at"]
    assert f"({at['op']} in {at['module']}, {at['phase']})" in out
    assert data["top_saved_modules"], data
    for m in data["top_saved_modules"]:
        line = f"{m['module']} ({m['type']})"
        assert re.search(rf"^    {re.escape(line)} +{re.escape(format_bytes(m['saved_bytes']))}$", out, re.M)
    for key, label in (("forward", "forward"), ("backward", "backward"), ("other", "other (elementwise)")):
        figure = re.escape(human_flops(data["flops"][key]))
        assert re.search(rf"^    {re.escape(label)} +{figure}$", out, re.M), key


def test_max_batch_size_names_the_input_not_a_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    # --batch-size is where the search starts, not the answer: the heading names one row's input.
    code, out, err = run(capsys, "max-batch-size", *MLP, "--memory-budget", "1MiB")
    assert code == 0, err
    heading = out.splitlines()[0]
    assert heading.startswith("max batch size of cli_models:TinyMLP (rows of 16, "), heading
    assert "batch 8" not in heading


def test_measure_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "measure", *LM)
    assert set(data) == {"peak_bytes", "reserved_bytes", "step_seconds", "loop", "approximate"}
    assert data["loop"] == "train"
    assert data["approximate"] is False  # measured for real
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


@pytest.mark.parametrize(
    "argv",
    [
        [*CONV, "--loop", "validate", "--batch-size", "32"],
        [*CONV, "--loop", "predict", "--batch-size", "32", "--precision", "bf16-mixed"],
        [*LM, "--loop", "predict"],
        [*MLP, "--loop", "validate", "--precision", "bf16-true"],
    ],
    ids=["conv-validate", "conv-predict-bf16-mixed", "lm-predict", "mlp-validate-bf16-true"],
)
def test_loops_match_measurement_within_1_percent(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """``--loop validate|predict``: one batch in eval mode, without gradients, estimated against the real
    batch (inference_mode keeps composite ops such as conv2d whole: the simulation decomposes them
    as the real run does)."""
    est = run_json(capsys, "estimate", *argv, "--calibrate")
    real = run_json(capsys, "measure", *argv)
    assert est["loop"] == real["loop"] == argv[argv.index("--loop") + 1]
    assert est["peak_bytes"]["steady_state"] == pytest.approx(real["peak_bytes"]["steady_state"], rel=0.01)
    at_peak = est["breakdown_bytes"]
    assert at_peak["gradients"] == at_peak["optimizer_state"] == at_peak["activations"] == 0
    assert est["flops"]["forward"] > 0 and not est["flops"]["backward"]
    code, out, _ = run(capsys, "estimate", *argv)
    assert code == 0 and "batch in eval mode" in out and "steady state" not in out, out


def test_compare_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "compare", *MLP[:1], "cli_models:make_mlp", *MLP[1:], "--optimizer", "sgd")
    assert code == 0, err
    assert err == ""  # progress only where a person watches (tests/test_progress.py)
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
        "approximate",
        "error",
    }
    assert row["data_dependent"] is None and row["error"] is None and row["approximate"] is False
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
        {
            "op": "aten._local_scalar_dense.default",
            "module": "",
            "exact": False,
            "assumed": "0.0",
            "bound": False,  # a neutral answer: it could have lowered the estimate
            "count": 2,
        }
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
    # Nothing on stderr: no progress for --json (nor off a terminal), the profiler's chatter silenced.
    assert proc.stderr == ""


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
    assert cases.output_shape(model, InputSpec(batch_size=6, shape=(4,))) == (6, 3)


def test_nothing_of_the_batch_is_real_until_a_real_step(capsys: pytest.CaptureFixture[str]) -> None:
    # The command at 100 times its batch (6 TB of input, more than any machine has): the
    # estimate answers, because the input is never made; the class ids are too many to follow.
    data = run_json(capsys, "estimate", "torchvision.models:resnet18", "--input-shape", "3,224,224",
                    "--batch-size", "10000000")  # fmt: skip
    assert data["breakdown_bytes"]["inputs"] >= 10**7 * 3 * 224 * 224 * 4
    case = build_case("cli_models:TinyLM", InputSpec(batch_size=10**7, tokens=12, vocab=50))
    assert all(t.device.type == "meta" for t in case.estimate_batch)  # beyond what the engine follows
    small = build_case("cli_models:TinyLM", InputSpec(batch_size=2, tokens=5, vocab=50))
    # Small integer inputs are real for the estimate, with the values the real step gets.
    assert all(torch.equal(a, b) for a, b in zip(small.estimate_batch, small.batch, strict=True))


def test_max_batch_size_starts_at_the_smallest_batch_the_step_accepts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # BatchNorm in training rejects one sample per channel: the search starts at 2 instead of failing.
    args = ["max-batch-size", "cli_models:BatchNormMLP", "--input-shape", "16", "--memory-budget", "64MiB"]
    data = run_json(capsys, *args)
    assert data["smallest"] == 2 and data["max_batch_size"] > 2 and data["approximate"] is False
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "the step fails below batch size 2" in out and "Expected more than 1 value per channel" in out


def test_max_batch_size_takes_the_documented_cuda_capability(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "max-batch-size", *MLP, "--memory-budget", "64MiB", "--device", "cuda",
                    "--cuda-capability", "9.0")  # fmt: skip
    assert data["max_batch_size"] > 0
    assert data["approximate"] is not torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a what-if is what a machine without a GPU answers")
def test_every_json_says_whether_it_is_approximate(capsys: pytest.CaptureFixture[str]) -> None:
    cuda = ["--device", "cuda"]
    assert run_json(capsys, "estimate", *MLP, *cuda)["approximate"] is True
    assert run_json(capsys, "profile", *MLP, *cuda)["approximate"] is True
    assert run_json(capsys, "profile", *MLP, *cuda, "--by", "module")["approximate"] is True
    assert run_json(capsys, "max-batch-size", *MLP, *cuda, "--memory-budget", "64MiB")["approximate"] is True
    assert run_json(capsys, "estimate", *MLP)["approximate"] is False
    assert run_json(capsys, "profile", *MLP)["approximate"] is False


def test_compare_keeps_every_result_when_a_model_fails(capsys: pytest.CaptureFixture[str]) -> None:
    # TinyLM takes the token ids; TinyMLP cannot (its input is 16 floats): its row says so, the
    # others keep their figures, and the command succeeds.
    models = ["cli_models:TinyLM", "cli_models:TinyMLP", "cli_models:PositionalLM"]
    args = ["compare", *models, "--tokens", "12", "--vocab", "50", "--optimizer", "sgd"]
    rows = run_json(capsys, *args)
    assert [row["model"] for row in rows] == models
    good, bad, positional = rows
    assert good["error"] is None and good["measured_bytes"] is not None
    assert positional["error"] is None and positional["estimated_bytes"] is not None
    assert bad["error"].startswith("estimating failed: the model rejected an input of shape (8, 12)")
    assert bad["estimated_bytes"] is None and bad["measured_bytes"] is None
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "cli_models:TinyMLP                  estimating failed: the model rejected" in out
    assert out.count("steady") == 2  # the two models that ran


def test_compare_fails_only_when_every_model_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "compare", "cli_models:TinyLM", "cli_models:TinyMLP", "--tokens", "4",
                         "--vocab", "500", "--json")  # fmt: skip
    assert code == 2
    rows = json.loads(out)
    assert all(row["error"] for row in rows)
    assert err == "memest: error: every model failed (see each row)\n"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.startswith("memest 0.") and "lightning " in out
    assert f"(torch {torch.__version__}," in out  # read without importing torch, its +cu/+cpu tag kept


# ------------------------------------------------------------------------------------------ startup

#: Run in a fresh process: what answers without torch (or Lightning), and the package's lazy names.
TORCH_FREE = """
import json, sys
from lightning_memest.cli import main

def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "pytorch_lightning"))

for argv, expected in json.loads(sys.argv[1]):
    code = main(argv)
    assert code == expected, f"memest {' '.join(argv)} exited {code}"
    assert not heavy(), f"memest {' '.join(argv)} imported {heavy()[:3]}"
import lightning_memest
assert not heavy(), f"import lightning_memest imported {heavy()[:3]}"
assert set(lightning_memest.__all__) <= set(dir(lightning_memest))
from lightning_memest import StepEstimate, estimate_step
from lightning_memest.report import StepEstimate as defined
assert StepEstimate is defined and lightning_memest.estimate_step is estimate_step
for name in set(lightning_memest.__all__) - {"FitBatchSize", "MemEstimate"}:  # those: test_packaging
    getattr(lightning_memest, name)
try:
    lightning_memest.nope
except AttributeError:
    pass
else:
    raise AssertionError("lightning_memest.nope")
"""


def test_help_version_and_usage_errors_import_no_torch() -> None:
    # Importing torch takes seconds (benchmarks/cli_startup.py times it): memest answers these without.
    runs = [
        (["--help"], 0),
        (["estimate", "--help"], 0),
        (["max-batch-size", "--help"], 0),
        (["--version"], 0),
        (["estimate"], 2),
        (["bogus"], 2),
        (["estimate", *MLP, "--batch-size", HUGE], 2),
        (["estimate", *MLP, "--precision", "64-true"], 2),
        (["estimate", "cli_models:TinyMLP"], 2),
    ]
    proc = subprocess.run([sys.executable, "-c", TORCH_FREE, json.dumps(runs)], cwd=TESTS,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "usage: memest" in proc.stdout and "memest: error: " in proc.stderr
    # And `python -m lightning_memest.cli --help` (its __main__) the same: no torch among its imports.
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_memest.cli", "--help"],
                          cwd=TESTS, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "usage: memest" in proc.stdout, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "lightning_memest.cli.parser" in imported and "torch" not in imported


def test_the_parser_s_choices_are_the_library_s() -> None:
    # One definition each, in lightning_memest.constants (torch-free, for the parser); where the
    # library still spells one itself, it must say the same.
    from lightning_memest import constants, fx, search
    from lightning_memest.engine import inference_step, step
    from lightning_memest.engine.parallel import distributed
    from lightning_memest.report import tables

    assert step.PRECISIONS == constants.PRECISIONS
    assert (cases.LOSSES, cases.OPTIMIZERS) == (constants.LOSSES, constants.OPTIMIZERS)
    assert (cases.DEFAULT_BATCH_SIZE, cases.DEFAULT_LOSS, cases.DEFAULT_OPTIMIZER) == (
        constants.DEFAULT_BATCH_SIZE, constants.DEFAULT_LOSS, constants.DEFAULT_OPTIMIZER
    )  # fmt: skip
    assert distributed.STRATEGIES == constants.STRATEGIES
    assert inference_step.LOOPS == constants.LOOPS
    assert search.DEFAULT_CAP == constants.DEFAULT_CAP
    assert fx.NODE_ORDERS == constants.NODE_ORDERS and tables.MODULE_ORDERS == constants.MODULE_ORDERS


# ------------------------------------------------------------------------------------------- profile


def test_profile_by_node_and_by_module(capsys: pytest.CaptureFixture[str]) -> None:
    profile = run_json(capsys, "profile", *MLP)
    assert {"fwd_in", "fwd_tmp", "fwd_out", "bwd_tmp", "bwd_out", "fwd_flops", "bwd_flops"} <= set(
        profile["nodes"][0]
    )
    data = run_json(capsys, "profile", *MLP, "--by", "module", "--sort", "saved", "--top", "2")
    assert set(data) == {"modules", "device", "precision", "approximate"}
    modules = data["modules"]
    assert len(modules) == 2 and modules[0]["saved_bytes"] >= modules[1]["saved_bytes"]
    code, out, err = run(capsys, "profile", *MLP, "--top", "3")
    assert code == 0 and "fwd_in" in out and "bwd FLOPs" in out
    # --top N without --sort: the N that save the most, not the first N in graph order.
    every = run_json(capsys, "profile", *MLP, "--sort", "saved")["nodes"]
    top = run_json(capsys, "profile", *MLP, "--top", "1")["nodes"]
    assert [n["name"] for n in top] == [every[0]["name"]], (top, every)
    assert every[0]["name"] != run_json(capsys, "profile", *MLP)["nodes"][0]["name"]  # not graph order
    modules = run_json(capsys, "profile", *CONV, "--by", "module", "--top", "1")["modules"]
    saved = run_json(capsys, "profile", *CONV, "--by", "module", "--sort", "saved")["modules"]
    assert modules == saved[:1]
    code, out, err = run(capsys, "profile", *MLP, "--sort", "nope")
    assert code == 2 and err.startswith("memest: error: --sort") and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------- plan

_PLANNED = (
    "models:TinyGPT",
    "--model-kwargs",
    '{"n_layers": 6, "d_model": 64, "vocab": 256, "seq_len": 32}',
    "--tokens",
    "32",
    "--vocab",
    "256",
    "--batch-size",
    "8",
)


def test_plan_prints_the_plan_and_its_json_holds_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """``memest plan``: the table of checkpointed modules and the peaks before and after (the command,
    in a fresh process); ``--json`` the same plan, whose peak is the re-simulated estimate's and within
    the budget; where nothing fits, a note on stderr and the floor."""
    peak = run_json(capsys, "estimate", *_PLANNED)["peak_bytes"]["steady_state"]
    budget = str(peak - peak // 5)
    proc = memest("plan", *_PLANNED, "--budget", budget)
    assert proc.returncode == 0, proc.stderr
    assert "checkpointing" in proc.stdout and "within the budget" in proc.stdout
    assert "blocks.0" in proc.stdout and "(re-simulated)" in proc.stdout
    data = run_json(capsys, "plan", *_PLANNED, "--budget", budget, "--kinds", "full")
    assert data["fits"] and data["peak_bytes"]["before"] == peak
    assert data["peak_bytes"]["after"] == data["estimate"]["peak_bytes"]["steady_state"] <= int(budget)
    assert {m["kind"] for m in data["modules"]} == {"full"} and data["recompute_flops"] > 0
    code, out, err = run(capsys, "plan", *_PLANNED, "--budget", "1MiB")
    assert code == 0 and "no checkpointing of these modules fits" in err
    assert "nothing fits: every candidate checkpointed in full peaks at" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here measures the context")
def test_a_what_ifs_cuda_context_is_said_to_be_assumed_unless_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "estimate", *MLP, "--device", "cuda")
    assert code == 0, err
    assert re.search(r"^  CUDA context \(assumed\) +512\.00 MiB", out, re.M), out
    assert "--cuda-context SIZE sets it" in out
    data = run_json(capsys, "estimate", *MLP, "--device", "cuda")
    assert (data["cuda_context_bytes"], data["context_bytes_assumed"]) == (512 * 2**20, True)
    given = run_json(capsys, "estimate", *MLP, "--device", "cuda", "--cuda-context", "1.5GiB")
    assert (given["cuda_context_bytes"], given["context_bytes_assumed"]) == (3 * 2**29, False)
    assert given["peak_bytes"] == data["peak_bytes"]
    code, out, err = run(capsys, "estimate", *MLP, "--device", "cuda", "--cuda-context", "1.5GiB")
    assert "(assumed)" not in out and re.search(r"^  CUDA context +1\.50 GiB", out, re.M), out
    assert run_json(capsys, "estimate", *MLP)["context_bytes_assumed"] is None  # (CPU)


def test_plan_of_a_compiled_step_offers_the_compilers_budget_and_it_fits_as_measured() -> None:
    # A compiled step over its budget: `plan --compile` offers the highest activation_memory_budget
    # whose re-simulated step fits, and the step compiled under it measures within the budget and
    # within 1 % of what was offered (the compiler's recompute is not a formula: each value simulated).
    case = ["cli_models:Net", "--input-shape", "64,128", "--batch-size", "8", "--loss", "sum"]
    case += ["--optimizer", "adamw"]
    proc = memest("estimate", *case, "--compile", "--json")
    assert proc.returncode == 0, proc.stderr
    estimate = json.loads(proc.stdout)
    assert estimate["compiled"] == [""] and estimate["compiled_eagerly"] is None, estimate
    assert estimate["compiled_graphs"], estimate
    peak = max(estimate["peak_bytes"].values())
    budget = peak - 1
    proc = memest("plan", *case, "--compile", "--budget", str(budget), "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["compiled_budget"]
    assert found["baseline_peak_bytes"] == peak, found
    value, trials = found["value"], found["trials"]
    assert value is not None and 0 < value < 1 and trials[-1]["value"] == value, found
    assert all(t["peak_bytes"] > budget for t in trials[:-1]), found  # every value above it missed
    proc = memest("compare", *case, "--compile", "--activation-memory-budget", str(value), "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)[0]
    assert max(row["estimated_bytes"].values()) == found["peak_bytes"], (row, found)  # the same simulation
    assert max(row["measured_bytes"].values()) <= budget, (row, budget)
    assert all(abs(row["error_percent"][key]) <= 1.0 for key in ("first_step", "steady_state")), row
    assert_usage_error(memest("estimate", *case, "--activation-memory-budget", "0.5"), "needs --compile")
