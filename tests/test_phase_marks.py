"""The memory held at the end of each phase (``StepEstimate.phase_marks``), against the CPU allocator's
events of the same step run for real: the running sum of its allocations and frees, from what was
resident when the step began, read at markers placed between the phases (``record_function``)."""

from __future__ import annotations

import copy
import gc

import torch
import torch.nn.functional as F
from probe import running_sum, storage_blocks
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_memest import estimate_step

MARKS = ("after_forward", "after_backward", "after_optimizer")


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _held_at_marks(model: nn.Module, batch: tuple[Tensor, Tensor]) -> list[int]:
    """One real step, the allocator's held bytes at each of :data:`MARKS`."""
    opt = torch.optim.Adam(model.parameters())
    resident = storage_blocks([*model.parameters(), *batch])
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = _loss(model, batch)
            with record_function(MARKS[0]):
                pass
            loss.backward()
            with record_function(MARKS[1]):
                pass
            opt.step()
            with record_function(MARKS[2]):
                pass
    finally:
        gc.enable()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    at = {e.name(): e.start_ns() for e in prof.profiler.kineto_results.events() if e.name() in MARKS}
    sums = list(running_sum(prof, resident))
    # What was resident, and the running sum at each mark (after its last event before the mark).
    before = sum(resident.values())
    return [before + next((held for t, held in reversed(sums) if t <= at[mark]), 0) for mark in MARKS]


def test_phase_marks_are_what_a_real_step_holds_between_its_phases() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    est = estimate_step(model, batch, loss_fn=_loss, optimizer=torch.optim.Adam, steps=1)
    assert [(m.step, m.phase.value) for m in est.phase_marks] == [
        (1, "forward"),
        (1, "backward"),
        (1, "optimizer"),
    ]
    real = _held_at_marks(copy.deepcopy(model), batch)
    assert [m.live_bytes for m in est.phase_marks] == real
    assert all(m.allocated_bytes is None for m in est.phase_marks)  # (CPU)
    json = est.to_json()["phase_marks"]
    assert [(m["phase"], m["live_bytes"]) for m in json] == [
        ("forward", real[0]),
        ("backward", real[1]),
        ("optimizer", real[2]),
    ]


def test_a_cuda_what_if_marks_the_allocators_blocks_too() -> None:
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    batch = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    est = estimate_step(model, batch, loss_fn=_loss, optimizer=torch.optim.Adam, device="cuda", steps=2)
    assert len(est.phase_marks) == 6
    for mark in est.phase_marks:
        assert mark.allocated_bytes is not None and mark.allocated_bytes >= mark.live_bytes
