"""The largest batch size that fits a memory budget, found on fake tensors; the pre-check before ``fit``.

Three things live here, all built on the estimator (no real step ever runs):

* :func:`max_batch_size` -- the largest batch size whose estimated peak (``StepEstimate.peak_bytes``, the
  larger of the first step and the steady state) is within a budget. It is exact *with respect to the
  estimator*: ``estimate(max) <= budget < estimate(max + 1)``. Memory is close to affine in the batch
  size, so the search probes two sizes, fits a line, and then verifies the boundary (``max`` and
  ``max + 1``), falling back to secant and bisection steps where the line was wrong -- typically four
  probes. Every probe is a full fake run of two steps, so a probe costs the same at any batch size;
  the batches are built on the meta device, so no size costs real memory.
* :func:`device_budget` and :func:`precheck` -- how much memory a device has for the step, and whether
  an estimate fits it (with the message :class:`MemoryBudgetError` carries). ``MemEstimate`` calls them
  on fit start.
* :class:`FitBatchSize` -- a Lightning callback that sets the batch size (where Lightning's
  ``BatchSizeFinder`` would: the module attribute, ``hparams``, the datamodule) to the largest one that
  fits, from the estimator alone: no trial steps, no OOMs, and it works under DDP.

The margin model of :func:`device_budget`
-----------------------------------------
The estimate is of the bytes the allocator hands out (on CUDA: ``max_memory_allocated``). What the
device must have on top of that:

* CUDA: ``torch.cuda.mem_get_info`` runs inside this process's CUDA context, so the context is
  already outside ``free``. Not yet outside it: memory that the first real steps allocate outside the
  caching allocator -- cuBLAS/cuDNN handles, kernels loaded lazily (``CUDA_MODULE_LOADING=LAZY``), NCCL
  buffers under DDP. That is a fixed ``margin_bytes`` (default :data:`CUDA_MARGIN_BYTES`). And the
  caching allocator reserves more than it hands out (blocks rounded up, segments split and cached):
  ``overhead`` (default :data:`CUDA_RESERVED_OVERHEAD`) of the peak. Memory this process's allocator
  already reserves (the model's weights, moved to the device before ``on_fit_start``) is available to
  the step -- the estimate counts those weights itself -- so it is added back.
* CPU: ``MemAvailable`` of ``/proc/meminfo`` (the kernel's estimate of what can be allocated without
  swapping), plus ``resident_bytes`` that the caller says the estimate counts but that already exist
  (the model's parameters on the host). No margin by default: the CPU allocator hands out what is
  asked, and the budget is a snapshot shared with every other process anyway.

So the budget is ``(free + reclaimable - margin_bytes) / (1 + overhead)``: the largest *estimated*
peak that fits.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_memest.batch_size import max_batch_size
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

import contextlib
import math
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.engine.distributed import Strategy
from lightning_memest.engine.step import LossFn, OptimizerFactory, sum_loss
from lightning_memest.errors import EstimationError, MemestError, MemoryBudgetError
from lightning_memest.estimate import PeakProfile, peak_profile, simulate_lightning_step, simulate_step
from lightning_memest.lightning_step import first_batch
from lightning_memest.measure import module_tensors, resident_bytes
from lightning_memest.report import StepEstimate, format_bytes

if TYPE_CHECKING:
    from lightning_memest.models import Case

__all__ = [
    "CUDA_MARGIN_BYTES",
    "CUDA_RESERVED_OVERHEAD",
    "DEFAULT_CAP",
    "BatchSizeResult",
    "FitBatchSize",
    "MemoryBudgetError",
    "PrecheckResult",
    "batch_size_of",
    "case_batch_maker",
    "device_budget",
    "lightning_max_batch_size",
    "max_batch_size",
    "parse_size",
    "precheck",
    "resize_batch",
    "search_batch_size",
]

#: The largest batch size the search considers: far beyond any real batch, small enough that the
#: bisection ends in at most 20 steps.
DEFAULT_CAP = 2**20
#: Device memory that real CUDA steps take outside the caching allocator (library handles, lazily
#: loaded kernels, NCCL buffers): not in the estimate, not yet out of ``mem_get_info``'s free bytes.
CUDA_MARGIN_BYTES = 512 * 2**20
#: Reserved over allocated bytes of the caching allocator at a training step's peak (rounding,
#: cached and split blocks); the estimate is of allocated bytes.
CUDA_RESERVED_OVERHEAD = 0.10

#: Called after each probe with ``(batch_size, peak_bytes)``: progress for slow searches.
Progress = Callable[[int, int], None]


# ------------------------------------------------------------------------------------------- sizes

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from a size: ``'12345'``, ``'512MiB'``, ``'1.5GB'``, ``'8g'``.

    Units, case-insensitive: ``B``; binary ``KiB MiB GiB TiB`` and their one-letter forms ``K M G T``
    (as in ``docker --memory 8g``); decimal ``KB MB GB TB``. Fractions round down to whole bytes.

    >>> parse_size("10GiB"), parse_size("1.5GB"), parse_size("8g"), parse_size("4096")
    (10737418240, 1500000000, 8589934592, 4096)
    >>> parse_size("ten gigs")
    Traceback (most recent call last):
    ...
    ValueError: a size is a number and an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T) such as 10GiB or 1.5GB; got 'ten gigs'
    """  # noqa: E501
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            "a size is a number and an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T) "
            f"such as 10GiB or 1.5GB; got {text!r}"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"a size must be at least one byte; got {text!r}")
    return int(value)


# ------------------------------------------------------------------------------------------ batches


def batch_size_of(batch: Any) -> int:
    """The batch size of ``batch``: the leading size of its first tensor with one.

    >>> batch_size_of({"x": torch.zeros(4, 3), "y": (torch.zeros(4),)})
    4
    """
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.ndim else None)
    if not sizes:
        raise MemestError("the batch holds no tensor with a batch dimension, so it cannot be resized")
    return sizes[0]


def resize_batch(batch: Any, old: int, new: int) -> Any:
    """``batch`` with each tensor of leading size ``old`` replaced by a meta tensor of leading size ``new``.

    Meta tensors have shapes and dtypes but no memory, so a batch of any size costs nothing; the
    estimator accepts them. Other tensors and values are kept as they are. Nested tuples, lists, dicts,
    named tuples and dataclasses are rebuilt (``lightning_utilities``' ``apply_to_collection``).

    A tensor whose leading size equals ``old`` by coincidence (a sequence length equal to the batch
    size) is resized too; choose a probe batch size that no other leading dimension shares.

    >>> x, y = resize_batch((torch.zeros(8, 3, 32, 32), torch.zeros(8, dtype=torch.long)), 8, 1000)
    >>> x.shape, x.device, y.dtype
    (torch.Size([1000, 3, 32, 32]), device(type='meta'), torch.int64)
    """

    def resize(t: Tensor) -> Tensor:
        if t.ndim == 0 or t.shape[0] != old:
            return t
        shape = (new, *t.shape[1:])
        # Keep channels-last inputs channels-last: convolution kernels (and their memory) depend on it.
        channels_last = (
            t.ndim == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
        )
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        return torch.empty(shape, dtype=t.dtype, device="meta", memory_format=fmt)

    return apply_to_collection(batch, Tensor, resize)


def case_batch_maker(case: Case) -> Callable[[int], Any]:
    """``make_batch`` for a :class:`~lightning_memest.models.Case`: its batch (the input, and the
    cross-entropy target made from the output's shape) resized on the meta device.

    >>> from lightning_memest.models import InputSpec, build_case
    >>> case = build_case("torch.nn:Linear", InputSpec(batch_size=4, shape=(8,)),
    ...                   model_kwargs={"in_features": 8, "out_features": 3})
    >>> [tuple(t.shape) for t in case_batch_maker(case)(100)]
    [(100, 8), (100,)]
    """
    old = case.input.batch_size
    return lambda n: resize_batch(case.batch, old, n)


# ------------------------------------------------------------------------------------------- search


@dataclass(frozen=True)
class BatchSizeResult:
    """The outcome of a batch-size search.

    ``max_batch_size`` is 0 when even one sample is over the budget (``peak_bytes_at_max`` is then
    ``None``); ``capped`` says the search stopped at ``cap`` with memory to spare.
    """

    max_batch_size: int
    peak_bytes_at_max: int | None
    budget_bytes: int
    probes: tuple[tuple[int, int], ...]
    """Every ``(batch_size, peak_bytes)`` estimated, in order."""
    seconds: float
    capped: bool = False

    @property
    def message(self) -> str:
        """One sentence for people."""
        peaks = dict(self.probes)
        budget = format_bytes(self.budget_bytes)
        if self.max_batch_size == 0:
            return (
                f"even batch size 1 is over the memory budget: its estimated peak is "
                f"{format_bytes(peaks[1])}, the budget {budget}"
            )
        assert self.peak_bytes_at_max is not None
        text = (
            f"the largest batch size within {budget} is {self.max_batch_size} "
            f"(estimated peak {format_bytes(self.peak_bytes_at_max)}"
        )
        if self.capped:
            return text + f"); the search stops at {self.max_batch_size}, a larger one may fit too"
        return text + f"; {self.max_batch_size + 1} needs {format_bytes(peaks[self.max_batch_size + 1])})"

    def to_json(self) -> dict[str, Any]:
        """What ``memest max-batch-size --json`` prints."""
        return {
            "max_batch_size": self.max_batch_size,
            "peak_bytes_at_max": self.peak_bytes_at_max,
            "probes": len(self.probes),
            "seconds": round(self.seconds, 3),
        }


@dataclass
class _Search:
    peak_of: Callable[[int], int | PeakProfile]
    budget: int
    progress: Progress | None
    probes: list[tuple[int, int]] = field(default_factory=list)
    known: dict[int, int] = field(default_factory=dict)
    curves: dict[int, tuple[int, ...]] = field(default_factory=dict)
    worker: _Worker | None = None

    def peak(self, n: int) -> int:
        if n not in self.known:
            try:
                answer = self.peak_of(n)
            except EstimationError as e:
                raise _at_batch_size(e, n) from e
            self._record(n, answer)
        return self.known[n]

    def _record(self, n: int, answer: int | PeakProfile) -> None:
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
            here = self.peak_of(todo[0])
        except EstimationError:
            worker.result()
            raise
        self._record(todo[0], here)
        there = worker.result()
        if there is None:
            self.worker = None
            worker.close()
        else:
            self._record(todo[1], there)

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

    def line_guess(self, a: int, b: int) -> float | None:
        """Where the line through the peaks at ``a`` and ``b`` crosses the budget (None: flat or falling)."""
        pa, pb = self.known[a], self.known[b]
        if pb <= pa:
            return None
        return a + (self.budget - pa) * (b - a) / (pb - pa)


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
) -> BatchSizeResult:
    """The largest ``n <= cap`` with ``peak_of(n) <= budget_bytes < peak_of(n + 1)`` (0: none fits).

    ``peak_of`` is any peak model (one estimator run per call; each ``n`` is asked once), returning the
    peak or a :class:`~lightning_memest.estimate.PeakProfile`. It probes 1 and ``start``, extrapolates
    to the budget (through the two probes nearest the boundary: the lines of their memory curves when
    it has them, else the line of their peaks), and verifies the guess and its neighbour; when the
    guess was wrong, the next guesses interpolate inside the bracket, and bisect when that does not
    halve it. The result is exact for any ``peak_of`` that is non-decreasing; for one that is not, the
    answer is still a size that fits next to one that does not.

    With ``workers`` > 1 (and where :func:`can_fork`), pairs of probes run at once, one in a worker
    process forked at the start: 1 and ``start``, and a guess from the curves with its neighbour (one
    of them may go unused: it is still listed among the probes).

    >>> r = search_batch_size(lambda n: 1000 + 37 * n, 10_000)
    >>> r.max_batch_size, [n for n, _ in r.probes]  # an affine peak: two probes to fit, two to verify
    (243, [1, 8, 243, 244])
    >>> search_batch_size(lambda n: 100 * n, 50).max_batch_size
    0
    """
    if budget_bytes < 0:
        raise ValueError(f"the budget must not be negative; got {budget_bytes}")
    if cap < 1:
        raise ValueError(f"the cap must be at least 1; got {cap}")
    began = time.perf_counter()
    s = _Search(peak_of, budget_bytes, progress, worker=_start_worker(peak_of) if workers > 1 else None)
    try:
        return _search(s, budget_bytes, start, cap, began)
    finally:
        if s.worker is not None:
            s.worker.close()


def _search(s: _Search, budget_bytes: int, start: int, cap: int, began: float) -> BatchSizeResult:
    def result(n: int, capped: bool = False) -> BatchSizeResult:
        peak = s.known[n] if n else None
        return BatchSizeResult(n, peak, budget_bytes, tuple(s.probes), time.perf_counter() - began, capped)

    start = min(max(start, 2), cap)
    s.prefetch([1, start])
    if not s.fits(1):
        return result(0)
    lo, hi = 1, None  # lo fits, hi (when known) does not; the answer is in [lo, hi - 1]
    if start > 1:
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
) -> BatchSizeResult:
    """The largest batch size whose training steps' estimated peak is within ``budget_bytes``.

    ``make_batch(n)`` builds the batch of size ``n`` -- on the meta device, so that no size costs real
    memory (:func:`resize_batch` makes one from an example batch). The other arguments are those of
    :func:`~lightning_memest.estimate.estimate_step` (with a ``strategy``, the batch is one rank's and
    so is the budget; ``gpu`` for CUDA); ``workers`` is how many probes may run at once (default: 2
    where the machine has two cores and :func:`can_fork` allows it); ``start`` is the second size
    probed (after 1) and ``cap`` the largest size considered. The search is :func:`search_batch_size` over
    ``estimate_step(...).peak_bytes``; an :class:`~lightning_memest.errors.EstimationError` of a probe
    propagates, with the batch size named.

    Example:
        >>> import torch
        >>> r = max_batch_size(torch.nn.Linear(1000, 1000), lambda n: torch.empty(n, 1000, device="meta"),
        ...                    2**24, optimizer=torch.optim.SGD)
        >>> r.max_batch_size, r.peak_bytes_at_max <= 2**24
        (1096, True)
    """

    def peak_of(n: int) -> PeakProfile:
        # estimate_step(...).peak_bytes, without FLOPs or the report: a probe only needs the peak.
        sim = simulate_step(
            model,
            make_batch(n),
            loss_fn=loss_fn,
            optimizer=optimizer,
            precision=precision,
            device=device,
            steps=steps,
            flops=False,
            strategy=strategy,
        )
        return peak_profile(sim, gpu)

    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    return search_batch_size(peak_of, budget_bytes, start=start, cap=cap, progress=progress, workers=workers)


def can_fork() -> bool:
    """Whether probes may run in forked processes here: Linux, no CUDA context, no other Python
    thread and no process group in this process (forking any of those is unsafe)."""
    return (
        sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        and threading.active_count() == 1
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    )


def _start_worker(peak_of: Callable[[int], int | PeakProfile]) -> _Worker | None:
    """A worker for the search, or ``None`` where forking is unsafe or the child cannot run backward
    (autograd refuses in a child forked after this process ran backward on fake tensors: the worker
    is forked before the search's own first probe, and says at once whether it can)."""
    if not can_fork():
        return None
    worker = _Worker(peak_of)
    if worker.ready:
        return worker
    worker.close()
    return None


class _Worker:
    """A forked process that answers probes for the search (``None`` for one it could not answer)."""

    def __init__(self, peak_of: Callable[[int], int | PeakProfile]) -> None:
        ctx = multiprocessing.get_context("fork")
        self._conn, child_end = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(peak_of, child_end), daemon=True)
        self._process.start()
        child_end.close()
        self.ready = self.result() == 0  # the child's first answer: whether it can run backward

    def submit(self, n: int) -> None:
        self._conn.send(n)

    def result(self) -> int | PeakProfile | None:
        try:
            answer: int | PeakProfile | None = self._conn.recv()
        except (EOFError, OSError):
            return None
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()


def _serve(peak_of: Callable[[int], int | PeakProfile], conn: Any) -> None:
    # A child forked after the parent ran backward on another device than the CPU (fake tensors' is
    # meta) cannot run backward (autograd's device threads): say so at once; the search runs alone.
    try:
        torch.ones(1, device="meta", requires_grad=True).sum().backward()  # type: ignore[no-untyped-call]
    except RuntimeError:
        conn.send(None)
        return
    conn.send(0)
    while (n := conn.recv()) is not None:
        try:
            answer = peak_of(n)
        except BaseException:
            answer = None
        conn.send(answer)


def lightning_max_batch_size(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    batch: Any,
    budget_bytes: int,
    *,
    batch_size: int | None = None,
    cap: int = DEFAULT_CAP,
    progress: Progress | None = None,
) -> BatchSizeResult:
    """:func:`max_batch_size` for a LightningModule as ``trainer`` trains it.

    ``batch`` is one batch of the train dataloader (``lightning_step.first_batch``); its tensors whose leading
    size is ``batch_size`` (default: :func:`batch_size_of` the batch) are resized on the meta device for
    each probe, and ``estimate_lightning_step`` runs the module's own ``training_step``.
    """
    old = batch_size_of(batch) if batch_size is None else batch_size

    def peak_of(n: int) -> PeakProfile:
        sim = simulate_lightning_step(trainer, module, resize_batch(batch, old, n), flops=False)
        return peak_profile(sim)

    return search_batch_size(peak_of, budget_bytes, start=old, cap=cap, progress=progress)


# ---------------------------------------------------------------------------------------- the budget


def _mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``; psutil's figure where there is no ``/proc`` (macOS)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except OSError:
        pass
    try:
        import psutil  # optional: only where /proc is missing
    except ImportError:
        raise MemestError(
            "cannot tell the memory this machine has available (no /proc/meminfo, no psutil); "
            "give the budget explicitly"
        ) from None
    return int(psutil.virtual_memory().available)


def device_budget(
    device: str | torch.device,
    *,
    margin_bytes: int | None = None,
    overhead: float | None = None,
    resident_bytes: int = 0,
) -> int:
    """The largest estimated peak (``StepEstimate.peak_bytes``) that fits the memory ``device`` has now.

    ``(free + reclaimable - margin_bytes) / (1 + overhead)``, floored at 0, where on CUDA ``free`` is
    ``torch.cuda.mem_get_info`` and ``reclaimable`` is what this process's caching allocator already
    reserves, and on CPU ``free`` is ``MemAvailable`` and ``reclaimable`` is ``resident_bytes`` (bytes
    the estimate counts that are already allocated: the model's parameters). ``margin_bytes`` defaults
    to :data:`CUDA_MARGIN_BYTES` on CUDA and 0 on CPU, ``overhead`` to :data:`CUDA_RESERVED_OVERHEAD`
    on CUDA and 0 on CPU; the module docstring says why.

    >>> device_budget("cpu") > 0
    True
    >>> device_budget("cpu", margin_bytes=2**60)
    0
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(index)
        reclaimable = torch.cuda.memory_reserved(index)
        margin = CUDA_MARGIN_BYTES if margin_bytes is None else margin_bytes
        factor = 1.0 + (CUDA_RESERVED_OVERHEAD if overhead is None else overhead)
    elif dev.type == "cpu":
        free, reclaimable = _mem_available(), resident_bytes
        margin = 0 if margin_bytes is None else margin_bytes
        factor = 1.0 + (0.0 if overhead is None else overhead)
    else:
        raise MemestError(f"cannot tell the memory of device {dev}; give the budget explicitly")
    return max(0, int((free + reclaimable - margin) / factor))


# ---------------------------------------------------------------------------------------- pre-check


@dataclass(frozen=True)
class PrecheckResult:
    """Whether an estimate fits a budget, and the sentence that says so."""

    fits: bool
    peak_bytes: int
    budget_bytes: int
    batch_size: int | None
    max_batch_size: int | None
    """The largest batch size that fits (only computed when the estimate does not fit)."""
    message: str

    def error(self) -> MemoryBudgetError:
        """The error to raise when it does not fit."""
        return MemoryBudgetError(
            self.message,
            peak_bytes=self.peak_bytes,
            budget_bytes=self.budget_bytes,
            batch_size=self.batch_size,
            max_batch_size=self.max_batch_size,
        )


def precheck(
    estimate: StepEstimate,
    budget_bytes: int,
    *,
    batch_size: int | None = None,
    max_fit: Callable[[], int] | None = None,
) -> PrecheckResult:
    """Compare the estimated peak with ``budget_bytes`` (from :func:`device_budget`, say).

    ``max_fit`` computes the largest batch size that fits (a :func:`lightning_max_batch_size` search);
    it is called only when the estimate does not fit, as it costs a few estimator runs. The message
    names the estimated peak, the budget, the batch size in use and the largest that fits.

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> est = estimate_step(torch.nn.Linear(1000, 1000), torch.randn(64, 1000))
        >>> r = precheck(est, 2**20, batch_size=64, max_fit=lambda: 0)
        >>> r.fits
        False
        >>> print(r.message)
        the estimated peak of a training step at batch size 64, 8.12 MiB (8,516,008 B), is over the memory budget of 1.00 MiB (1,048,576 B); even batch size 1 does not fit
        >>> precheck(est, 2**30).fits
        True
    """  # noqa: E501
    peak = estimate.peak_bytes
    at = f" at batch size {batch_size}" if batch_size is not None else ""
    amounts = (
        f"the estimated peak of a training step{at}, {format_bytes(peak)} ({peak:,} B), is {{}} the "
        f"memory budget of {format_bytes(budget_bytes)} ({budget_bytes:,} B)"
    )
    if peak <= budget_bytes:
        return PrecheckResult(True, peak, budget_bytes, batch_size, None, amounts.format("within"))
    best = max_fit() if max_fit is not None else None
    message = amounts.format("over")
    if best is not None:
        message += (
            "; even batch size 1 does not fit"
            if best == 0
            else f"; the largest batch size that fits is {best}"
        )
    return PrecheckResult(False, peak, budget_bytes, batch_size, best, message)


# ------------------------------------------------------------------------------------ the callback


class FitBatchSize(Callback):
    """Sets the batch size to the largest that fits the device, from the estimator alone.

    On fit start -- the module is on its device, in its precision, with its optimizers, and the train
    dataloader not yet built -- it takes one batch of the train dataloader, searches the largest batch
    size whose estimated peak is within the budget (:func:`lightning_max_batch_size`: fake runs of the
    module's own ``training_step`` on meta batches; no real step, so no OOM trials), and sets it where
    Lightning's ``BatchSizeFinder`` would: ``attr_name`` of the module, its ``hparams``, the datamodule
    and its ``hparams`` (``lightning_setattr``). The fit loop then builds the train dataloader with it;
    a dataloader already built (``estimated_stepping_batches`` in ``configure_optimizers`` builds one)
    is dropped so that it is rebuilt.

    Args:
        budget: bytes (or a size such as ``"10GiB"``) for the estimated peak; ``None``: what the
            device has (:func:`device_budget`, with its margin model).
        margin: the fraction of the budget kept back for safety (0.1: the peak stays within 90 %).
        attr_name: where the batch size lives (``lightning_getattr``'s names).
        max_batch_size: the largest batch size considered.
        raise_if_none_fits: when not even batch size 1 fits, raise
            :class:`~lightning_memest.errors.MemoryBudgetError` (stopping ``fit`` before any step);
            otherwise warn and leave the batch size alone.

    Under DDP each rank searches with its own device's budget (the estimate is per rank: a rank holds a
    full replica and its own batch), and all ranks take the smallest answer, so the batch size stays the
    same across ranks. Lightning's ``BatchSizeFinder`` refuses distributed strategies because its trials
    are real steps that can OOM one rank; these cannot. (Not tested with several processes here.)

    Put it before ``MemEstimate`` in ``callbacks``, so that ``MemEstimate`` estimates the chosen size.
    ``result`` holds the search's :class:`BatchSizeResult` after fit start.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[FitBatchSize("2GiB")], max_steps=1)  # doctest: +SKIP
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
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1); got {margin}")
        self.budget = parse_size(budget) if isinstance(budget, str) else budget
        self.margin = margin
        self.attr_name = attr_name
        self.max_batch_size = max_batch_size
        self.raise_if_none_fits = raise_if_none_fits
        self.result: BatchSizeResult | None = None

    def _budget(self, trainer: pl.Trainer, module: pl.LightningModule) -> int:
        if self.budget is not None:
            budget = self.budget
        else:
            device = trainer.strategy.root_device
            # On CPU the weights already take host memory that MemAvailable no longer shows, and the
            # estimate counts them: give them back. (On CUDA the allocator's reserved bytes do that.)
            resident = resident_bytes(module_tensors(module)) if device.type == "cpu" else 0
            budget = device_budget(device, resident_bytes=resident)
        return int(budget * (1.0 - self.margin))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:

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
        batch = first_batch(trainer, pl_module)
        # The dataloader may batch differently from the attribute (a sampler, a collate); resize what it
        # yields, and say so if they differ.
        seen = batch_size_of(batch)
        result = lightning_max_batch_size(
            trainer, pl_module, batch, budget, batch_size=seen, cap=self.max_batch_size
        )
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
        rank_zero_info(
            f"FitBatchSize: {self.attr_name} {current} -> {best}{note}: {result.message}; "
            f"{len(result.probes)} estimates in {result.seconds:.1f} s"
        )


def _min_over_ranks(trainer: pl.Trainer, value: int) -> int:
    """All ranks must train with the same batch size: the one every rank's memory allows."""
    if trainer.world_size == 1:
        return value
    gathered = trainer.strategy.all_gather(torch.tensor(value, device=trainer.strategy.root_device))
    return int(gathered.min().item())
