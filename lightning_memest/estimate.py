"""``estimate_step``: the public entry of the plain-torch path -- keyword arguments, one validated
``StepConfig``, a simulation on fake tensors (``engine``), its accounting (``accounting``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from lightning_memest.accounting import account, capture_filter
from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.accounting.kernels.calibrate import calibrate as calibrate_kernels
from lightning_memest.constants import LOOPS
from lightning_memest.engine.inference_step import PlainLoop, loop_runner
from lightning_memest.engine.parallel.distributed import Strategy
from lightning_memest.engine.simulate import Simulation, simulate, simulate_replaying
from lightning_memest.engine.step import LossFn, OptimizerFactory, Precision, StepConfig, sum_loss
from lightning_memest.options import check_choice, check_step_options, check_strategy
from lightning_memest.report import StepEstimate

__all__ = ["estimate", "estimate_step"]


def estimate_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn = sum_loss,
    optimizer: OptimizerFactory | None = None,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    steps: int = 2,
    strategy: Strategy | None = None,
    gpu: CudaDevice | None = None,
    calibrate: bool = False,
    next_batches: Sequence[Any] = (),
    loop: PlainLoop = "train",
    replay_blocks: bool = True,
) -> StepEstimate:
    """Estimate the peak memory of training steps of ``model`` on ``batch``, without running them.

    The real step code runs ``steps`` times (forward and ``loss_fn``, backward, ``optimizer.step()``,
    ``zero_grad(set_to_none=True)``) on fake tensors of ``device``; every storage's life is followed.
    Nothing real is allocated for the model or the batch, and ``model`` is left exactly as it was.
    Every option is checked before anything is simulated (``lightning_memest.options``): a value of
    the wrong type is a ``TypeError``, one out of range a ``ValueError``, each naming the option.

    Args:
        model: real, meta-device or fake weights.
        batch: a tensor or nested tuples/lists/dicts of tensors (real or meta); ``loss_fn`` gets it.
        loss_fn: ``loss_fn(model, batch) -> loss``; the default sums the model's output.
        optimizer: an optimizer class or factory called with the trainable parameters
            (``torch.optim.AdamW`` or ``lambda ps: torch.optim.SGD(ps, lr=0.1)``); ``None``: no step.
        precision: Lightning's precision names: ``32-true``, ``16-mixed``, ``bf16-mixed``,
            ``16-true``, ``bf16-true``.
        device: where the step would run; defaults to the model's device (``cpu`` for meta models).
            ``cuda`` on a machine without a GPU is a what-if: the step runs on fake CPU tensors with
            CUDA's optimizer defaults and is accounted through the CUDA caching allocator model
            (``StepEstimate.approximate`` is then true).
        steps: steps to simulate, an int of at least 1 (2: the first step and the steady state).
        strategy: a parallel job from ``lightning_memest``: ``DDP(world_size)``, ``FSDP(world_size)``,
            ``TP``, ``ModelParallel`` or ``Pipeline``: the step runs as its ``rank`` (0 by default),
            with PyTorch's own DDP / FSDP2 / DTensor / pipelining code on a fake process group, and
            every figure is one rank's. ``loss_fn`` then gets the DDP wrapper (under FSDP the model
            itself, sharded); a ``Pipeline``'s schedule computes its own loss (its ``loss``).
        gpu: for ``device="cuda"``, the GPU (``CudaDevice``: its compute capability picks cuBLAS's
            workspace size, its context is reported apart); default: this machine's GPU, else an
            unknown one (PyTorch's pre-Hopper defaults, an assumed context).
        calibrate: measure what this machine's kernels allocate beyond their outputs, each distinct
            op signature run once for real, alone, at its exact shapes (small real allocations; cached
            on disk per machine, see ``accounting.kernels.calibrate``), instead of relying on the hand
            models alone. For the device the step runs on; not for a what-if.
        next_batches: the batches of the steps after the first, when they differ from ``batch`` (a
            dataloader that pads each batch to its longest sequence); the last one repeats.
        loop: ``"train"`` (the training step), or one batch outside training, in eval mode, as
            Lightning's loops run it: ``"validate"`` (forward and ``loss_fn`` under ``torch.no_grad``)
            or ``"predict"`` (the forward pass under ``torch.inference_mode``); one batch is
            simulated (``steps`` is for training), no optimizer runs, and ``StepEstimate.loop`` says
            which.
        replay_blocks: simulate a few instances of each run of six or more alike blocks (a decoder's
            layers, a ViT's encoder blocks) and replay their events for the others, wherever the
            checks of ``engine.replay.block_replay`` find that they repeat (said in
            ``StepEstimate.replayed_blocks``): the same figures to the byte, in a time that hardly
            grows with depth. Where a check fails after a block was replayed, the step is simulated
            again without replay (its code runs once more). Training only, without a ``strategy``;
            ``False``: every block simulated.

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        >>> est = estimate_step(model, torch.randn(32, 1024), optimizer=torch.optim.Adam)
        >>> est.steady_state.breakdown.parameters  # (1024 * 1024 + 1024 + 1024 * 10 + 10) * 4 bytes
        4239400
        >>> est.steady_state.breakdown.optimizer_state  # exp_avg, exp_avg_sq, and four step counters
        8478816
        >>> estimate_step(model, torch.randn(32, 1024), replay_blocks="no")  # a flag is True or False
        Traceback (most recent call last):
        ...
        TypeError: replay_blocks must be True or False; got 'no'
    """
    check_strategy(strategy)  # before StepConfig, which takes any object
    config = StepConfig(loss_fn, optimizer, cast(Precision, precision), strategy)  # validates itself
    return estimate(
        model,
        batch,
        config,
        device=device,
        steps=steps,
        gpu=gpu,
        calibrate=calibrate,
        next_batches=next_batches,
        loop=loop,
        replay_blocks=replay_blocks,
    )


def estimate(
    model: nn.Module,
    batch: Any,
    config: StepConfig,
    *,
    device: str | torch.device | None = None,
    steps: int = 2,
    gpu: CudaDevice | None = None,
    calibrate: bool = False,
    next_batches: Sequence[Any] = (),
    loop: PlainLoop = "train",
    replay_blocks: bool = True,
) -> StepEstimate:
    """:func:`estimate_step` for a step already described by a :class:`StepConfig` (what the CLI's cases
    and scripts hold): the simulation on fake tensors, then its accounting.

    Example:
        >>> import torch
        >>> est = estimate(torch.nn.Linear(8, 2), torch.randn(4, 8), StepConfig(optimizer=torch.optim.SGD))
        >>> est.peak_bytes > 0
        True
    """
    _check(model, config, device, steps, gpu, calibrate, next_batches, loop, replay_blocks)
    capture = capture_filter(flops=True, calibrate=calibrate)

    def run(replay: bool) -> Simulation:
        return simulate(
            model,
            batch,
            config,
            runner=loop_runner(loop),
            device=device,
            steps=steps if loop == "train" else 1,
            capture=capture,
            next_batches=next_batches,
            replay_blocks=replay,
            cuda_capability=gpu.capability if gpu is not None else None,
        )

    sim = simulate_replaying(run, replay_blocks and loop == "train" and config.strategy is None)
    calibration = calibrate_kernels(sim) if calibrate and sim.what_if is None else None
    return account(sim, gpu, calibration, loop=loop)


def _check(
    model: object,
    config: object,
    device: object,
    steps: object,
    gpu: object,
    calibrate: object,
    next_batches: object,
    loop: object,
    replay_blocks: object,
) -> None:
    """Every option checked before anything is simulated (``lightning_memest.options``)."""
    if not isinstance(config, StepConfig):
        raise TypeError(f"config must be a StepConfig; got {type(config).__name__}")
    check_step_options(
        model=model,
        steps=steps,
        strategy=config.strategy,
        device=device,
        gpu=gpu,
        calibrate=calibrate,
        replay_blocks=replay_blocks,
    )
    # A tensor or a string is no list of batches: iterated, it would be read as one batch per row.
    if not isinstance(next_batches, Sequence) or isinstance(next_batches, (str, bytes)):
        raise TypeError(f"next_batches must be a list or tuple of batches; got {type(next_batches).__name__}")
    check_choice("loop", loop, LOOPS)
