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
line in the size (shortcuts/sizes.py), so search() runs the script at two sizes (the asked batch's row of
the table, and four times a guess at the answer: first_guess, from the activations and
temporaries at the asked row's peak per sample), writes the trace of any size from the line and
bisects on replays of it; a third run, off the line, then checks it: the answer's (or, where the
answer was run, the next size up's: one sample more up to 32, then the next multiple of 8, the
sizes GPUs prefer), which must be the trace written; a size written beyond the runs is run too.
The next size up is then written between runs on a checked line (grid.confirmations). A later
search whose answer lies between sizes run, on a line a run has checked, needs no run.
Where the runs make no line (a choice by the size), search_by_estimates estimates every size
tried: a line through two estimates gives a candidate, and estimates confirm it. Which sizes
run is grid.py's to say; the runs, the line and every figure are the Question's
(estimate/question.py), which keeps them for the stack's and a later question's searches.
"""
from concurrent.futures import as_completed
from dataclasses import dataclass, field

from estimate.output import ProgressBar, size_text, worker_pool
from estimate.question import SMALLEST, NotBySizes, Question
from estimate.search import grid

MAX_ESTIMATES = 12  # per script: two for the line, then confirmations (usually one)
NOT_SEARCHED = ("compiled: its memory budget is solved over the whole joint graph of the step, "
                "so it is estimated once, at the asked size (no search)")


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
    written: int = 0  # sizes written from the line of sizes (shortcuts/sizes.py) and replayed
    not_by_sizes: str | None = None  # why the sizes were estimated one by one instead


def search(question, capacity, known=None, cap=grid.MAX_MICRO_BATCH, per_sample=None):
    """The largest micro-batch per process of `question` (a Question) whose predicted reserved
    memory is at most `capacity` bytes (to the granule: one sample up to 32, then 8), or `cap`
    (search_by_estimates' arguments): from the traces of a few sizes, written for any size
    (shortcuts/sizes.py) and replayed; the line checked by a third run, the answer's, and a size
    written beyond the runs estimated (grid.confirmations). Where the runs make no family of
    sizes, every size tried is estimated (search_by_estimates), the runs made so far counted."""
    found = Fit(question.name, question.accumulates, capacity=capacity, tried=dict(known or {}))
    if cap < SMALLEST:  # one sample a process is the whole batch (8 on 8 GPUs): nothing to search
        if 1 not in found.tried:
            record, problem, _ = question.answer(1)
            if problem:
                found.problem = problem
                return found
            found.tried[1] = (record["allocated_bytes"], record["reserved_bytes"])
        found.largest = 1 if found.tried[1][1] <= capacity else None
        found.capped = found.largest is not None
        return found
    found.tried.update(question.found(found.tried, cap))  # the known points', an earlier question's
    kept_before = len(found.tried)

    def estimated(micro):
        found.tried[micro] = question.estimate(micro)

    def fits(micro):
        if micro < SMALLEST:  # its own case: estimated
            if micro not in question.runs:
                estimated(micro)
            return found.tried[micro][1] <= capacity
        return question.reserved_written(micro) <= capacity

    def forget_unchecked():  # the runs from one probe that no line checked (question.py)
        for micro in question.unchecked():
            found.tried.pop(micro, None)

    try:
        off = question.off_any_line()
        if off:  # (a run shows it: none is made to find out)
            raise NotBySizes(off)
        for micro in grid.line_sizes(question.runs, found.tried, capacity, per_sample, cap):
            estimated(micro)
        for _ in range(3):  # a confirmation adds a run; the answer stands, or the family fails
            question.draw_line()
            answer = grid.largest_fitting(fits, cap)
            due = grid.confirmations(answer, cap, question.runs, question.line,
                                     question.from_one_probe())
            if not due:
                found.largest, found.capped = answer, answer is not None and answer >= cap
                found.written, found.estimated = len(question.written), len(found.tried) - kept_before
                return found
            for micro in due:
                estimated(micro)
                if not question.on_line(micro):
                    raise NotBySizes(f"micro-batch {micro} is not on the line of the sizes run")
        raise NotBySizes("the confirmations moved the answer")
    except RuntimeError as error:
        found.problem = str(error)
        forget_unchecked()
        return found
    except NotBySizes as why:
        found.not_by_sizes = str(why)
        forget_unchecked()  # (made again from two probes at least, where tried)
    estimates = search_by_estimates(question, capacity, found.tried, cap, per_sample)
    estimates.not_by_sizes = found.not_by_sizes
    return estimates


def search_by_estimates(question, capacity, known=None, cap=grid.MAX_MICRO_BATCH, per_sample=None):
    """The largest micro-batch per process of `question` whose predicted reserved memory is at
    most `capacity` bytes (to the granule: one sample up to 32, then 8), confirmed on fake
    tensors: it fits, and the next size does not; or `cap` fits (the search stops there).
    `known`: {micro-batch: (allocated, reserved)} already predicted (the asked batch's row);
    `per_sample`: the bytes a sample adds, as a known point's peak suggests (first_guess), so
    the line's second point is near the answer rather than at one sample."""
    found = Fit(question.name, question.accumulates, capacity=capacity, tried=dict(known or {}))

    def fits(micro):
        if micro not in found.tried:
            record, problem, _ = question.answer(micro)
            if problem:
                raise RuntimeError(problem)
            found.tried[micro] = (record["allocated_bytes"], record["reserved_bytes"])
        return found.tried[micro][1] <= capacity

    try:
        fits(grid.first_guess(found.tried, capacity, per_sample, cap))
        width = None  # the bracket's width before the last estimate
        while True:
            low = max((size for size, (_, nbytes) in found.tried.items() if nbytes <= capacity),
                      default=None)
            high = min((size for size, (_, nbytes) in found.tried.items() if nbytes > capacity),
                       default=None)
            if high == 1:
                return found  # not even one sample
            if low is not None and grid.settled(low, high, cap):
                break
            if len(found.tried) >= MAX_ESTIMATES:
                found.problem = f"no answer within {MAX_ESTIMATES} estimates: {low} fits, {high} not"
                break
            candidate = grid.next_estimate(found.tried, capacity, low, high, width, cap)
            width = None if high is None else high - (low or 0)
            fits(candidate)
        if low is None:
            return found  # (no answer within MAX_ESTIMATES: the problem says so)
        found.capped = low >= cap or high is None
        found.largest = low if low >= cap else grid.snap(low)  # the cap is an answer off the grid
    except RuntimeError as error:
        found.problem = str(error)
    return found


def accumulation_for(fit):
    """The fewest micro-batches that split the asked batch into ones of at most fit.largest per
    GPU, or None if none does."""
    per_gpu = fit.batch_size // fit.world_size
    for steps in range(1, per_gpu + 1):
        if per_gpu % steps == 0 and per_gpu // steps <= fit.largest:
            return steps
    return None


FLAGS_SEARCHED = ("--batch-size", "--accum-steps")


def without_batch_flags(argv):
    """`argv` less the flags the search sets itself."""
    return without(argv, FLAGS_SEARCHED)


def without(argv, flags):
    """`argv` less each of `flags` and its value."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            kept.append(word)
    return kept


def search_task(row, record, capacity, accumulates):
    """search()'s arguments for a script, from its asked row and that row's prediction."""
    micro = record["batch_size"] // (record["accum_steps"] * record["world_size"])
    # the asked row is a point of the search when it ran micro-batches as the search runs them
    as_searched = not accumulates or record["accum_steps"] > 1
    known = {micro: (record["allocated_bytes"], record["reserved_bytes"])} if as_searched else {}
    question = Question(row.script, without_batch_flags(row.argv), row.world_size, row.gpu,
                        accumulates, {micro: row} if known else None)
    return (question, capacity, known, grid.MAX_MICRO_BATCH,
            grid.bytes_per_sample(record, micro) if known else None)


def search_all(rows, outcomes, capacity, jobs, accumulates, interrupted):
    """A Fit for each script, from its first (asked) row; up to `jobs` scripts at a time (Ctrl-C
    among them: the words `interrupted()` gives)."""
    asked = {}
    for row, (record, _, took) in zip(rows, outcomes):
        asked.setdefault(row.script, (row, record, took or 0))
    fits, tasks = [], []
    for script, (row, record, took) in asked.items():
        if record is None:
            fits.append(Fit(script.stem, accumulates(script), problem="its estimate failed"))
            continue
        task = search_task(row, record, capacity, accumulates(script))
        if task[0].compiles:
            fits.append(Fit(script.stem, accumulates(script), batch_size=record["batch_size"],
                            world_size=record["world_size"], capacity=capacity,
                            asked_reserved=record["reserved_bytes"], not_searched=NOT_SEARCHED))
            continue
        tasks.append((task, record, took))
    started = (f"searching the largest batch that fits in {size_text(capacity)} for {len(tasks)} "
               "scripts: traces of a few sizes, written for the rest")
    bar = ProgressBar(len(tasks), "scripts searched")
    if jobs > 1 and len(tasks) > 1:
        with worker_pool(jobs, interrupted) as pool:
            # the longest first, as their rows took: no long one is left alone at the end
            futures = {index: pool.submit(search, *tasks[index][0]) for index in
                       sorted(range(len(tasks)), key=lambda index: -tasks[index][2])}
            print(started, flush=True)  # (Ctrl-C from here on: the pool's message)
            for future in as_completed(futures.values()):
                bar.advance(search_words(future.result()))
            found = [futures[index].result() for index in range(len(tasks))]
    else:
        print(started, flush=True)
        found = []
        for task, _, _ in tasks:
            found.append(search(*task))
            bar.advance(search_words(found[-1]))
    bar.close()
    for fit, (_, record, _) in zip(found, tasks):
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


