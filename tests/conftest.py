"""Session-wide settings: calibrated kernel memory goes to a fresh cache directory of this test session
(inherited by subprocesses), never to the user's cache, and starts cold as on a new machine."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache() -> Iterator[None]:
    before = os.environ.get("MEMEST_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="memest-cache-") as directory:
        os.environ["MEMEST_CACHE_DIR"] = directory
        yield
    if before is None:
        os.environ.pop("MEMEST_CACHE_DIR", None)
    else:
        os.environ["MEMEST_CACHE_DIR"] = before
