"""A LightningModule's training batch, run the way Lightning's fit loop runs it -- for the fake engine.

(``adapter/fit.py`` reads the trainer's settings once and builds this runner from them.)

What matters for memory is the order of things, and Lightning's differs from a textbook step: with
automatic optimization the closure runs ``training_step``, *then* ``optimizer_zero_grad`` (only on the
first batch of an accumulation window), then backward of ``loss / accumulate_grad_batches``; then
gradient clipping (``configure_gradient_clipping``), then ``optimizer.step()``. So the gradients of
the previous step are still alive during the next forward. A module that overrides
``optimizer_step`` gets that closure and a ``LightningOptimizer`` over the simulation's optimizer, as
the fit loop gives them: whatever it does (a warm-up, an update skipped) is simulated. Manual
optimization runs ``training_step`` alone, which calls ``self.optimizers()``, ``self.manual_backward``,
``opt.step()`` itself.

The module's own methods run (``training_step``, ``configure_optimizers``, ``optimizer_zero_grad``,
``backward``, ``configure_gradient_clipping``, ``on_after_batch_transfer``); of other callbacks' hooks
only what ``batch_end`` runs after each batch (the weight-averaging callbacks' update,
``adapter.weight_averaging``). The trainer's state is not touched: ``self.log``/``self.log_dict`` do nothing,
``self.optimizers()``/``self.lr_schedulers()`` return the simulation's own optimizers and
schedulers (built by the module's ``configure_optimizers`` on the fake parameters), and
``self.manual_backward``/``toggle_optimizer``/``untoggle_optimizer`` act on those. All of it is set as
instance attributes inside the simulation, which ``engine.fake`` removes afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers
from torch import Tensor, nn

from lightning_memest.adapter.batch_index import IndexReads, WatchedIndex
from lightning_memest.adapter.package import base_method, lightning_classes
from lightning_memest.engine.events import Phase
from lightning_memest.engine.fake import setattr_raw
from lightning_memest.engine.parallel.distributed import DDP, Strategy, wrap
from lightning_memest.engine.step import Precision, StepListener, autocast, optimizer_state_tensors
from lightning_memest.errors import EstimationError

__all__ = ["LightningRunner"]


def _loss_of(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned, as Lightning reads it."""
    if output is None or isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if loss is None or isinstance(loss, Tensor):
            return loss
    raise EstimationError(
        f"training_step returned {type(output).__name__}; Lightning needs a tensor, a dict with 'loss', "
        "or None"
    )


BatchEnd = Callable[[pl.LightningModule, Any, Any, int, int], None]
"""What runs after a batch (other callbacks' ``on_train_batch_end``): the module, the step's output,
the batch, its index and the optimizer steps taken so far."""


class LightningRunner:
    """Runs training batches of ``module`` as the fit loop would, telling ``listener`` the phases."""

    def __init__(
        self,
        module: pl.LightningModule,
        listener: StepListener,
        *,
        precision: Precision,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
        step_context: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
        strategy: Strategy | None = None,
        transferred: bool = False,
        batch_end: BatchEnd | None = None,
        batch_indices: Sequence[int] = (0,),
        index_reads: IndexReads | None = None,
    ) -> None:
        self.module = module
        self.listener = listener
        self.precision = precision
        self.accumulate = max(1, accumulate_grad_batches)
        self.clip_val = gradient_clip_val
        self.clip_algorithm = gradient_clip_algorithm
        self.device_type = next((p.device.type for p in module.parameters()), "cpu")
        # The precision plugin's train_step_context (autocast, or the default dtype of *-true).
        self.step_context = step_context or (lambda: autocast(self.device_type, self.precision))
        self.transferred = transferred  # the batch comes as the step gets it: transfer hooks applied
        self.steps_run = 0
        self.optimizer_steps = 0  # the trainer's global_step counts these
        self.batch_end = batch_end
        # What the module's code is given as batch_idx: each step's batch's own index, never one that
        # has not come yet (adapter/batch_index.py); accumulation follows the steps run.
        self.batch_indices = tuple(batch_indices) or (0,)
        self.index_reads = index_reads if index_reads is not None else IndexReads()
        self._current_phase = Phase.FORWARD
        self._toggled: dict[nn.Parameter, bool] = {}
        self._install_module_api()
        # Under DDP the fit loop calls training_step through the DDP wrapper (its forward prepares the
        # reducer for backward); built before the optimizers, as in strategy.setup.
        self._training_step: Callable[[Any, int], Any] = module.training_step
        if isinstance(strategy, DDP):
            self._training_step = wrap(_TrainingStep(module), strategy, listener.on_communication)
        elif strategy is not None:
            # ModelParallelStrategy calls training_step itself, not forward: FSDP's units are sharded
            # in the module (as configure_model did) and decide their roots lazily, as in the real run
            # (a unit that runs first without a root above it keeps its parameters gathered).
            wrap(module, strategy, listener.on_communication)
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        self.optimizers: list[torch.optim.Optimizer] = list(optimizers)
        self.lightning_optimizers = [_SimulatedOptimizer(opt, self) for opt in self.optimizers]
        """What ``self.optimizers()`` gives the module: Lightning's wrappers over :attr:`optimizers`."""
        self.schedulers = [config.scheduler for config in schedulers]
        self.scaler = torch.amp.GradScaler(device=self.device_type) if precision == "16-mixed" else None
        if not module.automatic_optimization:
            for optimizer in self.optimizers:
                self._watch_manual_optimizer(optimizer)

    # --- the module's API, answered by the simulation --------------------------------------------------
    def _install_module_api(self) -> None:
        module = self.module

        def no_log(*args: Any, **kwargs: Any) -> None:
            return None

        def optimizers(use_pl_optimizer: bool = True) -> Any:
            found: list[Any] = self.lightning_optimizers if use_pl_optimizer else self.optimizers
            return found[0] if len(found) == 1 else list(found)

        def lr_schedulers() -> Any:
            if not self.schedulers:
                return None
            return self.schedulers[0] if len(self.schedulers) == 1 else list(self.schedulers)

        def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
            self._backward(loss, *args, **kwargs)

        for name, value in (
            ("log", no_log),
            ("log_dict", no_log),
            ("optimizers", optimizers),
            ("lr_schedulers", lr_schedulers),
            ("manual_backward", manual_backward),
            ("toggle_optimizer", self._toggle),
            ("untoggle_optimizer", self._untoggle),
        ):
            setattr_raw(module, name, value)

    def _toggle(self, optimizer: torch.optim.Optimizer | LightningOptimizer) -> None:
        # LightningModule.toggle_optimizer over the simulation's optimizers.
        optimizer = _unwrapped(optimizer)
        state: dict[nn.Parameter, bool] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param not in state:
                        state[param] = param.requires_grad
                        param.requires_grad = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.requires_grad = state[param]
        self._toggled = state

    def _untoggle(self, optimizer: torch.optim.Optimizer | LightningOptimizer) -> None:
        optimizer = _unwrapped(optimizer)
        state = self._toggled
        for opt in self.optimizers:
            if opt is not optimizer:
                for group in opt.param_groups:
                    for param in group["params"]:
                        if param in state:
                            param.requires_grad = state[param]
        self._toggled = {}

    def _watch_manual_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """In manual optimization the user calls step/zero_grad: mark the phases there."""
        step, zero_grad = optimizer.step, optimizer.zero_grad

        @functools.wraps(step)
        def watched_step(*args: Any, **kwargs: Any) -> Any:
            self._phase(Phase.OPTIMIZER)
            if self.scaler is None:
                result = step(*args, **kwargs)
            else:
                # GradScaler.step calls optimizer.step: the original one, not this wrapper again.
                optimizer.step = step  # type: ignore[method-assign]
                try:
                    result = self.scaler.step(optimizer, *args, **kwargs)
                finally:
                    optimizer.step = watched_step  # type: ignore[method-assign]
                self.scaler.update()
            self.listener.on_optimizer_state(optimizer_state_tensors(optimizer))
            self.optimizer_steps += 1
            self._phase(Phase.FORWARD)
            return result

        @functools.wraps(zero_grad)
        def watched_zero_grad(*args: Any, **kwargs: Any) -> Any:
            self._phase(Phase.ZERO_GRAD)
            result = zero_grad(*args, **kwargs)
            self._phase(Phase.FORWARD)
            return result

        optimizer.step = watched_step  # type: ignore[method-assign]
        optimizer.zero_grad = watched_zero_grad  # type: ignore[method-assign]

    # --- one batch ---------------------------------------------------------------------------------------
    def _phase(self, phase: Phase) -> None:
        self._current_phase = phase
        self.listener.on_phase(phase, self.steps_run)

    def _backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        previous = self._current_phase
        self._phase(Phase.BACKWARD)
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        self.module.backward(scaled, *args, **kwargs)
        self.listener.on_gradients([p.grad for p in self.module.parameters() if p.grad is not None])
        self._phase(previous)

    def run(self, batch: Any) -> object:
        step = self.steps_run
        index = self.batch_indices[min(step, len(self.batch_indices) - 1)]
        batch_idx = WatchedIndex(index, self.index_reads)
        module = self.module
        self._phase(Phase.FORWARD)
        if not self.transferred:
            batch = module.on_after_batch_transfer(batch, 0)
        if not module.automatic_optimization:
            with self.step_context():
                output = self._training_step(batch, batch_idx)
        else:
            output = self._automatic(batch, batch_idx, step)
        self.steps_run += 1
        if self.batch_end is not None:
            self._phase(Phase.OPTIMIZER)  # after the step, as other callbacks' on_train_batch_end
            self.batch_end(module, output, batch, batch_idx, self.optimizer_steps)
        return output

    def _automatic(self, batch: Any, batch_idx: int, step: int) -> Tensor | None:
        module = self.module
        optimizer = self.optimizers[0] if self.optimizers else None
        accumulating = (step + 1) % self.accumulate != 0
        if optimizer is not None and not accumulating and _overrides_optimizer_step(module):
            # The fit loop hands the module's optimizer_step the closure (training_step, zero_grad,
            # backward); what it does with them -- a warm-up, a skipped update -- is the step's.
            closure = _Closure(lambda: self._closure(batch, batch_idx, step))
            module.optimizer_step(module.current_epoch, batch_idx, self.lightning_optimizers[0], closure)
            if not closure.ran:
                raise EstimationError(
                    "optimizer_step did not call its optimizer_closure (Lightning's fit stops there: "
                    "call `optimizer.step(closure=optimizer_closure)` or `optimizer_closure()`)"
                )
            return closure.loss
        loss = self._closure(batch, batch_idx, step)
        if optimizer is None or accumulating:
            return loss
        self._optimizer_step(optimizer, loss)
        return loss

    def _closure(self, batch: Any, batch_idx: int, step: int) -> Tensor | None:
        """What Lightning's closure runs: ``training_step``, then ``optimizer_zero_grad`` on the first
        batch of an accumulation window, then backward; the loss."""
        module = self.module
        optimizer = self.optimizers[0] if self.optimizers else None
        with self.step_context():
            loss = _loss_of(self._training_step(batch, batch_idx))
        if optimizer is not None and step % self.accumulate == 0:
            self._phase(Phase.ZERO_GRAD)
            module.optimizer_zero_grad(module.current_epoch, batch_idx, optimizer)
        if loss is not None:
            self._backward(loss / self.accumulate)  # as Lightning's ClosureResult, also when 1
        return loss

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, loss: Tensor | None) -> None:
        """After the closure: unscaling, gradient clipping, the update (as the precision plugin)."""
        module = self.module
        self._phase(Phase.OPTIMIZER)
        if self.scaler is not None and loss is not None:
            self.scaler.unscale_(optimizer)
        module.configure_gradient_clipping(
            optimizer, gradient_clip_val=self.clip_val, gradient_clip_algorithm=self.clip_algorithm
        )
        if self.scaler is not None:
            if loss is not None:  # Lightning's MixedPrecision skips the step where backward was skipped
                self.scaler.step(optimizer)
                self.scaler.update()
        else:
            optimizer.step()
        self.listener.on_optimizer_state(optimizer_state_tensors(optimizer))
        self.optimizer_steps += 1


def _overrides_optimizer_step(module: pl.LightningModule) -> bool:
    return type(module).optimizer_step is not base_method(module, "optimizer_step")


class _Closure:
    """The closure a module's ``optimizer_step`` gets in automatic optimization: it runs the step's
    forward and backward once, and gives the loss."""

    def __init__(self, run: Callable[[], Tensor | None]) -> None:
        self._run = run
        self.ran = False
        self.loss: Tensor | None = None

    def __call__(self) -> Tensor | None:
        self.loss = self._run()
        self.ran = True
        return self.loss


def _unwrapped(optimizer: torch.optim.Optimizer | LightningOptimizer) -> torch.optim.Optimizer:
    if isinstance(optimizer, lightning_classes("LightningOptimizer")):
        return cast(LightningOptimizer, optimizer).optimizer
    return cast(torch.optim.Optimizer, optimizer)


class _SimulatedOptimizer(LightningOptimizer):
    """What ``self.optimizers()`` gives in manual optimization, and an overridden ``optimizer_step`` in
    automatic optimization: Lightning's wrapper (its ``isinstance`` checks, ``.optimizer``,
    ``toggle_model``, ``step(closure)``) over a simulation's optimizer, without a strategy. In manual
    optimization its step is the runner's watched one: a closure runs just before it (what torch's step
    does first; the forward and backward inside keep their phases), or inside it for an optimizer
    that calls it again (L-BFGS). In automatic optimization it is the fit loop's step after the closure
    (unscaling, gradient clipping, the update)."""

    def __init__(self, optimizer: torch.optim.Optimizer, runner: LightningRunner) -> None:
        super().__init__(optimizer)
        self._runner = runner

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        self._runner._toggle(self._optimizer)
        yield
        self._runner._untoggle(self._optimizer)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        self._on_before_step()
        if self._runner.module.automatic_optimization:
            # From an overridden optimizer_step: the closure, then what the precision plugin does after
            # it (unscaling, clipping) and the update, as the fit loop's own step.
            with torch.enable_grad():
                result = closure() if closure is not None else None
            self._runner._optimizer_step(self._optimizer, _loss_of(result))
        elif closure is None:
            result = self._optimizer.step(**kwargs)
        elif isinstance(self._optimizer, torch.optim.LBFGS) and self._runner.scaler is None:
            result = self._optimizer.step(closure=closure, **kwargs)  # type: ignore[no-untyped-call]
        else:
            with torch.enable_grad():
                result = closure()
            self._optimizer.step(**kwargs)
        self._on_after_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The runner's watched zero_grad is the optimizer's own attribute; the class's would skip it.
        self._optimizer.zero_grad(set_to_none=set_to_none)


class _TrainingStep(nn.Module):
    """``training_step`` as a module's forward, for DDP to wrap (Lightning's wrapper does the same)."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)
