"""The model summary as a user sees it: a real ``Trainer.fit`` in a fresh process, with and without rich
installed, read from the console (stdout and stderr), never from the package's loggers.

Exactly one summary table, ours (Lightning's columns, the estimate's, and the estimate below), whatever
else is passed: a ``ModelSummary``, a ``RichModelSummary``, ``enable_model_summary=False``. And the main
example's first screen at 80 columns, with and without rich, its progress bar on: no header cut, no
figure wrapped, the progress bar never across the table.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
NO_RICH = TESTS / "no_rich"  # a sitecustomize that makes rich uninstalled for the process

#: (rich installed, what summary_fit.py passes beside MemEstimate)
RUNS = [
    (False, None),
    (False, "ModelSummary"),
    (True, None),
    (True, "RichModelSummary"),
    (True, "ModelSummary"),
    (True, "no-summary"),
]


def _fit(rich: bool, extra: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")  # Rich's table on one line per row, as in a wide terminal
    path = [str(NO_RICH)] if not rich else []
    env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])
    command = [sys.executable, str(TESTS / "summary_fit.py"), *([extra] if extra else [])]
    return subprocess.run(command, cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def consoles() -> dict[tuple[bool, str | None], subprocess.CompletedProcess[str]]:
    # The fits are independent processes: run them side by side.
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = pool.map(lambda run: _fit(*run), RUNS)
        return dict(zip(RUNS, done, strict=True))


def _headers(console: str) -> list[str]:
    """The column names of the summary table, plain (``Name | Type``) or Rich (``┃ Name ┃ Type``)."""
    for line in console.splitlines():
        for sep in ("┃", "|"):
            cells = [c.strip() for c in line.split(sep)]
            if "Name" in cells and "Type" in cells:
                return [c for c in cells if c]
    raise AssertionError(f"no summary table in:\n{console}")


@pytest.mark.parametrize(("rich", "extra"), RUNS)
def test_one_summary_table_with_the_estimate(
    consoles: dict[tuple[bool, str | None], subprocess.CompletedProcess[str]], rich: bool, extra: str | None
) -> None:
    proc = consoles[(rich, extra)]
    assert proc.returncode == 0, proc.stderr
    console = proc.stdout + proc.stderr
    assert console.count("Trainable params") == 1, console  # one table
    assert console.count("Estimated peak memory, first step (cpu)") == 1, console
    assert "Estimated peak memory, steady state" in console
    assert "At the steady-state peak: parameters" in console
    headers = _headers(console)
    assert [h.split()[0] for h in headers[-3:]] == ["Saved", "Fwd", "Bwd"], headers
    assert re.fullmatch(r"Saved [KMG]?i?B", headers[-3]) and headers[-1].endswith("FLOP"), headers
    assert "a saved tensor counts for the layer that" in " ".join(console.split())  # the footnote
    assert "FLOPs" not in headers  # Lightning's forward-only column gives way to the estimate's
    assert "layer.0" in console  # MemEstimate(max_depth=2) is honoured
    # The style: Rich where Lightning would pick it or the user passed RichModelSummary; plain where
    # rich is missing or the user passed the plain ModelSummary.
    plain = not rich or extra == "ModelSummary"
    assert ("┃" in console) is not plain
    if plain:
        # Where Lightning's plain summary goes: its logger's console handler (stderr).
        assert headers[-3] in proc.stderr
    else:
        assert headers[-3] in proc.stdout


def test_without_rich_lightning_itself_has_no_rich() -> None:
    # The environment is what it claims: with rich hidden, RichModelSummary cannot even be built.
    proc = _fit(False, "RichModelSummary")
    assert proc.returncode != 0
    assert "requires `rich` to be installed" in proc.stderr


# ------------------------------------------------------------------------ the main example, 80 columns

ROOT = TESTS.parent
UNIT = r"(?:B|KiB|MiB|GiB|TiB|[KMGTP]?FLOP)\b"


def _example(rich: bool) -> subprocess.CompletedProcess[str]:
    """``python examples/train_classifier.py`` in a terminal 80 columns wide (stdout and stderr in one
    stream, in the order a terminal shows them), its progress bar on."""
    env = dict(os.environ, COLUMNS="80", KINETO_LOG_LEVEL="6")
    path = [str(NO_RICH)] if not rich else []
    env["PYTHONPATH"] = os.pathsep.join([*path, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    command = [sys.executable, "examples/train_classifier.py", "--steps", "2"]
    # Bytes: text mode would turn the bar's carriage returns into line breaks.
    done = subprocess.run(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600
    )
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), None)


@pytest.fixture(scope="module")
def narrow() -> dict[bool, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip((True, False), pool.map(_example, (True, False)), strict=True))


def _screen(output: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in output.split("\n")]


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_the_example_at_80_columns(narrow: dict[bool, subprocess.CompletedProcess[str]], rich: bool) -> None:
    proc = narrow[rich]
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = _screen(proc.stdout)
    top = next(i for i, line in enumerate(lines) if re.search(r"[┃|] +Name +[┃|]", line))
    end = next(i for i in range(top, len(lines)) if lines[i].endswith("2 x MACs of one training step."))
    shown = lines[top : end + 1]
    assert all(len(line) <= 80 for line in shown), "\n".join(line for line in shown if len(line) > 80)
    # Every header whole, on one line: none cut ("FLOPs/st…"), none folded onto a second header line.
    headers = [h.strip() for h in re.split(r"[┃|]", lines[top]) if h.strip()]
    assert headers == ["Name", "Type", "Params", "Mode", "Saved MiB", "Fwd GFLOP", "Bwd GFLOP"], lines[top]
    assert not any("…" in line for line in shown)
    # The layer's row is one line, each cell a whole number in the header's unit.
    row = next(line for line in shown if " model " in line and "ResNet" in line)
    assert re.search(r"[│|] +\d+\.\d\d +[│|] +\d+\.\d\d +[│|] +\d+\.\d\d *[│|]?$", row), row
    # No figure is parted from its unit by a line break.
    for a, b in itertools.pairwise(shown):
        assert not (re.search(r"\d$", a) and re.match(rf" *{UNIT}", b)), (a, b)
    assert "(a saved tensor counts for the layer that made it:" in " ".join(" ".join(shown).split())
    # The progress bar is never across the table: nothing of it on the screen above the table's
    # header, down to the check after training.
    assert not [line for line in lines[:top] if "Epoch" in line or "it/s" in line], lines[:top]
    assert not any("it/s" in line for line in shown)
    # And the check after training, within 80 columns too.
    check = next(i for i, line in enumerate(lines) if line.startswith("MemEstimate (cpu, 32-true), 2 steps:"))
    assert all(len(line) <= 80 for line in lines[check : check + 5]), lines[check : check + 5]
    assert re.match(
        r"  step 2: estimated [\d.]+ MiB, measured [\d.]+ MiB \([+-]\d+\.\d\d %\)$", lines[check + 2]
    )
