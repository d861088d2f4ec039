"""The model summary as a user sees it: a real ``Trainer.fit`` in a fresh process, with and without rich
installed, read from the console (stdout and stderr), never from the package's loggers.

Exactly one summary table, ours (Lightning's columns, the estimate's, and the estimate below), whatever
else is passed: a ``ModelSummary``, a ``RichModelSummary``, ``enable_model_summary=False``.
"""

from __future__ import annotations

import os
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
    assert headers[-3:] == ["Saved for bwd", "Fwd FLOPs/step", "Bwd FLOPs/step"], headers
    assert "FLOPs" not in headers  # Lightning's forward-only column gives way to the estimate's
    assert "layer.0" in console  # MemEstimate(max_depth=2) is honoured
    # The style: Rich where Lightning would pick it or the user passed RichModelSummary; plain where
    # rich is missing or the user passed the plain ModelSummary.
    plain = not rich or extra == "ModelSummary"
    assert ("┃" in console) is not plain
    if plain:
        # Where Lightning's plain summary goes: its logger's console handler (stderr).
        assert "Saved for bwd" in proc.stderr
    else:
        assert "Saved for bwd" in proc.stdout


def test_without_rich_lightning_itself_has_no_rich() -> None:
    # The environment is what it claims: with rich hidden, RichModelSummary cannot even be built.
    proc = _fit(False, "RichModelSummary")
    assert proc.returncode != 0
    assert "requires `rich` to be installed" in proc.stderr
