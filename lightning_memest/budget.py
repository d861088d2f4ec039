"""How much memory a device has for a training step, and the pre-check.

* :func:`parse_size` -- bytes from ``"10GiB"``, ``"1.5GB"``, ``"8g"`` (``sizes.py``, with
  :class:`~lightning_memest.sizes.MemoryBudget`: bytes, a size or ``"80%"`` of the device);
* :func:`device_budget` -- the largest estimated peak that fits the memory a device has now;
* :func:`precheck` -- whether an estimate fits a budget, with the sentence (and the
  :class:`~lightning_memest.errors.MemoryBudgetError`) that says so. ``MemEstimate`` calls these on fit
  start.

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_memest.errors import MemestError, MemoryBudgetError
from lightning_memest.machine import mem_available
from lightning_memest.report import StepEstimate, format_bytes
from lightning_memest.sizes import MemoryBudget, parse_size

if TYPE_CHECKING:
    from lightning_memest.advice import Option

__all__ = [
    "CUDA_MARGIN_BYTES",
    "CUDA_RESERVED_OVERHEAD",
    "PrecheckResult",
    "budget_for",
    "device_budget",
    "parse_size",
    "precheck",
    "what_it_holds",
    "what_runs",
]

#: Device memory that real CUDA steps take outside the caching allocator (library handles, lazily
#: loaded kernels, NCCL buffers): not in the estimate, not yet out of ``mem_get_info``'s free bytes.
CUDA_MARGIN_BYTES = 512 * 2**20
#: Reserved over allocated bytes of the caching allocator at a training step's peak (rounding,
#: cached and split blocks); the estimate is of allocated bytes.
CUDA_RESERVED_OVERHEAD = 0.10

#: Called after each probe with ``(batch_size, peak_bytes)``: progress for slow searches.

# ---------------------------------------------------------------------------------------- the budget


def _mem_available() -> int:
    available = mem_available()
    if available is None:
        raise MemestError(
            "cannot tell the memory this machine has available (no /proc/meminfo, no psutil); "
            "give the budget explicitly"
        )
    return available


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


def budget_for(
    estimate: StepEstimate,
    device: str | torch.device,
    *,
    memory_budget: int | str | MemoryBudget | None = None,
    margin_bytes: int | None = None,
) -> int:
    """The budget ``estimate`` is checked against: ``memory_budget`` where given -- bytes, a size
    (``"10GiB"``) or a share of what the device has (``"80%"``, see :class:`MemoryBudget`) -- else what
    :func:`device_budget` finds, with what the estimate counts that already takes memory (the
    parameters, buffers and other tensors at the first peak) given back on a CPU, whose available
    memory no longer shows it (CUDA's reserved bytes do).

    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> budget_for(estimate_step(torch.nn.Linear(4, 4), torch.randn(2, 4)), "cpu", memory_budget="1GiB")
    1073741824
    """
    given = MemoryBudget.parse(memory_budget) if memory_budget is not None else None
    if given is not None and given.bytes is not None:
        return given.bytes
    first = estimate.first_step.breakdown
    resident = first.parameters + first.buffers + first.other_tensors
    dev = torch.device(device)
    available = device_budget(
        dev, margin_bytes=margin_bytes, resident_bytes=resident if dev.type == "cpu" else 0
    )
    return given.of(available) if given is not None else available


# ---------------------------------------------------------------------------------------- pre-check
#: What each loop's estimate is of, in the pre-check's words.
_LOOP_STEPS = {
    "train": "a training step",
    "validate": "a validation batch",
    "test": "a test batch",
    "predict": "a predict batch",
}


def what_runs(loop: str) -> str:
    """What one batch of ``loop`` (``StepEstimate.loop``) is called in a message.

    >>> what_runs("train"), what_runs("predict")
    ('a training step', 'a predict batch')
    """
    return _LOOP_STEPS.get(loop, f"a {loop} batch")


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
    options: tuple[Option, ...] = ()
    """What would fit, each estimated, cheapest first (``advice.advise``; only when it does not fit)."""

    def error(self) -> MemoryBudgetError:
        """The error to raise when it does not fit."""
        return MemoryBudgetError(
            self.message,
            peak_bytes=self.peak_bytes,
            budget_bytes=self.budget_bytes,
            batch_size=self.batch_size,
            max_batch_size=self.max_batch_size,
            options=self.options,
        )


def precheck(
    estimate: StepEstimate,
    budget_bytes: int,
    *,
    batch_size: int | None = None,
    max_fit: Callable[[], int | None] | None = None,
    what: str | None = None,
    options: Callable[[], Sequence[Option]] | None = None,
) -> PrecheckResult:
    """Compare the estimated peak with ``budget_bytes`` (from :func:`device_budget`, say): the least
    the step can run in (``StepEstimate.runnable_peak_bytes``: on CUDA, with cuDNN's smallest
    convolution workspaces), the typical peak named beside it where it differs.

    ``max_fit`` computes the largest batch size that fits (a batch-size search: ``SizedStep.largest_batch``
    in ``fit``), ``options`` what would fit (``advice.advise``); both are called only when the estimate
    does not fit, as they cost estimator runs. The message names what runs (``what``, else the
    estimate's loop: "a training step", "a validation batch" ...), the estimated peak, the budget, what
    the peak holds, the batch size in use, the largest that fits and the options.

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> est = estimate_step(torch.nn.Linear(1000, 1000), torch.randn(64, 1000))
        >>> r = precheck(est, 2**20, batch_size=64, max_fit=lambda: 0)
        >>> r.fits
        False
        >>> print(r.message)
        the estimated peak of a training step at batch size 64, 8.12 MiB (8,516,008 B), is over the memory budget of 1.00 MiB (1,048,576 B); at the peak (step 1, backward): parameters 3.82 MiB, gradients 3.81 MiB, workspaces 250.00 KiB; 7.63 MiB of it (94 %) is the model's state and other tensors, whatever the batch size; even batch size 1 does not fit
        >>> precheck(est, 2**30).fits
        True
    """  # noqa: E501
    # On CUDA the step runs in less than its typical peak when cuDNN falls back to convolution plans
    # with smaller workspaces (accounting.kernels.cudnn_workspace): that is what must fit.
    peak, typical = estimate.runnable_peak_bytes, estimate.peak_bytes
    at = f" at batch size {batch_size}" if batch_size is not None else ""
    what = what or what_runs(estimate.loop)
    least = (
        f" with cuDNN's smallest convolution workspaces ({format_bytes(typical)} with the plans it prefers)"
        if peak != typical
        else ""
    )
    amounts = (
        f"the estimated peak of {what}{at}, {format_bytes(peak)} ({peak:,} B){least}, is {{}} the "
        f"memory budget of {format_bytes(budget_bytes)} ({budget_bytes:,} B)"
    )
    if peak <= budget_bytes:
        message = amounts.format("within")
        if typical > budget_bytes:
            message += "; cuDNN will fall back to convolution plans with smaller workspaces (slower)"
        return PrecheckResult(True, peak, budget_bytes, batch_size, None, message)
    best = max_fit() if max_fit is not None else None
    message = amounts.format("over") + f"; {what_it_holds(estimate)}"
    if best is not None:
        message += (
            "; even batch size 1 does not fit"
            if best == 0
            else f"; the largest batch size that fits is {best}"
        )
    offered = tuple(options()) if options is not None else ()
    if offered:
        message += "; what would fit, each estimated, cheapest first: " + "; ".join(
            f"({i}) {option}" for i, option in enumerate(offered, 1)
        )
    return PrecheckResult(False, peak, budget_bytes, batch_size, best, message, offered)


#: What a batch of another size does not change: the model's state and what else lives on the device.
_FIXED = ("parameters", "buffers", "gradients", "optimizer_state", "other_tensors")


def what_it_holds(estimate: StepEstimate, top: int = 3) -> str:
    """What the highest peak of ``estimate`` holds, in words: its largest roles, and how much of it no
    batch size changes (the parameters, buffers, gradients, optimizer state and other tensors; what
    the optimizer's update allocates is among the temporaries, which do change with it).

    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> est = estimate_step(torch.nn.Linear(1000, 1000), torch.randn(64, 1000), optimizer=torch.optim.Adam)
    >>> print(what_it_holds(est))
    at the peak (step 1, optimizer): optimizer state 7.64 MiB, temporaries 7.63 MiB, parameters 3.82 MiB; 15.27 MiB of it (66 %) is the model's state and other tensors, whatever the batch size
    """  # noqa: E501
    peak = max(estimate.peaks, key=lambda p: p.bytes)
    held = sorted(((n, name) for name, n in peak.breakdown.items() if n), reverse=True)[:top]
    roles = ", ".join(f"{name.replace('_', ' ')} {format_bytes(n)}" for n, name in held)
    fixed = sum(n for name, n in peak.breakdown.items() if name in _FIXED)
    share = f" ({100 * fixed / peak.bytes:.0f} %)" if peak.bytes else ""
    return (
        f"at the peak (step {peak.step}, {peak.phase.value}): {roles}; {format_bytes(fixed)} of it{share} "
        "is the model's state and other tensors, whatever the batch size"
    )
