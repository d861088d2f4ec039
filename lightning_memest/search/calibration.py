"""The batch-size search with the kernels calibrated on this machine, without a real step per probe.

Calibrating a step (``accounting/kernels/calibrate.py``) runs each of its op signatures for real: about
the time of one real step. A search probes a dozen sizes, each with its own signatures, so calibrating
every probe would cost what the search is there to avoid. :class:`CalibratedPeaks` calibrates two sizes
in full instead -- the *anchors*, the batch in hand and half of it (:func:`anchor_sizes`) -- and
answers every other probe from them:

1. **The fit** (``accounting/kernels/batch_fit.py``): the two steps run the same ops; each op
   signature is paired with its twin at the other anchor, and its kernel memory follows the batch size
   on a line (exact where the signature does not depend on the batch: weights, the optimizer).
2. **Where the fit could move the peak, a measurement.** A kernel's workspace can bend upwards with the
   batch (oneDNN's backward convolution takes the larger of a weight-sized and a batch-sized buffer),
   which a line through two small anchors misses. So at each probe, every fitted call whose high point
   could reach the peak -- its high point with the workspace at its plausible largest
   (``BatchFit.workspace_bound``) -- is measured at the probe's own size, a few ops run alone rather
   than a whole step; and again, until the peak stands on measured calls or on calls that cannot reach
   it. The search's answer is then as exact as a calibration of the whole step at that size.

Measuring runs real kernels, which only the search's own process may do (a process forked after this
one ran OpenMP kernels hangs in its first parallel kernel): the anchors are calibrated here once the
search's worker process is forked (:meth:`CalibratedPeaks.prepare`); the worker gets the fit with each
probe (:meth:`share` / :meth:`receive`), answers with its fitted peak and the calls it could not
measure, and this process measures them and corrects the worker's memory curve (:meth:`finish`).
Everything measured goes to the calibration cache: a second search of the same model measures nothing.

Example:
    >>> import torch
    >>> from lightning_memest.accounting import capture_filter
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> model, capture = torch.nn.Linear(64, 64), capture_filter(flops=False, calibrate=True)
    >>> at = lambda n: simulate(model, torch.empty(n, 64, device="meta"), StepConfig(), capture=capture)
    >>> peaks = CalibratedPeaks(at, start=8, gpu=None, cache_dir=None)
    >>> known, parallel = peaks.prepare()  # the anchors, calibrated in full
    >>> sorted(known), parallel
    ([4, 8], True)
    >>> peaks(100).peak > known[8].peak
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lightning_memest.accounting import PeakProfile, peak_profile
from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.accounting.kernels import KernelMemory, kernel_fn
from lightning_memest.accounting.kernels.batch_fit import Anchor, BatchFit
from lightning_memest.accounting.kernels.calibrate import (
    Calibration,
    calibratable,
    calibrate,
    calibrate_calls,
    outputs_only,
    signature,
)
from lightning_memest.engine.events import OpCall, OpEvent, Phase, TensorMeta
from lightning_memest.engine.simulate import Simulation
from lightning_memest.errors import EstimationError

__all__ = ["CalibratedPeaks", "SearchCalibration", "anchor_sizes"]


def anchor_sizes(start: int) -> tuple[int, int]:
    """The two batch sizes calibrated in full: ``start`` (the batch in hand, whose calibration an
    estimate has usually cached already) and half of it; never 1 (a batch of one takes other kernel
    paths: matrix-vector products, a convolution's degenerate strides), so 2 and 4 below 4.

    >>> anchor_sizes(8), anchor_sizes(5), anchor_sizes(3), anchor_sizes(1)
    ((4, 8), (2, 5), (2, 3), (2, 4))
    """
    low = max(2, start // 2)
    return (low, start) if start > low else (2, 4)


@dataclass(frozen=True)
class SearchCalibration:
    """What calibrating the kernels took in a batch-size search."""

    anchors: tuple[int, int] | None
    """The batch sizes calibrated in full (``None``: no fit -- each probe was calibrated in full)."""
    seconds: float
    """Wall seconds of measuring (0 when the cache had everything)."""
    measured: int
    """Op signatures measured now (the rest came from the cache)."""
    refined: int
    """Of the fitted calls, how many were measured at a probe's own size (where the fit could move the
    peak)."""
    failed: tuple[str, ...] = ()
    """Ops with signatures that could not be measured (their fitted or hand-modelled figures hold)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "anchors": list(self.anchors) if self.anchors is not None else None,
            "seconds": round(self.seconds, 3),
            "measured": self.measured,
            "refined": self.refined,
            "failed": list(self.failed),
        }


@dataclass(frozen=True)
class _Uncertain:
    """A call of a probe whose kernel memory was not measured at its own signature."""

    index: int
    """The call's op in the probe's memory curve."""
    signature: str
    call: tuple[Any, ...]
    """The call, portable to another process (:func:`_portable`)."""
    used: int
    """The workspace the probe's curve counts for it."""
    hand: int
    """The hand model's workspace: what counts where the call is on no line of the fit."""
    hand_bound: int
    """How large the workspace could be where the hand model answers: twice the model, or the call's own
    bytes if more (a kernel that copies its tensors)."""
    per_sample: int
    """The bytes of the call's tensors per sample (at most): how fast a batch-sized buffer may grow."""


@dataclass(frozen=True)
class _Pending(PeakProfile):
    """A worker's probe: its fitted profile, its batch size and its uncertain calls (for :meth:`finish`)."""

    batch_size: int = 0
    uncertain: tuple[_Uncertain, ...] = ()


def _portable(call: OpCall) -> tuple[Any, ...]:
    # An op overload does not pickle; its name does.
    return (str(call.op), call.args, call.kwargs, call.outputs, call.device_type, call.grad_enabled)


def _call(portable: tuple[Any, ...]) -> OpCall:
    name, args, kwargs, outputs, device_type, grad_enabled = portable
    namespace, packet, overload = name.split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    return OpCall(op, args, kwargs, outputs, device_type, grad_enabled)


def _tensor_bytes(call: OpCall) -> int:
    values = [*tree_leaves((call.args, call.kwargs)), *call.outputs]
    return sum(v.bytes for v in values if isinstance(v, TensorMeta))


@dataclass
class _Counts:
    seconds: float = 0.0
    measured: int = 0
    refined: int = 0
    failed: set[str] = field(default_factory=set)

    def add(self, calibration: Calibration) -> None:
        self.seconds += calibration.seconds
        self.measured += calibration.measured
        self.failed.update(calibration.failed)


class CalibratedPeaks:
    """The search's peak model with calibrated kernels: ``peaks(n)`` is the :class:`PeakProfile` of the
    step at batch size ``n`` (``simulate_at(n)``, simulated with ``capture_filter(..., calibrate=True)``),
    its kernels fitted from the anchors and measured where that could move the peak (see the module's
    text). A what-if simulation (CUDA on a machine without a GPU) has nothing to calibrate: its probes
    keep the hand models."""

    def __init__(
        self,
        simulate_at: Callable[[int], Simulation],
        *,
        start: int,
        gpu: CudaDevice | None,
        cache_dir: Path | str | bool | None = True,
    ) -> None:
        self.simulate_at = simulate_at
        self.anchors = anchor_sizes(start)
        self.gpu = gpu
        self.cache_dir = cache_dir
        self.fit: BatchFit | None = None
        self.in_worker = False
        self.counts = _Counts()

    # ------------------------------------------------------------------ the search's protocol

    def prepare(self) -> tuple[dict[int, PeakProfile], bool]:
        """Calibrate the anchors (in this process, once the search's worker is forked): their profiles,
        and whether the worker may answer probes (not without a fit, nor on a GPU, where the peak is
        the caching allocator's and a curve cannot be corrected from here)."""
        known: dict[int, PeakProfile] = {}
        anchors: list[Anchor] = []
        device = "cpu"
        for n in self.anchors:
            try:
                sim = self.simulate_at(n)
            except EstimationError:
                return known, False  # the search probes this size itself, and meets the error there
            if sim.what_if is not None:
                known[n] = peak_profile(sim, self.gpu)
                continue
            calibration = self._calibrate(sim)
            known[n] = peak_profile(sim, self.gpu, calibration)
            anchors.append(Anchor.of(n, sim, calibration))
            device = sim.device.type
        if len(anchors) == 2:
            self.fit = BatchFit.of(*anchors)
        return known, len(anchors) in (0, 2) and device == "cpu"

    def share(self) -> BatchFit | None:
        """What the worker needs: the fit."""
        return self.fit

    def receive(self, fit: BatchFit | None) -> None:
        """In the worker: the fit, before a probe; it measures nothing itself."""
        self.fit = fit
        self.in_worker = True

    def finish(self, answer: int | PeakProfile) -> int | PeakProfile:
        """A worker's answer, here: its curve corrected by what the fit knows now (a probe measured
        meanwhile is a point next door), its uncertain calls measured where they could move the peak."""
        if not isinstance(answer, _Pending):
            return answer
        n, items = answer.batch_size, answer.uncertain

        def evaluate() -> tuple[int, list[int]]:
            curve = list(answer.curve)
            for u in items:
                curve[u.index] += self._status(u, n)[0] - u.used
            return max(curve, default=answer.peak), curve

        peak, curve = self._refine(n, items, evaluate)
        return PeakProfile(peak, tuple(curve))

    def summary(self) -> SearchCalibration:
        c = self.counts
        anchors = self.anchors if self.fit is not None else None
        return SearchCalibration(anchors, c.seconds, c.measured, c.refined, tuple(sorted(c.failed)))

    # -------------------------------------------------------------------------------- a probe

    def __call__(self, n: int) -> PeakProfile:
        sim = self.simulate_at(n)
        if sim.what_if is not None:
            return peak_profile(sim, self.gpu)
        fit = self.fit
        if fit is None:  # no anchors: the probe is calibrated in full
            return peak_profile(sim, self.gpu, self._calibrate(sim))
        device = sim.device.type
        if self.in_worker:  # nothing real runs here: this process measures the calls (finish)
            profile = peak_profile(sim, self.gpu, fit.calibration(sim, n, device))
            return _Pending(profile.peak, profile.curve, n, self._uncertain(sim, n))
        # Here the step itself is at hand: after each round of measurements it is accounted again.
        state: list[PeakProfile] = []

        def evaluate() -> tuple[int, list[int]]:
            state[:] = [peak_profile(sim, self.gpu, fit.calibration(sim, n, device))]
            return state[0].peak, list(state[0].curve)

        self._refine(n, self._uncertain(sim, n), evaluate)
        return state[0]

    def _calibrate(self, sim: Simulation) -> Calibration:
        calibration = calibrate(sim, cache_dir=self.cache_dir)
        self.counts.add(calibration)
        return calibration

    def _uncertain(self, sim: Simulation, n: int) -> tuple[_Uncertain, ...]:
        """The calls of ``sim`` whose kernel memory the fit did not measure at their own signature, with
        the workspace the fitted profile counts for each."""
        assert self.fit is not None
        ops = [e for e in sim.events if type(e) is OpEvent and e.phase is not Phase.SETUP]
        hand = kernel_fn(sim.device.type, what_if=False)
        found: list[_Uncertain] = []
        for index, event in enumerate(ops):
            call = event.call
            if call is None or not calibratable(call.op) or outputs_only(call):
                continue
            sig = signature(call)
            if sig in self.fit.exact:
                continue
            model, size = _workspace(hand(call)), _tensor_bytes(call)
            u = _Uncertain(index, sig, _portable(call), 0, model, max(2 * model, size), -(-size // n))
            found.append(replace(u, used=self._status(u, n)[0]))
        return tuple(found)

    def _status(self, u: _Uncertain, n: int) -> tuple[int, int]:
        """``(workspace counted, how large it could be)`` for ``u`` at batch size ``n``, by the fit as
        it is now: equal where measured."""
        assert self.fit is not None
        found, km = self.fit.at(u.signature, n)
        if not found:
            return u.hand, u.hand_bound
        bound = self.fit.workspace_bound(u.signature, n, u.per_sample)
        return _workspace(km), _workspace(km) if bound is None else max(bound, _workspace(km))

    def _refine(
        self, n: int, items: tuple[_Uncertain, ...], evaluate: Callable[[], tuple[int, list[int]]]
    ) -> tuple[int, list[int]]:
        """Measure, round by round, the uncertain calls whose high point -- with their workspace at its
        bound -- reaches the peak, unless the bound is within 0.02 % of the peak of the figure counted;
        ``evaluate()`` gives the peak and the curve by the fit as it is. Each measurement becomes a
        point of the fit."""
        assert self.fit is not None
        peak, curve = evaluate()
        tried: set[str] = set()
        while True:
            todo: dict[str, OpCall] = {}
            for u in items:
                used, bound = self._status(u, n)
                reach = curve[u.index] - used + bound
                if u.signature not in tried and bound - used > peak // 5_000 and reach >= peak:
                    todo.setdefault(u.signature, _call(u.call))
            if not todo:
                return peak, curve
            tried.update(todo)
            device = torch.device(next(iter(todo.values())).device_type)
            calibration = calibrate_calls(todo, device, cache_dir=self.cache_dir)
            self.counts.add(calibration)
            for sig in todo:
                if sig in calibration.entries:
                    self.fit.add(sig, n, calibration.entries[sig])
                    self.counts.refined += 1
            peak, curve = evaluate()


def _workspace(km: KernelMemory | None) -> int:
    return 0 if km is None else km.workspace_bytes
