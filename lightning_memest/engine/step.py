"""The training step that is both simulated (on fake tensors) and measured (on real ones).

One definition serves the estimator and the ground truth, so the two can only differ in what the
kernels allocate, never in what the step does: forward and loss (under autocast for ``*-mixed``),
backward (through a ``GradScaler`` for ``16-mixed``, as Lightning does), ``optimizer.step()`` and
``optimizer.zero_grad(set_to_none=True)``.

Example:
    >>> import torch
    >>> from lightning_memest.engine.step import StepConfig, StepRunner
    >>> model = torch.nn.Linear(4, 2)
    >>> runner = StepRunner(model, StepConfig(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    >>> loss = runner.run(torch.randn(3, 4))
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_memest.constants import PRECISIONS, Precision
from lightning_memest.engine.events import Phase
from lightning_memest.engine.parallel.distributed import Strategy, pipeline_parts, wrap
from lightning_memest.engine.parallel.pipeline import Pipeline, PipelineRun
from lightning_memest.options import check_strategy

__all__ = [
    "PRECISIONS",
    "LossFn",
    "OptimizerFactory",
    "Precision",
    "Runner",
    "RunnerFactory",
    "StepConfig",
    "StepListener",
    "StepRunner",
    "autocast",
    "autocast_dtype",
    "call_model",
    "check_precision",
    "first_output",
    "optimizer_state_tensors",
    "plain_runner",
    "sum_loss",
    "true_dtype",
]


#: ``loss_fn(model, batch) -> loss``: forward and loss; the runner does the rest of the step.
LossFn = Callable[[nn.Module, Any], Tensor]
#: Anything that builds an optimizer from parameters: ``torch.optim.Adam`` or ``lambda ps: SGD(ps, lr=.1)``.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def first_output(out: Any) -> Tensor:
    """The tensor a loss is computed from, for models that return more than a tensor.

    A tuple or list gives its first tensor; a mapping its ``logits`` or ``out`` entry, else its first
    tensor value; an object with a ``logits`` attribute (Hugging Face outputs) that attribute.
    """
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping):
        for key in ("logits", "out"):
            if isinstance(out.get(key), Tensor):
                return out[key]  # type: ignore[no-any-return]
        values: Iterable[Any] = out.values()
    elif isinstance(out, (tuple, list)):
        values = out
    elif isinstance(getattr(out, "logits", None), Tensor):
        return out.logits  # type: ignore[no-any-return]
    else:
        raise TypeError(f"the model returned {type(out).__name__}, which holds no tensor to take a loss of")
    for value in values:
        if isinstance(value, Tensor):
            return value
        with contextlib.suppress(TypeError):
            return first_output(value)
    raise TypeError(f"the model returned a {type(out).__name__} that holds no tensor to take a loss of")


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch: a tensor as is, a tuple/list as positional, a mapping as keyword args."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def sum_loss(model: nn.Module, batch: Any) -> Tensor:
    """The default loss: the sum of the model's (first) output."""
    return first_output(call_model(model, batch)).sum()


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a ``*-mixed`` precision, ``None`` for the others."""
    return {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager[object]:
    """The forward context of a precision: autocast for ``*-mixed``, nothing otherwise.

    ``cache_enabled=False`` as in Lightning's ``MixedPrecision`` plugin: with the cache, the casts of
    the weights would stay alive until the context ends, which changes the peak.
    """
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def true_dtype(precision: str) -> torch.dtype | None:
    """The dtype a ``*-true`` precision converts parameters and float inputs to (``None`` for 32-true)."""
    return {"16-true": torch.float16, "bf16-true": torch.bfloat16}.get(precision)


def check_precision(precision: str) -> Precision:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    return precision  # type: ignore[return-value]


class StepListener(Protocol):
    """What the runner tells an observer (the fake-tensor tracker) as the step goes on."""

    def on_phase(self, phase: Phase, step: int) -> None: ...

    def on_gradients(self, grads: list[Tensor]) -> None: ...

    def on_optimizer_state(self, state: list[Tensor]) -> None: ...

    def on_communication(self, buffers: list[Tensor]) -> None: ...


@dataclass(frozen=True)
class StepConfig:
    """What one training step does, besides the model and the batch; validated when made.

    >>> StepConfig(precision="bf16")
    Traceback (most recent call last):
    ...
    ValueError: precision must be one of 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true; got 'bf16'
    """

    loss_fn: LossFn = sum_loss
    optimizer: OptimizerFactory | None = None
    precision: Precision = "32-true"
    strategy: Strategy | None = None
    """Data parallelism (``DDP`` / ``FSDP``): the model is wrapped, and ``loss_fn`` gets the wrapper."""

    def __post_init__(self) -> None:
        check_precision(self.precision)
        check_strategy(self.strategy)
        if not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch); got {self.loss_fn!r}")
        if self.optimizer is not None and not callable(self.optimizer):
            raise TypeError(f"optimizer must be an optimizer class or factory; got {self.optimizer!r}")


class Runner(Protocol):
    """Runs one training step (batch) each call: :class:`StepRunner`, or the Lightning adapter's."""

    def run(self, batch: Any) -> object: ...


#: Builds the runner of a simulation inside the fake mode (so that optimizers are created on the fake
#: parameters): ``factory(model, config, listener)``.
RunnerFactory = Callable[[nn.Module, StepConfig, StepListener], Runner]


def plain_runner(model: nn.Module, config: StepConfig, listener: StepListener) -> StepRunner:
    """The :data:`RunnerFactory` of the plain step (:class:`StepRunner`)."""
    return StepRunner(model, config, listener=listener)


class StepRunner:
    """Runs training steps of ``model`` with the optimizer built once, on the first step's parameters."""

    def __init__(self, model: nn.Module, config: StepConfig, listener: StepListener | None = None) -> None:
        self.config = config
        self.listener = listener
        self.device_type = _device_type(model)
        self.pipeline: PipelineRun | None = None
        if isinstance(config.strategy, Pipeline):
            if config.precision == "16-mixed":
                raise ValueError("Pipeline parallelism with 16-mixed (a GradScaler) is not simulated")
            on_buffers = listener.on_communication if listener is not None else None
            group, parallelize = pipeline_parts(model, config.strategy, on_buffers)
            self.pipeline = PipelineRun(model, config.strategy, group, parallelize)
            model = self.pipeline.module  # this rank's stage: what it holds and its optimizer updates
        elif config.strategy is not None:
            model = wrap(model, config.strategy, listener.on_communication if listener is not None else None)
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = config.optimizer(params) if config.optimizer is not None and params else None
        self.scaler: torch.amp.GradScaler | None = None
        if config.precision == "16-mixed":
            # Lightning's MixedPrecision plugin scales the loss for float16 (on any device).
            self.scaler = torch.amp.GradScaler(device=self.device_type)
        self.steps_run = 0

    def _phase(self, phase: Phase) -> None:
        if self.listener is not None:
            self.listener.on_phase(phase, self.steps_run)

    def run(self, batch: Any) -> Tensor:
        """One step; returns the (detached) loss."""
        self._phase(Phase.FORWARD)
        if self.pipeline is not None:
            # The schedule runs the microbatches' forwards and backwards, and their losses.
            with autocast(self.device_type, self.config.precision):
                loss = self.pipeline.step(batch, self._phase)
        else:
            with autocast(self.device_type, self.config.precision):
                loss = self.config.loss_fn(self.model, batch)
            if not isinstance(loss, Tensor):
                raise TypeError(f"the loss function returned {type(loss).__name__}, not a tensor")
            self._phase(Phase.BACKWARD)
            if loss.requires_grad:
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()  # type: ignore[no-untyped-call]
        if self.listener is not None:
            self.listener.on_gradients([p.grad for p in self.model.parameters() if p.grad is not None])
        if self.optimizer is not None:
            self._phase(Phase.OPTIMIZER)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.listener is not None:
                self.listener.on_optimizer_state(optimizer_state_tensors(self.optimizer))
        self._phase(Phase.ZERO_GRAD)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.model.parameters():
                p.grad = None
        self.steps_run += 1
        return loss.detach()


def _device_type(model: nn.Module) -> str:
    for t in itertools.chain(model.parameters(), model.buffers()):  # the first only: no list of all
        return t.device.type
    return "cpu"


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor an optimizer keeps in its ``state`` (momentum, Adam's moments, step counters)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
