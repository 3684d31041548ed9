"""A model of PyTorch's CUDA caching allocator, to turn an allocation order into what
`torch.cuda.max_memory_allocated` and `max_memory_reserved` would report; and of its caching host
allocator, which hands out pinned host memory (HostAllocatorModel).

The constants are those of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.13, default settings).
"""
import bisect
import itertools
from collections import Counter

ALLOCATION_GRANULE = 512              # kMinBlockSize: every block is a multiple of this
SMALL_REQUEST = 1 << 20               # kSmallSize: requests up to 1 MiB come from the small pool
SMALL_SEGMENT = 2 << 20               # kSmallBuffer: small requests share 2 MiB segments
MEDIUM_SEGMENT = 20 << 20             # kLargeBuffer: requests of 1-10 MiB share 20 MiB segments
LARGE_REQUEST = 10 << 20              # kMinLargeAlloc: from here a request gets its own segment
LARGE_ROUNDING = 2 << 20              # kRoundLarge: ... rounded up to a multiple of 2 MiB


def rounded(nbytes):
    """A request's size as the allocator hands it out (at least one granule)."""
    return max(ALLOCATION_GRANULE, -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE)


def segment_size(request):
    """Bytes the allocator asks the driver for when no cached block fits `request`."""
    if request <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if request < LARGE_REQUEST:
        return MEDIUM_SEGMENT
    return -(-request // LARGE_ROUNDING) * LARGE_ROUNDING


class Block:
    __slots__ = ("address", "size", "free", "previous", "next", "small")

    def __init__(self, address, size, small, previous=None, following=None):
        self.address, self.size, self.small = address, size, small
        self.free, self.previous, self.next = True, previous, following


class CachingAllocatorModel:
    """PyTorch's CUDA caching allocator (native backend, default settings), one stream.

    Requests are rounded to 512 bytes. Each pool (small: up to 1 MiB; large) keeps its free blocks
    sorted by size and hands out the smallest that fits, split when the rest is worth keeping
    (small pool: at least 512 bytes; large pool: over 1 MiB), else whole. With no fitting block
    it reserves a new segment (2 MiB, 20 MiB, or the request rounded to 2 MiB). Freed blocks
    merge with free neighbours in their segment; segments are never given back (no empty_cache,
    and the device is assumed large enough never to force it). `allocated` counts whole blocks,
    as `memory_allocated` does, so an unsplit block counts with its slack.
    """

    def __init__(self, observer=None):
        self.observer = observer  # told of each segment, allocation and free (estimate/replay/snapshot.py)
        self.free_blocks = {True: [], False: []}  # small pool?: sorted [(size, address, block)]
        self.addresses = itertools.count(step=1 << 40)  # segments never touch each other
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    def _take_free(self, small, size):
        pool = self.free_blocks[small]
        index = bisect.bisect_left(pool, (size, -1))
        if index == len(pool):
            return None
        return pool.pop(index)[2]

    def _put_free(self, block):
        block.free = True
        bisect.insort(self.free_blocks[block.small], (block.size, block.address, block))

    def _remove_free(self, block):
        pool = self.free_blocks[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]

    def malloc(self, nbytes, what=None):
        """Allocate `nbytes` (holding `what`, for the observer); returns the block (keep it to
        free it)."""
        size = rounded(nbytes)
        small = size <= SMALL_REQUEST
        block = self._take_free(small, size)
        if block is None:
            segment = segment_size(size)
            block = Block(next(self.addresses), segment, small)
            self.reserved += segment
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            if self.observer is not None:
                self.observer.segment(block.address, segment, small)
        remaining = block.size - size
        if remaining >= ALLOCATION_GRANULE if small else remaining > SMALL_REQUEST:
            rest = Block(block.address + size, remaining, small, previous=block, following=block.next)
            if block.next is not None:
                block.next.previous = rest
            block.next, block.size = rest, size
            self._put_free(rest)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        if self.observer is not None:
            self.observer.alloc(block.address, block.size, nbytes, what)
        return block

    def free(self, block):
        if self.observer is not None:
            self.observer.free(block.address, block.size)
        self.allocated -= block.size
        for neighbour in (block.previous, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                first, second = (neighbour, block) if neighbour is block.previous else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.previous = first
                block = first
        self._put_free(block)


def pinned_size(nbytes):
    """A pinned host request as the caching host allocator hands it out: rounded up to a power of
    two (c10::llvm::PowerOf2Ceil; 0 bytes take no block)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class HostAllocatorModel:
    """PyTorch's caching host allocator, where pinned host memory comes from on a GPU
    (ATen/core/CachingHostAllocator.h, 2.13, default settings: pinned_max_round_threshold and
    pinned_max_cached_size unset). Each request gets a block of its own, rounded up to a power of
    two and never split; a freed block is kept in the free list of its size and handed to the
    next request of that size; memory goes back to the system only on
    `torch._C._host_emptyCache()`, which no script calls. So what it holds only grows: `held`,
    which `torch.cuda.host_memory_stats()` reports as allocated_bytes. A freed block that copies
    were recorded on waits for them (an event on each stream) before reuse; here it is reused at
    once, a lower bound where copies lag behind."""

    def __init__(self):
        self.free_blocks = Counter()  # block size -> blocks of that size in its free list
        self.held = 0

    def malloc(self, nbytes):
        """The block size for `nbytes` (keep it to free it), from the free list or made anew."""
        size = pinned_size(nbytes)
        if self.free_blocks[size]:
            self.free_blocks[size] -= 1
        else:
            self.held += size
        return size

    def free(self, size):
        self.free_blocks[size] += 1
