"""Lightning's weight-averaging callbacks (``WeightAveraging``: ``EMAWeightAveraging``, SWA-style
subclasses) inside the simulation of a training batch.

Such a callback keeps an averaged copy of the weights (an ``AveragedModel``) on the device and updates
it in ``on_train_batch_end``, after the optimizer step, while the gradients and the optimizer's state
are still alive. An EMA update computes ``decay * ema + (1 - decay) * w`` per parameter: two products
and a sum the size of the parameter. Where the weights dominate (an MLP) that is the step's peak, which
the training step alone never reaches (-9 % at step 2 without it). So the simulation runs the
callback's own hook after each simulated batch: its averaged model is faked for the simulation
(``engine.simulate``'s ``companions``), the hook sees the trainer with the simulated ``global_step``,
and the callback's attributes are put back afterwards. An averaged copy kept on another device than
the training's is left out: its update does not touch the training device beyond reading the weights.

Example (what ``fit_setup`` does)::

    averaging = WeightAveragingMirror.of(trainer)
    simulate(module, batch, config, runner=..., companions=averaging.companions)
    # the runner calls averaging.on_batch_end(module, output, batch, batch_idx, optimizer_steps)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import lightning.pytorch as pl
from torch import nn

from lightning_memest.adapter.package import lightning_classes
from lightning_memest.engine.fake import resident_tensors

__all__ = ["WeightAveragingMirror"]


class _TrainerAt:
    """The trainer as a callback's hook reads it, ``global_step`` being the simulated one."""

    def __init__(self, trainer: pl.Trainer, global_step: int) -> None:
        self._trainer = trainer
        self.global_step = global_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


@dataclass(frozen=True)
class WeightAveragingMirror:
    """The weight-averaging callbacks of a trainer whose averaged copy lives on the training device."""

    trainer: pl.Trainer
    callbacks: tuple[pl.Callback, ...]

    @staticmethod
    def of(trainer: pl.Trainer) -> WeightAveragingMirror | None:
        """The trainer's weight-averaging callbacks with their copy on the training device; ``None``
        where there is none."""
        averagers = lightning_classes("WeightAveraging")  # new in lightning 2.6
        if not averagers:
            return None
        device = trainer.strategy.root_device
        found: list[pl.Callback] = []
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            averaged = getattr(callback, "_average_model", None)
            if not isinstance(callback, averagers) or not isinstance(averaged, nn.Module):
                continue
            tensors = [t for _, t, _ in resident_tensors(averaged)]
            if tensors and all(t.device == device for t in tensors):
                found.append(cast(pl.Callback, callback))
        return WeightAveragingMirror(trainer, tuple(found)) if found else None

    @property
    def companions(self) -> tuple[nn.Module, ...]:
        """The averaged models, for the simulation to fake beside the module."""
        return tuple(c._average_model for c in self.callbacks)  # type: ignore[attr-defined]

    def on_batch_end(
        self, module: pl.LightningModule, output: Any, batch: Any, batch_idx: int, optimizer_steps: int
    ) -> None:
        """Each callback's ``on_train_batch_end`` after a simulated batch (``optimizer_steps`` taken
        in the simulation so far), as the fit loop calls it."""
        trainer = _TrainerAt(self.trainer, self.trainer.global_step + optimizer_steps)
        for callback in self.callbacks:
            callback.on_train_batch_end(trainer, module, output, batch, batch_idx)  # type: ignore[arg-type]

    @contextmanager
    def kept(self) -> Iterator[None]:
        """The callbacks' attributes (the step of their latest update) as they were, on exit."""
        saved = [(c, dict(vars(c))) for c in self.callbacks]
        try:
            yield
        finally:
            for callback, attributes in saved:
                vars(callback).clear()
                vars(callback).update(attributes)
