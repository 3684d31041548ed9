"""`python -m common.estimate --gpu-memory SIZE`: does each step fit, and with what batch?

For each script the search finds the largest micro-batch per GPU whose predicted
`max_memory_reserved` fits in SIZE, on fake tensors:

- a script without gradient accumulation (01-03, 04a) trains the whole batch at once: its
  micro-batch is the batch (per GPU);
- a script with it (04 on) holds one micro-batch's activations at a time, beside the gradients
  of the batch: it is run with two micro-batches of the size tried (`--batch-size 2mW
  --accum-steps 2`), which peaks as any number of them does (tests/estimate checks it), so the
  answer holds for every batch made of such micro-batches.

Memory grows about linearly with the micro-batch, so two estimates give a line, the line gives a
candidate, and estimates confirm it: the candidate fits and one more sample does not. The
asked batch is estimated as it is (the table's row), so the answer also says whether it fits.
"""
import gc
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from common.estimate.predict import GB, Row, attempt, in_units

UNITS = {"": GB, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
         "g": 2**30, "t": 2**40}
MAX_ESTIMATES = 12  # per script: two for the line, then confirmations (usually two or three)


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
    capped: bool = False    # the data set has no more samples: the largest may be larger
    tried: dict = field(default_factory=dict)  # micro-batch per GPU: predicted reserved bytes
    problem: str | None = None


def micro_row(script, base_argv, world_size, micro, accumulates):
    """The row whose run has micro-batches of `micro` samples per process."""
    if accumulates:
        flags = ["--batch-size", str(2 * micro * world_size), "--accum-steps", "2"]
    else:
        flags = ["--batch-size", str(micro * world_size)]
    return Row(script, [*base_argv, *flags], world_size)


def search(script, base_argv, world_size, capacity, accumulates, samples, known=None):
    """The largest micro-batch per process of `script` whose predicted reserved memory is at
    most `capacity` bytes, confirmed on fake tensors; at most what the data set's `samples`
    allow. `known`: {micro-batch: reserved bytes} already predicted (the asked batch's row)."""
    found = Fit(script.stem, accumulates, capacity=capacity, tried=dict(known or {}))
    limit = max(1, samples // (world_size * (2 if accumulates else 1)))

    def reserved(micro):
        if micro not in found.tried:
            row = micro_row(script, base_argv, world_size, micro, accumulates)
            record, problem, _ = attempt(row)
            if problem:
                raise RuntimeError(problem)
            found.tried[micro] = record["reserved_bytes"]
        return found.tried[micro]

    try:
        if reserved(1) > capacity:
            return found  # not even one sample
        fitting = [size for size, nbytes in found.tried.items() if nbytes <= capacity]
        fits = min(max(fitting), limit)
        too_big = min((size for size, nbytes in found.tried.items() if nbytes > capacity),
                      default=None)
        width = None  # the bracket's width before the last estimate
        while too_big != fits + 1 and not (too_big is None and fits >= limit):
            if len(found.tried) >= MAX_ESTIMATES:
                found.problem = (f"no answer within {MAX_ESTIMATES} estimates: {fits} fits, "
                                 f"{too_big} does not")
                break
            candidate = next_candidate(found.tried, capacity, fits, too_big, limit)
            if too_big is not None and width is not None and too_big - fits > width / 2:
                candidate = (fits + too_big) // 2  # the line did not halve the bracket: bisect
            width = None if too_big is None else too_big - fits
            if reserved(candidate) <= capacity:
                fits = candidate
            else:
                too_big = candidate
        found.largest, found.capped = fits, too_big is None
    except RuntimeError as error:
        found.problem = str(error)
    return found


def next_candidate(tried, capacity, fits, too_big, limit):
    """The micro-batch to estimate next, strictly between the largest that fits and the
    smallest that does not: where the line through the two points nearest the boundary meets
    `capacity`. Memory that does not grow with the micro-batch sends it to the data's limit."""
    upper = too_big - 1 if too_big is not None else limit
    below = sorted(size for size in tried if size <= fits)
    (x0, x1) = (fits, too_big) if too_big is not None else (
        (below[-2], below[-1]) if len(below) > 1 else (None, None))
    if x0 is None:
        return min(2 * fits, upper)
    slope = (tried[x1] - tried[x0]) / (x1 - x0)
    guess = int(x0 + (capacity - tried[x0]) / slope) if slope > 0 else upper
    return min(max(guess, fits + 1), upper)


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


def training_samples(argv):
    """How many training samples the data set of this command line has (the fake run's count)."""
    from common.cli import parse_args
    from common.estimate.fake_run import TRAIN_SAMPLES
    from common.presets import preset_for
    return TRAIN_SAMPLES[preset_for(parse_args("", [*argv, "--estimate"])).dataset]


def search_task(row, record, capacity, accumulates):
    """search()'s arguments for a script, from its asked row and that row's prediction."""
    micro = record["batch_size"] // (record["accum_steps"] * record["world_size"])
    # the asked row is a point of the search when it ran micro-batches as the search runs them
    known = {micro: record["reserved_bytes"]} if (not accumulates or record["accum_steps"] > 1) else {}
    return (row.script, without_batch_flags(row.argv), row.world_size, capacity, accumulates,
            training_samples(row.argv), known)


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
        tasks.append((search_task(row, record, capacity, accumulates(script)), record))
    if jobs > 1 and len(tasks) > 1:
        gc.freeze()
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            found = list(pool.map(search, *zip(*(task for task, _ in tasks))))
    else:
        found = [search(*task) for task, _ in tasks]
    for fit, (_, record) in zip(found, tasks):
        fit.batch_size, fit.world_size = record["batch_size"], record["world_size"]
        fit.asked_reserved = record["reserved_bytes"]
        fits.append(fit)
    order = [script.stem for script in asked]
    return sorted(fits, key=lambda fit: order.index(fit.script))


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
    if fit.problem and fit.largest is None:
        return "search failed (see the note)"
    if fit.largest is None:
        return "not even 1 sample"
    more = "+" if fit.capped else ""  # the data set ran out first
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
        reserved = in_units(fit.asked_reserved) if fit.asked_reserved is not None else ""
        fits_now = ("" if fit.asked_reserved is None else
                    "yes" if fit.asked_reserved <= fit.capacity else "no")
        lines.append(f"| {fit.script} | {asked} | {reserved} | {fits_now} | {fit_words(fit)} "
                     f"| {len(fit.tried)} |")
    return "\n".join(lines)
