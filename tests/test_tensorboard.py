"""What a user sees of MemEstimate in TensorBoard: a real ``Trainer.fit`` on CPU with a
``TensorBoardLogger``, read back through a real TensorBoard server's data routes (the requests its
dashboards make), and, where Chromium is installed, a page as the browser draws it."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from tensorboard_server import TensorBoardServer, chromium, screenshot
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import MemEstimate
from lightning_memest.adapter.loggers.scalars import lightning_logs_now, logging_step
from lightning_memest.adapter.loggers.timeline import PHASE_COLOURS, timeline_figure
from lightning_memest.adapter.step_peaks import StepPeaks
from lightning_memest.engine.events import Phase

MIB = 2**20
RUN = "tb/version_0"
ESTIMATE, MEASURED = f"{RUN}/memest/simulated", f"{RUN}/memest/measured"


class Tiny(pl.LightningModule):
    """A small MLP under AdamW (whose per-parameter ops outnumber the passes'), logging its batch index."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.log("batch_idx", float(batch_idx))  # which batch Lightning logged at each step
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g))
        return DataLoader(data, batch_size=8)


def fit(
    root: Path,
    callbacks: list[Any],
    logger: TensorBoardLogger | None = None,
    module: pl.LightningModule | None = None,
    **kwargs: Any,
) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=kwargs.pop("max_steps", 4),
        log_every_n_steps=kwargs.pop("log_every_n_steps", 1),
        callbacks=callbacks,
        logger=logger or TensorBoardLogger(root, name="tb", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module or Tiny())


@dataclass(frozen=True)
class Run:
    logdir: Path
    memest: MemEstimate


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    logdir = tmp_path_factory.mktemp("tb")
    memest = MemEstimate(max_depth=0)
    fit(logdir, [memest])
    assert len(memest.measured) == 2
    return Run(logdir, memest)


@pytest.fixture(scope="module")
def tb(run: Run) -> Iterator[TensorBoardServer]:
    server = TensorBoardServer.start(run.logdir)
    if server is None:
        pytest.skip("tensorboard could not start")
    with server:
        loaded = server.wait_for(lambda: MEASURED in server.get("/data/plugin/scalars/tags"))
        assert loaded, "the server never served the measured run"
        yield server


def series(tb: TensorBoardServer, run: str, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one scalar, as the scalars dashboard reads it."""
    return [(int(step), value) for _, step, value in tb.get("/data/plugin/scalars/scalars", run=run, tag=tag)]


def test_scalars_are_in_mib_with_the_unit_in_the_tag(run: Run, tb: TensorBoardServer) -> None:
    tags = tb.get("/data/plugin/scalars/tags")
    memest_tags = {tag for tags_of_run in tags.values() for tag in tags_of_run if tag.startswith("memest/")}
    assert memest_tags == {
        "memest/peak_MiB",
        "memest/first_step/peak_MiB",
        "memest/error_pct",
        "memest/GFLOP_per_batch/forward",
        "memest/GFLOP_per_batch/backward",
    }
    measured = [m.peak_bytes / MIB for m in run.memest.measured]
    # The first batch's peaks are a series of their own: what only the first step makes (the
    # optimizer's state) would be averaged with the steady state by a chart's smoothing.
    assert [v for _, v in series(tb, MEASURED, "memest/first_step/peak_MiB")] == pytest.approx(measured[:1])
    assert [v for _, v in series(tb, MEASURED, "memest/peak_MiB")] == pytest.approx(measured[1:])
    estimate = run.memest.estimate
    assert estimate is not None and estimate.flops is not None
    first = series(tb, ESTIMATE, "memest/first_step/peak_MiB")
    assert [v for _, v in first] == pytest.approx([run.memest.measured[0].estimated_bytes / MIB])
    # The estimate of every later logged batch: the second's, then the steady state's for the others.
    estimated = [run.memest.measured[1].estimated_bytes / MIB] + [estimate.steady_state.bytes / MIB] * 2
    assert [v for _, v in series(tb, ESTIMATE, "memest/peak_MiB")] == pytest.approx(estimated)
    forward = series(tb, RUN, "memest/GFLOP_per_batch/forward")
    assert forward[-1][1] == pytest.approx(estimate.flops.forward / 1e9)


def test_estimate_and_measurement_are_two_runs_on_one_chart(run: Run, tb: TensorBoardServer) -> None:
    # TensorBoard colours lines by run: the two series are two runs of one tag.
    tags = tb.get("/data/plugin/scalars/tags")
    for tag in ("memest/peak_MiB", "memest/first_step/peak_MiB"):
        assert tag in tags[ESTIMATE] and tag in tags[MEASURED]
    # The steady state's estimate a line over the training (every logged step after the first: 3), its
    # measurement the second batch; the first step one point of each.
    assert len(series(tb, ESTIMATE, "memest/peak_MiB")) == 3
    assert len(series(tb, MEASURED, "memest/peak_MiB")) == 1
    assert len(series(tb, ESTIMATE, "memest/first_step/peak_MiB")) == 1
    layout = tb.get("/data/plugin/custom_scalars/layout")
    charts = {chart["title"]: chart["multiline"]["tag"] for chart in layout["category"][0]["chart"]}
    # one chart: the steady state's series and the first step's, each a run's
    assert charts["peak allocated (MiB): estimate vs measured"] == ["^memest/(first_step/)?peak_MiB$"]
    assert "estimate error (%)" in charts


def test_measured_points_are_at_the_steps_lightning_logs_their_batches_at(
    run: Run, tb: TensorBoardServer
) -> None:
    batch_at = dict(series(tb, RUN, "batch_idx"))  # step -> the batch Lightning logged there
    measured = series(tb, MEASURED, "memest/first_step/peak_MiB") + series(tb, MEASURED, "memest/peak_MiB")
    assert [batch_at[step] for step, _ in measured] == [0.0, 1.0]  # the first and the second batch
    estimated = [step for step, _ in series(tb, ESTIMATE, "memest/first_step/peak_MiB")]
    estimated += [step for step, _ in series(tb, ESTIMATE, "memest/peak_MiB")]
    assert [batch_at[step] for step in estimated] == [0.0, 1.0, 2.0, 3.0]  # every batch, at its own step
    assert set(estimated) >= {step for step, _ in measured}
    assert [step for step, _ in series(tb, RUN, "memest/error_pct")] == [step for step, _ in measured]


def test_hparams_tab_shows_the_memest_metrics_beside_the_module_hparams(
    run: Run, tb: TensorBoardServer
) -> None:
    experiment = tb.post("/data/plugin/hparams/experiment", {"experimentName": ""})
    assert {h["name"] for h in experiment["hparamInfos"]} >= {"lr", "memest/device", "memest/precision"}
    metrics = {(m["name"].get("group", ""), m["name"]["tag"]) for m in experiment["metricInfos"]}
    assert metrics >= {
        ("", "hp_metric"),  # Lightning's own stays
        ("memest/simulated", "memest/peak_MiB"),
        ("memest/measured", "memest/peak_MiB"),
        ("", "memest/error_pct"),
        ("", "memest/GFLOP_per_batch/forward"),
    }
    groups = tb.post(
        "/data/plugin/hparams/session_groups",
        {"experimentName": "", "allowedStatuses": ["STATUS_SUCCESS", "STATUS_UNKNOWN"], "sliceSize": 10},
    )["sessionGroups"]
    assert [g["name"] for g in groups] == [RUN]  # one session: the series' runs are not sessions
    assert groups[0]["hparams"]["lr"] == pytest.approx(1e-3)
    values = {(m["name"].get("group", ""), m["name"]["tag"]): m["value"] for m in groups[0]["metricValues"]}
    steady = run.memest.measured[-1]
    assert values[("memest/measured", "memest/peak_MiB")] == pytest.approx(steady.peak_bytes / MIB)
    assert values[("memest/simulated", "memest/peak_MiB")] == pytest.approx(steady.estimated_bytes / MIB)


def test_timeline_and_tables_are_served_at_the_last_measured_step(tb: TensorBoardServer) -> None:
    last = series(tb, MEASURED, "memest/peak_MiB")[-1][0]
    images = tb.get("/data/plugin/images/images", run=RUN, tag="memest/timeline")
    assert images[-1]["step"] == last
    png = tb.read("/data/plugin/images/individualImage?" + images[-1]["query"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1000, 450)
    text = tb.get("/data/plugin/text/text", run=RUN, tag="memest/breakdown/text_summary")
    assert text[-1]["step"] == last
    assert "<td>measured</td>" in text[-1]["text"] and "<td>error</td>" in text[-1]["text"]


def _phase_widths(figure: Any) -> dict[Phase, float]:
    """The width each phase's shading takes on the drawn figure."""
    colours = {tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)): p for p, c in PHASE_COLOURS.items()}
    widths: dict[Phase, float] = {}
    for patch in figure.axes[0].patches:
        rgb = tuple(round(v * 255) for v in patch.get_facecolor()[:3])
        if rgb in colours:  # an axvspan: a rectangle, x and width in data units
            widths[colours[rgb]] = widths.get(colours[rgb], 0.0) + patch.get_width()
    return widths


def test_timeline_gives_forward_and_backward_their_width(run: Run) -> None:
    estimate = run.memest.estimate
    assert estimate is not None
    ops = {p: sum(1 for t in estimate.timeline if t.phase is p) for p in Phase}
    assert ops[Phase.OPTIMIZER] > ops[Phase.FORWARD] + ops[Phase.BACKWARD]  # AdamW's per-parameter ops
    widths = _phase_widths(timeline_figure(estimate, None))
    passes = widths[Phase.FORWARD] + widths[Phase.BACKWARD]
    assert widths[Phase.OPTIMIZER] <= 0.25 * passes + 2  # squeezed (at least one unit a step)
    assert passes >= 0.75 * sum(widths.values())
    labels = [t.get_text() for t in timeline_figure(estimate, None).axes[0].texts]
    assert any(label.startswith("optimizer\n(squeezed") for label in labels)


def test_timeline_draws_the_measured_peaks_in_distinct_styles(run: Run) -> None:
    estimate = run.memest.estimate
    assert estimate is not None
    ax = timeline_figure(estimate, [m.peak_bytes for m in run.memest.measured]).axes[0]
    legend = ax.get_legend()
    assert legend is not None
    labels = [t.get_text() for t in legend.get_texts()]
    drawn = {c.get_label(): c for c in ax.collections}
    first, second = (
        drawn[next(label for label in labels if label.startswith(f"measured peak, step {step}:"))]
        for step in (1, 2)
    )
    assert first.get_color().tolist() != second.get_color().tolist()
    assert first.get_linestyle() != second.get_linestyle()


def _hparams_metrics_served(logdir: Path) -> list[str]:
    """The metric tags of a run's first hparams record: the one TensorBoard's HParams tab shows."""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    content = acc.SummaryMetadata("_hparams_/experiment").plugin_data.content
    return [m.name.tag for m in HParamsPluginData.FromString(content).experiment.metric_infos]


def test_a_users_own_hparams_record_is_left_to_them(tmp_path: Path) -> None:
    # With default_hp_metric=False Lightning writes no record, and Lightning's docs have the user
    # write one with their own metrics: that record must stay the one TensorBoard shows.
    class OwnRecord(Tiny):
        def on_train_start(self) -> None:
            assert isinstance(self.logger, TensorBoardLogger)
            self.logger.log_hyperparams(self.hparams, {"own/metric": 0.0})

    logger = TensorBoardLogger(tmp_path, name="tb", version=0, default_hp_metric=False)
    fit(tmp_path, [MemEstimate(max_depth=0, check=False)], logger=logger, max_steps=1, module=OwnRecord())
    assert _hparams_metrics_served(tmp_path / "tb" / "version_0") == ["own/metric"]


def test_per_step_logging_follows_lightnings_cadence_and_steps(tmp_path: Path) -> None:
    # The cadence and the step that per-step CUDA peaks are logged at, checked against where Lightning
    # itself logged the batches' metrics (with gradient accumulation, where the two part).
    logged: list[tuple[int, int]] = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if lightning_logs_now(trainer):
                logged.append((logging_step(trainer), args[-1]))

    fit(tmp_path, [Probe()], max_steps=4, log_every_n_steps=2, accumulate_grad_batches=2)
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    acc.Reload()
    lightning = [(e.step, int(e.value)) for e in acc.Scalars("batch_idx")]
    assert logged == lightning and len(logged) >= 2


def test_step_peaks_keep_the_largest_since_the_last_logged_point(monkeypatch: pytest.MonkeyPatch) -> None:
    peaks = iter([(10, 20), (30, 25), (5, 40), (7, 7)])
    current: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: current.clear())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: current[0][0])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: current[0][1])
    step = StepPeaks()
    device = torch.device("cuda", 0)
    for _ in range(3):
        step.start(device)
        current.append(next(peaks))
        step.stop(device)
    assert step.take() == (30, 40)  # the largest of three batches, each kind on its own
    assert step.take() is None
    step.start(device)
    current.append(next(peaks))
    step.stop(device)
    assert step.take() == (7, 7)  # a fresh window after a take


@pytest.mark.skipif(chromium() is None, reason="no chromium installed")
def test_custom_scalars_page_draws_the_series_in_chromium(tb: TensorBoardServer, tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "charts.png"
    screenshot(tb.url("/") + "#custom_scalars", out)  # TensorBoard's defaults: smoothing 0.6, no outliers
    pixels = matplotlib.image.imread(out)[:, 360:, :3]  # the charts, right of the run selector
    # TensorBoard's colours of the second and third runs: the estimate's and the measurement's, each
    # drawn (the estimate's line runs past the measured points, so both show where they agree).
    columns = {}
    for name, colour in (("estimate", (0x00, 0x77, 0xBB)), ("measurement", (0xCC, 0x33, 0x11))):
        mask = abs(pixels * 255 - torch.tensor(colour).numpy()).max(axis=-1) < 8
        assert int(mask.sum()) > 20, f"no line of the {name}'s run on the charts ({int(mask.sum())} pixels)"
        columns[name] = sorted(set(mask.nonzero()[1].tolist()))
    # The measured steps are markers (the first step's and the steady state's series: one point each,
    # which no smoothing moves); the estimate's line runs over the training.
    measured, estimated = columns["measurement"], columns["estimate"]
    assert estimated[-1] - estimated[0] > 3 * (measured[-1] - measured[0]), (estimated, measured)
