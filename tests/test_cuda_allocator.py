"""The CUDA caching allocator model (accounting/cuda_allocator.py): hand-computed sequences for each rule.

Constants of c10/cuda/CUDACachingAllocator.cpp used in the comments: kMinBlockSize = 512 B,
kSmallSize = 1 MiB, kSmallBuffer = 2 MiB, kLargeBuffer = 20 MiB, kMinLargeAlloc = 10 MiB,
kRoundLarge = 2 MiB.
"""

from __future__ import annotations

import doctest
import random
import time

import pytest

import lightning_memest.accounting.cuda_allocator as allocator_module
from lightning_memest import CudaCachingAllocator

KiB = 1024
MiB = 1024 * 1024


def state(a: CudaCachingAllocator) -> tuple[int, int]:
    return a.allocated_bytes, a.reserved_bytes


def test_docstring_examples_run() -> None:
    result = doctest.testmod(allocator_module)
    assert result.attempted > 0 and result.failed == 0


def test_zero_byte_request_allocates_nothing() -> None:
    # NativeCachingAllocator::allocate only calls malloc `if (size != 0)`: a null pointer, no block.
    a = CudaCachingAllocator()
    h = a.malloc(0)
    assert h == 0
    assert state(a) == (0, 0)
    a.free(h)  # free(nullptr) is a no-op
    assert state(a) == (0, 0)


def test_round_size_to_512() -> None:
    a = CudaCachingAllocator()
    # round_size: < kMinBlockSize -> 512; otherwise up to a multiple of 512.
    assert a.round_size(1) == 512
    assert a.round_size(512) == 512
    assert a.round_size(513) == 1024
    assert a.round_size(1_000_001) == 1954 * 512  # ceil(1_000_001 / 512) = 1954
    a.malloc(1)  # 512
    a.malloc(513)  # 1024
    a.malloc(1024)  # 1024
    # all three are small (<= kSmallSize) and fit one 2 MiB (kSmallBuffer) segment
    assert state(a) == (512 + 1024 + 1024, 2 * MiB)


def test_small_pool_carved_from_2mib_segments_and_reused() -> None:
    a = CudaCachingAllocator()
    h1 = a.malloc(1 * MiB)  # exactly kSmallSize: small pool; new 2 MiB segment, 1 MiB left (>= 512: split)
    assert state(a) == (1 * MiB, 2 * MiB)
    h2 = a.malloc(1 * MiB)  # the 1 MiB remainder fits exactly: no new segment
    assert state(a) == (2 * MiB, 2 * MiB)
    a.malloc(512)  # nothing cached in the small pool: a second 2 MiB segment
    assert state(a) == (2 * MiB + 512, 4 * MiB)
    a.free(h1)
    # cached small blocks: 1 MiB (segment 1) and 2 MiB - 512 (segment 2); best fit takes the 1 MiB one
    # and splits it (remainder 1 MiB - 700 KiB = 331_776 >= 512)
    a.malloc(700 * KiB)
    assert state(a) == (700 * KiB + 1 * MiB + 512, 4 * MiB)
    # the 2 MiB - 512 block is untouched: a 1 MiB request still fits without a new segment
    a.malloc(1 * MiB)
    assert state(a) == (700 * KiB + 2 * MiB + 512, 4 * MiB)
    a.free(h2)
    assert a.reserved_bytes == 4 * MiB


def test_mid_sized_request_gets_a_20mib_segment_shared_by_the_next() -> None:
    a = CudaCachingAllocator()
    a.malloc(3 * MiB)  # 1 MiB < 3 MiB < kMinLargeAlloc: get_allocation_size = kLargeBuffer (20 MiB)
    assert state(a) == (3 * MiB, 20 * MiB)  # remainder 17 MiB > kSmallSize: split
    a.malloc(5 * MiB)  # fits the 17 MiB remainder: split again, 12 MiB left
    assert state(a) == (8 * MiB, 20 * MiB)
    a.malloc(12 * MiB)  # the 12 MiB remainder fits exactly, even though 12 MiB >= kMinLargeAlloc
    assert state(a) == (20 * MiB, 20 * MiB)
    a.malloc(1 * MiB + 1)  # 1_049_088 B after rounding: > kSmallSize, large pool, nothing cached: 20 MiB
    assert state(a) == (20 * MiB + 1_049_088, 40 * MiB)


def test_large_request_gets_its_own_segment_rounded_to_2mib() -> None:
    a = CudaCachingAllocator()
    a.malloc(10 * MiB)  # kMinLargeAlloc: kRoundLarge * ceil(10 MiB / 2 MiB) = 10 MiB, its own segment
    assert state(a) == (10 * MiB, 10 * MiB)
    # 11 MiB + 1 -> 11 MiB + 512 -> a 12 MiB segment; remainder 1 MiB - 512 is not > kSmallSize, so the
    # whole 12 MiB block is handed out and counted as allocated
    a.malloc(11 * MiB + 1)
    assert state(a) == (22 * MiB, 22 * MiB)
    a.malloc(10 * MiB - 512)  # just below kMinLargeAlloc: a 20 MiB segment, 10 MiB + 512 left, split
    assert state(a) == (32 * MiB - 512, 42 * MiB)


def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    a = CudaCachingAllocator()
    h14 = a.malloc(14 * MiB)  # own 14 MiB segment (created first: the lower address)
    h12 = a.malloc(12 * MiB)  # own 12 MiB segment
    a.free(h14)
    a.free(h12)
    assert state(a) == (0, 26 * MiB)
    # 11 MiB: both fit; BlockComparatorSize orders by size first, so the 12 MiB block is chosen; the
    # 1 MiB remainder is not > kSmallSize, so the whole 12 MiB block is allocated
    a.malloc(11 * MiB)
    assert state(a) == (12 * MiB, 26 * MiB)
    # 13 MiB: only the 14 MiB block is left and fits: no new segment (a worst or first fit that had
    # taken the 14 MiB block for the 11 MiB request would need a new 14 MiB segment here)
    a.malloc(13 * MiB)
    assert state(a) == (26 * MiB, 26 * MiB)


def test_large_pool_does_not_split_when_at_most_1mib_remains() -> None:
    a = CudaCachingAllocator()
    a.malloc(3 * MiB)  # 20 MiB segment: [3 MiB used][17 MiB free]
    h = a.malloc(16 * MiB + 512 * KiB)  # the 17 MiB block: remainder 512 KiB <= kSmallSize: no split
    assert state(a) == (3 * MiB + 17 * MiB, 20 * MiB)  # the whole 17 MiB block counts as allocated
    a.free(h)
    assert state(a) == (3 * MiB, 20 * MiB)
    # with > 1 MiB left the same block is split: 17 MiB - 15 MiB = 2 MiB > kSmallSize
    a.malloc(15 * MiB)
    assert state(a) == (18 * MiB, 20 * MiB)


def test_small_pool_splits_whenever_512_bytes_remain() -> None:
    a = CudaCachingAllocator()
    h1 = a.malloc(1024)  # 2 MiB small segment: [1024][rest]
    a.malloc(512)  # [1024][512][2 MiB - 1536 free]: keeps h1's block from merging with the tail
    a.free(h1)  # a cached 1024 B block
    # best fit: the 1024 B block; remainder 512 >= kMinBlockSize: split (a large-pool block never
    # splits off less than 1 MiB, see above)
    a.malloc(512)
    assert state(a) == (1024, 2 * MiB)
    a.malloc(512)  # the 512 B remainder, exact fit
    assert state(a) == (1536, 2 * MiB)


def test_freed_neighbours_merge_into_a_reusable_block() -> None:
    a = CudaCachingAllocator()
    h1, h2, h3 = a.malloc(3 * MiB), a.malloc(3 * MiB), a.malloc(3 * MiB)  # [3][3][3][11 free] in 20 MiB
    a.free(h1)  # [3 free][3][3][11 free]
    a.free(h3)  # merges with the tail: [3 free][3][14 free]
    assert state(a) == (3 * MiB, 20 * MiB)
    a.free(h2)  # merges with both neighbours: one 20 MiB free block again
    # 19 MiB (>= kMinLargeAlloc) fits only in the merged block; remainder 1 MiB is not split
    a.malloc(19 * MiB)
    assert state(a) == (20 * MiB, 20 * MiB)

    # without the merge (h2 still held) the same request needs a new 20 MiB segment (19 MiB rounded up)
    b = CudaCachingAllocator()
    g1, g2, g3 = b.malloc(3 * MiB), b.malloc(3 * MiB), b.malloc(3 * MiB)
    b.free(g1)
    b.free(g3)
    b.malloc(19 * MiB)
    assert state(b) == (3 * MiB + 20 * MiB, 40 * MiB)
    del g2


def test_reserved_never_decreases_without_empty_cache() -> None:
    a = CudaCachingAllocator()
    rng = random.Random(0)
    live: list[int] = []
    last = 0
    for _ in range(2000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice([100, 4 * KiB, 700 * KiB, 3 * MiB, 9 * MiB, 33 * MiB])))
        assert a.reserved_bytes >= last
        assert a.allocated_bytes <= a.reserved_bytes
        last = a.reserved_bytes
    for h in live:
        a.free(h)
    assert a.allocated_bytes == 0
    assert a.reserved_bytes == last > 0  # everything is cached, nothing went back
    a.empty_cache()
    assert a.reserved_bytes == 0  # every segment is whole again once all blocks are free


def test_empty_cache_releases_only_fully_free_segments() -> None:
    a = CudaCachingAllocator()
    h1 = a.malloc(3 * MiB)  # segment A: 20 MiB, 17 MiB of it free
    h2 = a.malloc(24 * MiB)  # does not fit the 17 MiB: segment B, 24 MiB (>= kMinLargeAlloc, 2 MiB multiple)
    h3 = a.malloc(1000)  # segment C: 2 MiB (small pool)
    assert a.reserved_bytes == 46 * MiB
    a.free(h2)
    a.free(h3)
    a.empty_cache()  # release_blocks frees blocks with no prev/next: B and C; A is split (h1 lives)
    assert state(a) == (3 * MiB, 20 * MiB)
    a.free(h1)
    a.empty_cache()
    assert state(a) == (0, 0)
    assert a.peak_reserved_bytes == 46 * MiB


def test_expandable_segments_map_pages_as_needed() -> None:
    a = CudaCachingAllocator(expandable_segments=True)
    a.malloc(1000)  # small pool: one 2 MiB (kSmallBuffer) page mapped, 1024 B handed out
    assert state(a) == (1024, 2 * MiB)
    h2 = a.malloc(3 * MiB)  # large pool: one 20 MiB (kLargeBuffer) page; split, 17 MiB free
    assert state(a) == (1024 + 3 * MiB, 22 * MiB)
    # 25 MiB: no cached block fits; find_expandable_block starts at the free 17 MiB before the unmapped
    # tail and maps one more 20 MiB page (8 MiB short -> 1 page); the merged 37 MiB block is split
    # (expandable: split whenever >= 512 B remain), 12 MiB stay free at the end
    h3 = a.malloc(25 * MiB)
    assert state(a) == (1024 + 28 * MiB, 42 * MiB)
    # without expandable segments: 20 MiB segment + a 26 MiB segment + the 2 MiB small one = 48 MiB, and
    # the 26 MiB segment's 1 MiB remainder is not split (not > kSmallSize): 26 MiB allocated for 25
    b = CudaCachingAllocator()
    b.malloc(1000)
    b.malloc(3 * MiB)
    b.malloc(25 * MiB)
    assert state(b) == (1024 + 29 * MiB, 48 * MiB)

    a.free(h2)  # [3 free][25][12 free][unmapped...]
    a.malloc(12 * MiB)  # best fit: the 12 MiB free tail, exact; no page mapped
    assert state(a) == (1024 + 37 * MiB, 42 * MiB)
    # empty_cache unmaps only whole free pages: the 3 MiB block and the small pool's 2 MiB - 1024 hold none
    a.empty_cache()
    assert a.reserved_bytes == 42 * MiB
    del h3


def test_expandable_empty_cache_unmaps_free_pages_inside_a_segment() -> None:
    a = CudaCachingAllocator(expandable_segments=True)
    h1 = a.malloc(30 * MiB)  # pages 0-1 (40 MiB): [30][10 free]
    h2 = a.malloc(10 * MiB)  # the 10 MiB, exact: [30][10]
    a.malloc(25 * MiB)  # pages 2-3: [30][10][25][15 free], 80 MiB mapped
    assert state(a) == (65 * MiB, 80 * MiB)
    a.free(h2)
    a.free(h1)  # [40 free][25][15 free]
    a.empty_cache()
    # unmap_block: the 40 MiB block covers pages 0-1 entirely -> unmapped; the 15 MiB block at 65-80 MiB
    # covers no whole page. A cudaMalloc'd segment could not shrink while the 25 MiB block lives.
    assert state(a) == (25 * MiB, 40 * MiB)
    a.malloc(30 * MiB)  # find_expandable_block: the unmapped hole at address 0 is the lowest: 2 pages
    assert state(a) == (55 * MiB, 80 * MiB)


def test_expandable_best_fit_prefers_a_block_that_cannot_grow() -> None:
    a = CudaCachingAllocator(expandable_segments=True)
    h1 = a.malloc(6 * MiB)  # one 20 MiB page: [6][14 free tail]
    a.malloc(9 * MiB)  # [6][9][5 free tail]
    a.free(h1)  # [6 free][9][5 free tail][unmapped]
    # 4 MiB: lower_bound finds the 5 MiB tail, but get_free_block walks on to the 6 MiB block because
    # its expandable size (6 MiB) is below the tail's (5 MiB + the unmapped rest): [4][2 free][9][5 free]
    a.malloc(4 * MiB)
    assert state(a) == (13 * MiB, 20 * MiB)
    # 6 MiB: nothing fits (2 and 5 MiB free); the 5 MiB tail grows by one page: 40 MiB mapped. Had the
    # 4 MiB request taken the tail, the 6 MiB block would fit here and nothing would be mapped.
    a.malloc(6 * MiB)
    assert state(a) == (19 * MiB, 40 * MiB)


def test_max_split_size_oversize_blocks() -> None:
    a = CudaCachingAllocator(max_split_size=100 * MiB)
    a.free(a.malloc(150 * MiB))  # a cached 150 MiB block, >= max_split_size: "oversize"
    assert state(a) == (0, 150 * MiB)
    # get_free_block: "Do not return an oversized block for a large request" (50 MiB < max_split_size)
    h50 = a.malloc(50 * MiB)
    assert state(a) == (50 * MiB, 200 * MiB)
    # 140 MiB >= max_split_size and 150 < 140 + kLargeBuffer (max_non_split_rounding_size): the oversize
    # block is reused, unsplit (should_split: size >= max_split_size), all 150 MiB count as allocated
    h140 = a.malloc(140 * MiB)
    assert state(a) == (200 * MiB, 200 * MiB)
    a.free(h140)
    # 120 MiB: 150 >= 120 + 20, beyond the rounding limit: a new 120 MiB segment
    a.malloc(120 * MiB)
    assert state(a) == (170 * MiB, 320 * MiB)
    del h50

    # the default (unlimited) splits the 150 MiB block for 50 MiB: remainder 100 MiB > kSmallSize
    b = CudaCachingAllocator()
    b.free(b.malloc(150 * MiB))
    b.malloc(50 * MiB)
    assert state(b) == (50 * MiB, 150 * MiB)

    # max_non_split_rounding_mb widens the reuse window: 150 < 120 + 64
    c = CudaCachingAllocator(max_split_size=100 * MiB, max_non_split_rounding_size=64 * MiB)
    c.free(c.malloc(150 * MiB))
    c.malloc(120 * MiB)
    assert state(c) == (150 * MiB, 150 * MiB)

    with pytest.raises(ValueError, match="max_split_size"):
        CudaCachingAllocator(max_split_size=1 * MiB)  # the parser refuses max_split_size_mb < 20


def test_roundup_power2_divisions() -> None:
    a = CudaCachingAllocator(roundup_power2_divisions=4)
    # roundup_power2_next_division(5 MiB + 1, 4): floor 4 MiB, step 4 MiB >> 2 = 1 MiB -> 6 MiB
    assert a.round_size(5 * MiB + 1) == 6 * MiB
    assert a.round_size(4 * MiB) == 4 * MiB  # powers of 2 stay
    # round_size only uses divisions when size > kMinBlockSize * divisions (2048): 1200 -> 1536
    assert a.round_size(1200) == 1536
    a.malloc(5 * MiB + 1)  # 6 MiB from a 20 MiB segment
    assert state(a) == (6 * MiB, 20 * MiB)
    assert CudaCachingAllocator().round_size(5 * MiB + 1) == 5 * MiB + 512  # off by default

    # per interval: [256:1,512:2,>:4] -> intervals 0-8 use 1, interval 9 (512 MiB-1 GiB) 2, the rest 4
    b = CudaCachingAllocator.from_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert b.round_size(5 * MiB + 1) == 5 * MiB + 512
    assert b.round_size(600 * MiB + 1) == 768 * MiB  # floor 512 MiB, step 256 MiB
    assert b.round_size(1100 * MiB) == 1280 * MiB  # floor 1 GiB, step 256 MiB
    with pytest.raises(ValueError, match="power"):
        CudaCachingAllocator(roundup_power2_divisions=3)


def test_from_alloc_conf() -> None:
    a = CudaCachingAllocator.from_alloc_conf(
        "expandable_segments:True,max_split_size_mb:256,garbage_collection_threshold:0.6"
    )
    assert a.expandable_segments
    assert a.max_split_size == 256 * MiB
    assert a.max_non_split_rounding_size == 20 * MiB
    assert not CudaCachingAllocator.from_alloc_conf("").expandable_segments


def test_peaks_and_reset_peak_stats() -> None:
    a = CudaCachingAllocator()
    h1 = a.malloc(3 * MiB)
    h2 = a.malloc(5 * MiB)
    a.free(h1)
    a.free(h2)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (8 * MiB, 20 * MiB)
    a.reset_peak_stats()  # resetPeakStats: peak = current
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (0, 20 * MiB)
    a.malloc(1 * MiB)  # small pool: a new 2 MiB segment
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (1 * MiB, 22 * MiB)
    a.empty_cache()  # the 20 MiB segment goes back; peaks stay
    assert state(a) == (1 * MiB, 2 * MiB)
    assert a.peak_reserved_bytes == 22 * MiB


def test_invalid_frees_raise() -> None:
    a = CudaCachingAllocator()
    h = a.malloc(10)
    a.free(h)
    with pytest.raises(ValueError, match="invalid handle"):
        a.free(h)
    with pytest.raises(ValueError):
        a.malloc(-1)


@pytest.mark.parametrize("expandable", [False, True])
def test_random_replay_is_consistent_and_fast(expandable: bool) -> None:
    a = CudaCachingAllocator(expandable_segments=expandable)
    rng = random.Random(1)
    sizes = [4, 512, 3000, 40 * KiB, 600 * KiB, 1 * MiB + 7, 2 * MiB, 7 * MiB, 12 * MiB, 70 * MiB]
    live: dict[int, int] = {}
    start = time.perf_counter()
    for i in range(40_000):
        if live and rng.random() < 0.5:
            h = rng.choice(list(live)) if i % 97 == 0 else next(iter(live))
            live.pop(h)
            a.free(h)
        else:
            n = rng.choice(sizes)
            live[a.malloc(n)] = n
        if i % 10_000 == 0:
            a.empty_cache()
    elapsed = time.perf_counter() - start
    assert a.allocated_bytes >= sum(a.round_size(n) for n in live.values())
    assert a.allocated_bytes <= a.reserved_bytes <= a.peak_reserved_bytes
    for h in live:
        a.free(h)
    assert a.allocated_bytes == 0
    a.empty_cache()
    assert a.reserved_bytes == 0
    assert elapsed < 10.0  # typically well under a second


def test_a_segment_that_does_not_fit_releases_the_cache_retries_then_runs_out() -> None:
    from lightning_memest.accounting.cuda_allocator import OutOfMemory

    mib = 2**20
    uncapped = CudaCachingAllocator()
    uncapped.free(uncapped.malloc(30 * mib))
    uncapped.malloc(50 * mib)
    assert uncapped.reserved_bytes == 80 * mib  # the freed 30 MiB segment stays cached
    a = CudaCachingAllocator(capacity=60 * mib)
    a.free(a.malloc(30 * mib))
    a.malloc(50 * mib)  # 30 cached + 50 > 60: release_cached_blocks, and the retry fits
    assert (a.reserved_bytes, a.out_of_memory) == (50 * mib, None)
    a.malloc(20 * mib)  # nothing left to release: torch raises OutOfMemoryError here
    assert a.out_of_memory == OutOfMemory(20 * mib, 50 * mib, 50 * mib, 60 * mib)
    assert a.reserved_bytes == 70 * mib  # served anyway: the replay says what the step would need
