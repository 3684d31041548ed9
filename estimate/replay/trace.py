"""The replay of a run's allocation trace (the order in which its tensor storages appear, change
and go, as MemTracker counted them: estimate/fake/recording.py) through a model of the caching
allocator: the peak a GPU reaches, its breakdown, and the host memory's.

Host memory: where a GPU is emulated, the host side of the run is on the meta device
(fake/stand_ins.py), and what the run offloads is counted there or by its category (FSDP's offloaded
state). A GPU's run pins some of it: what it copies out of the GPU (non_blocking copies land in
pinned memory; 05e and 05i copy into pinned buffers on a GPU), the optimizer's weights on the
host (05f, 05i, 10's --optimizer-on-host copy them so before training), and FSDP's offloaded
shards (CPUOffloadPolicy(pin_memory=True) on a GPU). The trace marks those storages PINNED; the
replay counts them as the caching host allocator holds them, each rounded up to a power of two
and kept once freed (caching_allocator.HostAllocatorModel), and the rest of the host memory
exactly. FSDP's offloaded gradients count exactly too: a GPU copies each weight's shard of the
gradient to the host, the first micro-batch's pinned, but here they stay the reduce-scatter's
outputs, a storage per group of weights, whose rounding would not be a GPU's.
"""
from dataclasses import dataclass, field

from common.breakdown import fold_breakdown
from estimate.gpu_choices import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES
from estimate.replay.allocator import CachingAllocatorModel, HostAllocatorModel

ALLOC, FREE, RESIZE, LABEL = "alloc", "free", "resize", "label"
WORKSPACE_CATEGORY = "Temp"  # cuBLAS workspaces are counted with the temporaries
HOST_SIDE = "meta"  # an emulated GPU's host memory: the device fake/stand_ins.py's HOST_DEVICE names
OFFLOADED = "host"  # storages made while counted_as_host (offloaded shards)
PINNED = "pinned"  # host-side storages a GPU's run pins (above)
PINNED_WHEN_OFFLOADED = frozenset({"Sharded Param"})  # FSDP's pinned shards (above)
HOST_OPTIMIZER_STATE = "Optstate"  # the optimizer's state on the host (where its weights are)
ON_DEVICE, PINNED_HOST, PAGEABLE_HOST = "device", "pinned host", "pageable host"  # replay's places
PHASES = ("forward", "backward", "optimizer step", "between")  # a training event's part of the step


@dataclass
class Peak:
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    host_bytes: int = 0  # the highest host memory of what lives there: offloaded, or kept on
    # the host by the run (pinned blocks as the host allocator holds them, the rest exact)
    pinned_host_bytes: int = 0  # of it, what the caching host allocator holds at the end
    breakdown_bytes: dict = field(default_factory=dict)


class ExactCounter:
    """Counts bytes as they are requested: MemTracker's own arithmetic (no allocator)."""

    def __init__(self):
        self.allocated = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes, what=None):
        self.allocated += nbytes
        self.peak_allocated = self.peak_reserved = max(self.peak_allocated, self.allocated)
        return nbytes

    def free(self, nbytes):
        self.allocated -= nbytes


def block_size(block):
    return block if isinstance(block, int) else block.size


def replay(events, device_type, emulate_cuda, host_categories=frozenset(), workspaces=True,
           observer=None, workspace_bytes=CUBLAS_WORKSPACE_BYTES):
    """The peak that `events` reach on `device_type`, with its breakdown, and the host memory's.

    With `emulate_cuda`, requests go through the caching allocator model (rounding, segments,
    cuBLAS workspaces at the first computed tensor), and host memory is counted (`host_bytes`):
    storages whose category is in `host_categories` (offloaded), the host side's PINNED ones, and
    the optimizer's state the host side keeps (its step's temporaries left out: a GPU's host
    steps Adam with the fused kernel, which makes none); pinned ones as the caching host
    allocator holds them (`pinned_host_bytes`), the rest exactly. Without, bytes are counted as
    MemTracker counts them. `workspaces=False` leaves the cuBLAS workspaces out (model creation
    multiplies no matrices); `workspace_bytes` is one workspace's size on the GPU emulated.
    `observer` (with emulate_cuda) sees the allocator's every step and, after each event, its
    index and the bytes by category (estimate/replay/snapshot.py draws the step from them).
    """
    allocator = CachingAllocatorModel(observer) if emulate_cuda else ExactCounter()
    pinned, pageable = HostAllocatorModel(), 0
    # storage -> [storage, bytes, category, device, where it is counted, its block or bytes there]
    storages = {}
    freed = {event[1] for event in events if event[0] == FREE}
    by_category = {}
    peak = Peak()
    workspaces_due = emulate_cuda and workspaces

    def place_of(storage, device, category):
        """ON_DEVICE, PINNED_HOST or PAGEABLE_HOST, or None: not counted (another device's, or
        the host side's batch and temporaries)."""
        if category in host_categories:  # offloaded
            return PINNED_HOST if category in PINNED_WHEN_OFFLOADED else PAGEABLE_HOST
        if device == PINNED:
            return PINNED_HOST
        if device == HOST_SIDE and category == HOST_OPTIMIZER_STATE and storage not in freed:
            return PAGEABLE_HOST
        return ON_DEVICE if device == device_type else None

    def place(state):
        nonlocal pageable
        storage, nbytes, category, device = state[:4]
        where = state[4] = place_of(storage, device, category) if nbytes else None
        if where == ON_DEVICE:
            block = state[5] = allocator.malloc(nbytes, category)
            by_category[category] = by_category.get(category, 0) + block_size(block)
            if allocator.allocated > peak.allocated_bytes:
                peak.allocated_bytes = allocator.allocated
                peak.breakdown_bytes = dict(by_category)
        elif where is not None:
            if where == PINNED_HOST:
                state[5] = pinned.malloc(nbytes)
            else:
                state[5] = nbytes
                pageable += nbytes
            peak.host_bytes = max(peak.host_bytes, pinned.held + pageable)
            peak.pinned_host_bytes = pinned.held

    def remove(state):
        nonlocal pageable
        where, held = state[4:]
        if where == ON_DEVICE:
            by_category[state[2]] -= block_size(held)
            allocator.free(held)
        elif where == PINNED_HOST:
            pinned.free(held)
        elif where == PAGEABLE_HOST:
            pageable -= held
        state[4:] = [None, None]

    for index, event in enumerate(events):
        if observer is not None and index:
            observer.after(index - 1, by_category)
        kind, storage = event[0], event[1]
        if kind == ALLOC:
            nbytes, event_device, category = event[2:]
            state = storages[storage] = [storage, nbytes, category, event_device, None, None]
            if (workspaces_due and place_of(storage, event_device, category) == ON_DEVICE
                    and category not in ("Parameter", "Buffer", "Sharded Param")):
                for _ in range(CUBLAS_WORKSPACES):
                    place([None, workspace_bytes, WORKSPACE_CATEGORY, device_type, None, None])
                workspaces_due = False
            place(state)
            continue
        state = storages.get(storage)
        if state is None:
            continue  # tracked before recording began
        if kind == FREE:
            remove(storages.pop(storage))
        elif kind == RESIZE:  # resize_ allocates the new size before it frees the old one
            grown = storages[storage] = [storage, event[2], *state[2:4], None, None]
            place(grown)
            remove(state)
        elif kind == LABEL:  # MemTracker re-files a storage (e.g. a gradient first seen as Temp)
            category = event[2]
            where = place_of(storage, state[3], category) if state[1] else None
            if where != state[4]:
                remove(state)  # offload: it moves between host and device
                state[2] = category
                place(state)
            elif where == ON_DEVICE:
                by_category[state[2]] -= block_size(state[5])
                by_category[category] = by_category.get(category, 0) + block_size(state[5])
                state[2] = category
                if observer is not None:
                    observer.relabel(state[5].address, category)
            else:
                state[2] = category
    if observer is not None and events:
        observer.after(len(events) - 1, by_category)
    peak.reserved_bytes = allocator.peak_reserved
    peak.breakdown_bytes = fold_breakdown(peak.breakdown_bytes)
    return peak
