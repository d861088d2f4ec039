"""``FitBatchSize``: the Lightning callback that sets the batch size to the largest that fits, from the
estimator alone (no trial steps, no OOMs), and works under DDP."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_memest.adapter.fit import dataset_length, first_batch, fit_setup, train_loader
from lightning_memest.adapter.gloo_exit import settle_gloo_workers_at_exit
from lightning_memest.batches import batch_size_of
from lightning_memest.budget import device_budget
from lightning_memest.errors import MemestError, MemoryBudgetError
from lightning_memest.measure import module_tensors, resident_bytes
from lightning_memest.options import check_budget, check_count, check_flag, check_fraction
from lightning_memest.search import DEFAULT_CAP, BatchSizeResult

__all__ = ["FitBatchSize"]


class FitBatchSize(Callback):
    """Sets the batch size to the largest that fits the device, from the estimator alone.

    On fit start -- the module is on its device, in its precision, with its optimizers, and the train
    dataloader not yet built -- it takes one batch of the train dataloader, searches the largest batch
    size whose estimated peak is within the budget (``FitSetup.max_batch_size``: fake runs of the
    module's own ``training_step`` on meta batches; no real step, so no OOM trials), and sets it where
    Lightning's ``BatchSizeFinder`` would: ``attr_name`` of the module, its ``hparams``, the datamodule
    and its ``hparams`` (``lightning_setattr``). The fit loop then builds the train dataloader with it;
    a dataloader already built (``estimated_stepping_batches`` in ``configure_optimizers`` builds one)
    is dropped so that it is rebuilt.

    Args:
        budget: bytes (or a size such as ``"10GiB"``, or ``"80%"`` of what the device has) for the
            estimated peak; ``None``: what the device has (``lightning_memest.budget.device_budget``,
            with its margin model).
        margin: the fraction of the budget kept back for safety, a number in [0, 1) (0.1: the peak
            stays within 90 %).
        attr_name: where the batch size lives (``lightning_getattr``'s names).
        max_batch_size: the largest batch size considered, an int of at least 1; never more than the
            length of the train dataset (as Lightning's ``BatchSizeFinder``; iterable-style datasets
            have none).
        raise_if_none_fits: when not even batch size 1 fits, raise
            :class:`~lightning_memest.errors.MemoryBudgetError` (stopping ``fit`` before any step);
            otherwise (``False``) warn and leave the batch size alone.

    Every argument is checked when the callback is made (``lightning_memest.options``): a value of
    the wrong type is a ``TypeError``, one out of range a ``ValueError``, each naming the argument.

    Under DDP each rank searches with its own device's budget (the estimate is per rank: a rank holds a
    full replica and its own batch), and all ranks take the smallest answer, so the batch size stays the
    same across ranks. Lightning's ``BatchSizeFinder`` refuses distributed strategies because its trials
    are real steps that can OOM one rank; these cannot. (Not tested with several processes here.)

    Put it before ``MemEstimate`` in ``callbacks``, so that ``MemEstimate`` estimates the chosen size.
    ``result`` holds the search's ``BatchSizeResult`` after fit start.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[FitBatchSize("2GiB")], max_steps=1)  # doctest: +SKIP
        >>> FitBatchSize(max_batch_size=0)
        Traceback (most recent call last):
        ...
        ValueError: max_batch_size must be at least 1; got 0
    """

    def __init__(
        self,
        budget: int | str | None = None,
        *,
        margin: float = 0.1,
        attr_name: str = "batch_size",
        max_batch_size: int = DEFAULT_CAP,
        raise_if_none_fits: bool = True,
    ) -> None:
        self.budget = check_budget("budget", budget) if budget is not None else None
        self.margin = check_fraction("margin", margin, " (0.1 keeps a tenth of the budget back)")
        if not isinstance(attr_name, str):
            raise TypeError(f"attr_name must be the name of the batch size, a str; got {attr_name!r}")
        if not attr_name:
            raise ValueError("attr_name must be the name of the batch size; got ''")
        self.attr_name = attr_name
        self.max_batch_size = check_count("max_batch_size", max_batch_size)
        self.raise_if_none_fits = check_flag("raise_if_none_fits", raise_if_none_fits)
        self.result: BatchSizeResult | None = None

    def _budget(self, trainer: pl.Trainer, module: pl.LightningModule) -> int:
        if self.budget is not None and self.budget.bytes is not None:
            budget = self.budget.bytes
        else:
            device = trainer.strategy.root_device
            # On CPU the weights already take host memory that MemAvailable no longer shows, and the
            # estimate counts them: give them back. (On CUDA the allocator's reserved bytes do that.)
            resident = resident_bytes(module_tensors(module)) if device.type == "cpu" else 0
            budget = device_budget(device, resident_bytes=resident)
            if self.budget is not None:
                budget = self.budget.of(budget)
        return int(budget * (1.0 - self.margin))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        settle_gloo_workers_at_exit()  # a PyTorch race at a gloo rank's exit (see adapter/gloo_exit.py)
        if not lightning_hasattr(pl_module, self.attr_name):
            raise MemestError(
                f"FitBatchSize: {self.attr_name!r} is neither an attribute of the module, nor in its "
                "hparams, nor in the datamodule; set attr_name to where the batch size lives"
            )
        value = lightning_getattr(pl_module, self.attr_name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise MemestError(f"FitBatchSize: {self.attr_name!r} must be an int; it is {value!r}")
        current = value
        budget = self._budget(trainer, pl_module)
        loader = train_loader(trainer)
        fit = fit_setup(trainer, pl_module, first_batch(trainer, pl_module, loader))
        # The dataloader may batch differently from the attribute (a sampler, a collate); resize what it
        # yields, and say so if they differ.
        seen = batch_size_of(fit.batch)
        # As Lightning's BatchSizeFinder: no batch larger than the dataset (it would only ever be one
        # partial batch of all the samples).
        length = dataset_length(loader) if loader is not None else None
        cap = self.max_batch_size if length is None else max(1, min(self.max_batch_size, length))
        result = fit.max_batch_size(budget, cap=cap)
        self.result = result
        best = _min_over_ranks(trainer, result.max_batch_size)
        if best == 0:
            error = MemoryBudgetError(
                f"FitBatchSize: {result.message}",
                peak_bytes=dict(result.probes)[1],
                budget_bytes=budget,
                batch_size=current,
                max_batch_size=0,
            )
            if self.raise_if_none_fits:
                raise error
            rank_zero_info(f"{error}; the batch size stays {current}")
            return
        lightning_setattr(pl_module, self.attr_name, best)
        # Lightning sets up the train data after on_fit_start, unless something asked for it earlier:
        # drop what was built so that the fit loop builds it again with the new size.
        trainer.fit_loop._combined_loader = None
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        val_loop._combined_loader = None
        note = "" if seen == current else f" (the dataloader yielded batches of {seen})"
        if length is not None and cap == length and best == length:
            why = f"capped at the length of the train dataset ({length} samples), which fits"
        else:
            why = result.message
        rank_zero_info(
            f"FitBatchSize: {self.attr_name} {current} -> {best}{note}: {why}; "
            f"{len(result.probes)} estimates in {result.seconds:.1f} s"
        )


def _min_over_ranks(trainer: pl.Trainer, value: int) -> int:
    """All ranks must train with the same batch size: the one every rank's memory allows."""
    if trainer.world_size == 1:
        return value
    gathered = trainer.strategy.all_gather(torch.tensor(value, device=trainer.strategy.root_device))
    return int(gathered.min().item())
