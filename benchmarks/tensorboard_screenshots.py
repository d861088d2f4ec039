"""Regenerate the TensorBoard pictures in docs/ from a real run of the main example, as a browser shows it.

    python benchmarks/tensorboard_screenshots.py                  # trains examples/train_classifier.py
    python benchmarks/tensorboard_screenshots.py --logdir DIR     # or shoots an existing run

Serves the run with a real TensorBoard (``tensorboard --logdir``) and writes:

* ``docs/tensorboard_charts.png``: the Custom Scalars tab, estimate against measurement;
* ``docs/tensorboard_tables.png``: the Text tab, the breakdown at each peak and the top layers;
* ``docs/tensorboard_hparams.png``: the HParams tab, the memest metrics beside the module's hparams;
* ``docs/timeline.png``: the timeline figure, the image TensorBoard serves for the last step.

Needs a Chromium (``apt-get install --no-install-recommends chromium``) for the first three.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tensorboard_server import TensorBoardServer, chromium, screenshot  # noqa: E402

DOCS = ROOT / "docs"
#: (file, page, window size): TensorBoard's own settings (smoothing 0.6, outliers ignored), as a
#: user first sees it.
PAGES = (
    ("tensorboard_charts.png", "#custom_scalars", (1400, 760)),
    ("tensorboard_tables.png", "#text", (1400, 1000)),
    ("tensorboard_hparams.png", "#hparams", (2200, 330)),
)


def train(workdir: Path) -> Path:
    """The main example's run (resnet18 on FakeData, CPU), its logs under ``workdir``."""
    env = {**os.environ, "KINETO_LOG_LEVEL": "6"}
    command = [sys.executable, str(ROOT / "examples" / "train_classifier.py")]  # as the README runs it
    subprocess.run(command, cwd=workdir, env=env, check=True)
    return workdir / "lightning_logs"


def measured_run(tb: TensorBoardServer) -> str | None:
    runs = tb.get("/data/plugin/scalars/tags")
    return next((run for run in runs if run.endswith("/memest/measured")), None)


def save_timeline(tb: TensorBoardServer, run: str, out: Path) -> None:
    images = tb.get("/data/plugin/images/images", run=run, tag="memest/timeline")
    out.write_bytes(tb.read("/data/plugin/images/individualImage?" + images[-1]["query"]))


def shoot(logdir: Path) -> None:
    tb = TensorBoardServer.start(logdir)
    if tb is None:
        raise SystemExit("tensorboard did not start")
    with tb:
        if not tb.wait_for(lambda: measured_run(tb) is not None):
            raise SystemExit(f"no measured memest run under {logdir}")
        measured = measured_run(tb)
        assert measured is not None
        run = measured.removesuffix("/memest/measured")
        save_timeline(tb, run, DOCS / "timeline.png")
        print(f"wrote {DOCS / 'timeline.png'}")
        if chromium() is None:
            print("no chromium installed: the TensorBoard pages were not shot", file=sys.stderr)
            return
        for name, page, (width, height) in PAGES:
            screenshot(tb.url("/") + page, DOCS / name, width, height)
            print(f"wrote {DOCS / name}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--logdir", type=Path, help="an existing run's log directory (default: train one)")
    args = parser.parse_args()
    if args.logdir is not None:
        shoot(args.logdir)
        return
    with tempfile.TemporaryDirectory(prefix="memest-screenshots-") as workdir:
        shoot(train(Path(workdir)))


if __name__ == "__main__":
    main()
