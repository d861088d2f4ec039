"""A model of PyTorch's CUDA caching allocator, for predicting ``max_memory_allocated/reserved``.

:class:`CudaCachingAllocator` replays a sequence of ``malloc``/``free`` calls the way
``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x) serves them on one
device and one stream, and tracks the two numbers ``torch.cuda`` reports:

* ``allocated_bytes`` — the sizes of the *blocks* handed out (``stats.allocated_bytes``, what
  ``torch.cuda.memory_allocated`` returns): a request rounded by ``round_size``, or a whole unsplit
  cached block when ``should_split`` refuses to split it;
* ``reserved_bytes`` — the bytes obtained from the device (``stats.reserved_bytes``,
  ``torch.cuda.memory_reserved``): whole ``cudaMalloc`` segments, or mapped pages of expandable segments.
  They go back only through :meth:`CudaCachingAllocator.empty_cache`.

The rules follow the source function by function (``round_size``, ``get_pool``,
``get_allocation_size``, ``get_free_block``, ``should_split``, ``alloc_found_block``, ``free_block``,
``try_merge_blocks``, ``release_cached_blocks``, and for expandable segments
``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``, ``unmap_block``).
With a ``capacity`` (the device bytes the allocator can have: the GPU's memory less the context),
a new segment that does not fit makes it release its cached segments and try again
(``release_cached_blocks``, as ``malloc`` does when ``cudaMalloc`` fails), and where it still does not
fit, :attr:`CudaCachingAllocator.out_of_memory` records the first such request (PyTorch raises
``OutOfMemoryError`` there); the replay goes on uncapped, so the figures say what the step would need.
Not modelled: several streams (and ``record_stream`` events), CUDA graph private pools,
``garbage_collection_threshold`` (it only acts with ``set_per_process_memory_fraction``) and
``trigger_free_memory_callbacks``.

Example:
    >>> from lightning_memest import CudaCachingAllocator
    >>> a = CudaCachingAllocator()
    >>> h = a.malloc(1000)            # rounded to 1024 B, carved from a new 2 MiB small segment
    >>> a.allocated_bytes, a.reserved_bytes
    (1024, 2097152)
    >>> h2 = a.malloc(3 * 2**20)      # 1-10 MiB: a 20 MiB segment, split
    >>> a.free(h2)
    >>> a.allocated_bytes, a.reserved_bytes   # the 20 MiB stay cached
    (1024, 23068672)
    >>> a.empty_cache()               # the large segment is whole again, so it goes back
    >>> a.reserved_bytes, a.peak_reserved_bytes
    (2097152, 23068672)
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_memest.accounting.cuda_alloc_conf import ROUNDUP_INTERVALS, parse_alloc_conf

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "CudaCachingAllocator",
    "OutOfMemory",
]

# The source's constants (CUDACachingAllocator.cpp):
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = 1_048_576  # kSmallSize: "largest 'small' allocation is 1 MiB"
K_SMALL_BUFFER = 2_097_152  # kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"
K_LARGE_BUFFER = 20_971_520  # kLargeBuffer: "'large' allocations may be packed in 20 MiB blocks"
K_MIN_LARGE_ALLOC = 10_485_760  # kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2_097_152  # kRoundLarge: "round up large allocations to 2 MiB"

_SIZE_MAX = 2**64 - 1  # max_split_size's default: std::numeric_limits<size_t>::max()
# AllocatorConfig: the kRoundUpPowerOfTwoIntervals intervals start at 1 MiB (2**20) and end at 64 GiB.
_ROUNDUP_INTERVALS = ROUNDUP_INTERVALS
_ROUNDUP_START_LOG2 = 20
# An expandable segment reserves virtual address space for 9/8 of the GPU's memory; the size only matters
# once a program needs more than that, which would be an OOM anyway. 16 TiB is beyond any device.
_EXPANDABLE_ADDRESS_SPACE = 1 << 44


class _Block:
    """One ``Block``: a range of a segment, free or allocated, linked to its neighbours in the segment."""

    __slots__ = ("addr", "allocated", "mapped", "next", "prev", "size", "small")

    def __init__(self, addr: int, size: int, small: bool, *, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.small = small  # Block::pool: the small or the large pool
        self.allocated = False
        self.mapped = mapped  # False only for the unmapped address space of an expandable segment
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """A ``BlockPool``: its cached free blocks ordered like ``BlockComparatorSize`` (size, then address),
    and for expandable segments the unmapped ranges ordered like ``BlockComparatorAddress``."""

    __slots__ = ("free", "keys", "page", "unmapped", "unmapped_addrs")

    def __init__(self, page: int) -> None:
        self.keys: list[tuple[int, int]] = []  # sorted (size, addr) of the free mapped blocks
        self.free: dict[int, _Block] = {}  # addr -> free mapped block
        self.unmapped_addrs: list[int] = []  # sorted addresses of unmapped blocks
        self.unmapped: dict[int, _Block] = {}
        # Expandable segments map pages of kSmallBuffer in the small pool and kLargeBuffer in the large
        # one (find_expandable_block: `segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer`).
        self.page = page

    def insert(self, b: _Block) -> None:
        insort(self.keys, (b.size, b.addr))
        self.free[b.addr] = b

    def erase(self, b: _Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, (b.size, b.addr))]
        del self.free[b.addr]

    def insert_unmapped(self, b: _Block) -> None:
        insort(self.unmapped_addrs, b.addr)
        self.unmapped[b.addr] = b

    def erase_unmapped(self, b: _Block) -> None:
        addrs = self.unmapped_addrs
        del addrs[bisect_left(addrs, b.addr)]
        del self.unmapped[b.addr]


def _allocatable(b: _Block | None) -> bool:
    # find_expandable_block's `allocatable`: not allocated (one stream, so no pending events).
    return b is not None and not b.allocated


def _expandable_size(b: _Block) -> int:
    # get_free_block: "for the purposes of 'best fit' we consider its size to be the size it can expand to"
    n = b.next
    return b.size + (n.size if n is not None and not n.mapped else 0)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next of ``divisions`` steps between powers of 2."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    floor = size & ~(power2_division - 1)
    return size if floor == size else floor + power2_division


@dataclass(frozen=True)
class OutOfMemory:
    """The first request the device could not serve, its cache released: what PyTorch's
    ``OutOfMemoryError`` says ("Tried to allocate ...")."""

    requested: int
    """The rounded request, in bytes."""
    allocated: int
    reserved: int
    """Allocated and reserved bytes when it failed (the cache already released)."""
    capacity: int


class CudaCachingAllocator:
    """PyTorch's CUDA caching allocator (one device, one stream), replayed on sizes alone.

    Args:
        expandable_segments: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. One segment per pool
            grows by mapping pages — 2 MiB (kSmallBuffer) in the small pool, 20 MiB (kLargeBuffer) in the
            large pool — instead of one ``cudaMalloc`` per new segment; blocks split whenever 512 B remain.
        max_split_size: ``max_split_size_mb`` in bytes (``None``: unlimited, PyTorch's default). Cached
            blocks at least this big are never split and serve only requests that are themselves at
            least this big and less than ``max_non_split_rounding_size`` smaller than the block.
        max_non_split_rounding_size: ``max_non_split_rounding_mb`` in bytes (default kLargeBuffer, 20 MiB).
        roundup_power2_divisions: ``roundup_power2_divisions``: one number for all sizes, or 16 numbers,
            one per power-of-2 interval of the request size from 1 MiB (sizes below 2 MiB use the first)
            up to 64 GiB. 0 or 1: off (the default), plain 512 B rounding.

    ``malloc`` returns an opaque positive handle (0 for a zero-byte request, which, as in
    ``NativeCachingAllocator::allocate``, allocates nothing); ``free`` takes it back (``free(0)`` is a
    no-op, like freeing a null pointer).

    Example:
        >>> a = CudaCachingAllocator(expandable_segments=True)
        >>> h = a.malloc(25 * 2**20)       # large pool: maps two 20 MiB pages, splits off the rest
        >>> a.allocated_bytes, a.reserved_bytes
        (26214400, 41943040)
        >>> a.free(h); a.empty_cache()     # unmaps the pages, releases the segment
        >>> a.reserved_bytes, a.peak_allocated_bytes
        (0, 26214400)
    """

    def __init__(
        self,
        expandable_segments: bool = False,
        *,
        max_split_size: int | None = None,
        max_non_split_rounding_size: int = K_LARGE_BUFFER,
        roundup_power2_divisions: int | Sequence[int] = 0,
        capacity: int | None = None,
    ) -> None:
        # The parser refuses max_split_size_mb / max_non_split_rounding_mb below kLargeBuffer / 1 MiB.
        if max_split_size is not None and max_split_size < K_LARGE_BUFFER:
            raise ValueError(f"max_split_size must be >= {K_LARGE_BUFFER} (20 MiB), got {max_split_size}")
        if max_non_split_rounding_size < K_LARGE_BUFFER:
            raise ValueError(
                f"max_non_split_rounding_size must be >= {K_LARGE_BUFFER} (20 MiB), "
                f"got {max_non_split_rounding_size}"
            )
        if isinstance(roundup_power2_divisions, int):
            divisions = [roundup_power2_divisions] * _ROUNDUP_INTERVALS
        else:
            divisions = list(roundup_power2_divisions)
            if len(divisions) != _ROUNDUP_INTERVALS:
                raise ValueError(
                    f"roundup_power2_divisions needs {_ROUNDUP_INTERVALS} values, got {divisions}"
                )
        for d in divisions:
            if d < 0 or d & (d - 1):
                raise ValueError(f"roundup_power2_divisions must be 0 or powers of 2, got {divisions}")

        self.expandable_segments = expandable_segments
        self.max_split_size: int | None = max_split_size
        self.max_non_split_rounding_size = max_non_split_rounding_size
        self.roundup_power2_divisions: tuple[int, ...] = tuple(divisions)
        self._max_split = _SIZE_MAX if max_split_size is None else max_split_size
        self._divisions = self.roundup_power2_divisions if any(d > 1 for d in divisions) else None

        self._small = _Pool(K_SMALL_BUFFER)
        self._large = _Pool(K_LARGE_BUFFER)
        self._live: dict[int, _Block] = {}  # handle -> allocated block
        self._next_handle = 1
        self._next_addr = K_LARGE_BUFFER  # synthetic device addresses; 0 stays the null pointer
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self.capacity = capacity
        self.out_of_memory: OutOfMemory | None = None
        """The first request that did not fit in :attr:`capacity` after the cache was released."""

    @classmethod
    def from_alloc_conf(cls, conf: str, capacity: int | None = None) -> CudaCachingAllocator:
        """An allocator configured like ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` (the keys
        ``accounting/cuda_alloc_conf.py`` reads).

        >>> CudaCachingAllocator.from_alloc_conf("expandable_segments:True").expandable_segments
        True
        >>> CudaCachingAllocator.from_alloc_conf("max_split_size_mb:128").max_split_size
        134217728
        """
        conf_ = parse_alloc_conf(conf)
        return cls(
            conf_.expandable_segments,
            max_split_size=conf_.max_split_size,
            max_non_split_rounding_size=conf_.max_non_split_rounding_size,
            roundup_power2_divisions=conf_.roundup_power2_divisions,
            capacity=capacity,
        )

    # -- statistics -------------------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Bytes in blocks handed out and not freed (``torch.cuda.memory_allocated``)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Bytes held from the device (``torch.cuda.memory_reserved``)."""
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        """Highest ``allocated_bytes`` since creation or ``reset_peak_stats`` (``max_memory_allocated``)."""
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """Highest ``reserved_bytes`` since creation or ``reset_peak_stats`` (``max_memory_reserved``)."""
        return self._peak_reserved

    def reset_peak_stats(self) -> None:
        """``resetPeakStats``: every peak becomes the current value."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    # -- allocation --------------------------------------------------------------------------------------

    def round_size(self, nbytes: int) -> int:
        """``round_size``: the block size a request of ``nbytes`` asks the pools for."""
        if nbytes < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        if self._divisions is not None:
            index = min(max(nbytes.bit_length() - 1 - _ROUNDUP_START_LOG2, 0), _ROUNDUP_INTERVALS - 1)
            div = self._divisions[index]
            if div > 1 and nbytes > K_MIN_BLOCK_SIZE * div:
                return _roundup_power2_next_division(nbytes, div)
        return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; return a handle for :meth:`free` (0, allocating nothing, for 0 bytes)."""
        if nbytes <= 0:
            if nbytes == 0:
                # NativeCachingAllocator::allocate: `if (size != 0) this->malloc(...)`: a null DataPtr.
                return 0
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = self.round_size(nbytes)
        # get_pool: `(size <= kSmallSize) ? small_blocks : large_blocks`
        pool = self._small if size <= K_SMALL_SIZE else self._large
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block_within_capacity(pool, size)
        if self._should_split(block, size, pool):
            block = self._split(block, size, pool)
        block.allocated = True
        self._allocated += block.size  # alloc_found_block: increase_stat(allocated_bytes, block->size)
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        handle = self._next_handle
        self._next_handle = handle + 1
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Give back the block of ``handle``; it stays cached (``free`` → ``free_block``)."""
        if handle == 0:
            return  # NativeCachingAllocator::free: `if (!ptr) return;`
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"invalid handle: {handle}")
        block.allocated = False
        self._allocated -= block.size
        pool = self._small if block.small else self._large
        # free_block: merge with free neighbours of the same segment, then cache the result.
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``emptyCache`` → ``release_cached_blocks``: return fully free segments (expandable: free pages)."""
        for pool in (self._large, self._small):  # release_cached_blocks: large_blocks, then small_blocks
            if self.expandable_segments:
                self._release_expandable(pool)
            else:
                # release_blocks: "Frees all non-split blocks" — a free block with no neighbours is a
                # whole segment; a segment with any block still allocated stays.
                for _, addr in list(pool.keys):
                    b = pool.free[addr]
                    if b.prev is None and b.next is None:
                        pool.erase(b)
                        self._reserved -= b.size

    # -- the source's steps --------------------------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit, the first cached block in (size, address) order that fits."""
        keys = pool.keys
        i = bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        block = pool.free[keys[i][1]]
        if self.expandable_segments:
            # Walk on while the next block (in size order) could expand to less than this one: a block
            # followed by unmapped space counts as big as it could grow.
            n = len(keys)
            while i + 1 < n:
                nxt = pool.free[keys[i + 1][1]]
                if _expandable_size(nxt) >= _expandable_size(block):
                    break
                i += 1
                block = nxt
        mss = self._max_split
        # "Do not return an oversized block for a large request"
        if size < mss and block.size >= mss:
            return None
        # "Allow oversized block size to be rounded up but within a limit"
        if size >= mss and block.size >= size + self.max_non_split_rounding_size:
            return None
        pool.erase(block)
        return block

    def _should_split(self, block: _Block, size: int, pool: _Pool) -> bool:
        """``should_split``: small pool or expandable: >= kMinBlockSize left; large: > kSmallSize left."""
        remaining = block.size - size
        if pool is self._small or self.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _split(self, block: _Block, size: int, pool: _Pool) -> _Block:
        """``alloc_found_block`` with ``split_remainder``: hand out the front, cache the rest."""
        head = _Block(block.addr, size, block.small)
        head.prev = block.prev
        if head.prev is not None:
            head.prev.next = head
        head.next = block
        block.prev = head
        block.addr += size
        block.size -= size
        pool.insert(block)
        return head

    def _alloc_block_within_capacity(self, pool: _Pool, size: int) -> _Block:
        """``alloc_block``; where the device has no room for it (:attr:`capacity`), first
        ``release_cached_blocks`` and again, and where there is still none, the request is recorded as
        :attr:`out_of_memory` (and served: the replay says what the step would need)."""
        if self.capacity is not None and self._reserved + self._segment_size(size) > self.capacity:
            self.empty_cache()
        before = self._reserved
        block = self._alloc_block(pool, size)
        if self.capacity is not None and self._reserved > self.capacity and self.out_of_memory is None:
            self.out_of_memory = OutOfMemory(size, self._allocated, before, self.capacity)
        return block

    def _segment_size(self, size: int) -> int:
        """The bytes a new segment for a ``size`` request reserves (``get_allocation_size``: <= kSmallSize:
        kSmallBuffer; < kMinLargeAlloc: kLargeBuffer; else rounded up to kRoundLarge), at most, for
        expandable pages."""
        if self.expandable_segments:
            page = K_SMALL_BUFFER if size <= K_SMALL_SIZE else K_LARGE_BUFFER
            return -(-size // page) * page
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE

    def _alloc_block(self, pool: _Pool, size: int) -> _Block:
        """``alloc_block``: a new ``cudaMalloc`` segment of ``get_allocation_size`` (or expandable pages)."""
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        alloc_size = self._segment_size(size)
        block = _Block(self._new_address_range(alloc_size, K_ROUND_LARGE), alloc_size, pool is self._small)
        self._grow_reserved(alloc_size)
        return block

    def _try_merge_blocks(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        """``try_merge_blocks``: absorb a free neighbour of the same mapping state; return its size."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        dst.size += src.size
        return src.size

    # -- expandable segments -----------------------------------------------------------------------------

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest address with ``size`` bytes of free + unmapped space."""
        for addr in pool.unmapped_addrs:
            c = pool.unmapped[addr]
            # "we found the lowest address of an unmapped segment but there might be a free segment we
            # can also use right before it"
            if _allocatable(c.prev):
                assert c.prev is not None
                c = c.prev
            total = 0
            b: _Block | None = c
            while total < size and b is not None and _allocatable(b):
                total += b.size
                b = b.next
            if total >= size:
                return c
        # A new segment: all of it unmapped address space, aligned to the pool's page size.
        va = -(-_EXPANDABLE_ADDRESS_SPACE // pool.page) * pool.page
        c = _Block(self._new_address_range(va, pool.page), va, pool is self._small, mapped=False)
        pool.insert_unmapped(c)
        return c

    def _map_block(self, to_map: _Block, size: int, pool: _Pool) -> None:
        """``map_block``: map the pages covering ``size`` bytes from the start of an unmapped block."""
        assert not to_map.mapped and 0 < size <= to_map.size and to_map.addr % pool.page == 0
        mapped = -(-size // pool.page) * pool.page  # ExpandableSegment::map: whole pages
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:  # to_map -> remaining (still unmapped) -> to_map.next
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, to_map.small, mapped=False)
            rest.prev = to_map
            rest.next = to_map.next
            if rest.next is not None:
                rest.next.prev = rest
            to_map.next = rest
            to_map.size = mapped
            pool.insert_unmapped(rest)
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._grow_reserved(mapped)  # map_block: increase_stat(reserved_bytes, mapped_range.size)

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``try_allocate_expandable_block``: map just enough pages after the lowest free space."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped:
            self._map_block(candidate, min(candidate.size, size), pool)
        while candidate.size < size:
            # invariant: free -> unmapped -> *; map_block maps some of it and merges it with the free part
            nxt = candidate.next
            assert nxt is not None
            self._map_block(nxt, min(size - candidate.size, nxt.size), pool)
            candidate = nxt
        pool.erase(candidate)
        return candidate

    def _release_expandable(self, pool: _Pool) -> None:
        """``release_blocks``, expandable: ``unmap_block`` each free block, drop empty segments."""
        to_unmap = [pool.free[addr] for _, addr in pool.keys]
        page = pool.page
        for block in to_unmap:
            # ExpandableSegment::unmap: only the pages entirely inside the free block.
            begin = -(-block.addr // page) * page
            end = (block.addr + block.size) // page * page
            if begin >= end:
                continue
            pool.erase(block)
            if begin > block.addr:  # prev? -> before_free -> block
                before = _Block(block.addr, begin - block.addr, block.small)
                before.prev = block.prev
                if before.prev is not None:
                    before.prev.next = before
                before.next = block
                block.prev = before
                pool.insert(before)
            if end < block.addr + block.size:  # block -> after_free -> next?
                after = _Block(end, block.addr + block.size - end, block.small)
                after.next = block.next
                if after.next is not None:
                    after.next.prev = after
                after.prev = block
                block.next = after
                pool.insert(after)
            block.addr = begin
            block.size = end - begin
            block.mapped = False
            self._try_merge_blocks(block, block.prev, pool)
            self._try_merge_blocks(block, block.next, pool)
            pool.insert_unmapped(block)
            self._reserved -= end - begin  # unmap_block: decrease_stat(reserved_bytes, unmapped.size)
            if block.prev is None and block.next is None:  # release_expandable_segment
                pool.erase_unmapped(block)

    # -- bookkeeping ----------------------------------------------------------------------------------------

    def _new_address_range(self, size: int, align: int) -> int:
        # Segments get disjoint synthetic addresses with a gap between them: blocks only merge through
        # their prev/next links, as in the source, so addresses only order blocks of equal size.
        addr = -(-self._next_addr // align) * align
        self._next_addr = addr + size + align
        return addr

    def _grow_reserved(self, nbytes: int) -> None:
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
