"""The trainer, read once: what a fit does with a training batch, and the estimator's entry points for it.

:func:`fit_setup` reads everything the simulation needs from a ``Trainer`` -- the precision, the
strategy (as the engine's ``DDP``/``FSDP``), the device, gradient accumulation and clipping, the
precision plugin's step context, a training batch -- into a frozen :class:`FitSetup`. Its methods are
what the callbacks call: :meth:`FitSetup.estimate` (the training batch's ``StepEstimate``),
:meth:`FitSetup.simulate`, and :meth:`FitSetup.max_batch_size` (the batch-size search over the module's
own ``training_step``). :func:`first_batch` takes one batch of the train dataloader as the fit loop
would.

Example (in a callback's ``on_fit_start``, where the module is attached and on its device)::

    estimate = fit_setup(trainer, pl_module).estimate()
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor, nn

from lightning_memest.accounting import capture_filter
from lightning_memest.adapter.batch_index import IndexReads
from lightning_memest.adapter.package import is_lightning_module, lightning_classes
from lightning_memest.adapter.runner import LightningRunner
from lightning_memest.adapter.weight_averaging import WeightAveragingMirror
from lightning_memest.engine.parallel.arrived import arrived_model_parallel
from lightning_memest.engine.parallel.distributed import DDP, Strategy
from lightning_memest.engine.simulate import Simulation, simulate, simulate_replaying
from lightning_memest.engine.step import Precision, StepConfig, StepListener, autocast, check_precision
from lightning_memest.errors import EstimationError
from lightning_memest.report import StepEstimate
from lightning_memest.search import DEFAULT_CAP, BatchSizeResult, Progress
from lightning_memest.search.sizing import Calibrate, SizedStep

__all__ = ["FitSetup", "dataset_length", "first_batch", "fit_setup", "train_loader"]


@dataclass(frozen=True, eq=False)
class FitSetup:
    """What ``fit`` does with a training batch of its module, read from the trainer once
    (:func:`fit_setup`)."""

    module: pl.LightningModule
    """The module being fit, attached to the trainer."""
    batch: Any
    """A training batch as the train dataloader yields it (:func:`first_batch`, unless given)."""
    config: StepConfig
    """The precision and the strategy (the loss and the optimizers are the module's own)."""
    device: torch.device
    """The device the trainer trains on (``strategy.root_device``)."""
    accumulate_grad_batches: int
    gradient_clip_val: int | float | None
    gradient_clip_algorithm: str | None
    step_context: Callable[[], contextlib.AbstractContextManager[object]]
    """The precision plugin's ``train_step_context`` (autocast, or the default dtype of ``*-true``)."""
    transferred: bool = False
    """Whether :attr:`batch` is as the step gets it (moved to the device, ``on_after_batch_transfer``
    applied: a batch from ``on_train_batch_start``), not as the dataloader yields it."""
    averaging: WeightAveragingMirror | None = None
    """The trainer's weight-averaging callbacks, whose update runs after each simulated batch."""
    batch_indices: tuple[int, ...] = (0,)
    """The ``batch_idx`` of each simulated step's batch (the last repeats): the index Lightning gave
    the batch in hand, never a later one (``adapter/batch_index.py``)."""
    index_reads: IndexReads = field(default_factory=IndexReads)
    """Whether a simulated step's code read its ``batch_idx``."""
    replay_blocks: bool = True
    """Whether repeated blocks are replayed (``estimate_step``'s ``replay_blocks``; never under a
    strategy): the callback's ``replay_blocks``."""

    def runner(self, module: nn.Module, config: StepConfig, listener: StepListener) -> LightningRunner:
        """The engine's runner factory: the fit loop's order of things, for ``module``."""
        if not is_lightning_module(module):
            raise EstimationError(f"expected a LightningModule, got {type(module).__name__}")
        return LightningRunner(
            module,
            listener,
            precision=config.precision,
            accumulate_grad_batches=self.accumulate_grad_batches,
            gradient_clip_val=self.gradient_clip_val,
            gradient_clip_algorithm=self.gradient_clip_algorithm,
            step_context=self.step_context,
            strategy=config.strategy,
            transferred=self.transferred,
            batch_end=self.averaging.on_batch_end if self.averaging is not None else None,
            batch_indices=self.batch_indices,
            index_reads=self.index_reads,
        )

    def simulate(
        self,
        batch: Any,
        *,
        steps: int = 2,
        flops: bool = True,
        calibrate: bool = False,
        next_batches: Sequence[Any] = (),
        residents: Sequence[Tensor] = (),
    ) -> Simulation:
        """Training batches of the module on fake tensors, as this fit runs them (``flops=False``
        records only what memory needs; ``calibrate`` records what calibration needs; ``next_batches``
        and ``residents`` as in ``engine.simulate``)."""
        averaging = self.averaging

        def run(replay: bool) -> Simulation:
            with averaging.kept() if averaging is not None else contextlib.nullcontext():
                return simulate(
                    self.module,
                    batch,
                    self.config,
                    runner=self.runner,
                    device=self.device,
                    steps=steps,
                    capture=capture_filter(flops=flops, calibrate=calibrate),
                    next_batches=next_batches,
                    residents=residents,
                    companions=averaging.companions if averaging is not None else (),
                    replay_blocks=replay,
                )

        return simulate_replaying(run, self.replay_blocks and self.config.strategy is None)

    def varied(self, *, precision: Precision | None = None, strategy: Strategy | None = None) -> FitSetup:
        """This fit with another precision (its autocast, or its dtype for ``*-true``) or data
        parallelism: a variant the pre-check's advice estimates (``advice.advise``)."""
        config = StepConfig(
            precision=precision or self.config.precision,
            strategy=strategy if strategy is not None else self.config.strategy,
        )
        if precision is None or precision == self.config.precision:
            return dataclasses.replace(self, config=config)
        device_type = self.device.type
        return dataclasses.replace(self, config=config, step_context=lambda: autocast(device_type, precision))

    def sized(
        self,
        *,
        steps: int = 2,
        calibrate: Calibrate = False,
        next_batches: Sequence[Any] = (),
        residents: Sequence[Tensor] = (),
    ) -> SizedStep:
        """``steps`` training batches like :attr:`batch` (then ``next_batches``) with ``residents``
        alive beside them, the batch size left open: its ``estimate_at()`` is :meth:`estimate`, its
        ``largest_batch(budget)`` the largest batch size whose estimate, made the same way, fits."""

        def run(
            batch: Any, *, flops: bool, calibrate: bool, next_batches: Sequence[Any] = next_batches
        ) -> Simulation:
            return self.simulate(
                batch,
                steps=steps,
                flops=flops,
                calibrate=calibrate,
                next_batches=next_batches,
                residents=residents,
            )

        return SizedStep(run, self.batch, calibrate=calibrate, next_batches=next_batches)

    def estimate(
        self,
        *,
        steps: int = 2,
        calibrate: Calibrate = False,
        next_batches: Sequence[Any] = (),
        residents: Sequence[Tensor] = (),
    ) -> StepEstimate:
        """The estimate of ``steps`` training batches like :attr:`batch` (then ``next_batches``): the
        module's own ``training_step`` (automatic or manual optimization), ``configure_optimizers``,
        precision, accumulation and clipping, with ``residents`` alive beside them; with ``calibrate``,
        the kernels' memory measured on the device the trainer trains on
        (``accounting.kernels.calibrate``; ``"cached"``: what the cache knows, nothing run)."""
        return self.sized(
            steps=steps, calibrate=calibrate, next_batches=next_batches, residents=residents
        ).estimate_at()

    def max_batch_size(
        self,
        budget_bytes: int,
        *,
        cap: int = DEFAULT_CAP,
        progress: Progress | None = None,
        calibrate: Calibrate = False,
        residents: Sequence[Tensor] = (),
    ) -> BatchSizeResult:
        """The largest batch size whose estimate fits ``budget_bytes``, for the module as this fit trains
        it (``SizedStep.largest_batch`` of :meth:`sized`): the tensors of :attr:`batch` of its leading
        size are resized on the meta device for each probe, the module's own ``training_step`` runs,
        with ``residents`` alive beside it; ``calibrate``: the kernels measured on the device."""
        return self.sized(calibrate=calibrate, residents=residents).largest_batch(
            budget_bytes, cap=cap, progress=progress
        )


def fit_setup(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batch: Any = None,
    *,
    transferred: bool = False,
    batch_indices: Sequence[int] = (0,),
    replay_blocks: bool = True,
) -> FitSetup:
    """Read what the simulation needs from ``trainer`` and its ``module`` (attached: from ``setup`` on):
    the settings, and a training batch (``batch``, or else the first of the train dataloader, see
    :func:`first_batch`; ``transferred``: ``batch`` is as the step gets it; ``batch_indices``: the
    ``batch_idx`` of each simulated step's batch; ``replay_blocks``: :attr:`FitSetup.replay_blocks`).
    An ``EstimationError`` for what it cannot simulate
    (a precision, a sharded strategy)."""
    return FitSetup(
        module=module,
        batch=first_batch(trainer, module) if batch is None else batch,
        transferred=transferred,
        config=StepConfig(precision=_precision(trainer), strategy=_strategy(trainer)),
        device=trainer.strategy.root_device,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        step_context=trainer.precision_plugin.train_step_context,
        averaging=WeightAveragingMirror.of(trainer),
        batch_indices=tuple(batch_indices),
        replay_blocks=replay_blocks,
    )


def _precision(trainer: pl.Trainer) -> Precision:
    """The trainer's precision in the names the engine knows, or an ``EstimationError``."""
    name = str(trainer.precision)
    try:
        return check_precision(name)
    except ValueError:
        raise EstimationError(f"precision {name!r} is not supported by the estimator yet") from None


def _strategy(trainer: pl.Trainer) -> Strategy | None:
    """The data parallelism the trainer trains with, as the simulation runs it (``None``: none).

    ``DDPStrategy`` (``ddp``, ``ddp_spawn``, ...) becomes :class:`DDP` with its bucket settings, as this
    rank. ``ModelParallelStrategy`` becomes what its ``configure_model`` did, read back from the module
    (``engine.parallel.arrived``): a :class:`ModelParallel` that redoes its tensor parallelism and FSDP2
    units on a fake mesh of the job's sizes. Other sharded strategies
    (``FSDPStrategy``'s FSDP1, DeepSpeed) are not simulated inside ``fit``: an ``EstimationError`` says
    so (the callback turns it into one warning); ``memest estimate --strategy fsdp`` answers for them.
    """
    strategy = trainer.strategy
    if isinstance(strategy, lightning_classes("DDPStrategy")):
        kwargs = getattr(strategy, "_ddp_kwargs", {})
        return DDP(
            trainer.world_size,
            rank=trainer.global_rank,
            bucket_cap_mb=float(kwargs.get("bucket_cap_mb") or 25.0),
            gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", False)),
        )
    if any(cls.__name__ == "ModelParallelStrategy" for cls in type(strategy).__mro__):
        # configure_model has parallelised the module: simulated by doing it again, on fake tensors.
        mesh = cast(Any, strategy).device_mesh
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
        arrived = arrived_model_parallel(
            trainer.lightning_module, sizes["data_parallel"], sizes["tensor_parallel"], trainer.global_rank
        )
        if arrived is not None:
            return arrived
    if any(cls.__name__ in _SHARDED for cls in type(strategy).__mro__):
        raise EstimationError(
            f"per-rank estimates under {type(strategy).__name__} are not simulated inside fit yet: the "
            "module is already sharded at fit start (use `memest estimate --strategy fsdp --world-size N`)"
        )
    return None


_SHARDED = frozenset({"FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy", "XLAFSDPStrategy"})


def train_loader(trainer: pl.Trainer) -> CombinedLoader | None:
    """The train dataloader(s) the trainer will use, combined as the fit loop combines them (built
    anew: ``train_dataloader`` is called); ``None`` without any."""
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return None
    with _rng_kept(trainer):  # a train_dataloader may draw (a random dataset), training must not notice
        return CombinedLoader(source.dataloader(), "max_size_cycle")


def _rng_kept(trainer: pl.Trainer) -> contextlib.AbstractContextManager[None]:
    device = trainer.strategy.root_device
    return torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])


def dataset_length(loader: CombinedLoader) -> int | None:
    """The length of the dataset(s) behind ``loader`` as Lightning's ``BatchSizeFinder`` reads it (the
    longest, in ``max_size_cycle``); ``None`` for iterable-style datasets."""
    try:
        return loader._dataset_length()
    except NotImplementedError:
        return None


def first_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, loader: CombinedLoader | None = None
) -> Any:
    """One batch from a fresh iterator over the train dataloader(s) the trainer will use (``loader``,
    if given: :func:`train_loader`'s).

    Falls back to the module's ``example_input_array``. ``on_before_batch_transfer`` is applied, as
    the fit loop would; ``on_after_batch_transfer`` runs inside the simulation, on fake tensors. The
    global RNG is left as it was: a fresh (shuffling) iterator draws its seed from it, and training
    must not notice.
    """
    combined = loader if loader is not None else train_loader(trainer)
    if combined is not None:
        with _rng_kept(trainer):
            batch, _, _ = next(iter(combined))
    elif pl_module.example_input_array is not None:
        batch = pl_module.example_input_array
    else:
        raise ValueError("no train dataloader and no example_input_array to take a batch from")
    return pl_module.on_before_batch_transfer(batch, 0)
