"""A LightningModule's validation, test or predict batch, run the way Lightning's loops run it -- for the
engine.

Lightning's evaluation and prediction loops put the module in eval mode, run the whole loop under
``torch.inference_mode`` (``torch.no_grad`` with gloo, FSDP1 or ``Trainer(inference_mode=False)``), and
call the step inside the precision plugin's ``val_step_context``/``test_step_context``/
``predict_step_context`` (autocast under ``*-mixed``); the step gets ``dataloader_idx`` only where
there are several dataloaders and it takes one. The prediction loop keeps every batch's predictions
(``return_predictions``), moved to the CPU: on a CPU they stay where they are, so a predict step's
outputs are alive through the next batch.

As in the training runner, ``self.log``/``self.log_dict`` do nothing and the module's state is restored
afterwards (``engine.fake``); no other hook runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_memest.engine.events import Phase
from lightning_memest.engine.fake import setattr_raw
from lightning_memest.engine.inference_step import wrap_for_inference
from lightning_memest.engine.parallel.distributed import Strategy
from lightning_memest.engine.step import StepListener

__all__ = ["STEP_METHODS", "EvalRunner", "Loop"]

#: The loops besides training, as the trainer's entry points name them.
Loop = Literal["validate", "test", "predict"]

#: The LightningModule method each loop calls.
STEP_METHODS: dict[Loop, str] = {
    "validate": "validation_step",
    "test": "test_step",
    "predict": "predict_step",
}


class EvalRunner:
    """Runs ``loop``'s step of ``module`` as Lightning's loop would, telling ``listener`` the phase.

    Example (what ``adapter.loops`` builds for the engine)::

        runner = EvalRunner(module, listener, loop="validate", step_context=contextlib.nullcontext,
                            inference_mode=True)
        runner.run(batch)
    """

    def __init__(
        self,
        module: pl.LightningModule,
        listener: StepListener,
        *,
        loop: Loop,
        step_context: Callable[[], contextlib.AbstractContextManager[object]],
        inference_mode: bool,
        dataloader_idx: int | None = None,
        keep_outputs: bool = False,
        strategy: Strategy | None = None,
    ) -> None:
        self.module = module
        self.listener = listener
        self.loop = loop
        self.step_context = step_context
        self.no_grad: Callable[[], contextlib.AbstractContextManager[object]] = (
            torch.inference_mode if inference_mode else torch.no_grad
        )
        self.dataloader_idx = dataloader_idx
        self.keep_outputs = keep_outputs
        self.outputs: list[Any] = []
        self.steps_run = 0
        module.eval()  # as the loop does; the simulation restores the training flags afterwards
        for name in ("log", "log_dict"):
            setattr_raw(module, name, _no_log)
        wrap_for_inference(module, strategy, listener.on_communication)  # FSDP2 shards in place
        self._step: Callable[..., Any] = getattr(module, STEP_METHODS[loop])

    def run(self, batch: Any) -> object:
        self.listener.on_phase(Phase.FORWARD, self.steps_run)
        with self.no_grad(), self.step_context():
            output = self._step(*self._args(batch))
        self.steps_run += 1
        if self.keep_outputs:
            self.outputs.append(output)  # the prediction loop's list
        return output

    def _args(self, batch: Any) -> tuple[Any, ...]:
        """``(batch, batch_idx[, dataloader_idx])`` as the loop passes them (``_build_step_args``)."""
        args: list[Any] = [batch]
        if is_param_in_hook_signature(self._step, "batch_idx", min_args=2):
            args.append(self.steps_run)
        if self.dataloader_idx is not None:
            args.append(self.dataloader_idx)
        return tuple(args)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None
