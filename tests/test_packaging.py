"""What ``pip install`` ships: the package with its ``py.typed`` marker (PEP 561), so that users' type
checkers read its annotations; and what importing it costs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_py_typed(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    # Built from a copy: setuptools writes its build folders beside the sources.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "lightning_memest", source / "lightning_memest",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
               "-w", str(tmp_path / "dist"), "-q"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_memest/py.typed" in names
    assert "lightning_memest/cli/progress.py" in names


def test_lightning_is_imported_only_for_the_callbacks() -> None:
    # Importing Lightning takes seconds: `memest` and estimate_step do without it, the callbacks bring it.
    code = """
import sys
import lightning_memest, lightning_memest.cli
assert not [m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning")], "imported"
from lightning_memest import FitBatchSize, MemEstimate
import lightning.pytorch as pl
assert issubclass(MemEstimate, pl.Callback) and issubclass(FitBatchSize, pl.Callback)
assert {"FitBatchSize", "MemEstimate"} <= set(dir(lightning_memest))
assert lightning_memest.MemEstimate is MemEstimate
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
