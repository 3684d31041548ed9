"""Traces for any micro-batch size, written from runs at a few sizes: the --gpu-memory search
(search/fit.py) replays them through the caching allocator instead of running the script at every size
it tries.

Two optimizer steps at micro-batches of m and of m' samples make the same allocations in the same
order, each of a byte count that is an affine function of the size: a batch's tensor holds m
samples of one shape, while the weights, their gradients and the optimizer's state do not grow.
A `Family` checks that of its runs (every event alike but its bytes, every byte count on one line
through the smallest and the largest size, each run between them written event for event) and
writes the trace at any size. What chooses by the size breaks the line, and a size between two
runs cannot show where: so the code that makes such a choice declares it while the run makes it
(`note_choice`), and a family whose runs noted one is not written at all (the search then runs
every size it tries, as before). Declared today: bitsandbytes' 4-bit matmul, whose kernel
depends on the rows it multiplies (fake/four_bit.py), and the fused loss, whose pieces are
ceil(tokens / LOSS_CHUNKS) of the micro-batch's tokens (05h, 10's --loss fused: fake/run.py
notes it). A compiled run is not written either: a graph may be compiled again for another shape.

A size beyond the runs (below the smallest, above the largest) is an extrapolation: the search
confirms its answer there by running it (search/fit.py).
"""
from dataclasses import replace

from estimate.replay.trace import ALLOC, FREE, RESIZE

SMALLEST = 2  # the smallest size written: with one sample a tensor's batch dimension has size 1,
# and a copy that makes such a tensor contiguous may then be a view (the events differ)
CHOICES = []  # what the fake run under way chose by the micro-batch's size (note_choice)
SIZED = (ALLOC, RESIZE)  # the events that carry bytes, at index 2


def note_choice(words):
    """Say, during a fake run, that the code just chose something by the micro-batch's size."""
    CHOICES.append(words)


class NotBySizes(Exception):
    """The runs do not make one family of sizes: the search runs each size it tries."""


def canonical(events):
    """`events` with each run of consecutive frees in the order of their storages: a run's
    frees leave the allocator as they found it in any order (freed blocks merge with their free
    neighbours), and some follow no order of the run's (autocast's cache of cast weights is
    freed in the order of a hash table of their addresses)."""
    out, frees = [], []
    for event in events:
        if event[0] == FREE:
            frees.append(event)
            continue
        if frees:
            out += sorted(frees, key=lambda free: free[1])
            frees = []
        out.append(event)
    return out + sorted(frees, key=lambda free: free[1])


def alike(events, other):
    """Whether two traces are the same events but for their byte counts."""
    if len(events) != len(other):
        return False
    for event, that in zip(events, other):
        if event != that and (event[0] not in SIZED or event[:2] != that[:2]
                              or event[3:] != that[3:]):
            return False
    return True


SAME = ("script", "emulate_cuda", "creation", "parameter_count", "parameters_held", "offloaded",
        "compiled", "gpu_read")


def model_blocks(kept):
    """The blocks of the model a run stands for where probes of them ran (None: it ran whole),
    whichever probes ran at its size (shortcuts/blocks.py)."""
    return kept.blocks and kept.blocks[0]


def off_any_line(kept):
    """Why no line of sizes goes through `kept`, a KeptRun, as the run itself shows (the words),
    or None: it chose by its size, or it was compiled."""
    if kept.size_choices:
        return f"the run chose by its size: {'; '.join(kept.size_choices)}"
    if kept.compiled or kept.unfused_events is not None:
        return "compiled: a graph may be compiled again for another size"
    return None


class Family:
    """KeptRuns of one script and setting at several micro-batch sizes, as one line of traces."""

    def __init__(self, points):
        """`points`: {micro-batch size: KeptRun}, two sizes at least; NotBySizes unless they
        make a family (module docstring)."""
        if len(points) < 2:
            raise NotBySizes("one size is no line")
        if min(points) < SMALLEST:
            raise NotBySizes(f"sizes below {SMALLEST} are their own case")
        self.sizes = sorted(points)
        self.points = points
        self.events = {size: canonical(kept.events) for size, kept in points.items()}
        low = points[self.sizes[0]]
        for size in self.sizes:
            kept = points[size]
            off = off_any_line(kept)
            if off:
                raise NotBySizes(off)
            if any(getattr(kept, name) != getattr(low, name) for name in SAME) \
                    or model_blocks(kept) != model_blocks(low):
                raise NotBySizes("the runs differ in more than their batch")
            if not alike(self.events[size], self.events[self.sizes[0]]):
                raise NotBySizes(f"micro-batches of {self.sizes[0]} and {size} make other events")
        self.span = self.sizes[-1] - self.sizes[0]
        # (index, rise over the span, bytes at the smallest size) of each event whose bytes grow
        self.lines = [(index, that[2] - event[2], event[2])
                      for index, (event, that) in enumerate(zip(self.events[self.sizes[0]],
                                                                self.events[self.sizes[-1]]))
                      if event[0] in SIZED and event[2] != that[2]]
        for size in self.sizes[1:-1]:  # the runs between: written from the line, event for event
            if self.written(size, check=True).events != self.events[size]:
                raise NotBySizes(f"micro-batch {size} is not on the line through "
                                 f"{self.sizes[0]} and {self.sizes[-1]}")

    def value(self, line, size):
        """The bytes on `line` (rise over the span, bytes at the smallest size) at `size`."""
        rise, start = line
        value, remainder = divmod(start * self.span + rise * (size - self.sizes[0]), self.span)
        if remainder or value < 0:
            raise NotBySizes(f"a byte count is not a whole number at micro-batch {size}")
        return value

    def written(self, size, check=False):
        """The KeptRun at micro-batch `size`, written from the line (its frees in canonical
        order); `check`: written even where a run of that size is known, to compare."""
        if size in self.points and not check:
            return self.points[size]
        low = self.points[self.sizes[0]]
        events = list(self.events[self.sizes[0]])
        for index, rise, start in self.lines:
            event = events[index]
            events[index] = (*event[:2], self.value((rise, start), size), *event[3:])
        # what the search replays is the trace; the batch a run was asked for (the table's
        # row runs its own) is not written
        record = {**low.record, "batch_size": None, "accum_steps": None}
        return replace(low, events=events, record=record, batch_bytes=None)

    def between(self, size):
        """Whether `size` lies within the sizes run (written, not extrapolated)."""
        return self.sizes[0] <= size <= self.sizes[-1]
