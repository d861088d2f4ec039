"""A plain model's batch outside training: a validation batch (forward and loss, no gradients) or a
predict batch (forward only), in eval mode -- what ``memest estimate --loop`` simulates and ``memest
measure --loop`` measures.

As Lightning's loops do: the model in eval mode (dropout off, batch norm on its running statistics),
the forward pass under ``torch.no_grad`` for validation and ``torch.inference_mode`` for prediction,
autocast under the ``*-mixed`` precisions. Nothing is kept from one batch to the next: no gradients,
no optimizer step. The model's training flags are restored after each batch.

Example:
    >>> import torch
    >>> from lightning_memest.engine.step import StepConfig
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    >>> runner = InferenceRunner(model, StepConfig(), loop="predict")
    >>> out = runner.run(torch.ones(2, 4))
    >>> out.requires_grad, out.is_inference(), model.training  # no graph; the flags restored
    (False, True, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_memest.constants import LOOPS, PlainLoop
from lightning_memest.engine.events import Phase
from lightning_memest.engine.parallel.distributed import DDP, Strategy, wrap
from lightning_memest.engine.step import (
    RunnerFactory,
    StepConfig,
    StepListener,
    autocast,
    call_model,
    plain_runner,
)

__all__ = ["LOOPS", "InferenceRunner", "PlainLoop", "loop_runner", "wrap_for_inference"]


class InferenceRunner:
    """Runs a validation or predict batch of ``model`` (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        config: StepConfig,
        listener: StepListener | None = None,
        *,
        loop: Literal["validate", "predict"],
    ) -> None:
        if loop not in ("validate", "predict"):
            raise ValueError(f"loop must be 'validate' or 'predict'; got {loop!r}")
        self.config = config
        self.listener = listener
        self.loop = loop
        self.device_type = next((t.device.type for t in (*model.parameters(), *model.buffers())), "cpu")
        on_communication = listener.on_communication if listener is not None else None
        self.model = wrap_for_inference(model, config.strategy, on_communication)
        self.no_grad: Callable[[], contextlib.AbstractContextManager[object]] = (
            torch.inference_mode if loop == "predict" else torch.no_grad
        )
        self.steps_run = 0

    def run(self, batch: Any) -> object:
        """One batch; returns its output (predict) or its loss (validate)."""
        if self.listener is not None:
            self.listener.on_phase(Phase.FORWARD, self.steps_run)
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with self.no_grad(), autocast(self.device_type, self.config.precision):
                if self.loop == "predict":
                    out = call_model(self.model, batch)
                else:
                    out = self.config.loss_fn(self.model, batch)
        finally:
            for module, training in modes:
                module.training = training
        self.steps_run += 1
        return out


def wrap_for_inference(
    model: nn.Module, strategy: Strategy | None, on_communication: Callable[[list[Tensor]], None] | None
) -> nn.Module:
    """``model`` as a batch without gradients runs it under ``strategy``: a sharded model (FSDP2)
    gathers its parameters for the forward pass; DDP's wrapper does nothing for memory without
    gradients, so a DDP model runs as it is."""
    if strategy is None or isinstance(strategy, DDP):
        return model
    return wrap(model, strategy, on_communication)


def loop_runner(loop: PlainLoop) -> RunnerFactory:
    """The engine's runner factory for ``loop``: the training step (``plain_runner``) or an
    :class:`InferenceRunner`."""
    if loop == "train":
        return plain_runner
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}; got {loop!r}")

    def factory(model: nn.Module, config: StepConfig, listener: StepListener) -> InferenceRunner:
        return InferenceRunner(model, config, listener, loop=loop)

    return factory
