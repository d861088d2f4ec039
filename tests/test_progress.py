"""Progress of long commands, as a person at a terminal sees it: ``memest`` in a fresh process with its
stderr on a pseudo-terminal (with and without rich installed), and silent where nobody watches
(``--json``, or stderr not a terminal)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
NO_RICH = TESTS / "no_rich"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _memest_on_a_terminal(*argv: str, rich: bool = True) -> tuple[int, str, str]:
    """Run ``python -m lightning_memest.cli ARGV`` with stderr on a terminal: (status, stdout, what the
    terminal showed, escape sequences removed)."""
    env = dict(os.environ, COLUMNS="120", TERM="xterm")
    if not rich:
        env["PYTHONPATH"] = os.pathsep.join([str(NO_RICH), *filter(None, [os.environ.get("PYTHONPATH")])])
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_memest.cli", *argv],
        cwd=TESTS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=terminal,
        text=True,
    )
    os.close(terminal)
    shown = bytearray()

    def read() -> None:  # drain the terminal as it writes, so that the child never blocks on it
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    out, _ = proc.communicate(timeout=300)
    reader.join(timeout=10)
    os.close(controller)
    return proc.returncode, out, ANSI.sub("", shown.decode(errors="replace"))


MODELS = ["compare", "cli_models:TinyMLP", "cli_models:make_mlp", "--input-shape", "16", "--optimizer", "sgd"]


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_compare_shows_its_progress_on_a_terminal(rich: bool) -> None:
    code, out, shown = _memest_on_a_terminal(*MODELS, rich=rich)
    assert code == 0, shown
    assert "estimating cli_models:TinyMLP" in shown and "measuring cli_models:make_mlp" in shown, shown
    assert "cli_models:make_mlp" in out and "steady" in out  # the table on stdout, untouched
    if not rich:
        assert "memest: [2/2] measuring cli_models:make_mlp" in shown  # the plain line: which, stage


def test_max_batch_size_shows_each_probe_on_a_terminal() -> None:
    argv = ["max-batch-size", "cli_models:TinyMLP", "--input-shape", "16", "--memory-budget", "64MiB"]
    code, out, shown = _memest_on_a_terminal(*argv, rich=False)
    assert code == 0, shown
    assert re.search(r"searching: batch size \d+ needs [\d.]+ \w+ \((fits|over)\)", shown), shown
    assert "the largest batch size within 64.00 MiB" in out


def test_no_progress_under_json_even_on_a_terminal() -> None:
    code, out, shown = _memest_on_a_terminal(*MODELS, "--json")
    assert code == 0
    assert shown == ""
    assert len(out.splitlines()) == 1  # one JSON value


def test_no_progress_when_stderr_is_not_a_terminal() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_memest.cli", *MODELS],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
