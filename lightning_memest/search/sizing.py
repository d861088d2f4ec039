"""One step, one answer: a step as it was estimated, at any batch size, and the largest that fits.

A pre-check that finds a step over its budget says which batch size would fit. That answer is advice,
and advice is an estimate too: it must come from the *same* simulation as the estimate it corrects --
the same other tensors alive beside the step (a dataset held in memory), the same calibration of the
kernels, the same loop, precision and strategy -- or a user who follows it runs out of memory.
:class:`SizedStep` is that one simulation with the batch size left open: :meth:`SizedStep.estimate_at`
is the estimate (the pre-check's, at the batch in hand), :meth:`SizedStep.largest_batch` the batch-size
search over it, whose answer is then checked by :meth:`~SizedStep.estimate_at` itself --
``estimate_at(n) <= budget < estimate_at(n + 1)`` -- and corrected where the search's fitted kernel
memory (``search/calibration.py``) disagreed.

Example:
    >>> import torch
    >>> from lightning_memest.accounting import capture_filter
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    >>> def run(batch, *, flops, calibrate):
    ...     capture = capture_filter(flops=flops, calibrate=calibrate)
    ...     return simulate(model, batch, StepConfig(), capture=capture)
    >>> step = SizedStep(run, torch.randn(16, 64), calibrate=False)
    >>> budget = step.estimate_at(16).peak_bytes - 1  # just under the batch in hand
    >>> result = step.largest_batch(budget)
    >>> n = result.max_batch_size
    >>> step.estimate_at(n).peak_bytes <= budget < step.estimate_at(n + 1).peak_bytes
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_memest.accounting import account
from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.accounting.kernels import Calibration
from lightning_memest.accounting.kernels.calibrate import calibrate as calibrate_kernels
from lightning_memest.batches import batch_size_of, resize_batch
from lightning_memest.engine.simulate import Simulation
from lightning_memest.report import StepEstimate
from lightning_memest.search.batch_size import (
    DEFAULT_CAP,
    BatchSizeResult,
    Progress,
    search_batch_size,
    search_steps,
)

__all__ = ["Calibrate", "SizedStep"]

#: ``True``: the kernels measured on this machine where the cache lacks them; ``"cached"``: the cache
#: only (nothing may run: a CPU profiler of the caller's is measuring); ``False``: the hand models.
Calibrate = bool | Literal["cached"]


@dataclass(frozen=True, eq=False)
class SizedStep:
    """A step as it is estimated, its batch size left open (see the module docstring).

    ``simulate(batch, *, flops, calibrate[, next_batches])`` runs the step on a batch, everything else
    bound (the module, its residents, loop, precision and strategy; ``flops`` and ``calibrate`` pick
    what the engine records, as ``accounting.capture_filter``);
    ``batch`` is the batch in hand (a tensor, or any structure ``batches.py`` walks); ``calibrate``
    how its kernels' memory is found (:data:`Calibrate`); ``loop`` names what the step runs, as
    ``StepEstimate.loop``; ``next_batches``: the batches of the steps after the first (resized with
    it: each tensor of the batch's leading size becomes the new size); ``gpu`` as ``estimate_step``'s.
    """

    simulate: Callable[..., Simulation]
    batch: Any
    calibrate: Calibrate = False
    loop: str = "train"
    next_batches: Sequence[Any] = ()
    gpu: CudaDevice | None = None
    """For a CUDA step: the GPU its accounting is for (``estimate_step``'s ``gpu``)."""
    _estimates: dict[int, StepEstimate] = field(default_factory=dict, repr=False)  # -1: the batch in hand
    _trace: list[tuple[Simulation, Calibration | None, StepEstimate]] = field(
        default_factory=list, repr=False
    )

    @property
    def batch_size(self) -> int:
        """The batch size of the batch in hand (``batches.batch_size_of``); with :attr:`next_batches`,
        the largest of the steps' batches (a later, larger batch is what the step must fit, and what a
        smaller size is said against)."""
        return max(batch_size_of(b) for b in (self.batch, *self.next_batches))

    def _batches_at(self, n: int | None) -> tuple[Any, list[Any]]:
        if n is None:  # the batches in hand, whatever they hold (one need not have a batch size)
            return self.batch, list(self.next_batches)

        def at(batch: Any) -> Any:
            old = batch_size_of(batch)
            return batch if n == old else resize_batch(batch, old, n)

        return at(self.batch), [at(b) for b in self.next_batches]

    def _simulate_at(self, n: int | None, *, flops: bool, calibrate: bool) -> Simulation:
        batch, following = self._batches_at(n)
        if following:
            return self.simulate(batch, flops=flops, calibrate=calibrate, next_batches=following)
        return self.simulate(batch, flops=flops, calibrate=calibrate)

    def estimate_at(self, n: int | None = None) -> StepEstimate:
        """The ``StepEstimate`` at batch size ``n`` (default: the batch in hand, as it is), with this
        step's residents and calibration; each size is estimated once."""
        key = -1 if n is None else n
        known = self._estimates.get(key)
        if known is None:
            known = self._estimates[key] = self.traced_at(n)[2]
        return known

    @property
    def has_trace(self) -> bool:
        """Whether :meth:`traced` has run (its simulation is kept)."""
        return bool(self._trace)

    def traced(self) -> tuple[Simulation, Calibration | None, StepEstimate]:
        """:meth:`traced_at` of the batch in hand, made once (what :meth:`estimate_at` returns the last
        of): the first estimate's simulation, for a caller that reads its events (a checkpointing plan)."""
        if not self._trace:
            self._trace.append(self.traced_at())
            self._estimates.setdefault(-1, self._trace[0][2])
        return self._trace[0]

    def traced_at(self, n: int | None = None) -> tuple[Simulation, Calibration | None, StepEstimate]:
        """The simulation at batch size ``n`` (default: the batch in hand), its calibration (``None``
        without) and its estimate: what :meth:`estimate_at` returns the last of, made anew (the model
        may have changed: a checkpointing plan applied for the simulation)."""
        sim = self._simulate_at(n, flops=True, calibrate=bool(self.calibrate))
        calibration = calibrate_kernels(sim, measure=self.calibrate is True) if self.calibrate else None
        return sim, calibration, account(sim, self.gpu, calibration, loop=self.loop)

    def fresh(self) -> SizedStep:
        """This step with nothing estimated yet (for a model changed since: a plan applied)."""
        return dataclasses.replace(self, _estimates={}, _trace=[])

    def largest_batch(
        self, budget_bytes: int, *, cap: int = DEFAULT_CAP, progress: Progress | None = None
    ) -> BatchSizeResult:
        """The largest batch size ``n <= cap`` whose estimate fits ``budget_bytes``:
        ``estimate_at(n).peak_bytes <= budget_bytes < estimate_at(n + 1).peak_bytes`` (0: not even the
        smallest size the step accepts fits).

        The search probes on fast simulations (no FLOPs; with ``calibrate=True`` two sizes calibrated
        and the others fitted from them, ``search.search_steps``); its answer and the size above it are
        then estimated as the pre-check estimates, and where those disagree with the search, the
        search runs again over those estimates, so that the answer holds for the estimate a user gets
        at that size. The result's probes list both kinds, the checking ones last."""
        measured = self.calibrate is True
        found = search_steps(
            lambda n: self._simulate_at(n, flops=False, calibrate=measured),
            budget_bytes,
            start=self.batch_size,
            cap=cap,
            progress=progress,
            gpu=self.gpu,
            calibrate=measured,
        )
        checks: dict[int, int] = {}

        def peak(n: int) -> int:
            checks[n] = self.estimate_at(n).peak_bytes
            return checks[n]

        def checked(result: BatchSizeResult, n: int, peak_at: int | None) -> BatchSizeResult:
            return dataclasses.replace(
                result, max_batch_size=n, peak_bytes_at_max=peak_at, probes=(*result.probes, *checks.items())
            )

        n = found.max_batch_size
        if n == 0:
            smallest = found.smallest
            if peak(smallest) > budget_bytes:
                return checked(found, 0, None)
        else:
            at = peak(n)
            if at <= budget_bytes and (found.capped or peak(n + 1) > budget_bytes):
                return checked(found, n, at)
        # The search's fitted figures were off at the boundary: search again, over the estimates.
        again = search_batch_size(peak, budget_bytes, start=max(n, 2), cap=cap, progress=progress)
        return dataclasses.replace(
            checked(found, again.max_batch_size, again.peak_bytes_at_max),
            capped=again.capped,
            smallest=again.smallest,
            rejection=again.rejection,
        )
