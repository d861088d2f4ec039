"""The memest figures in TensorBoard's HParams tab.

The tab shows, per run, the hparams and metrics of the run's *first* hparams record only (the plugin
keeps each tag's metadata from its first summary), and as metrics only the tags that record's
experiment lists, each with the run's last value of that tag. Lightning writes its record right after
``on_fit_start``, listing ``hp_metric`` alone, so a record written later is never shown. Where
Lightning is about to write that default record, :func:`log_hparams` writes the same record first
with the memest tags added to its metrics; the values then come from the scalars logged as training
goes. Where Lightning writes none (``default_hp_metric=False``, ``enable_autolog_hparams=False``,
hparams not logged) the record is the user's to write, and nothing is written.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams.api_pb2 import MetricInfo, MetricName
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from torch.utils.tensorboard.summary import hparams

from lightning_memest.adapter.loggers.scalars import hparams_metrics
from lightning_memest.adapter.loggers.tensorboard import series_of

__all__ = ["lightning_hparams", "log_hparams"]


def lightning_hparams(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The hparams Lightning's ``_log_hyperparams`` is about to log (module's and datamodule's), or
    ``None`` where it logs none."""
    if not getattr(trainer, "enable_autolog_hparams", True):
        return None
    module, datamodule = trainer.lightning_module, getattr(trainer, "datamodule", None)
    with_module = bool(module._log_hyperparams)
    with_data = datamodule is not None and bool(datamodule._log_hyperparams)
    if not (with_module or with_data):
        return None
    params = {**(module.hparams_initial if with_module else {})}
    if datamodule is not None and with_data:
        params.update(datamodule.hparams_initial)
    return {k: v for k, v in params.items() if k != "_class_path"}  # LightningCLI's own, as Lightning


def log_hparams(logger: TensorBoardLogger, trainer: pl.Trainer) -> None:
    """Before Lightning's default hparams record: the same record, with the memest metrics (call in
    ``on_fit_start``, on rank 0)."""
    params = lightning_hparams(trainer)
    if params is None or not logger._default_hp_metric:
        return
    params = logger._sanitize_params(_flatten_dict(_convert_params(params)))
    params["memest/device"] = str(trainer.strategy.root_device)
    params["memest/precision"] = str(trainer.precision)
    experiment, start, end = hparams(params, {"hp_metric": -1})  # type: ignore[no-untyped-call]
    cuda = trainer.strategy.root_device.type == "cuda"
    _add_metrics(experiment, [_metric(tag) for tag in hparams_metrics(cuda)])
    writer = logger.experiment._get_file_writer()
    for summary in (experiment, start, end):
        writer.add_summary(summary)


def _metric(tag: str) -> MetricInfo:
    """A metric of the record: a series' tag is read from its own run (``group``, relative to the run's)."""
    place = series_of(tag)
    if place is None:
        return MetricInfo(name=MetricName(tag=tag), display_name=tag)
    run, series_tag = place
    return MetricInfo(name=MetricName(group=run, tag=series_tag), display_name=tag)


def _add_metrics(experiment: Summary, metrics: list[MetricInfo]) -> None:
    """``metrics`` into an experiment summary (torch's ``hparams`` names metrics of the run's own only)."""
    plugin_data = experiment.value[0].metadata.plugin_data
    data = HParamsPluginData.FromString(plugin_data.content)
    data.experiment.metric_infos.extend(metrics)
    plugin_data.content = data.SerializeToString()
