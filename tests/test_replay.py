"""The one walker and its allocator observers (accounting/replay.py) over hand-written event streams."""

from __future__ import annotations

from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator
from lightning_memest.accounting.replay import CachingAllocatorReplay, LiveBytes, Observer, final_roles, walk
from lightning_memest.engine.events import Alloc, Event, Free, OpEvent, Phase, Role, Tag

MiB = 1 << 20


def op(index: int, step: int, phase: Phase = Phase.FORWARD) -> OpEvent:
    return OpEvent(index, step, phase, "", "aten.fake", None, None)


def stream() -> list[Event]:
    # A 4 MiB parameter; step 0 makes 3 MiB and 100 B, frees the 3 MiB; step 1 makes 1 MiB.
    return [
        Alloc(0, 4 * MiB, resident=True),
        Tag(0, Role.PARAMETER, "w"),
        op(0, 0),
        Alloc(1, 3 * MiB),
        op(1, 0),
        Alloc(2, 100),
        Free(1),
        op(2, 1, Phase.BACKWARD),
        Alloc(3, MiB),
    ]


def test_exact_replay() -> None:
    events = stream()
    result = LiveBytes(final_roles(events), steps=2)
    walk(events, result)
    assert [p.live_bytes for p in result.peaks] == [7 * MiB + 100, 5 * MiB + 100]
    assert result.peaks[0].by_role[0] == 4 * MiB  # parameters
    assert [s.live_bytes for s in result.samples] == [7 * MiB, 7 * MiB + 100, 5 * MiB + 100]


def test_caching_allocator_replay_counts_blocks_and_segments() -> None:
    replay = CachingAllocatorReplay(CudaCachingAllocator(), steps=2)
    walk(stream(), replay)
    peaks = replay.peaks
    # 4 MiB: a large-pool request below 10 MiB -> a 20 MiB segment, split; 3 MiB is carved from its
    # free 16 MiB (remainder 13 MiB > 1 MiB: split). 100 B -> 512 B from a new 2 MiB small segment.
    assert peaks.allocated[0] == 7 * MiB + 512
    assert peaks.reserved[0] == 20 * MiB + 2 * MiB
    # step 1: 3 MiB freed and cached; 1 MiB (exactly kSmallSize: small pool) -> 1 MiB in the small
    # segment, which has 2 MiB - 512 B free.
    assert peaks.allocated[1] == 5 * MiB + 512
    assert peaks.reserved[1] == 22 * MiB


def test_walk_feeds_each_observer_only_the_events_it_handles_in_order() -> None:
    class Ops(Observer):
        def __init__(self) -> None:
            self.seen: list[int] = []
            self.finished = False

        def on_op(self, e: OpEvent) -> None:
            self.seen.append(e.index)

        def finish(self) -> None:
            self.finished = True

    class Frees(Observer):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_free(self, e: Free) -> None:
            self.seen.append(e.storage)

    ops, ops_too, frees = Ops(), Ops(), Frees()
    walk(stream(), ops, frees, ops_too)
    assert ops.seen == ops_too.seen == [0, 1, 2] and ops.finished and ops_too.finished
    assert frees.seen == [1]


def test_roles_take_the_first_role_in_priority_order() -> None:
    events: list[Event] = [Alloc(0, 8), Tag(0, Role.ACTIVATION, "a"), Tag(0, Role.GRADIENT, "")]
    assert final_roles(events) == {0: Role.GRADIENT}
