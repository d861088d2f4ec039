"""The callback's hooks for the loops besides training -- the sanity check, validation, ``test``,
``predict``: each loop's first batch is estimated before it runs, checked against the budget and
measured (``adapter/loop_checks.py`` does the work). A part of ``MemEstimate``, kept apart so that
the callback's own file stays about training.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_memest.adapter.budget_check import BudgetCheck
from lightning_memest.adapter.eval_runner import Loop
from lightning_memest.adapter.guard import Guard
from lightning_memest.adapter.loop_checks import LoopChecks
from lightning_memest.measure import StepProbe

__all__ = ["LoopHooks"]


class LoopHooks(pl.Callback):
    """The other loops' hooks of ``MemEstimate``, over the state it keeps."""

    check: bool
    _loops: LoopChecks
    _guard: Guard
    _probe: StepProbe | None
    _summarized: bool

    def _budget(self) -> BudgetCheck:
        raise NotImplementedError  # the callback's

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit":  # trainer.validate: a new call (a fit's validations are one loop)
            self._forget("validate")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget("test")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget("predict")

    def _forget(self, name: str) -> None:
        self._loops.forget(name)
        self._guard.warned = False  # a new call: its failure is worth a warning of its own

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._loop_start(trainer, pl_module, batch, dataloader_idx, "validate")

    @override
    def on_test_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._loop_start(trainer, pl_module, batch, dataloader_idx, "test")

    @override
    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._loop_start(trainer, pl_module, batch, dataloader_idx, "predict")

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._loops.on_batch_end(trainer, self._guard)

    # The same for the other loops' batches (the three hooks take the same arguments).
    on_test_batch_end = on_validation_batch_end
    on_predict_batch_end = on_validation_batch_end

    def _loop_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, dataloader_idx: int, loop: Loop
    ) -> None:
        # A training step measured on the CPU keeps its profiler open across the measured batches.
        profiling = self._probe is not None and trainer.strategy.root_device.type == "cpu"
        self._loops.on_batch_start(
            trainer,
            pl_module,
            batch,
            dataloader_idx,
            loop,
            guard=self._guard,
            budget=self._budget(),
            measure=self.check,
            profiling=profiling,
            announce=self._summarized,
        )
