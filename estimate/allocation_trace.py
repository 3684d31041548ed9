"""The order in which a run's tensor storages appear, change and go, as MemTracker sees them.

MemTracker (and FSDPMemTracker, its subclass) keeps running totals and a peak, not the order of
events. Predicting a GPU needs the order: to replay it through a model of the caching allocator,
and to keep host memory apart from device memory. `AllocationTrace.recording()` listens to every
change MemTracker makes to its running totals (`_update_snap`) while it is open, so the trace
holds exactly what MemTracker counts, event by event.
"""
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

from common.memory import fold_breakdown
from estimate.caching_allocator import CachingAllocatorModel
from estimate.gpu_choices import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES

ALLOC, FREE, RESIZE, LABEL = "alloc", "free", "resize", "label"
WORKSPACE_CATEGORY = "Temp"  # cuBLAS workspaces are counted with the temporaries


class AllocationTrace:
    """Events `(kind, storage, ...)`: alloc (bytes, device type, category), free, resize (bytes),
    label (category); `storage` numbers each storage MemTracker tracked, in order of appearance."""

    def __init__(self):
        self.events = []
        self.phases = []  # each event's part of the step: PHASES
        self._numbers = {}  # id(MemTracker's record of a storage) -> storage number, while alive
        self._next_number = itertools.count()
        self._on_host = False

    def new_tracker(self):
        """The next events come from another tracker (creation's, then training's): forget the
        records of the last one, whose ids Python may give to new records. Returns the index of
        the next event."""
        self._numbers.clear()
        return len(self.events)

    @contextmanager
    def counted_as_host(self):
        """Storages that appear while inside are host memory (offloaded shards), not the GPU's."""
        self._on_host = True
        try:
            yield
        finally:
            self._on_host = False

    def observe(self, update, record, phase=None):
        count = len(self.events)
        self._observe(update, record)
        self.phases += [phase] * (len(self.events) - count)

    def _observe(self, update, record):
        key = id(record)
        known = key in self._numbers
        if update is _UpdateType.ADD or (update is _UpdateType.SIZE and not known):
            # a storage that first appears, or first grows from zero bytes (MemTracker adds none)
            number = self._numbers[key] = next(self._next_number)
            device = "host" if self._on_host else record.device.type
            self.events.append((ALLOC, number, record.mem_consumed, device,
                                str(record.reftype.value)))
        elif not known:
            return  # tracked before recording began
        elif update is _UpdateType.DEL:
            self.events.append((FREE, self._numbers.pop(key)))
        elif update is _UpdateType.SIZE:
            self.events.append((RESIZE, self._numbers[key], record.mem_consumed))
        elif update is _UpdateType.REF:
            self.events.append((LABEL, self._numbers[key], str(record.reftype.value)))

    @contextmanager
    def recording(self):
        """Record every tracker's updates while inside (the run has one tracker at a time)."""
        original = MemTracker._update_snap
        trace = self

        def update_snap(tracker, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            original(tracker, u_type, winfo, old_mem_consumed, old_reftype)
            trace.observe(u_type, winfo, phase_of(tracker))

        MemTracker._update_snap = update_snap
        try:
            yield self
        finally:
            MemTracker._update_snap = original


PHASES = ("forward", "backward", "optimizer step", "between")


def phase_of(tracker):
    """The part of the step a tracker is in: the optimizer's step, backward, a module's forward,
    or between them (a batch's copy, the loss's division)."""
    if getattr(tracker, "_in_opt", False):
        return "optimizer step"
    modules = getattr(tracker, "_mod_tracker", None)
    if modules is None:
        return "between"
    if modules.is_bw:
        return "backward"
    return "forward" if modules.parents - {"Global"} else "between"


@dataclass
class Peak:
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    host_bytes: int = 0  # the highest host memory in categories that live there (offload)
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
    """The peak that `events` reach on `device_type`, with its breakdown.

    With `emulate_cuda`, requests go through the caching allocator model (rounding, segments,
    cuBLAS workspaces at the first computed tensor) and storages whose category is in
    `host_categories` count as host memory; without, bytes are counted as MemTracker counts them.
    `workspaces=False` leaves the cuBLAS workspaces out (model creation multiplies no matrices);
    `workspace_bytes` is one workspace's size on the GPU emulated. `observer` (with
    emulate_cuda) sees the allocator's every step and, after each event, its index and the bytes
    by category (estimate/snapshot.py draws the step from them).
    """
    allocator = CachingAllocatorModel(observer) if emulate_cuda else ExactCounter()
    storages = {}  # storage -> [bytes, category, block on the device or None]
    by_category = {}
    peak, host_now = Peak(), 0
    workspaces_due = emulate_cuda and workspaces

    def place(state):
        nonlocal host_now
        nbytes, category, _ = state
        if not nbytes:
            return
        if category in host_categories:
            host_now += nbytes
            peak.host_bytes = max(peak.host_bytes, host_now)
            return
        block = state[2] = allocator.malloc(nbytes, category)
        by_category[category] = by_category.get(category, 0) + block_size(block)
        if allocator.allocated > peak.allocated_bytes:
            peak.allocated_bytes = allocator.allocated
            peak.breakdown_bytes = dict(by_category)

    def remove(state):
        nonlocal host_now
        nbytes, category, block = state
        if block is not None:
            by_category[category] -= block_size(block)
            allocator.free(block)
            state[2] = None
        elif category in host_categories:
            host_now -= nbytes

    for index, event in enumerate(events):
        if observer is not None and index:
            observer.after(index - 1, by_category)
        kind, storage = event[0], event[1]
        if kind == ALLOC:
            nbytes, event_device, category = event[2:]
            if event_device != device_type:
                continue  # e.g. the host-side batch, before it is copied to the device
            if workspaces_due and category not in ("Parameter", "Buffer", "Sharded Param"):
                for _ in range(CUBLAS_WORKSPACES):
                    place([workspace_bytes, WORKSPACE_CATEGORY, None])
                workspaces_due = False
            state = storages[storage] = [nbytes, category, None]
            place(state)
            continue
        state = storages.get(storage)
        if state is None:
            continue  # a storage on another device
        if kind == FREE:
            remove(storages.pop(storage))
        elif kind == RESIZE:  # resize_ allocates the new size before it frees the old one
            grown = storages[storage] = [event[2], state[1], None]
            place(grown)
            remove(state)
        elif kind == LABEL:  # MemTracker re-files a storage (e.g. a gradient first seen as Temp)
            category = event[2]
            if (category in host_categories) != (state[1] in host_categories):
                remove(state)  # offload: it moves between host and device
                state[1] = category
                place(state)
            elif state[2] is not None:
                by_category[state[1]] -= block_size(state[2])
                by_category[category] = by_category.get(category, 0) + block_size(state[2])
                state[1] = category
                if observer is not None:
                    observer.relabel(state[2].address, category)
            else:
                state[1] = category
    if observer is not None and events:
        observer.after(len(events) - 1, by_category)
    peak.reserved_bytes = allocator.peak_reserved
    peak.breakdown_bytes = fold_breakdown(peak.breakdown_bytes)
    return peak
