"""The largest batch size that fits a memory budget, found on fake tensors (no real step ever runs).

:func:`max_batch_size` finds the largest batch size whose estimated peak (``StepEstimate.peak_bytes``,
the larger of the first step and the steady state) is within a budget. It is exact *with respect to the
estimator*: ``estimate(max) <= budget < estimate(max + 1)``. Memory is close to affine in the batch
size, so the search probes two sizes, extrapolates, and then verifies the boundary (``max`` and
``max + 1``), falling back to secant and bisection steps where the line was wrong -- typically four
probes. The first size probed is the smallest the step accepts: 1, or, where the step fails at 1 but
not at a larger size (batch norm over a single value per channel), the first of 2, 4, ... it accepts.
Every probe is a full fake run of two steps, so a probe costs the same at any batch size; the
batches are built on the meta device, so no size costs real memory. :func:`search_batch_size` is the
search itself over any peak model, with its worker process (pairs of probes at once).

With ``calibrate=True`` the probes' kernel memory is this machine's, without a real step per probe:
two sizes are calibrated in full, every other probe is fitted from them and measured only where the
fit could move its peak (``search/calibration.py``); the search then starts from those two sizes.

    >>> import torch
    >>> from torch import nn
    >>> from lightning_memest.search import max_batch_size
    >>> model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    >>> make = lambda n: torch.empty(n, 256, device="meta")  # any size, no real memory
    >>> result = max_batch_size(model, make, 64 * 2**20, optimizer=torch.optim.Adam)
    >>> result.max_batch_size
    4791
    >>> below, above = dict(result.probes)[4791], dict(result.probes)[4792]
    >>> below <= 64 * 2**20 < above
    True
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from lightning_memest.accounting import PeakProfile, capture_filter, peak_profile
from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.constants import DEFAULT_CAP
from lightning_memest.engine.parallel.distributed import Strategy
from lightning_memest.engine.simulate import Simulation, simulate, simulate_replaying
from lightning_memest.engine.step import LossFn, OptimizerFactory, Precision, StepConfig, sum_loss
from lightning_memest.errors import EstimationError, one_line
from lightning_memest.options import check_callable, check_count, check_step_options
from lightning_memest.report import format_bytes
from lightning_memest.search.calibration import CalibratedPeaks, SearchCalibration
from lightning_memest.search.worker import ProbeModel, Worker, can_fork, start_worker

__all__ = [
    "DEFAULT_CAP",
    "BatchSizeResult",
    "ProbeModel",
    "Progress",
    "can_fork",
    "max_batch_size",
    "search_batch_size",
    "search_steps",
]


#: Called after each probe with ``(batch_size, peak_bytes)``: progress for slow searches.
Progress = Callable[[int, int], None]


# ------------------------------------------------------------------------------------------- search


@dataclass(frozen=True)
class BatchSizeResult:
    """The outcome of a batch-size search.

    ``max_batch_size`` is 0 when even the smallest batch the step accepts is over the budget
    (``peak_bytes_at_max`` is then ``None``); ``capped`` says the search stopped at ``cap`` with memory
    to spare. ``print(result)`` gives :attr:`message`.
    """

    max_batch_size: int
    peak_bytes_at_max: int | None
    budget_bytes: int
    probes: tuple[tuple[int, int], ...]
    """Every ``(batch_size, peak_bytes)`` estimated, in order."""
    seconds: float
    capped: bool = False
    smallest: int = 1
    """Where the search starts: the smallest batch size the step accepts (1, else 2, 4, ...), or the
    smaller of the calibrated sizes when it fits (the step is not tried below it)."""
    rejection: str | None = None
    """Why the step fails below :attr:`smallest` (its error at batch size 1); ``None`` when it did not."""
    approximate: bool = False
    """The probes were a CUDA what-if on a machine without a GPU (``StepEstimate.approximate``)."""
    calibration: SearchCalibration | None = None
    """What calibrating the kernels took (``calibrate=True``); ``None`` with the hand models."""

    def __str__(self) -> str:
        return self.message

    @property
    def message(self) -> str:
        """One sentence for people."""
        peaks = dict(self.probes)
        budget = format_bytes(self.budget_bytes)
        below = (
            ""
            if self.rejection is None
            else f" (the step fails below batch size {self.smallest}: {self.rejection})"
        )
        if self.max_batch_size == 0:
            return (
                f"even batch size {self.smallest} is over the memory budget: its estimated peak is "
                f"{format_bytes(peaks[self.smallest])}, the budget {budget}{below}"
            )
        assert self.peak_bytes_at_max is not None
        text = (
            f"the largest batch size within {budget} is {self.max_batch_size} "
            f"(estimated peak {format_bytes(self.peak_bytes_at_max)}"
        )
        if self.capped:
            return text + f"); the search stops at {self.max_batch_size}, a larger one may fit too{below}"
        after = self.max_batch_size + 1
        return text + f"; {after} needs {format_bytes(peaks[after])}){below}"

    def to_json(self) -> dict[str, Any]:
        """What ``memest max-batch-size --json`` prints."""
        return {
            "max_batch_size": self.max_batch_size,
            "peak_bytes_at_max": self.peak_bytes_at_max,
            "probes": len(self.probes),
            "seconds": round(self.seconds, 3),
            "smallest": self.smallest,
            "approximate": self.approximate,
            **({"calibration": self.calibration.to_json()} if self.calibration is not None else {}),
        }


@dataclass
class _Search:
    peak_of: Callable[[int], int | PeakProfile]
    budget: int
    progress: Progress | None
    probes: list[tuple[int, int]] = field(default_factory=list)
    known: dict[int, int] = field(default_factory=dict)
    curves: dict[int, tuple[int, ...]] = field(default_factory=dict)
    rejected: dict[int, EstimationError] = field(default_factory=dict)
    """The sizes the step failed at, with the failure."""
    worker: Worker | None = None

    def peak(self, n: int) -> int:
        if not self.accepts(n):
            e = self.rejected[n]
            raise _at_batch_size(e, n) from e
        return self.known[n]

    def accepts(self, n: int) -> bool:
        """Whether the step runs at batch size ``n`` (probing it once; a failure is kept)."""
        if n not in self.known and n not in self.rejected:
            try:
                self.record(n, self.peak_of(n))
            except EstimationError as e:
                self.rejected[n] = e
        return n in self.known

    def smallest(self, start: int, low: int = 1) -> int:
        """The smallest batch size the step accepts: 1, else the first of 2, 4, ... up to ``start``
        (a step that fails at 1 but runs at a larger size rejects small batches -- batch norm over one
        value per channel -- rather than the model). Raises the failure at 1 where all fail. With
        ``low`` > 1, ``low`` when it fits the budget (the answer is not below it, so nothing is)."""
        self.prefetch([low, start])
        if low > 1 and self.accepts(low) and self.fits(low):
            return low
        self.prefetch([1, start])
        n = 1
        while not self.accepts(n):
            if n >= start:  # the step fails at every size tried: the first failure says why
                raise _at_batch_size(self.rejected[1], 1) from self.rejected[1]
            n = min(n * 2, start)
        return n

    def record(self, n: int, answer: int | PeakProfile) -> None:
        if isinstance(answer, PeakProfile):
            value = answer.peak
            # Shifted so that its top is the peak (a CUDA peak counts whole allocator blocks).
            shift = value - max(answer.curve, default=value)
            self.curves[n] = tuple(c + shift for c in answer.curve)
        else:
            value = answer
        self.known[n] = value
        self.probes.append((n, value))
        if self.progress is not None:
            self.progress(n, value)

    def prefetch(self, sizes: list[int]) -> None:
        """Probe two sizes at once, one here and one in the worker process, when the search has one (a
        probe the worker could not answer is left to run here, so that its error surfaces with its
        batch size; the worker is then retired)."""
        todo = [n for n in dict.fromkeys(sizes) if n not in self.known]
        worker = self.worker
        if worker is None or len(todo) < 2:
            return
        worker.submit(todo[1])
        try:
            self.record(todo[0], self.peak_of(todo[0]))
        except EstimationError as e:
            self.rejected[todo[0]] = e  # raised, with its batch size, where the search needs that size
        there = worker.answer()
        if there is None:
            self.worker = None
            worker.close()
        else:
            self.record(todo[1], there)

    def fits(self, n: int) -> bool:
        return self.peak(n) <= self.budget

    def curve_guess(self, a: int, b: int) -> float | None:
        """The largest size whose predicted peak fits: each point of the memory curve follows its own
        line through sizes ``a`` and ``b``, and the peak is the highest of them (None: no curves, or
        the two runs did not run the same ops)."""
        ca, cb = self.curves.get(a), self.curves.get(b)
        if ca is None or cb is None or len(ca) != len(cb) or not ca:
            return None
        guess = math.inf
        for pa, pb in zip(ca, cb, strict=True):
            if pb > pa:
                guess = min(guess, a + (self.budget - pa) * (b - a) / (pb - pa))
            elif pa > self.budget:
                return None  # a point over the budget that does not grow: the lines cannot say
        return guess if guess != math.inf else None


def _at_batch_size(e: EstimationError, n: int) -> EstimationError:
    error = EstimationError(f"at batch size {n}: {e}")
    error.op, error.module = e.op, e.module
    return error


def search_batch_size(
    peak_of: Callable[[int], int | PeakProfile],
    budget_bytes: int,
    *,
    start: int = 8,
    cap: int = DEFAULT_CAP,
    progress: Progress | None = None,
    workers: int = 1,
    low: int = 1,
) -> BatchSizeResult:
    """The largest ``n <= cap`` with ``peak_of(n) <= budget_bytes < peak_of(n + 1)`` (0: none fits).

    ``peak_of`` is any peak model (one estimator run per call; each ``n`` is asked once), returning the
    peak or a :class:`~lightning_memest.estimate.PeakProfile`. It probes the smallest size ``peak_of``
    accepts (1, else 2, 4, ... where it raises :class:`EstimationError` below some size) and ``start``,
    extrapolates to the budget (through the two probes nearest the boundary: the lines of their memory
    curves when it has them, else the line of their peaks), and verifies the guess and its neighbour; when the
    guess was wrong, the next guesses interpolate inside the bracket, and bisect when that does not
    halve it. The result is exact for any ``peak_of`` that is non-decreasing; for one that is not, the
    answer is still a size that fits next to one that does not.

    With ``workers`` > 1 (and where :func:`can_fork`), pairs of probes run at once, one in a worker
    process forked at the start: 1 and ``start``, and a guess from the curves with its neighbour (one
    of them may go unused: it is still listed among the probes). With ``low`` > 1 the first pair is
    ``low`` and ``start``, and sizes below ``low`` are probed only if ``low`` does not fit. A
    :class:`ProbeModel` is prepared once the worker is forked (its answers count as probes).

    >>> r = search_batch_size(lambda n: 1000 + 37 * n, 10_000)
    >>> r.max_batch_size, [n for n, _ in r.probes]  # an affine peak: two probes to fit, two to verify
    (243, [1, 8, 243, 244])
    >>> search_batch_size(lambda n: 100 * n, 50).max_batch_size
    0
    >>> def rejects_one(n: int) -> int:  # a step that fails at batch size 1 (batch norm, say)
    ...     if n == 1:
    ...         raise EstimationError("Expected more than 1 value per channel when training")
    ...     return 1000 + 37 * n
    >>> r = search_batch_size(rejects_one, 10_000)
    >>> r.max_batch_size, r.smallest, [n for n, _ in r.probes]
    (243, 2, [2, 8, 243, 244])
    """
    if budget_bytes < 0:
        raise ValueError(f"the budget must not be negative; got {budget_bytes}")
    if cap < 1:
        raise ValueError(f"the cap must be at least 1; got {cap}")
    began = time.perf_counter()
    s = _Search(peak_of, budget_bytes, progress, worker=start_worker(peak_of) if workers > 1 else None)
    try:
        if isinstance(peak_of, ProbeModel):
            known, parallel = peak_of.prepare()
            for n, answer in sorted(known.items()):
                s.record(n, answer)
            if not parallel and s.worker is not None:
                s.worker.close()
                s.worker = None
        return _search(s, budget_bytes, start, cap, began, low)
    finally:
        if s.worker is not None:
            s.worker.close()


def _search(
    s: _Search, budget_bytes: int, start: int, cap: int, began: float, low: int = 1
) -> BatchSizeResult:
    start = min(max(start, 2), cap)
    smallest = s.smallest(start, min(max(low, 1), start))
    rejection = one_line(s.rejected[1]) if 1 in s.rejected and smallest > 1 else None

    def result(n: int, capped: bool = False) -> BatchSizeResult:
        peak = s.known[n] if n else None
        seconds = time.perf_counter() - began
        return BatchSizeResult(n, peak, budget_bytes, tuple(s.probes), seconds, capped, smallest, rejection)

    if not s.fits(smallest):
        return result(0)
    lo, hi = smallest, None  # lo fits, hi (when known) does not; the answer is in [lo, hi - 1]
    if start > smallest:
        if s.fits(start):
            lo = start
        else:
            hi = start
    widths: list[int] = []
    weights = [1.0, 1.0]  # Illinois: the weight of the end of the bracket that stayed put, halved each round
    while hi is None or hi - lo > 1:
        if hi is None and lo == cap:
            return result(cap, capped=True)
        upper = cap if hi is None else hi - 1  # the largest candidate
        widths.append(upper - lo)
        bracket = (lo, hi)
        guess: float | None = None
        curved: float | None = None
        if hi is None:
            # Extrapolate from the two largest sizes that fit (1 and ``start`` at first): the lines of
            # the memory curves when the probes have them, else the line of the peaks.
            a = max(n for n in s.known if n < lo)
            guess = curved = s.curve_guess(a, lo)
            if guess is None and s.known[lo] > s.known[a]:
                guess = lo + (budget_bytes - s.known[lo]) * (lo - a) / (s.known[lo] - s.known[a])
        elif (curved := s.curve_guess(lo, hi)) is not None and len(widths) < 3:
            guess = curved
        else:
            # Interpolate inside the bracket (regula falsi, with the Illinois weights so that a curved
            # peak does not pin one end); bisect when the bracket shrinks too slowly all the same.
            below = (budget_bytes - s.known[lo]) * weights[0]
            above = (s.known[hi] - budget_bytes) * weights[1]
            if len(widths) < 4 or widths[-1] * 4 <= widths[-4]:
                guess = lo + (hi - lo) * below / (below + above)
        if guess is None:
            n = (lo + upper + 1) // 2 if hi is not None else min(lo * 2, upper)
        else:
            n = math.floor(guess)
        n = min(max(n, lo + 1), upper)
        if curved is not None and n + 1 <= upper:
            s.prefetch([n, n + 1])  # the curves are usually right: the boundary is n, n + 1 the proof
        if s.fits(n):
            lo = n
        else:
            hi = n
        # Within one sample's bytes of the budget, the boundary is n or its neighbour: verify at once
        # (with a good line this is the last probe). Farther off, the next line does better.
        lower = max(m for m in s.known if m < n)
        slope = (s.known[n] - s.known[lower]) / (n - lower)
        neighbour = n + 1 if lo == n else n - 1
        if abs(budget_bytes - s.known[n]) <= slope and lo < neighbour < (cap + 1 if hi is None else hi):
            if s.fits(neighbour):
                lo = neighbour
            else:
                hi = neighbour
        if bracket[1] is not None:  # Illinois: only between two bracketed rounds
            weights[0] = weights[0] / 2 if bracket[0] == lo else 1.0
            weights[1] = weights[1] / 2 if bracket[1] == hi else 1.0
    return result(lo)


def max_batch_size(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    budget_bytes: int,
    *,
    loss_fn: LossFn = sum_loss,
    optimizer: OptimizerFactory | None = None,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    start: int = 8,
    cap: int = DEFAULT_CAP,
    steps: int = 2,
    progress: Progress | None = None,
    strategy: Strategy | None = None,
    gpu: CudaDevice | None = None,
    workers: int | None = None,
    calibrate: bool = False,
    replay_blocks: bool = True,
) -> BatchSizeResult:
    """The largest batch size whose training steps' estimated peak is within ``budget_bytes``.

    ``make_batch(n)`` builds the batch of size ``n`` -- on the meta device, so that no size costs real
    memory (:func:`resize_batch` makes one from an example batch). The other arguments are those of
    :func:`~lightning_memest.estimate.estimate_step` (with a ``strategy``, the batch is one rank's and
    so is the budget; ``gpu`` for CUDA); ``workers`` is how many probes may run at once (default: 2
    where the machine has two cores and :func:`can_fork` allows it); ``start`` is the second size
    probed (after 1) and ``cap`` the largest size considered. The search is :func:`search_batch_size` over
    ``estimate_step(...).peak_bytes``; an :class:`~lightning_memest.errors.EstimationError` of a probe
    propagates, with the batch size named. ``calibrate``: the kernels' memory measured on this machine
    (``estimate_step(..., calibrate=True)``) without a real step per probe: ``start`` and half of it
    are calibrated in full and the other probes fitted from them (:func:`search_steps`).
    ``replay_blocks`` (default): each probe replays repeated blocks as ``estimate_step`` does: the
    same peaks, in less time on deep models; a probe whose blocks turn out not to repeat is simulated
    again without; ``False``: every block of every probe simulated. Every option is checked before
    the first probe, as ``estimate_step``'s are: ``budget_bytes``, ``start``, ``cap`` and ``workers``
    are ints of at least 1.

    Example:
        >>> import torch
        >>> r = max_batch_size(torch.nn.Linear(1000, 1000), lambda n: torch.empty(n, 1000, device="meta"),
        ...                    2**24, optimizer=torch.optim.SGD)
        >>> r.max_batch_size, r.peak_bytes_at_max <= 2**24
        (1096, True)
        >>> max_batch_size(torch.nn.Linear(4, 4), lambda n: torch.empty(n, 4, device="meta"), 2**20, cap=0)
        Traceback (most recent call last):
        ...
        ValueError: cap must be at least 1; got 0
    """
    check_step_options(
        model=model,
        steps=steps,
        strategy=strategy,
        device=device,
        gpu=gpu,
        calibrate=calibrate,
        replay_blocks=replay_blocks,
    )
    check_callable("make_batch", make_batch, "make_batch(n) -> a batch of size n")
    for name, value in (("budget_bytes", budget_bytes), ("start", start), ("cap", cap)):
        check_count(name, value)
    if workers is not None:
        check_count("workers", workers)
    if progress is not None:
        check_callable("progress", progress, "progress(batch_size, peak_bytes)")
    config = StepConfig(loss_fn, optimizer, cast(Precision, precision), strategy)  # validates itself
    what_if: list[bool] = []  # whether the probes run here were CUDA what-ifs
    # estimate_step(...).peak_bytes, without FLOPs or the report: a probe only needs the peak.
    capture = capture_filter(flops=False, calibrate=calibrate)

    replay = replay_blocks and strategy is None

    def simulate_at(n: int) -> Simulation:
        def run(with_replay: bool) -> Simulation:
            return simulate(
                model, make_batch(n), config, device=device, steps=steps, capture=capture,
                replay_blocks=with_replay, cuda_capability=gpu.capability if gpu is not None else None,
            )  # fmt: skip

        sim = simulate_replaying(run, replay)
        what_if.append(sim.what_if is not None)
        return sim

    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    result = search_steps(
        simulate_at,
        budget_bytes,
        start=start,
        cap=cap,
        progress=progress,
        workers=workers,
        gpu=gpu,
        calibrate=calibrate,
    )
    return dataclasses.replace(result, approximate=any(what_if))


def search_steps(
    simulate_at: Callable[[int], Simulation],
    budget_bytes: int,
    *,
    start: int = 8,
    cap: int = DEFAULT_CAP,
    progress: Progress | None = None,
    workers: int = 1,
    gpu: CudaDevice | None = None,
    calibrate: bool = False,
) -> BatchSizeResult:
    """:func:`search_batch_size` over simulated steps: ``simulate_at(n)`` is the step at batch size ``n``
    on fake tensors, simulated with ``capture_filter(flops=False, calibrate=calibrate)``.

    With ``calibrate``, the kernels' memory is this machine's (:class:`CalibratedPeaks`): the steps at
    ``start`` (the batch in hand) and half of it are calibrated in full, which is where the search
    starts; every other probe's kernels are fitted from those two and measured at the probe's own size
    where the fit could move its peak. :attr:`BatchSizeResult.calibration` says what that took.
    """
    if not calibrate:

        def peak_of(n: int) -> PeakProfile:
            return peak_profile(simulate_at(n), gpu)

        return search_batch_size(
            peak_of, budget_bytes, start=start, cap=cap, progress=progress, workers=workers
        )
    peaks = CalibratedPeaks(simulate_at, start=min(max(start, 2), cap), gpu=gpu)
    low, high = peaks.anchors
    result = search_batch_size(
        peaks, budget_bytes, start=high, cap=cap, progress=progress, workers=workers, low=low
    )
    return dataclasses.replace(result, calibration=peaks.summary())
