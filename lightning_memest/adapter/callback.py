"""``MemEstimate``: the Lightning callback. Estimates on fit start, checks after the first steps.

The callback is thin: each hook reads the trainer's state, calls one function of the layers below,
and logs one report. Any failure becomes one warning; training goes on unchanged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_memest.adapter.fit import fit_setup
from lightning_memest.adapter.fit_batches import FitBatches
from lightning_memest.adapter.loggers import log_figures
from lightning_memest.adapter.summary import estimate_columns, footer_items, render_summary
from lightning_memest.batches import batch_size_of, iter_tensors
from lightning_memest.budget import PrecheckResult, device_budget, parse_size, precheck
from lightning_memest.engine.fake import local_tensor
from lightning_memest.engine.step import optimizer_state_tensors
from lightning_memest.errors import MemoryBudgetError
from lightning_memest.measure import StepProbe, live_tensors, module_tensors
from lightning_memest.report import StepEstimate, format_bytes

__all__ = ["CHECKED_STEPS", "MeasuredStep", "MemEstimate"]

_T = TypeVar("_T")

#: How many real training batches are measured: the first step and the steady state.
CHECKED_STEPS = 2
_PEAK_NAMES = ("first_step", "steady_state")


@dataclass(frozen=True)
class MeasuredStep:
    """The real peak of one training batch, as measured by the callback."""

    step: int
    peak_bytes: int
    reserved_bytes: int | None
    estimated_bytes: int

    @property
    def error_pct(self) -> float:
        """``(estimated - measured) / measured``, in percent."""
        return 100.0 * (self.estimated_bytes - self.peak_bytes) / self.peak_bytes


class MemEstimate(ModelSummary):
    """Estimates the memory of your ``training_step`` before it runs, then checks it against the device.

    On fit start the module's real ``training_step`` (with its ``configure_optimizers``, the
    trainer's precision, gradient accumulation and clipping) runs on fake tensors for two batches --
    no real compute, no real memory -- and the model summary shows the estimate. The first two real
    batches are then measured (CUDA: ``max_memory_allocated``/``max_memory_reserved``; CPU: the
    allocator's events in ``torch.profiler``), and estimated, measured and the error are logged:
    ``memest/first_step/{estimated_bytes,measured_bytes,error_pct}`` and the same under
    ``memest/steady_state/`` (plus ``estimated_reserved_bytes``/``measured_reserved_bytes`` on CUDA),
    and ``memest/flops/forward``,
    ``memest/flops/backward``. It sets ``pl_module.flops_per_batch`` (forward + backward FLOPs of one
    batch) unless you did, so ``ThroughputMonitor`` reports MFU. After the check it costs nothing.

    What real kernels allocate beyond their outputs (workspaces, reorders) is measured on the device
    the trainer trains on (``calibrate=True``, the default): each distinct op signature of the step
    runs once, alone, at its exact shapes -- a fraction of one real step, once per machine and shape
    (cached on disk; ``MEMEST_CACHE_DIR``). ``calibrate=False`` keeps to the hand-fitted kernel models.

    It takes the place of Lightning's ``ModelSummary`` (``max_depth`` and the other arguments mean
    the same). A failure while estimating or measuring is one warning, never an error.

    Before the first step it also compares the estimated peak with the memory the device has
    (``memory_check``: ``"warn"`` (default), ``"raise"`` -- a ``MemoryBudgetError`` that stops fit
    before any real step and names the largest batch size that fits --, or ``"off"``). The budget is
    ``memory_budget`` (bytes or ``"10GiB"``) or what ``budget.device_budget`` finds: CUDA's free
    memory less ``memory_margin_bytes`` and the caching allocator's overhead, or the CPU's available
    memory.

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> from lightning_memest import MemEstimate
        >>> memest = MemEstimate()
        >>> trainer = pl.Trainer(callbacks=[memest], max_steps=2, logger=False, enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=True)
        >>> trainer.fit(BoringModel())  # doctest: +SKIP
        >>> memest.measured[-1].error_pct  # doctest: +SKIP
        0.0
    """

    def __init__(
        self,
        max_depth: int = 1,
        *,
        check: bool = True,
        calibrate: bool = True,
        example_batch: Any = None,
        memory_check: Literal["off", "warn", "raise"] = "warn",
        memory_budget: int | str | None = None,
        memory_margin_bytes: int | None = None,
        **summarize_kwargs: Any,
    ) -> None:
        super().__init__(max_depth=max_depth, **summarize_kwargs)
        if memory_check not in ("off", "warn", "raise"):
            raise ValueError(f"memory_check must be 'off', 'warn' or 'raise'; got {memory_check!r}")
        self.check = check
        self.calibrate = calibrate
        self.example_batch = example_batch
        self.memory_check = memory_check
        self.memory_budget = memory_budget
        self.memory_margin_bytes = memory_margin_bytes
        self.estimate: StepEstimate | None = None
        """The estimate of the first two steps (``None`` before, or if it failed): made at the first
        training batch (on fit start with ``example_batch``), and again at the second where that batch
        needs other memory."""
        self.estimates: dict[tuple[tuple[int, ...], ...], StepEstimate] = {}
        """Every estimate made, by the batch shapes it is for (later batches larger than any before
        are estimated before their step)."""
        self.measured: list[MeasuredStep] = []
        """The measured first batches, once they ran."""
        self.setup_seconds: float | None = None
        """Wall seconds the estimate added to fit start (the batch, the simulation, the accounting)."""
        self._probe: StepProbe | None = None
        self._unseen: _UnseenBuckets | None = None
        self._steps_started = 0
        self._warned = False
        self._batches = FitBatches(calibrate)
        self._summarized = False
        self._trying = True  # estimating has not failed

    def describe(self) -> str:
        """What the callback found, in a few lines: the estimate, its cost, and the check.

        Example:
            >>> MemEstimate().describe()
            'MemEstimate: no estimate (fit has not started, or estimating failed)'
        """
        estimate = self.estimate
        if estimate is None:
            return "MemEstimate: no estimate (fit has not started, or estimating failed)"
        lines = [
            f"MemEstimate ({estimate.device}, {estimate.precision}): the estimate added "
            f"{self.setup_seconds or 0.0:.2f} s to fit start ({estimate.estimate_seconds:.2f} s simulating "
            f"{len(estimate.peaks)} steps)"
        ]
        for m in self.measured:
            lines.append(
                f"  step {m.step}: estimated {format_bytes(m.estimated_bytes)}, "
                f"measured {format_bytes(m.peak_bytes)} ({m.error_pct:+.2f} %)"
            )
        if not self.measured:
            lines += [
                f"  step {p.step}: estimated {format_bytes(p.bytes)} (not measured)" for p in estimate.peaks
            ]
        return "\n".join(lines)

    # --- estimates: from the batches training gets; then the summary --------------------------------------
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A new fit: nothing of an earlier one carries over.
        self.estimate, self.estimates, self.measured, self.setup_seconds = None, {}, [], None
        self._batches = FitBatches(self.calibrate)
        self._summarized, self._trying, self._warned = False, True, False
        self._probe, self._steps_started = None, 0
        if self.example_batch is None:
            return  # estimated at the first training batch, with the batch in hand
        example = pl_module.on_before_batch_transfer(self.example_batch, 0)
        self._first_estimate(trainer, pl_module, example, given=True)

    def _first_estimate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *, given: bool
    ) -> None:
        start = time.perf_counter()
        self.estimate = self._safely(
            "estimating", lambda: self._batches.estimate_first(trainer, pl_module, batch, given=given)
        )
        self.setup_seconds = time.perf_counter() - start
        self._trying = self.estimate is not None
        if self.estimate is not None:
            self._note(self.estimate)
            _set_flops_per_batch(pl_module, self.estimate)
            self._log_estimate(trainer, self.estimate)
        self._summarize(trainer, pl_module)
        if self.estimate is not None:
            # Not through _safely: with memory_check="raise" the error must stop fit before any step.
            self._precheck(trainer, pl_module, batch, self.estimate, transferred=not given)

    def _note(self, estimate: StepEstimate) -> None:
        for shapes in estimate.batch_shapes or ():
            self.estimates[shapes] = estimate

    def _summarize(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._max_depth and not self._summarized:
            self._summarized = True
            self._safely("printing the model summary", lambda: self._print_summary(trainer, pl_module))

    def _precheck(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        estimate: StepEstimate,
        *,
        transferred: bool,
    ) -> None:
        if self.memory_check == "off":
            return
        result = self._safely(
            "checking the memory budget", lambda: self._fits(trainer, pl_module, batch, estimate, transferred)
        )
        fits = True if result is None else result.fits
        # Under DDP every rank must decide alike, or the ranks that go on would wait for the others.
        if trainer.strategy.reduce_boolean_decision(fits, all=True):
            return
        if result is None:  # fits here, not on another rank
            error = MemoryBudgetError(
                "the estimate is over the memory budget on another rank",
                peak_bytes=estimate.peak_bytes,
                budget_bytes=0,
            )
        else:
            error = result.error()
        if self.memory_check == "raise":
            raise error
        rank_zero_warn(f"MemEstimate: {error}")

    def _fits(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        estimate: StepEstimate,
        transferred: bool,
    ) -> PrecheckResult:
        fit = fit_setup(trainer, pl_module, batch, transferred=transferred)
        if self.memory_budget is not None:
            budget = (
                parse_size(self.memory_budget) if isinstance(self.memory_budget, str) else self.memory_budget
            )
        else:
            # What the estimate counts that already takes memory is given back (the CPU's available
            # memory no longer shows it; CUDA's reserved bytes do).
            resident = estimate.first_step.breakdown.parameters + estimate.first_step.breakdown.buffers
            resident += estimate.first_step.breakdown.other_tensors
            budget = device_budget(
                fit.device,
                margin_bytes=self.memory_margin_bytes,
                resident_bytes=resident if fit.device.type == "cpu" else 0,
            )
        size = batch_size_of(fit.batch)

        def max_fit() -> int | None:
            # The largest batch size that fits: a search, worth trying, not worth failing the check for.
            try:
                return fit.max_batch_size(budget, batch_size=size).max_batch_size
            except Exception:
                return None

        return precheck(estimate, budget, batch_size=size, max_fit=max_fit)

    def _print_summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = self._summary(trainer, pl_module)
        data = summary._get_summary_data()
        footer: list[tuple[str, str]] = []
        if self.estimate is not None:
            data += estimate_columns(data[1][1], self.estimate)
            footer = footer_items(self.estimate)
        if trainer.is_global_zero:
            render_summary(
                data,
                summary.total_parameters,
                summary.trainable_parameters,
                summary.model_size,
                summary.total_training_modes,
                getattr(summary, "total_flops", 0),
                footer,
            )

    # --- each training batch: estimate what is new, measure the first ones -----------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        measuring = self._probe is not None and trainer.strategy.root_device.type == "cpu"
        if self._trying and self.estimate is None:
            self._first_estimate(trainer, pl_module, batch, given=False)
        elif self._trying and self._steps_started == 1:
            self._second_estimate(trainer, pl_module, batch, measuring)
        elif self._trying and self._steps_started > 1:
            self._later_estimate(trainer, pl_module, batch)
        if self.check and self.estimate is not None and self._steps_started < CHECKED_STEPS:
            self._start_measuring(trainer, pl_module, batch)
        else:
            self._steps_started += 1

    def _second_estimate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, measuring: bool
    ) -> None:
        """Step 2 runs on this batch: where it needs other memory than the first, estimate the two steps
        as they come (what the check of step 2 compares with)."""
        both = self._safely(
            "estimating the second batch",
            lambda: self._batches.estimate_second(trainer, pl_module, batch, measuring=measuring),
        )
        if both is not None:
            self.estimate = both
            self._note(both)
            self._log_estimate(trainer, both)

    def _later_estimate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """A batch larger than any estimated so far: its estimate, logged and checked before its step."""
        larger = self._safely(
            "estimating a larger batch", lambda: self._batches.estimate_if_larger(trainer, pl_module, batch)
        )
        if larger is None:
            return
        self._note(larger)
        self._log(
            trainer,
            {"memest/larger_batch/estimated_bytes": float(larger.peak_bytes)},
            step=trainer.global_step,
        )
        self._precheck(trainer, pl_module, batch, larger, transferred=True)

    def _start_measuring(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        device = trainer.strategy.root_device
        if self._probe is None:
            if device.type == "cpu":
                os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop chatter
            self._probe = StepProbe(device)
        probe = self._probe

        def start() -> bool:
            self._unseen = _UnseenBuckets.at_step_start(trainer)
            probe.start(_resident_tensors(trainer, pl_module, batch, own=self._batches.first))
            return True

        if self._safely("measuring", start):
            self._steps_started += 1
        else:
            self.check = False
            self._steps_started += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        probe = self._probe
        if probe is None or not self.check or self._steps_started > CHECKED_STEPS:
            return

        def stop() -> bool:
            unseen = self._unseen
            probe.stop(unseen.bytes_at_step_end() if unseen is not None else 0)
            return True

        if self._safely("measuring", stop) is None:
            self.check = False
        elif self._steps_started == CHECKED_STEPS:
            self._finish(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe is not None and self._steps_started:  # fewer batches than CHECKED_STEPS
            self._finish(trainer)
        self._summarize(trainer, pl_module)  # no training batch ran: the summary without an estimate

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # fit is failing (not because of us): give the garbage collector back, measure nothing more.
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()

    def _finish(self, trainer: pl.Trainer) -> None:
        """Read the measured steps (the CPU profiler runs across them), compare, log."""
        probe, self._probe = self._probe, None
        self._steps_started = CHECKED_STEPS + 1  # nothing more to measure
        results = self._safely("measuring", probe.finish) if probe is not None else None
        if results is None or self.estimate is None:
            return
        for step, result in enumerate(results):
            peak, reserved = _max_over_ranks(trainer, result)
            measured = MeasuredStep(step + 1, peak, reserved, self.estimate.peaks[step].bytes)
            self.measured.append(measured)
            self._safely("logging", lambda m=measured: self._log_measured(trainer, m))  # type: ignore[misc]
        self._safely("logging to TensorBoard", lambda: self._log_tensorboard(trainer, final=True))

    # --- logging -------------------------------------------------------------------------------------------
    def _log_estimate(self, trainer: pl.Trainer, estimate: StepEstimate) -> None:
        metrics = {
            f"memest/{name}/estimated_bytes": float(p.bytes)
            for name, p in zip(_PEAK_NAMES, estimate.peaks, strict=False)
        }
        if estimate.flops is not None:
            metrics["memest/flops/forward"] = float(estimate.flops.forward)
            metrics["memest/flops/backward"] = float(estimate.flops.backward or 0)
        self._log(trainer, metrics, step=0)
        self._safely("logging to TensorBoard", lambda: self._log_tensorboard(trainer, final=False))

    def _log_tensorboard(self, trainer: pl.Trainer, final: bool) -> None:
        estimate = self.estimate
        if estimate is None or not trainer.is_global_zero:
            return
        measured = [m.peak_bytes for m in self.measured] if final else None
        log_figures(trainer.loggers, estimate, measured, final=final)

    def _log_measured(self, trainer: pl.Trainer, measured: MeasuredStep) -> None:
        name = _PEAK_NAMES[measured.step - 1]
        metrics = {
            f"memest/{name}/estimated_bytes": float(measured.estimated_bytes),
            f"memest/{name}/measured_bytes": float(measured.peak_bytes),
            f"memest/{name}/error_pct": measured.error_pct,
        }
        if measured.reserved_bytes is not None:
            metrics[f"memest/{name}/measured_reserved_bytes"] = float(measured.reserved_bytes)
        if self.estimate is not None and self.estimate.reserved_bytes is not None:
            estimated = self.estimate.reserved_bytes[measured.step - 1]
            metrics[f"memest/{name}/estimated_reserved_bytes"] = float(estimated)
        self._log(trainer, metrics, step=measured.step)

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    # --- never in the way ----------------------------------------------------------------------------------
    def _safely(self, what: str, fn: Callable[[], _T]) -> _T | None:
        try:
            return fn()
        except Exception as exc:  # any failure must leave training alone
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"MemEstimate: {what} failed, training goes on without it: {type(exc).__name__}: {exc}"
                )
            return None


def _set_flops_per_batch(pl_module: pl.LightningModule, estimate: StepEstimate) -> None:
    """Lightning's ThroughputMonitor reads ``flops_per_batch`` to report MFU; a user's value wins."""
    if estimate.flops is not None and getattr(pl_module, "flops_per_batch", None) is None:
        setattr(pl_module, "flops_per_batch", estimate.flops.forward + (estimate.flops.backward or 0))  # noqa: B010


@dataclass(frozen=True)
class _UnseenBuckets:
    """DDP's gradient buckets, for the CPU ground truth: allocated when DDP wrapped the model (before the
    profiler started, so it never sees them) and named by no tensor the callback can reach -- but DDP
    reports their sizes. DDP re-buckets once, early in the second step; the profiler sees the new
    buckets allocated then (and not the old ones freed), so a step in which that happened needs
    nothing added."""

    ddp: DistributedDataParallel
    rebuilt_at_start: bool
    grads_are_buckets: bool

    @staticmethod
    def at_step_start(trainer: pl.Trainer) -> _UnseenBuckets | None:
        ddp = getattr(trainer.strategy, "model", None)
        if not isinstance(ddp, DistributedDataParallel) or trainer.strategy.root_device.type != "cpu":
            return None
        # With gradient_as_bucket_view, existing gradients are views of the buckets: already counted.
        views = ddp.gradient_as_bucket_view and any(p.grad is not None for p in ddp.parameters())
        return _UnseenBuckets(ddp, bool(ddp._has_rebuilt_buckets), views)

    def bytes_at_step_end(self) -> int:
        if self.grads_are_buckets or bool(self.ddp._has_rebuilt_buckets) != self.rebuilt_at_start:
            return 0
        sizes = str(self.ddp._get_ddp_logging_data().get("bucket_sizes", ""))  # type: ignore[no-untyped-call]
        return sum(int(n) for n in sizes.replace(",", " ").split())


def _resident_tensors(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, own: Any
) -> list[Tensor]:
    """What is resident at a step's start, for the CPU ground truth: the module's tensors (plain tensor
    attributes too: a cache a module made in the first step is resident in the second), the optimizers'
    state, the batch, and every other live tensor on the device (``own``, the callback's light copy of a
    batch, aside)."""
    state = [local_tensor(t) for optimizer in trainer.optimizers for t in optimizer_state_tensors(optimizer)]
    mine = [*module_tensors(pl_module), *state, *iter_tensors(batch)]
    if trainer.strategy.root_device.type != "cpu":
        return mine
    return [*mine, *live_tensors(trainer.strategy.root_device, besides=[*mine, *iter_tensors(own)])]


def _max_over_ranks(trainer: pl.Trainer, result: tuple[int, int | None]) -> tuple[int, int | None]:
    """Under DDP every rank measures its own step; the peak that matters is the largest."""
    if trainer.world_size == 1:
        return result
    peak, reserved = result
    values = torch.tensor([peak, reserved or 0], dtype=torch.float64, device=trainer.strategy.root_device)
    reduced = trainer.strategy.reduce(values, reduce_op="max")
    return int(reduced[0].item()), None if reserved is None else int(reduced[1].item())
