"""`python -m estimate --gpu-memory SIZE`: does each step fit, and with what batch?

For each script the search finds the largest micro-batch per GPU whose predicted
`max_memory_reserved` fits in SIZE, on fake tensors:

- a script without gradient accumulation (01-03, 04a) trains the whole batch at once: its
  micro-batch is the batch (per GPU);
- a script with it (04 on) holds one micro-batch's activations at a time, beside the gradients
  of the batch: it is run with two micro-batches of the size tried (`--batch-size 2mW
  --accum-steps 2`), which peaks as any number of them does (tests/estimate checks it), so the
  answer holds for every batch made of such micro-batches.

A step at micro-batches of m samples makes the same allocations as at m', each of bytes on a
line in the size (sizes.py), so search() runs the script at two sizes (the asked batch's row of
the table, and four times a guess at the answer: first_guess, from the activations and
temporaries at the asked row's peak per sample), writes the trace of any size from the line and
bisects on replays of it; the answer and the next size up (one sample more up to 32, then the
next multiple of 8: the sizes GPUs prefer) are then estimated, and must be the traces written.
A later search whose answer lies between sizes run, on a line a run has checked, needs no run.
Where the runs make no line (a choice by the size), search_by_estimates estimates every size
tried: a line through two estimates gives a candidate, and estimates confirm it. Every run and
the sizes run are kept (cache.py): the stack's and a later question's searches reuse them.
"""
import re
import shutil
import sys
from concurrent.futures import as_completed
from dataclasses import dataclass, field

from estimate import cache, records
from estimate.gpu_choices import DEFAULT_GPU
from estimate.predict import Row, attempt, attempt_run, compiles, record_of, replayed
from estimate.records import GB, size_text
from estimate.sizes import SMALLEST, Family, NotBySizes, canonical
from estimate.workers import worker_pool

UNITS = {"": GB, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
         "g": 2**30, "t": 2**40}
MAX_ESTIMATES = 12  # per script: two for the line, then confirmations (usually two)
MAX_MICRO_BATCH = 4096  # per GPU: the search stops there ("4096+")
FAR = 4  # the search's second run: this many times its guess at the answer (search())
NOT_SEARCHED = ("compiled: its memory budget is solved over the whole joint graph of the step, "
                "so it is estimated once, at the asked size (no search)")


def parse_size(text):
    """Bytes in "24GB" (10^9), "24GiB" or "24G" (2^30), "80 GB", "16000MB"; ValueError if not."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = found and found.group(2).lower()
    if not found or unit not in UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"--gpu-memory {text!r}: expected a size such as 24GB, 24GiB or 80GB "
                         "(GB = 10^9 bytes, GiB and G = 2^30; a GPU sold as 24 GB holds 24 GiB)")
    return int(float(found.group(1)) * UNITS[unit])


@dataclass
class Fit:
    """What the search found for one script, and the batch that was asked for."""
    script: str
    accumulates: bool       # the micro-batch is a part of the batch (04 on)
    batch_size: int = 0     # asked: samples per optimizer step, over all GPUs
    world_size: int = 1
    asked_reserved: int | None = None  # the asked batch's predicted reserved bytes
    capacity: int = 0       # bytes the GPU has for PyTorch (--gpu-memory)
    largest: int | None = None  # the largest micro-batch per GPU that fits (None: not even 1)
    capped: bool = False    # MAX_MICRO_BATCH fits: the largest may be larger
    tried: dict = field(default_factory=dict)  # micro-batch: (allocated, reserved) bytes, estimated
    problem: str | None = None
    not_searched: str | None = None  # why the asked batch alone was estimated
    estimated: int | None = None  # sizes estimated by this search (None: every one tried)
    written: int = 0  # sizes written from the line of sizes (sizes.py) and replayed
    not_by_sizes: str | None = None  # why the sizes were estimated one by one instead


def micro_row(script, base_argv, world_size, micro, accumulates, gpu=DEFAULT_GPU):
    """The row whose run has micro-batches of `micro` samples per process; a question of memory,
    so the data set's size does not limit it."""
    if accumulates:
        flags = ["--batch-size", str(2 * micro * world_size), "--accum-steps", "2"]
    else:
        flags = ["--batch-size", str(micro * world_size)]
    return Row(script, [*base_argv, *flags], world_size, gpu, any_batch_size=True)


def search(script, base_argv, world_size, capacity, accumulates, known=None, gpu=DEFAULT_GPU,
           cap=MAX_MICRO_BATCH, per_sample=None, known_rows=None):
    """The largest micro-batch per process of `script` whose predicted reserved memory is at
    most `capacity` bytes (to the granule: one sample up to 32, then 8), or `cap` (search_by_
    estimates' arguments): from the traces of a few sizes, written for any size (sizes.py) and
    replayed; the answer and the next size up each confirmed by an estimate of its own, unless
    the line was checked already on a size it was not drawn through, and the size lies between
    sizes estimated. `known_rows`: {micro-batch: Row} whose runs stand for the `known` points
    (the table's asked row). Where the runs make no family of sizes, every size tried is
    estimated (search_by_estimates), the runs made so far counted."""
    found = Fit(script.stem, accumulates, capacity=capacity, tried=dict(known or {}))
    if cap < SMALLEST:  # one sample a process is the whole batch (8 on 8 GPUs): nothing to search
        if 1 not in found.tried:
            record, problem, _ = attempt(micro_row(script, base_argv, world_size, 1, accumulates, gpu))
            if problem:
                found.problem = problem
                return found
            found.tried[1] = (record["allocated_bytes"], record["reserved_bytes"])
        found.largest = 1 if found.tried[1][1] <= capacity else None
        found.capped = found.largest is not None
        return found
    runs = {}
    for micro in found.tried:
        row = (known_rows or {}).get(micro) or micro_row(script, base_argv, world_size, micro,
                                                           accumulates, gpu)
        kept, _, _ = attempt_run(row)  # kept: the estimate that made the known point
        if kept is not None:
            runs[micro] = kept
    sizes_key = cache.key(micro_row(script, base_argv, world_size, 0, accumulates, gpu), False)
    for micro in cache.sizes_kept(sizes_key) if sizes_key else ():  # an earlier question's runs
        if micro not in runs and micro <= cap:
            kept, _, _ = attempt_run(micro_row(script, base_argv, world_size, micro,
                                               accumulates, gpu), run=False)
            if kept is not None:
                runs[micro] = kept
                record = record_of(kept, gpu)
                found.tried[micro] = (record["allocated_bytes"], record["reserved_bytes"])
    kept_before = len(found.tried)

    def estimated(micro):
        kept, problem, _ = attempt_run(micro_row(script, base_argv, world_size, micro,
                                                 accumulates, gpu))
        if problem:
            raise RuntimeError(problem)
        cache.note_size(sizes_key, micro)
        record = record_of(kept, gpu)
        runs[micro], found.tried[micro] = kept, (record["allocated_bytes"], record["reserved_bytes"])

    try:
        while len([size for size in runs if size >= SMALLEST]) < 2:  # two sizes draw the line
            # a run costs the same at any size: the second well beyond the guess at the answer,
            # so that the answer, and a later question's (another capacity or GPU), lies between
            guess = max(first_guess(found.tried, capacity, per_sample, cap), SMALLEST)
            if any(size >= SMALLEST for size in runs):
                guess = min(cap, snap(FAR * guess))
            if guess in runs:  # (nothing says how far the answer is: a size well above)
                guess = min(cap, snap(FAR * next_size(max(runs))))
            if guess in runs or guess < SMALLEST:
                raise NotBySizes(f"the search may try too few sizes (up to {cap})")
            estimated(guess)
        for _ in range(3):  # a confirmation adds a run; the answer stands, or the family fails
            family = Family({size: kept for size, kept in runs.items() if size >= SMALLEST})
            written = {}

            def fits(micro):
                if micro < SMALLEST:  # its own case: estimated
                    if micro not in runs:
                        estimated(micro)
                    return found.tried[micro][1] <= capacity
                if micro not in written:
                    kept = family.written(micro)
                    written[micro] = replayed(kept, kept.events, gpu).reserved_bytes
                return written[micro] <= capacity
            answer = largest_fitting(fits, cap)
            asked = [answer or 1] + ([next_size(answer)] if answer and answer < cap else [])
            checked = len(family.sizes) >= 3  # the line went through a run it was not drawn from
            due = [micro for micro in asked
                   if micro not in runs and not (checked and family.between(micro))]
            if not due:
                found.largest, found.capped = answer, answer is not None and answer >= cap
                found.written, found.estimated = len(written), len(found.tried) - kept_before
                return found
            for micro in due:
                estimated(micro)
                if canonical(runs[micro].events) != family.written(micro).events:
                    raise NotBySizes(f"micro-batch {micro} is not on the line of the sizes run")
        raise NotBySizes("the confirmations moved the answer")
    except RuntimeError as error:
        found.problem = str(error)
        return found
    except NotBySizes as why:
        found.not_by_sizes = str(why)
    estimates = search_by_estimates(script, base_argv, world_size, capacity, accumulates,
                                    found.tried, gpu, cap, per_sample)
    estimates.not_by_sizes = found.not_by_sizes
    return estimates


def next_size(size):
    """The next size the answer can take above `size` (on the grid)."""
    return snap(size) + granule(snap(size))


def largest_fitting(fits, cap):
    """The largest size on the grid (every size to 32, then multiples of 8), or `cap` itself,
    at most `cap`, for which `fits(size)` (true up to some size, false above it), or None."""
    if cap == 1 or not fits(2):  # (a size of one sample is estimated: asked last)
        return 1 if fits(1) else None
    if fits(cap):
        return cap
    low, high = 2, cap  # low fits, high does not: bisect the grid between
    while next_size(low) < high:
        middle = snap((low + high) // 2)
        if middle <= low:
            middle = next_size(low)
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def search_by_estimates(script, base_argv, world_size, capacity, accumulates, known=None,
                        gpu=DEFAULT_GPU, cap=MAX_MICRO_BATCH, per_sample=None):
    """The largest micro-batch per process of `script` whose predicted reserved memory is at
    most `capacity` bytes (to the granule: one sample up to 32, then 8), confirmed on fake
    tensors: it fits, and the next size does not; or `cap` fits (the search stops there).
    `known`: {micro-batch: (allocated, reserved)} already predicted (the asked batch's row);
    `per_sample`: the bytes a sample adds, as a known point's peak suggests (first_guess), so
    the line's second point is near the answer rather than at one sample."""
    found = Fit(script.stem, accumulates, capacity=capacity, tried=dict(known or {}))

    def fits(micro):
        if micro not in found.tried:
            record, problem, _ = attempt(micro_row(script, base_argv, world_size, micro,
                                                   accumulates, gpu))
            if problem:
                raise RuntimeError(problem)
            found.tried[micro] = (record["allocated_bytes"], record["reserved_bytes"])
        return found.tried[micro][1] <= capacity

    try:
        fits(first_guess(found.tried, capacity, per_sample, cap))
        width = None  # the bracket's width before the last estimate
        while True:
            low = max((size for size, (_, nbytes) in found.tried.items() if nbytes <= capacity),
                      default=None)
            high = min((size for size, (_, nbytes) in found.tried.items() if nbytes > capacity),
                       default=None)
            if high == 1:
                return found  # not even one sample
            if low is not None and settled(low, high, cap):
                break
            if len(found.tried) >= MAX_ESTIMATES:
                found.problem = f"no answer within {MAX_ESTIMATES} estimates: {low} fits, {high} not"
                break
            floor = snap(low or 0)  # the answer is at least this (0: not yet known)
            candidate = snap(next_candidate(found.tried, capacity, low, high, cap))
            if high is not None and width is not None and high - (low or 0) > width / 2:
                candidate = snap((floor + high) // 2)  # the line did not halve the bracket: bisect
            if candidate <= floor:  # the line says the answer is known: the next size confirms it
                candidate = floor + granule(floor)
            candidate = min(candidate, cap)
            if high is None and cap < MAX_MICRO_BATCH and cap not in found.tried:
                candidate = cap  # a batch was asked for: whether it fits whole settles the most
            width = None if high is None else high - (low or 0)
            fits(candidate)
        if low is None:
            return found  # (no answer within MAX_ESTIMATES: the problem says so)
        found.capped = low >= cap or high is None
        found.largest = low if low >= cap else snap(low)  # the cap is an answer off the grid
    except RuntimeError as error:
        found.problem = str(error)
    return found


def first_guess(tried, capacity, per_sample, cap=MAX_MICRO_BATCH):
    """The first micro-batch to estimate: one sample when nothing is known or nothing says how
    memory grows; else where a known point's reserved bytes plus `per_sample` bytes a sample
    reach `capacity` (a guess: the line through it and the known point then corrects it)."""
    if not tried or not per_sample or per_sample <= 0:
        return 1
    size, (_, reserved) = max(tried.items())
    guess = snap(min(max(int(size + (capacity - reserved) / per_sample), 1), cap))
    if guess == size:  # the known point is at the answer's granule: its neighbour settles it
        guess = size + granule(size) if reserved <= capacity else max(snap(size - 1), 1)
    return min(guess, cap)


def bytes_per_sample(record, micro):
    """What one more sample of the micro-batch adds to the peak, as a record suggests: the
    activations and temporaries at its peak over its micro-batch (a guess: the peak may fall
    where few of them are held, in the optimizer's step)."""
    breakdown = record.get("breakdown_bytes") or {}
    grows = breakdown.get("activations", 0) + breakdown.get("temporaries", 0)
    return grows / micro if micro and grows else None


def granule(size):
    """The answer's resolution: every size up to 32 samples, multiples of 8 above (the sizes
    GPUs prefer, and fewer estimates)."""
    return 1 if size < 32 else 8


def snap(size):
    """The largest size the answer can take at or below `size`."""
    return size - size % granule(size)


def settled(low, high, cap=MAX_MICRO_BATCH):
    """Whether the answer is known: snap(low) fits and the next size it could take does not
    (or the search has reached `cap`)."""
    if low >= cap:
        return True
    answer = snap(low)
    if high is None:
        return False
    return high <= answer + granule(answer)


def next_candidate(tried, capacity, low, high, cap=MAX_MICRO_BATCH):
    """The micro-batch to estimate next, strictly between `low` (fits, or None: nothing tried
    does) and `high` (does not, or None): where the line through the two tried sizes nearest the
    boundary reaches `capacity`, by allocated bytes (exactly linear within a phase of the step)
    plus the allocator's overhead seen at the nearest one. Memory that does not grow with the
    micro-batch sends it to the top."""
    lower, upper = (low or 0) + 1, high - 1 if high is not None else cap
    below = sorted(size for size in tried if low is not None and size <= low)
    above = sorted(size for size in tried if high is not None and size >= high)
    if low is not None and high is not None:
        x0, x1 = low, high
    elif high is None:
        x0, x1 = below[-2:] if len(below) > 1 else (low, None)
    else:
        x0, x1 = above[:2] if len(above) > 1 else (None, high)
    if x0 is None:
        return lower  # one size, too large: the smallest is next
    if x1 is None:
        return min(2 * low, upper)
    (a0, _), (a1, _) = tried[x0], tried[x1]
    slope = (a1 - a0) / (x1 - x0)
    nearest = low if low is not None else high
    overhead = tried[nearest][1] - tried[nearest][0]  # reserved beyond allocated: segments, rounding
    guess = int(x0 + (capacity - overhead - a0) / slope) if slope > 0 else upper
    return min(max(guess, lower), upper)


FLAGS_SEARCHED = ("--batch-size", "--accum-steps")


def without_batch_flags(argv):
    """`argv` less the flags the search sets itself."""
    kept, skip = [], False
    for flag in argv:
        if skip:
            skip = False
        elif flag in FLAGS_SEARCHED:
            skip = True
        else:
            kept.append(flag)
    return kept


def search_task(row, record, capacity, accumulates):
    """search()'s arguments for a script, from its asked row and that row's prediction."""
    micro = record["batch_size"] // (record["accum_steps"] * record["world_size"])
    # the asked row is a point of the search when it ran micro-batches as the search runs them
    as_searched = not accumulates or record["accum_steps"] > 1
    known = {micro: (record["allocated_bytes"], record["reserved_bytes"])} if as_searched else {}
    return (row.script, without_batch_flags(row.argv), row.world_size, capacity, accumulates,
            known, row.gpu, MAX_MICRO_BATCH, bytes_per_sample(record, micro) if known else None,
            {micro: row} if known else None)


def search_all(rows, outcomes, capacity, jobs, accumulates):
    """A Fit for each script, from its first (asked) row; up to `jobs` scripts at a time."""
    asked = {}
    for row, (record, _, _) in zip(rows, outcomes):
        asked.setdefault(row.script, (row, record))
    fits, tasks = [], []
    for script, (row, record) in asked.items():
        if record is None:
            fits.append(Fit(script.stem, accumulates(script), problem="its estimate failed"))
            continue
        if compiles(script, row.argv):
            fits.append(Fit(script.stem, accumulates(script), batch_size=record["batch_size"],
                            world_size=record["world_size"], capacity=capacity,
                            asked_reserved=record["reserved_bytes"], not_searched=NOT_SEARCHED))
            continue
        tasks.append((search_task(row, record, capacity, accumulates(script)), record))
    started = (f"searching the largest batch that fits in {size_text(capacity)} for {len(tasks)} "
               "scripts: traces of a few sizes, written for the rest")
    bar = ProgressBar(len(tasks), "scripts searched")
    if jobs > 1 and len(tasks) > 1:
        with worker_pool(jobs, lambda: "during the --gpu-memory search: no table of what fits, "
                         f"and {records.KEPT} is as it was") as pool:
            futures = [pool.submit(search, *task) for task, _ in tasks]
            print(started, flush=True)  # (Ctrl-C from here on: the pool's message)
            for future in as_completed(futures):
                bar.advance(search_words(future.result()))
            found = [future.result() for future in futures]
    else:
        print(started, flush=True)
        found = []
        for task, _ in tasks:
            found.append(search(*task))
            bar.advance(search_words(found[-1]))
    bar.close()
    for fit, (_, record) in zip(found, tasks):
        fit.batch_size, fit.world_size = record["batch_size"], record["world_size"]
        fit.asked_reserved = record["reserved_bytes"]
        fits.append(fit)
    order = [script.stem for script in asked]
    return sorted(fits, key=lambda fit: order.index(fit.script))


def search_words(fit):
    """A script's finished search in a few words."""
    answer = ("search failed" if fit.problem and fit.largest is None else
              "not even 1 sample fits" if fit.largest is None else
              f"{fit.largest}{'+' if fit.capped else ''} samples per GPU fit")
    return f"{fit.script}: {answer} ({estimates_words(fit)})"


def estimates_words(fit):
    made = "" if fit.estimated is None else f", {fit.estimated} new"
    return f"{len(fit.tried)} estimates{made}" + (f", {fit.written} sizes written" if fit.written
                                                  else "")


class ProgressBar:
    """Work done of `total`: on a terminal one line redrawn ([#####.....] 5/10 and the last
    item's words), elsewhere a line per item."""

    def __init__(self, total, what, stream=None):
        self.total, self.what, self.done = total, what, 0
        self.stream = stream or sys.stdout
        self.terminal = self.stream.isatty()

    def advance(self, words):
        self.done += 1
        if not self.terminal:
            print(f"[{self.done}/{self.total}] {words}", file=self.stream, flush=True)
            return
        width = 24
        filled = width * self.done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {self.what}: {words}"
        columns = shutil.get_terminal_size().columns
        print("\r" + line[:columns - 1].ljust(columns - 1), end="", file=self.stream, flush=True)

    def close(self):
        if self.terminal and self.done:
            print(file=self.stream, flush=True)


def accumulation_for(fit):
    """The fewest micro-batches that split the asked batch into ones of at most fit.largest per
    GPU, or None if none does."""
    per_gpu = fit.batch_size // fit.world_size
    for steps in range(1, per_gpu + 1):
        if per_gpu % steps == 0 and per_gpu // steps <= fit.largest:
            return steps
    return None


def fit_words(fit):
    """The table cell for the largest batch that fits."""
    if fit.not_searched:
        return "not searched (see the note)"
    if fit.problem and fit.largest is None:
        return "search failed (see the note)"
    if fit.largest is None:
        return "not even 1 sample"
    more = "+" if fit.capped else ""  # the search stopped at MAX_MICRO_BATCH
    if not fit.accumulates:
        return f"batch {fit.largest * fit.world_size}{more}"
    words = f"micro-batches of {fit.largest}{more}" + (" per GPU" if fit.world_size > 1 else "")
    steps = accumulation_for(fit)
    if steps:
        words += f"; batch {fit.batch_size} as --accum-steps {steps}"
    return words


def fit_table(fits, size):
    """The Markdown table of the search: does the asked batch fit, and what is the most that does."""
    lines = [f"Fits in --gpu-memory {size}: predicted max_memory_reserved at most {size} "
             "(the CUDA context, a few hundred MB that PyTorch does not count, comes on top)",
             "",
             "| script | asked | reserved | fits? | largest that fits | estimates |",
             "|---|---|---:|---|---|---:|"]
    for fit in fits:
        asked = (f"batch {fit.batch_size}" + (f", {fit.world_size} GPUs" if fit.world_size > 1
                                              else "")) if fit.batch_size else ""
        reserved = size_text(fit.asked_reserved) if fit.asked_reserved is not None else ""
        fits_now = ("" if fit.asked_reserved is None else
                    "yes" if fit.asked_reserved <= fit.capacity else "no")
        lines.append(f"| {fit.script} | {asked} | {reserved} | {fits_now} | {fit_words(fit)} "
                     f"| {len(fit.tried)} |")
    return "\n".join(lines)
