"""Peak memory of training and of model creation, with a breakdown by what the memory holds.

On every device the first optimizer steps run under PyTorch's MemTracker, which counts tensor
storages exactly (identical across runs with the same seed) and sorts them into parameters,
gradients, optimizer state, activations and temporaries. A training run reaches its peak within
its first two optimizer steps. The tracker roughly doubles the time of the steps it watches, so
those steps are left out of the training time. On CUDA the run also reports
`torch.cuda.max_memory_allocated` and `max_memory_reserved` over the whole run.
"""
import time
from contextlib import contextmanager

import torch
from torch.distributed._tools.mem_tracker import MemTracker

TRACKED_STEPS = 2

# MemTracker's categories, folded into the five this project reports
CATEGORIES = {
    "Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
    "Optstate": "optimizer_state", "Activation": "activations",
    "Temp": "temporaries", "Other": "temporaries",
}
BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


def device_snapshot(snapshot, device):
    """The part of a MemTracker snapshot that belongs to `device` (all zeros if it saw none)."""
    for dev, stats in snapshot.items():
        if dev.type == device.type:
            return stats
    return {}


def fold_breakdown(stats):
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for name, nbytes in stats.items():
        if name in CATEGORIES:
            breakdown[CATEGORIES[name]] += nbytes
    return breakdown


class MemoryMeter:
    """Wrap each optimizer step in `meter.step()`; read `meter.result()` at the end."""

    def __init__(self, device, model, optimizer, tracker_factory=MemTracker):
        self.device, self.model, self.optimizer = device, model, optimizer
        self.tracker_factory = tracker_factory
        self.tracker = None
        self.steps_seen = 0
        self.tracked_seconds = 0.0
        self.peak_bytes, self.breakdown = 0, dict.fromkeys(BREAKDOWN_KEYS, 0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextmanager
    def step(self):
        if self.steps_seen >= TRACKED_STEPS:
            self.steps_seen += 1
            yield
            return
        if self.tracker is None:
            self.tracker = self.tracker_factory()
            self.tracker.track_external(self.model, self.optimizer)
            self.tracker.__enter__()
        start = time.perf_counter()
        try:
            yield
            self.tracker.reset_mod_stats()  # MemTracker needs this between iterations
        except BaseException:
            self.stop_tracking()
            raise
        finally:
            self.tracked_seconds += time.perf_counter() - start
        self.steps_seen += 1
        if self.steps_seen == TRACKED_STEPS:
            self.stop_tracking()

    def stop_tracking(self):
        if self.tracker is None:
            return
        self.tracker.__exit__(None, None, None)
        stats = device_snapshot(self.tracker.get_tracker_snapshot("peak"), self.device)
        self.peak_bytes = stats.get("Total", 0)
        self.breakdown = fold_breakdown(stats)
        self.tracker = None

    def result(self):
        """Peak bytes (tracked steps), its breakdown, and on CUDA the allocator's own peaks."""
        self.stop_tracking()
        result = {"peak_memory_bytes": self.peak_bytes, "breakdown_bytes": self.breakdown}
        if self.device.type == "cuda":
            result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
            result["cuda_max_allocated_bytes"] = result["peak_memory_bytes"]
            result["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        return result


@contextmanager
def measure_creation(device):
    """Peak memory while the block runs (model creation); read `.peak_bytes` after it."""
    class Creation:
        peak_bytes = 0
    creation = Creation()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield creation
        creation.peak_bytes = torch.cuda.max_memory_allocated(device) - base
        return
    tracker = MemTracker()
    with tracker:
        yield creation
    creation.peak_bytes = device_snapshot(tracker.get_tracker_snapshot("peak"), device).get("Total", 0)
