"""Make it fit: an activation-checkpointing plan for a budget, proven by the estimator.

:func:`plan_step` is a client of the estimator: it estimates the step once, reads from that one
simulation what checkpointing each candidate module would free and cost (``windows.py``), lets the
solver pick the least recompute whose predicted peak fits (``solver.py``), and then **simulates the
step again with the plan applied** (torch's own ``checkpoint_wrapper`` on the model, put back after):
the plan's peak is that simulation's. Where it misses the budget, the solver runs again for a budget
lower by the miss, up to :data:`ATTEMPTS` times; where nothing the solver can choose fits, every
candidate is checkpointed in full and simulated, and the plan says that floor.

:func:`plan_checkpointing` is the same for a plain model, with ``estimate_step``'s arguments.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)])
    >>> batch = torch.randn(512, 256)
    >>> before = plan_checkpointing(net, batch, 2**40).baseline.peak_bytes
    >>> plan = plan_checkpointing(net, batch, before - 1_500_000)
    >>> plan.fits, len(plan.modules) < 8, plan.peak_bytes <= before - 1_500_000
    (True, True, True)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from lightning_memest.accounting import capture_filter
from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.engine.parallel.distributed import Strategy
from lightning_memest.engine.simulate import Simulation, simulate, simulate_replaying
from lightning_memest.engine.step import LossFn, OptimizerFactory, Precision, StepConfig, sum_loss
from lightning_memest.errors import EstimationError, one_line
from lightning_memest.options import check_budget, check_flag, check_model, check_names, check_step_options
from lightning_memest.plan.candidates import candidates as find_candidates
from lightning_memest.plan.checkpointing import KINDS, CheckpointKind, checkpointed
from lightning_memest.plan.report import CandidateModule, CheckpointPlan, model_ref
from lightning_memest.plan.solver import solve
from lightning_memest.plan.windows import Candidate, block_windows
from lightning_memest.report import StepEstimate
from lightning_memest.search.sizing import SizedStep

__all__ = ["ATTEMPTS", "plan_budget_bytes", "plan_checkpointing", "plan_step", "sized_step"]

#: How many plans are simulated before the planner gives its best (each miss lowers the solver's budget).
ATTEMPTS = 3


def plan_checkpointing(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    *,
    modules: Sequence[str] = (),
    kinds: Sequence[CheckpointKind] = KINDS,
    loss_fn: LossFn = sum_loss,
    optimizer: OptimizerFactory | None = None,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    steps: int = 2,
    strategy: Strategy | None = None,
    gpu: CudaDevice | None = None,
    calibrate: bool = False,
    max_batch_size: bool = False,
    replay_blocks: bool = True,
) -> CheckpointPlan:
    """The activation-checkpointing plan with the least recompute whose estimated peak is within
    ``budget`` (bytes or a size such as ``"24GiB"``), for training steps of ``model`` on ``batch``.

    The arguments after ``budget`` but ``modules``, ``kinds`` and ``max_batch_size`` are
    :func:`~lightning_memest.estimate_step`'s (``replay_blocks``: every plan's simulation replays the
    blocks that still repeat under it, runs of blocks checkpointed alike). The candidates are
    ``model``'s repeated blocks (transformer layers, residual blocks) and the ``modules`` named
    (qualified names); ``kinds`` the checkpointing offered: ``"full"`` and ``"selective"`` (torch's
    selective checkpointing saving the matrix products, see ``plan.checkpointing``). ``modules`` and
    ``kinds`` are lists or tuples of names, never one bare string (``kinds=("full",)``,
    ``modules=("blocks.0",)``); ``kinds`` names at least one kind. With ``max_batch_size`` (``True``
    or ``False``), the plan also says the largest batch size that fits with it (a batch-size search
    over the planned step). ``model`` is left as it was; ``plan.apply(model)`` applies the plan.
    Every option is checked before anything is simulated, as ``estimate_step``'s are.

    Example:
        >>> import torch
        >>> plan_checkpointing(torch.nn.Linear(4, 4), torch.randn(2, 4), "1MiB", kinds="full")
        Traceback (most recent call last):
        ...
        TypeError: kinds must be a collection of names, not one string: kinds=('full',); got 'full'
    """
    step = sized_step(
        model,
        batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        precision=precision,
        device=device,
        steps=steps,
        strategy=strategy,
        gpu=gpu,
        calibrate=calibrate,
        replay_blocks=replay_blocks,
    )
    # Checked here too, before anything is simulated; as tuples, so that an iterator is read once.
    _, modules, kinds = _check_plan_options(model, budget, modules, kinds, max_batch_size)
    return plan_step(step, model, budget, modules=modules, kinds=kinds, max_batch_size=max_batch_size)


def sized_step(
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
    replay_blocks: bool = True,
) -> SizedStep:
    """The training step of ``model`` on ``batch`` as ``estimate_step`` simulates it (its arguments,
    checked first), for a planner to estimate and re-simulate (``search.sizing.SizedStep``)."""
    check_step_options(
        model=model,
        steps=steps,
        strategy=strategy,
        device=device,
        gpu=gpu,
        calibrate=calibrate,
        replay_blocks=replay_blocks,
    )
    config = StepConfig(loss_fn, optimizer, cast(Precision, precision), strategy)

    def run(b: Any, *, flops: bool, calibrate: bool, next_batches: Sequence[Any] = ()) -> Simulation:
        def simulated(replay: bool) -> Simulation:
            return simulate(
                model,
                b,
                config,
                device=device,
                steps=steps,
                capture=capture_filter(flops=flops, calibrate=calibrate),
                next_batches=next_batches,
                replay_blocks=replay,
                cuda_capability=gpu.capability if gpu is not None else None,
            )

        return simulate_replaying(simulated, replay_blocks and strategy is None)

    return SizedStep(run, batch, calibrate=calibrate, gpu=gpu)


def plan_step(
    step: SizedStep,
    model: nn.Module,
    budget: int | str,
    *,
    modules: Sequence[str] = (),
    kinds: Sequence[CheckpointKind] = KINDS,
    max_batch_size: bool = False,
) -> CheckpointPlan:
    """The plan for ``step`` (a ``SizedStep``: its simulation, residents, calibration and GPU are the
    estimate's; its first simulation is reused where it has one, ``SizedStep.traced``), checkpointing
    modules of ``model`` -- the module ``step`` simulates, whose qualified names the plan uses (see the
    module docstring)."""
    began = time.perf_counter()
    budget_bytes, modules, kinds = _check_plan_options(model, budget, modules, kinds, max_batch_size)
    paths = find_candidates(model, modules)  # a module named that is not there: said before simulating
    simulations = 0 if step.has_trace else 1
    sim, calibration, first = step.traced()
    windows = block_windows(sim, paths, calibration)
    costs = [_costs(first, c.path, kinds) for c in windows.candidates]
    figures = tuple(_figures(model, c, cost) for c, cost in zip(windows.candidates, costs, strict=True))
    solved_seconds = 0.0
    notes: list[str] = []

    def planned(choices: Mapping[str, CheckpointKind]) -> StepEstimate:
        nonlocal simulations
        simulations += 1
        with checkpointed(model, choices):
            return step.fresh().traced_at()[2]

    def result(
        choices: Mapping[str, CheckpointKind], estimate: StepEstimate, floor: int | None = None
    ) -> CheckpointPlan:
        nonlocal simulations
        batch = None
        if max_batch_size:
            with checkpointed(model, choices):
                found = step.fresh().largest_batch(budget_bytes)
            simulations += len(found.probes)
            batch = found.max_batch_size
        by_path = {c.path: c for c in figures}
        flops = sum(by_path[p].recompute_flops[k] for p, k in choices.items() if p in by_path)
        return CheckpointPlan(
            budget_bytes=budget_bytes,
            modules=dict(choices),
            estimate=estimate,
            baseline=first,
            recompute_flops=flops,
            step_flops=_step_flops(first),
            candidates=figures,
            skipped=dict(windows.skipped),
            notes=tuple(notes),
            floor_bytes=floor,
            max_batch_size=batch,
            seconds=time.perf_counter() - began,
            simulations=simulations,
            solver_seconds=solved_seconds,
            _model=model_ref(model),
        )

    if first.peak_bytes <= budget_bytes:
        return result({}, first)  # fits as it is: nothing to recompute
    target = budget_bytes - windows.held_while_backward
    best: tuple[dict[str, CheckpointKind], StepEstimate] | None = None
    attempts = 0
    while attempts < ATTEMPTS:
        attempts += 1
        tic = time.perf_counter()
        solution = solve(windows, costs, target)
        solved_seconds += time.perf_counter() - tic
        if solution is None:
            break
        try:
            estimate = planned(solution.choices)
        except EstimationError as e:
            if "selective" not in solution.choices.values():
                raise
            # Selective checkpointing needs the recomputed forward to run the same ops as the first
            # (transformers' use_cache=True updates a cache in forward: the recompute differs).
            notes.append(f"selective checkpointing failed, full checkpointing only: {one_line(e)}")
            costs = [{k: v for k, v in c.items() if k == "full"} for c in costs]
            attempts -= 1
            continue
        if estimate.peak_bytes <= budget_bytes:
            return result(solution.choices, estimate)
        if best is None or estimate.peak_bytes < best[1].peak_bytes:
            best = (solution.choices, estimate)
        # The plan's peak missed by this much more than predicted: ask the solver for that much less.
        target -= estimate.peak_bytes - budget_bytes
    # Nothing the solver chose fitted: the floor, every candidate in full.
    everything: dict[str, CheckpointKind] = {c.path: "full" for c in windows.candidates}
    if best is not None and best[0] == everything:
        return result(best[0], best[1], best[1].peak_bytes)
    floor = planned(everything) if everything else first
    if floor.peak_bytes <= budget_bytes or best is None or floor.peak_bytes <= best[1].peak_bytes:
        return result(everything, floor, floor.peak_bytes)
    return result(best[0], best[1], floor.peak_bytes)


def _check_plan_options(
    model: object, budget: object, modules: object, kinds: object, max_batch_size: object
) -> tuple[int, tuple[str, ...], tuple[CheckpointKind, ...]]:
    """The options of a plan checked (``lightning_memest.options``): the budget in bytes, the modules
    and kinds named, each once."""
    check_model(model)
    budget_bytes = plan_budget_bytes(budget)
    names = check_names("modules", modules)
    chosen = cast(tuple[CheckpointKind, ...], check_names("kinds", kinds, known=KINDS, nonempty=True))
    check_flag("max_batch_size", max_batch_size)
    return budget_bytes, names, chosen


def plan_budget_bytes(budget: object) -> int:
    """A plan's ``budget`` checked (``lightning_memest.options``) and in bytes: bytes or a size
    (``"24GiB"``), not a share of a device (a plan is for a step, not for whatever a device has)."""
    parsed = check_budget("budget", budget)
    if parsed.bytes is None:
        raise ValueError(
            f"budget must be bytes or a size ('24GiB') for a plan, not a share of a device; got {budget!r}"
        )
    return parsed.bytes


def _costs(estimate: StepEstimate, path: str, kinds: Sequence[CheckpointKind]) -> dict[CheckpointKind, int]:
    """Recompute FLOPs per step of each kind for module ``path``: its forward again (full), or its
    forward but the matrix products, convolutions and attention -- its "other" FLOPs (selective)."""
    figures = estimate.flops.module(path) if estimate.flops is not None else None
    full = (figures.forward + figures.other_forward) if figures is not None else 0
    other = figures.other_forward if figures is not None else 0
    costs: dict[CheckpointKind, int] = {"full": max(full, 1), "selective": max(other, 1)}
    return {kind: costs[kind] for kind in kinds}


def _step_flops(estimate: StepEstimate) -> int:
    f = estimate.flops
    if f is None:
        return 0
    return f.forward + (f.backward or 0) + f.other_forward + (f.other_backward or 0)


def _figures(model: nn.Module, candidate: Candidate, costs: Mapping[CheckpointKind, int]) -> CandidateModule:
    try:
        type_name = type(model.get_submodule(candidate.path)).__name__
    except AttributeError:
        type_name = ""
    return CandidateModule(
        path=candidate.path,
        type_name=type_name,
        freed_bytes={k: f for k, f in candidate.freed.items() if k in costs and f > 0},
        recompute_flops=dict(costs),
        recompute_rise_bytes=candidate.transient,
    )
