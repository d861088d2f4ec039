"""A real TensorBoard server over a log directory, read the way its web app reads it, and a headless
Chromium to look at its pages where one is installed. For the tests and for
``benchmarks/tensorboard_screenshots.py``.

The server is ``tensorboard --logdir DIR --port 0`` in a subprocess (its default data server, the one
users get); its port is read from the line it prints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardServer", "chromium", "screenshot"]

_SERVING = re.compile(r"TensorBoard \S+ at http://[^:/]+:(\d+)/")


class TensorBoardServer:
    """``with TensorBoardServer.start(logdir) as tb: tb.get("/data/plugin/scalars/tags")``."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process, self.port, self._log = process, port, log

    @classmethod
    def start(cls, logdir: Path, timeout: float = 60.0) -> TensorBoardServer | None:
        """The server, once it serves; ``None`` where it cannot start (not installed, no port)."""
        log = Path(tempfile.mkstemp(prefix="tensorboard-", suffix=".log")[1])
        command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", "0"]
        with log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            found = _SERVING.search(log.read_text(errors="replace"))
            if found:
                return cls(process, int(found.group(1)), log)
            time.sleep(0.2)
        process.kill()
        process.wait()
        return None

    def url(self, route: str = "/", **params: str) -> str:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return f"http://localhost:{self.port}{route}{query}"

    def read(self, route: str, **params: str) -> bytes:
        with urllib.request.urlopen(self.url(route, **params), timeout=30) as response:
            return bytes(response.read())

    def get(self, route: str, **params: str) -> Any:
        return json.loads(self.read(route, **params))

    def post(self, route: str, body: dict[str, Any]) -> Any:
        """A JSON POST, as the HParams dashboard sends its requests."""
        request = urllib.request.Request(
            self.url(route), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def wait_for(self, ready: Callable[[], bool], timeout: float = 60.0) -> bool:
        """Until ``ready()`` (the data server loads the event files in the background)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(0.5)
        return False

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.unlink(missing_ok=True)

    def __enter__(self) -> TensorBoardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chromium() -> str | None:
    """A Chromium or Chrome executable, where one is installed."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(url: str, out: Path, width: int = 1400, height: int = 800, wait_ms: int = 15000) -> None:
    """A PNG of ``url`` as a headless Chromium draws it (``wait_ms`` of page time for its requests)."""
    browser = chromium()
    if browser is None:
        raise RuntimeError("no chromium installed")
    command = [
        browser,
        "--headless=new",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        f"--virtual-time-budget={wait_ms}",
        f"--screenshot={out}",
        url,
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    if not out.exists():
        raise RuntimeError(f"chromium wrote no screenshot of {url}")
