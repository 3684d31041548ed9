"""The predicted step as a picture: PyTorch's memory snapshot of the emulated allocator, and a PNG.

`--estimate --memory-snapshot FILE` replays the training steps through the caching allocator
model (allocator.py) with a `Recorder` watching: every segment it reserves, every block
it hands out and takes back. FILE is then what `torch.cuda.memory._dump_snapshot` writes on a
GPU (its `segments` at the end, its `device_traces` in order), so PyTorch's memory visualizer
(https://pytorch.org/memory_viz) and `torch.cuda._memory_viz` read it. A block's only frame
names what it holds (parameters, gradients, optimizer state, activations, temporaries): the
estimate knows that, not the line of code that made it. Times are event numbers, not
microseconds. Beside FILE, FILE.png shows memory over the steps, stacked by what holds it, with
the forward, backward and optimizer-step spans marked.
"""
import pickle
from pathlib import Path

from common.breakdown import BREAKDOWN_KEYS, CATEGORIES

COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
           "activations": "#c44e52", "temporaries": "#8172b3"}
PHASE_SHADES = {"forward": "#f2f2f2", "backward": "#dcdcdc", "optimizer step": "#fff2b3"}
MIB = 2**20


class Recorder:
    """Watches the allocator model during a replay (allocation_trace.replay's `observer`)."""

    def __init__(self):
        self.trace = []  # the snapshot's device trace: what the allocator did, in order
        self.segments = {}  # address: (size, small)
        self.active = {}  # block address: (size, requested bytes, what it holds)
        self.timeline = []  # (event index, {breakdown key: bytes}) after each event
        self.time = 0

    def entry(self, action, address, size, what=None):
        self.trace.append({"action": action, "addr": address, "size": size, "stream": 0,
                           "time_us": self.time, "compile_context": "N/A", "user_metadata": "",
                           "frames": frames(what)})

    def segment(self, address, size, small):
        self.segments[address] = (size, small)
        self.entry("segment_alloc", address, size)

    def alloc(self, address, size, requested, category):
        self.active[address] = (size, requested, CATEGORIES.get(category, "temporaries"))
        self.entry("alloc", address, size, self.active[address][2])

    def relabel(self, address, category):
        """What a block holds, as MemTracker re-files it (a gradient first seen as a temporary)."""
        size, requested, _ = self.active[address]
        self.active[address] = (size, requested, CATEGORIES.get(category, "temporaries"))

    def free(self, address, size):
        what = self.active.pop(address)[2]
        self.entry("free_requested", address, size, what)
        self.entry("free_completed", address, size, what)

    def after(self, index, by_category):
        self.time = index + 1
        folded = dict.fromkeys(BREAKDOWN_KEYS, 0)
        for category, nbytes in by_category.items():
            folded[CATEGORIES.get(category, "temporaries")] += nbytes
        self.timeline.append((index, folded))

    def snapshot(self):
        """The snapshot, as torch.cuda.memory._snapshot() gives it."""
        segments = []
        for address, (size, small) in sorted(self.segments.items()):
            blocks, offset = [], address
            inside = sorted(block for block in self.active if address <= block < address + size)
            for block in inside:
                if block > offset:
                    blocks.append(free_block(offset, block - offset))
                held, requested, what = self.active[block]
                blocks.append({"address": block, "size": held, "requested_size": requested,
                               "state": "active_allocated", "frames": frames(what)})
                offset = block + held
            if offset < address + size:
                blocks.append(free_block(offset, address + size - offset))
            allocated = sum(block["size"] for block in blocks if block["state"] != "inactive")
            segments.append({
                "device": 0, "address": address, "total_size": size, "allocated_size": allocated,
                "active_size": allocated, "requested_size": sum(
                    block["requested_size"] for block in blocks if block["state"] != "inactive"),
                "stream": 0, "segment_type": "small" if small else "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                "blocks": blocks})
        return {"segments": segments, "device_traces": [self.trace],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False},
                "external_annotations": []}


def frames(what):
    return [] if what is None else [{"name": what.replace("_", " "), "filename": "predicted",
                                     "line": 0}]


def free_block(address, size):
    return {"address": address, "size": size, "requested_size": 0, "state": "inactive",
            "frames": []}


def write(path, recorder, phases, title):
    """Write the snapshot to `path` and the picture to `path`.png; returns the picture's path."""
    path = Path(path)
    with open(path, "wb") as file:
        pickle.dump(recorder.snapshot(), file)
    picture = path.with_name(path.name + ".png")
    draw(picture, recorder.timeline, phases, title)
    return picture


def spans(phases):
    """[(first event, last event, phase)] of the runs of equal phases."""
    found = []
    for index, phase in enumerate(phases):
        if found and found[-1][2] == phase:
            found[-1][1] = index
        else:
            found.append([index, index, phase])
    return [tuple(span) for span in found]


def draw(path, timeline, phases, title):
    """Memory over the steps, stacked by what holds it, the parts of each step shaded."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(9, 3.6), dpi=110)
    x = [index for index, _ in timeline]
    stacks = [[folded[key] / MIB for _, folded in timeline] for key in BREAKDOWN_KEYS]
    for first, last, phase in spans(phases):
        if phase in PHASE_SHADES:
            axes.axvspan(first, last + 1, color=PHASE_SHADES[phase], zorder=0, linewidth=0)
    axes.stackplot(x, *stacks, labels=[key.replace("_", " ") for key in BREAKDOWN_KEYS],
                   colors=[COLOURS[key] for key in BREAKDOWN_KEYS], step="post", zorder=2)
    shades = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in PHASE_SHADES.values()]
    handles, labels = axes.get_legend_handles_labels()
    axes.legend(handles[::-1] + shades, labels[::-1] + list(PHASE_SHADES), fontsize=7,
                loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.set_xlabel("allocator events (two optimizer steps)")
    axes.set_ylabel("allocated (MiB)")
    axes.set_xlim(0, max(x, default=0) + 1)
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
