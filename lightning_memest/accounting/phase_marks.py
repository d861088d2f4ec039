"""The memory held at the end of each phase of each simulated step (forward, backward, optimizer step):
the figure a published "memory after forward" is, and what a reader holds the estimate against.

A phase ends where the next one starts (``PhaseStart`` events: the frees between them -- a
``training_step``'s locals -- have happened by then; ``zero_grad(set_to_none=True)`` frees the
gradients after the optimizer's mark; the simulation's end, where it frees its fake model, is a
``PhaseStart`` of the setup phase). Two figures at each mark: the exact bytes of the tensors alive
(``live_bytes``, the estimate's own accounting) and, on CUDA, what the caching allocator holds in whole
blocks (``allocated_bytes``, what ``torch.cuda.memory_allocated()`` would say there, the libraries'
workspaces included).

Example:
    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> linear, batch = torch.nn.Linear(256, 256), torch.randn(64, 256)
    >>> est = estimate_step(linear, batch, optimizer=torch.optim.Adam, steps=1)
    >>> [(m.step, m.phase.value) for m in est.phase_marks]
    [(1, 'forward'), (1, 'backward'), (1, 'optimizer')]
    >>> est.phase_marks[1].live_bytes - est.phase_marks[0].live_bytes  # the gradients
    263168
    >>> est.phase_marks[2].live_bytes - est.phase_marks[1].live_bytes  # Adam's moments and steps
    526344
"""

from __future__ import annotations

from lightning_memest.accounting.replay import CachingAllocatorReplay, LiveBytes, Observer
from lightning_memest.engine.events import Phase, PhaseStart
from lightning_memest.report import PhaseMark

__all__ = ["PhaseMarks"]

#: The phases marked (setup and the zero-grad call are not phases of the step a reader compares).
_MARKED = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


class PhaseMarks(Observer):
    """Walked *before* ``live`` (and ``device``): at a phase's start it sees what they hold after the
    events before it, what the previous phase left."""

    def __init__(self, live: LiveBytes, device: CachingAllocatorReplay | None) -> None:
        self.live = live
        self.device = device
        self.current: tuple[int, Phase] | None = None
        self.marks: list[PhaseMark] = []

    def on_phase_start(self, e: PhaseStart) -> None:
        self._mark()
        self.current = (e.step, e.phase)

    def _mark(self) -> None:
        if self.current is None or self.current[1] not in _MARKED:
            return
        allocated = self.device.allocator.allocated_bytes if self.device is not None else None
        self.marks.append(PhaseMark(self.current[0] + 1, self.current[1], self.live.live, allocated))

    def finish(self) -> None:
        self._mark()
        self.current = None
