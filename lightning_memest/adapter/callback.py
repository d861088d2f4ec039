"""``MemEstimate``: the Lightning callback. Estimates on fit start, checks after the first steps.

The callback is thin: each hook reads the trainer's state, calls one function of the layers below,
and logs one report. Any failure becomes one warning; training goes on unchanged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from torch import Tensor
from typing_extensions import override

from lightning_memest.adapter.budget_check import BudgetCheck
from lightning_memest.adapter.ddp_buckets import UnseenBuckets
from lightning_memest.adapter.describe import SetupCost, describe_checks
from lightning_memest.adapter.fit_advice import apply_plan, replan, training_check
from lightning_memest.adapter.fit_batches import FitBatches, resident_at_start
from lightning_memest.adapter.gloo_exit import settle_gloo_workers_at_exit
from lightning_memest.adapter.guard import Guard, attempt
from lightning_memest.adapter.loggers import log_scalars
from lightning_memest.adapter.loggers.fit_log import FitLog
from lightning_memest.adapter.loggers.scalars import (
    estimate_scalars,
    logging_step,
)
from lightning_memest.adapter.loop_checks import LoopChecks
from lightning_memest.adapter.loop_hooks import LoopHooks
from lightning_memest.adapter.options import check_options
from lightning_memest.adapter.ranks import max_over_ranks
from lightning_memest.adapter.summary import restore_summaries, show_summary, silence_other_summaries
from lightning_memest.batches import iter_tensors
from lightning_memest.budget import PrecheckResult
from lightning_memest.measure import LiveTensorScan, StepProbe
from lightning_memest.plan import CheckpointPlan
from lightning_memest.report import MeasuredStep, Peak, StepEstimate

__all__ = ["CHECKED_STEPS", "MeasuredStep", "MemEstimate", "SetupCost"]

_T = TypeVar("_T")

#: How many real training batches are measured: the first step and the steady state.
CHECKED_STEPS = 2


class MemEstimate(LoopHooks, ModelSummary):
    """Estimates the memory of your ``training_step`` before it runs, then checks it against the device.

    At the first training batch, before it runs, the module's real ``training_step`` (with its
    ``configure_optimizers``, the trainer's precision, accumulation and clipping) runs on that batch on
    fake tensors for two steps -- no real compute or memory, nothing drawn from the loader -- and the
    model summary shows the estimate (``example_batch=``: at fit start, for a batch you give). A later
    batch larger than any before is estimated, and checked, before its step. The first two real batches
    are measured (CUDA: ``max_memory_allocated``/``_reserved``; CPU: the allocator's events in
    ``torch.profiler``), on CUDA every later one too (peak statistics reset at each batch's start), and
    logged at the batch's step: ``memest/peak_MiB/{estimate,measured}`` (the first batch's under
    ``memest/first_step/``), ``memest/error_pct``,
    ``memest/GFLOP_per_batch/{forward,backward}`` (and ``memest/reserved_MiB/...`` on CUDA; see
    ``adapter/loggers``). It sets ``pl_module.flops_per_batch`` unless you did (``ThroughputMonitor``'s
    MFU).

    The other loops' first batches -- the sanity check, validation, ``trainer.test``, ``trainer.predict``
    -- are estimated before they run (eval mode, with the training state alive through them), checked
    against the budget and measured (:attr:`loop_estimates`, :attr:`loop_measured`,
    ``memest/<loop>/...``).

    Kernels' memory beyond their outputs (workspaces, reorders) is measured on the device
    (``calibrate=True``, the default): each distinct op signature runs once, alone, at its shapes, a
    fraction of one real step, cached per machine (``MEMEST_CACHE_DIR``). Runs of six or more alike
    blocks (a decoder's layers) are simulated a few blocks each and replayed for the rest where they
    repeat (``replay_blocks=True``, the default; the same figures, see ``estimate_step``).

    It takes the place of Lightning's ``ModelSummary`` (``max_depth`` and ``header_style`` as there). A
    failure while estimating or measuring is one warning, the same on every rank, never an error; an
    exception of your own (or Ctrl+C) reaches you unchanged, the profiler stopped, the collector on.

    Before the first step it compares the estimated peak with the budget (``memory_check``: ``"warn"``
    (default), ``"raise"`` -- a ``MemoryBudgetError`` before any real step --, or ``"off"``):
    ``memory_budget`` (bytes, ``"10GiB"``, ``"80%"`` of the device) or what ``budget.device_budget``
    finds (CUDA's free memory less ``memory_margin_bytes`` and the allocator's overhead; the CPU's
    available memory). Over it, the warning or error lists what would fit, each estimated as the step
    was: the largest batch size, an activation-checkpointing plan (``MemoryBudgetError.options``;
    ``checkpointing="auto"`` applies the plan before the first step, :attr:`plan`, and the measured
    steps check it), ``bf16-mixed`` for a ``32-true`` fit, FSDP over several GPUs.

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
        checkpointing: Literal["off", "auto"] = "off",
        replay_blocks: bool = True,
        **summarize_kwargs: Any,
    ) -> None:
        budget = check_options(
            max_depth=max_depth,
            memory_check=memory_check,
            checkpointing=checkpointing,
            memory_budget=memory_budget,
            margin_bytes=memory_margin_bytes,
            flags={"check": check, "calibrate": calibrate, "replay_blocks": replay_blocks},
            summarize_kwargs=summarize_kwargs,
        )
        super().__init__(max_depth=max_depth, **summarize_kwargs)
        self.check = check
        self.calibrate = calibrate
        self.example_batch = example_batch
        self.memory_check = memory_check
        self.memory_budget = budget
        """The budget the pre-check compares with (bytes, or a share of what the device has); ``None``:
        what the device has."""
        self.memory_margin_bytes = memory_margin_bytes
        self.checkpointing = checkpointing
        self.replay_blocks = replay_blocks
        self.plan: CheckpointPlan | None = None
        """The checkpointing plan ``checkpointing="auto"`` applied (``None``: none was needed, or none
        fitted)."""
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
        """Wall seconds the first estimate added to fit start (:attr:`setup_cost` says what to)."""
        self.setup_cost: SetupCost | None = None
        """What the first estimate's :attr:`setup_seconds` went to: simulating, calibrating the kernels,
        finding the other live tensors, the rest."""
        self._probe: StepProbe | None = None
        self._unseen: UnseenBuckets | None = None
        self._measure_failure: str | None = None  # why this rank's measurement stopped, if it did
        self._steps_started = 0
        self._against: list[Peak] = []  # what each measured step is checked against
        self._guard = Guard()
        self._batches = FitBatches(calibrate, replay_blocks)
        self._summarized = False
        self._trying = True  # estimating has not failed
        self._silenced: list[tuple[ModelSummary, int]] = []  # other summaries, off for this fit
        self._rich: bool | None = None  # the summary's style: Rich, plain, or as Lightning picks
        self._fit_log = FitLog()
        self._loops = LoopChecks(calibrate)

    @property
    def loop_estimates(self) -> dict[str, StepEstimate]:
        """The estimate of the first batch of each loop besides training, by loop name:
        ``sanity_check``, ``validate`` (a fit's validation or ``trainer.validate``), ``test``,
        ``predict``; each ``StepEstimate.loop`` says which step it ran (``validate``/``test``/
        ``predict``). A new call of a loop replaces its estimate."""
        return self._loops.estimates

    @property
    def loop_measured(self) -> dict[str, MeasuredStep]:
        """The measured first batch of each loop besides training, by loop name (as
        :attr:`loop_estimates`)."""
        return self._loops.measured

    def describe(self) -> str:
        """What the callback found, in a few lines: the estimate, its cost, and the check.

        Example:
            >>> MemEstimate().describe()
            'MemEstimate: no estimate (fit has not started, or estimating failed)'
        """
        return describe_checks(
            self.estimate, self.setup_cost, self.measured, self.loop_estimates, self.loop_measured
        )

    # --- estimates: from the batches training gets; then the summary --------------------------------------
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A new fit: nothing of an earlier one carries over.
        self.estimate, self.estimates, self.measured, self.setup_seconds = None, {}, [], None
        self.setup_cost, self.plan = None, None
        self._batches = FitBatches(self.calibrate, self.replay_blocks)
        self._batches.scan = self._loops.scan  # this call's (setup)
        self._summarized, self._trying, self._guard = False, True, Guard()
        self._close_probe()  # an earlier fit that ended inside its measured steps
        self._steps_started, self._measure_failure = 0, None
        self._against = []
        self._fit_log = FitLog()
        self._loops.reset()
        self._safely("logging to TensorBoard", lambda: self._fit_log.hparams(trainer))  # before Lightning's
        if self.example_batch is None:
            return  # estimated at the first training batch, with the batch in hand
        example = pl_module.on_before_batch_transfer(self.example_batch, 0)
        self._first_estimate(trainer, pl_module, example, 0, given=True)

    def _first_estimate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, *, given: bool
    ) -> None:
        start = time.perf_counter()
        self.estimate = self._together(
            trainer,
            "estimating",
            lambda: self._batches.estimate_first(trainer, pl_module, batch, given=given, batch_idx=batch_idx),
        )
        self.setup_seconds = time.perf_counter() - start
        self._trying = self.estimate is not None
        if self.estimate is not None:
            self.setup_cost = SetupCost.of(self.estimate, self.setup_seconds, self._batches.scan_seconds)
            if self.checkpointing == "auto":
                self._auto_checkpointing(trainer, pl_module, self.estimate)
            self._note(self.estimate)
            _set_flops_per_batch(pl_module, self.estimate)
            self._log_estimate(trainer, self.estimate)
        self._summarize(trainer, pl_module)
        if self.estimate is not None:
            # Not through _safely: with memory_check="raise" the error must stop fit before any step.
            estimate = self.estimate
            self._budget().act(
                trainer,
                self._guard,
                estimate,
                lambda: self._training_fits(trainer, pl_module, estimate),
            )

    def _auto_checkpointing(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, estimate: StepEstimate
    ) -> None:
        """``checkpointing="auto"``: the plan applied before the first step (``fit_advice.apply_plan``)."""
        plan = apply_plan(trainer, pl_module, self._batches, self._budget(), self._guard, estimate)
        if plan is not None:
            self.plan, self.estimate = plan, plan.estimate

    def _note(self, estimate: StepEstimate) -> None:
        for shapes in estimate.batch_shapes or ():
            self.estimates[shapes] = estimate

    def _summarize(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._max_depth and not self._summarized:
            self._summarized = True
            self._safely("printing the model summary", lambda: self._print_summary(trainer, pl_module))

    def _budget(self) -> BudgetCheck:
        return BudgetCheck(self.memory_check, self.memory_budget, self.memory_margin_bytes)

    def _training_fits(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, estimate: StepEstimate
    ) -> PrecheckResult:
        """``estimate`` against the budget; where it is over, the largest batch size and what else
        would fit, each estimated as this one was (``adapter/fit_advice.py``)."""
        return training_check(trainer, pl_module, self._batches, self._budget(), estimate)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        settle_gloo_workers_at_exit()  # a PyTorch race at a gloo rank's exit (see adapter/gloo_exit.py)
        # One scan for other live tensors per trainer call: a full collection at its first use only.
        self._loops.scan = LiveTensorScan()
        # One summary table, this one: a ModelSummary or RichModelSummary passed beside it would print
        # a second (without the estimate); it is silenced for the fit, and its style is kept.
        if stage == "fit":
            restore_summaries(self._silenced)
            callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
            self._silenced, self._rich = silence_other_summaries(callbacks, self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        restore_summaries(self._silenced)
        self._silenced = []

    def _print_summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            show_summary(
                self._summary(trainer, pl_module),
                self.estimate,
                self.loop_estimates,
                rich=self._rich,
                header_style=self._summarize_kwargs.get("header_style"),
                progress_bar=trainer.progress_bar_callback,  # printed through it, never across it
            )

    # --- each training batch: estimate what is new, measure the first ones -----------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        measuring = self._probe is not None and trainer.strategy.root_device.type == "cpu"
        if self._trying and self.estimate is None:
            self._first_estimate(trainer, pl_module, batch, batch_idx, given=False)
        elif self._trying and self._steps_started == 1:
            self._second_estimate(trainer, pl_module, batch, batch_idx, measuring)
        elif self._trying and self._steps_started > 1:
            self._later_estimate(trainer, pl_module, batch, batch_idx)
        others = self._batches.take_others(batch)  # what the estimate of this batch just found
        if self.check and self.estimate is not None and self._steps_started < CHECKED_STEPS:
            self._fit_log.measured_at.append(logging_step(trainer))
            self._start_measuring(trainer, pl_module, batch, others)
        else:
            self._steps_started += 1
            if self._every_step(trainer):
                self._safely(
                    "measuring", lambda: self._fit_log.step_peaks.start(trainer.strategy.root_device)
                )

    def _second_estimate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, measuring: bool
    ) -> None:
        """Step 2 runs on this batch: where it may need other memory than the first (other shapes,
        values or ``batch_idx``), estimate the two steps as they come (what the check of step 2
        compares with)."""
        probe = self._probe
        if measuring and self.calibrate and probe is not None and self._batches.needs_second(batch):
            # Between the measured steps: the CPU profile closes so that the estimate's calibration may
            # measure the kernels the first batch did not run (the next step opens another).
            self._safely("measuring", probe.pause)
            measuring = probe.profiling
        both = self._together(
            trainer,
            "estimating the second batch",
            lambda: self._batches.estimate_second(
                trainer, pl_module, batch, measuring=measuring, batch_idx=batch_idx
            ),
        )
        if both is not None:
            both = self._replanned(trainer, pl_module, both)
            self.estimate = both
            self._note(both)
            self._log_estimate(trainer, both)
            self._check_later(trainer, pl_module, both)

    def _later_estimate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """A batch larger than any estimated so far: its estimate, logged and checked before its step."""
        larger = self._safely(
            "estimating a larger batch",
            lambda: self._batches.estimate_if_larger(trainer, pl_module, batch, batch_idx),
        )
        if larger is None:
            return
        larger = self._replanned(trainer, pl_module, larger)
        self._note(larger)
        scalars = estimate_scalars(larger.peak_bytes, flops=larger.flops)
        log_scalars(trainer.loggers, scalars, logging_step(trainer))
        self._check_later(trainer, pl_module, larger)

    def _replanned(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, estimate: StepEstimate
    ) -> StepEstimate:
        """``checkpointing="auto"``: where a later batch's estimate is over the budget, the plan made
        again for it and applied before it runs (``fit_advice.replan``); the estimate the batch then
        runs with."""
        if self.checkpointing != "auto":
            return estimate
        plan = self._safely(  # taking a plan off or putting one on must not stop the fit either
            "planning activation checkpointing",
            lambda: replan(
                trainer, pl_module, self._batches, self._budget(), self._guard, estimate, self.plan
            ),
        )
        if plan is None:
            return estimate
        self.plan = plan
        return plan.estimate

    def _check_later(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, estimate: StepEstimate
    ) -> None:
        """A later batch's estimate against the budget, before its step: on the rank that has the batch
        (under DDP a warning, as ``BudgetCheck.act`` says)."""
        self._budget().act(
            trainer,
            self._guard,
            estimate,
            lambda: self._training_fits(trainer, pl_module, estimate),
            everywhere=False,
        )

    def _start_measuring(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, others: list[Tensor] | None
    ) -> None:
        device = trainer.strategy.root_device
        if self._probe is None:
            if device.type == "cpu":
                os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop chatter
            self._probe = StepProbe(device)
        probe = self._probe
        # The estimate this step is checked against, as it stands when the step starts (a later plan,
        # made for a larger batch, is not what an earlier step ran with).
        if self.estimate is not None:
            self._against.append(self.estimate.peaks[min(self._steps_started, len(self.estimate.peaks) - 1)])
        self._steps_started += 1
        if self._measure_failure is not None:
            return  # failed before: nothing measured, and _finish still agrees with the other ranks

        def start() -> None:
            self._unseen = UnseenBuckets.at_step_start(trainer)
            # A later step's scan: the collector has been off since the probe's full collection.
            resident = resident_at_start(
                trainer, pl_module, batch, own=self._batches.first, others=others, young=probe.collector_off
            )
            probe.start(resident)

        self._measure_failure = attempt("measuring", start)[1]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._every_step(trainer):
            self._safely("measuring", lambda: self._log_step_peak(trainer, batch))
        elif self._steps_started > CHECKED_STEPS and self.estimate is not None:  # a line over the training
            self._safely("logging", lambda: self._fit_log.step_estimate(trainer, self._estimate_of(batch)))
        probe = self._probe
        if probe is None or self._steps_started > CHECKED_STEPS:
            return

        def stop() -> None:
            unseen = self._unseen
            probe.stop(unseen.bytes_at_step_end() if unseen is not None else 0)

        if self._measure_failure is None:
            self._measure_failure = attempt("measuring", stop)[1]
        if self._steps_started == CHECKED_STEPS:
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
        # fit is failing (the user's exception, or an interrupt): measure nothing more, and leave the
        # profiler stopped and the garbage collector on -- a profiler open at exit crashes the process.
        self._close_probe()
        attempt("measuring", self._loops.close)
        restore_summaries(self._silenced)
        self._silenced = []

    def _close_probe(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            attempt("measuring", probe.close)  # never in the way of the exception fit is raising

    def _finish(self, trainer: pl.Trainer) -> None:
        """Read the measured steps (the CPU profiler runs across them), compare, log. Every rank comes
        here at the same batch; a failure on any rank is one warning on all of them."""
        probe, self._probe = self._probe, None
        self._steps_started = CHECKED_STEPS + 1  # nothing more to measure
        if probe is None:
            return
        results = self._guard.agreed_measurement(trainer, self._measure_failure, probe.finish, probe.close)
        estimate = self.estimate
        if results is None or estimate is None:
            return
        # Each measured step against the estimate of the same step (a fit shorter than the checked
        # steps measures fewer). Every rank has as many results: the ranks reduce alike.
        for result, estimated in zip(results, self._against, strict=False):
            peak, reserved = max_over_ranks(trainer, result)
            measured = MeasuredStep(estimated.step, peak, reserved, estimated.bytes)
            self.measured.append(measured)
            self._safely("logging", lambda m=measured: self._fit_log.measured(trainer, estimate, m))  # type: ignore[misc]
        self._safely(
            "logging to TensorBoard", lambda: self._fit_log.figures(trainer, self.estimate, self.measured)
        )

    # --- logging: adapter/loggers/fit_log.py ---------------------------------------------------------------
    def _log_estimate(self, trainer: pl.Trainer, estimate: StepEstimate) -> None:
        self._fit_log.estimate(trainer, estimate, index=self._steps_started)
        self._safely("logging to TensorBoard", lambda: self._fit_log.figures(trainer, self.estimate, None))

    def _every_step(self, trainer: pl.Trainer) -> bool:
        """On CUDA, once the first steps are measured, each batch's peak is too (``StepPeaks``)."""
        cuda = trainer.strategy.root_device.type == "cuda"
        return cuda and self.check and bool(self.measured) and self._steps_started > CHECKED_STEPS

    def _log_step_peak(self, trainer: pl.Trainer, batch: Any) -> None:
        self._fit_log.step_peak(trainer, self._estimate_of(batch))

    def _estimate_of(self, batch: Any) -> StepEstimate | None:
        """The estimate made for ``batch``'s shapes (the first estimate where none was)."""
        shapes = tuple(tuple(t.shape) for t in iter_tensors(batch))
        return self.estimates.get(shapes, self.estimate)

    # --- never in the way: adapter/guard.py -------------------------------------------------------------
    def _safely(self, what: str, fn: Callable[[], _T]) -> _T | None:
        return self._guard.safely(what, fn)

    def _together(self, trainer: pl.Trainer, what: str, fn: Callable[[], _T]) -> _T | None:
        return self._guard.together(trainer, what, fn)


def _set_flops_per_batch(pl_module: pl.LightningModule, estimate: StepEstimate) -> None:
    """Lightning's ThroughputMonitor reads ``flops_per_batch`` to report MFU; a user's value wins."""
    if estimate.flops is not None and getattr(pl_module, "flops_per_batch", None) is None:
        setattr(pl_module, "flops_per_batch", estimate.flops.forward + (estimate.flops.backward or 0))  # noqa: B010
