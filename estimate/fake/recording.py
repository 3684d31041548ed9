"""The order in which a run's tensor storages appear, change and go, as MemTracker sees them.

MemTracker (and FSDPMemTracker, its subclass) keeps running totals and a peak, not the order of
events. Predicting a GPU needs the order: to replay it through a model of the caching allocator
(estimate/replay/trace.py), and to keep host memory apart from device memory.
`AllocationTrace.recording()` listens to every change MemTracker makes to its running totals
(`_update_snap`) while it is open, so the trace holds exactly what MemTracker counts, event by
event, with the host-side storages a GPU's run pins marked PINNED (replay/trace.py says which).
"""
import itertools
from contextlib import contextmanager

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType

from estimate.replay.trace import ALLOC, FREE, HOST_SIDE, LABEL, OFFLOADED, PINNED, RESIZE

TO_COPY = torch.ops.aten._to_copy.default


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
                if func is TO_COPY and copies_to_the_host(args, kwargs):
                    with trace.pinning():
                        return dispatch(tracker, func, types, args, kwargs)
                return dispatch(tracker, func, types, args, kwargs)  # (every operation: no
                # context manager made for the rest)
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
