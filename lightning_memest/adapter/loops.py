"""The trainer's other loops, read once: what a validation, test or predict batch does, and its estimate.

:func:`loop_setup` reads, at a loop's batch start (the batch in hand, as the step will get it), what the
simulation needs: the loop's step method, the precision plugin's context for it, whether the loop runs
under ``inference_mode`` or ``no_grad``, the dataloader index the step is given, whether predictions are
kept, and the training state that stays alive through the batch (inside ``fit``: the gradients of the
last step and the optimizers' state, also after ``fit`` for a ``predict`` of the same trainer; during
the sanity check, before any step: no state yet). Its
:meth:`LoopSetup.estimate` is the batch's ``StepEstimate`` (one step: a forward pass),
:meth:`LoopSetup.sized` the same estimate with the batch size left open (the largest batch of this
shape that fits a budget).

Example (in a callback's ``on_validation_batch_start``)::

    setup = loop_setup(trainer, pl_module, "validate", batch, dataloader_idx)
    estimate = setup.estimate(residents=resident_besides(trainer, pl_module, batch))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_memest.accounting import capture_filter
from lightning_memest.adapter.eval_runner import STEP_METHODS, EvalRunner, Loop
from lightning_memest.adapter.fit import _precision, _strategy
from lightning_memest.adapter.package import is_lightning_module
from lightning_memest.engine.events import Role
from lightning_memest.engine.fake import local_tensor
from lightning_memest.engine.simulate import Simulation, simulate
from lightning_memest.engine.step import StepConfig, StepListener, optimizer_state_tensors
from lightning_memest.errors import EstimationError
from lightning_memest.report import StepEstimate
from lightning_memest.search.sizing import Calibrate, SizedStep

__all__ = ["LoopSetup", "loop_name", "loop_setup", "training_state"]


def loop_name(trainer: pl.Trainer) -> str:
    """The running loop as the estimates and logs name it: ``sanity_check``, ``validate``, ``test`` or
    ``predict`` (a fit's validation is ``validate``)."""
    if trainer.sanity_checking:
        return "sanity_check"
    if trainer.testing:
        return "test"
    if trainer.predicting:
        return "predict"
    return "validate"


@dataclass(frozen=True, eq=False)
class LoopSetup:
    """What one loop does with a batch of its module, read from the trainer once (:func:`loop_setup`)."""

    module: pl.LightningModule
    loop: Loop
    batch: Any
    """The batch as the step gets it (moved to the device, the transfer hooks applied)."""
    config: StepConfig
    device: torch.device
    step_context: Callable[[], contextlib.AbstractContextManager[object]]
    """The precision plugin's context for this loop's step."""
    inference_mode: bool
    """``torch.inference_mode`` (else ``torch.no_grad``), as the loop chooses."""
    dataloader_idx: int | None
    """What the step is given as ``dataloader_idx`` (``None``: a single dataloader, not passed)."""
    keep_outputs: bool
    """Whether each batch's output stays alive (predictions kept on the device they were made on)."""
    kept: tuple[tuple[Tensor, Role], ...]
    """The training state alive through the batch: gradients and the optimizers' state."""

    def runner(self, module: nn.Module, config: StepConfig, listener: StepListener) -> EvalRunner:
        """The engine's runner factory: the loop's order of things, for ``module``."""
        if not is_lightning_module(module):
            raise EstimationError(f"expected a LightningModule, got {type(module).__name__}")
        return EvalRunner(
            module,
            listener,
            loop=self.loop,
            step_context=self.step_context,
            inference_mode=self.inference_mode,
            dataloader_idx=self.dataloader_idx,
            keep_outputs=self.keep_outputs,
            strategy=config.strategy,
        )

    def simulate(
        self, batch: Any, *, flops: bool = True, calibrate: bool = False, residents: Sequence[Tensor] = ()
    ) -> Simulation:
        """One batch of the loop on fake tensors (``residents`` as in ``engine.simulate``)."""
        return simulate(
            self.module,
            batch,
            self.config,
            runner=self.runner,
            device=self.device,
            steps=1,
            capture=capture_filter(flops=flops, calibrate=calibrate),
            residents=residents,
            kept=self.kept,
        )

    def sized(self, *, calibrate: Calibrate = False, residents: Sequence[Tensor] = ()) -> SizedStep:
        """:attr:`batch` in this loop with ``residents`` alive beside it, the batch size left open: its
        ``estimate_at()`` is :meth:`estimate`, its ``largest_batch(budget)`` the largest batch of this
        shape (its leading size changed) whose estimate, made the same way, fits."""

        def run(batch: Any, *, flops: bool, calibrate: bool) -> Simulation:
            return self.simulate(batch, flops=flops, calibrate=calibrate, residents=residents)

        return SizedStep(run, self.batch, calibrate=calibrate, loop=self.loop)

    def estimate(self, *, calibrate: Calibrate = False, residents: Sequence[Tensor] = ()) -> StepEstimate:
        """The estimate of :attr:`batch` in this loop, with ``residents`` alive beside it; ``calibrate``
        as in ``FitSetup.estimate``."""
        return self.sized(calibrate=calibrate, residents=residents).estimate_at()


def loop_setup(
    trainer: pl.Trainer, module: pl.LightningModule, loop: Loop, batch: Any, dataloader_idx: int = 0
) -> LoopSetup:
    """Read what the simulation of ``loop``'s batch needs from ``trainer`` (inside the loop, at its batch
    start: ``batch`` as the step gets it). An ``EstimationError`` for what it cannot simulate."""
    plugin = trainer.precision_plugin
    contexts = {
        "validate": plugin.val_step_context,
        "test": plugin.test_step_context,
        "predict": plugin.predict_step_context,
    }
    if not callable(getattr(module, STEP_METHODS[loop], None)):
        raise EstimationError(f"the module has no {STEP_METHODS[loop]}")
    runs = _loop_of(trainer, loop)
    several = getattr(runs, "num_dataloaders", 1) > 1 and getattr(runs, "_is_sequential", True)
    return LoopSetup(
        module=module,
        loop=loop,
        batch=batch,
        config=StepConfig(precision=_precision(trainer), strategy=_strategy(trainer)),
        device=trainer.strategy.root_device,
        step_context=contexts[loop],
        inference_mode=_inference_mode(trainer, runs),
        dataloader_idx=dataloader_idx if several else None,
        keep_outputs=loop == "predict"
        and trainer.strategy.root_device.type == "cpu"
        and bool(getattr(runs, "return_predictions", False)),
        kept=training_state(trainer, module),
    )


def training_state(trainer: pl.Trainer, module: nn.Module) -> tuple[tuple[Tensor, Role], ...]:
    """The gradients and optimizer state alive now: through a validation batch inside ``fit``, and
    after it (the trainer keeps its optimizers, their state with them, for a later ``predict``)."""
    kept: list[tuple[Tensor, Role]] = [
        (local_tensor(p.grad), Role.GRADIENT) for p in module.parameters() if p.grad is not None
    ]
    for optimizer in trainer.optimizers:
        kept.extend((local_tensor(t), Role.OPTIMIZER_STATE) for t in optimizer_state_tensors(optimizer))
    return tuple(kept)


def _loop_of(trainer: pl.Trainer, loop: Loop) -> Any:
    if loop == "predict":
        return trainer.predict_loop
    if trainer.state.fn == "fit":
        return trainer.fit_loop.epoch_loop.val_loop
    return trainer.test_loop if loop == "test" else trainer.validate_loop


def _inference_mode(trainer: pl.Trainer, runs: Any) -> bool:
    """``inference_mode`` as ``lightning.pytorch.loops.utilities._no_grad_context`` decides it."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        return False
    if any(cls.__name__ == "FSDPStrategy" for cls in type(trainer.strategy).__mro__):
        return False
    return bool(getattr(runs, "inference_mode", True))
