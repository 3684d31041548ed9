"""The order in which a run's tensor storages appear, change and go, as MemTracker sees them.

MemTracker (and FSDPMemTracker, its subclass) keeps running totals and a peak, not the order of
events. Predicting a GPU needs the order: to replay it through a model of the caching allocator,
and to keep host memory apart from device memory. `AllocationTrace.recording()` listens to every
change MemTracker makes to its running totals (`_update_snap`) while it is open, so the trace
holds exactly what MemTracker counts, event by event.

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
import itertools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType

from common.memory import fold_breakdown
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


class AllocationTrace:
    """Events `(kind, storage, ...)`: alloc (bytes, device type, category), free, resize (bytes),
    label (category); `storage` numbers each storage MemTracker tracked, in order of appearance."""

    def __init__(self):
        self.events = []
        self.phases = []  # each event's part of the step: PHASES
        self._numbers = {}  # id(MemTracker's record of a storage) -> storage number, while alive
        self._next_number = itertools.count()
        self._on_host = False
        self._pinning = False

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

    @contextmanager
    def pinning(self):
        """Host-side storages that appear while inside are pinned on a GPU (PINNED)."""
        self._pinning = True
        try:
            yield
        finally:
            self._pinning = False

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
            device = OFFLOADED if self._on_host else record.device.type
            if device == HOST_SIDE and self._pinning:
                device = PINNED
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
        """Record every tracker's updates while inside (the run has one tracker at a time), the
        host-side storages a GPU's run pins marked so: copies out of the device (seen by
        MemTracker's dispatch, and by FSDPMemTracker's, its own), and the optimizer's weights on
        the host, which the tracker then counts from its start."""
        original = MemTracker._update_snap
        dispatches = {tracker: tracker.__torch_dispatch__ for tracker in (MemTracker, FSDPMemTracker)}
        external = MemTracker.track_external
        trace = self

        def update_snap(tracker, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            original(tracker, u_type, winfo, old_mem_consumed, old_reftype)
            trace.observe(u_type, winfo, phase_of(tracker))

        def copying_out(dispatch):
            def dispatched(tracker, func, types, args=(), kwargs=None):
                out = func is torch.ops.aten._to_copy.default and copies_to_the_host(args, kwargs)
                with trace.pinning() if out else nullcontext():
                    return dispatch(tracker, func, types, args, kwargs)
            return dispatched

        def with_host_weights(tracker, *objects):
            external(tracker, *objects)
            with trace.pinning():
                for weight in host_weights(objects):
                    tracker._update_and_maybe_create_winfos(weight, _MemRefType.OPT)

        MemTracker._update_snap, MemTracker.track_external = update_snap, with_host_weights
        for tracker, dispatch in dispatches.items():
            tracker.__torch_dispatch__ = copying_out(dispatch)
        try:
            yield self
        finally:
            MemTracker._update_snap, MemTracker.track_external = original, external
            for tracker, dispatch in dispatches.items():
                tracker.__torch_dispatch__ = dispatch


def copies_to_the_host(args, kwargs):
    """Whether `aten._to_copy(*args, **kwargs)` copies from the device to its host."""
    to = (kwargs or {}).get("device")
    return (to is not None and torch.device(to).type == HOST_SIDE
            and args[0].device.type != HOST_SIDE)


def host_weights(objects):
    """The weights on the host of the optimizers among `objects` (what a tracker is told of)."""
    return [weight for optimizer in objects if isinstance(optimizer, torch.optim.Optimizer)
            for group in optimizer.param_groups for weight in group["params"]
            if weight.device.type == HOST_SIDE]


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
