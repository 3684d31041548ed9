"""Which micro-batch sizes the --gpu-memory search runs, decided here alone: the sizes an answer
can take (every size up to 32 samples, then multiples of 8: the grid), the two runs a line of
traces is drawn through, the runs that confirm its answer, and where no line can be drawn, the
next size to estimate. Everything else the search writes from the line and replays (fit.py).
"""
from estimate.question import SMALLEST, NotBySizes

MAX_MICRO_BATCH = 4096  # per GPU: the search stops there ("4096+")
FAR = 4  # the line's second run: this many times the guess at the answer (line_sizes)


def line_sizes(runs, tried, capacity, per_sample, cap):
    """The sizes to run, in turn, until `runs` (the sizes run so far, which each one yielded
    joins) hold two of SMALLEST samples or more to draw the line through. A run costs the same at
    any size: the second goes well beyond the guess at the answer, so that the answer, and a later
    question's (another capacity or GPU), lies between. NotBySizes where too few sizes are left."""
    while len([size for size in runs if size >= SMALLEST]) < 2:
        guess = max(first_guess(tried, capacity, per_sample, cap), SMALLEST)
        if any(size >= SMALLEST for size in runs):
            guess = min(cap, snap(FAR * guess))
        if guess in runs:  # (nothing says how far the answer is: a size well above)
            guess = min(cap, snap(FAR * next_size(max(runs))))
        if guess in runs or guess < SMALLEST:
            raise NotBySizes(f"the search may try too few sizes (up to {cap})")
        yield guess


def confirmations(answer, cap, runs, line, unchecked=()):
    """The sizes to run to confirm `answer` (None: not even SMALLEST fits) on `line` (a Family):
    of it and the next size up, those not run already and not written between the sizes run on a
    line checked on a run it was not drawn through. Each written beyond the runs (an
    extrapolation) is run; where both lie between and the line is not checked yet, one run, the
    answer's, checks it (a third point off a line through two): the next size is then written
    between runs on a checked line. `unchecked`: the sizes of `runs` that no run checks by
    itself (written from one probe, estimate/question.py): a line of two sizes through one of
    them is checked by a third run even where the answer and the next size up were run, a size
    halfway between the two (NotBySizes where none lies between). A choice made by the size that
    the code declares (shortcuts/sizes.py) makes no line at all: every size is then estimated."""
    asked = [answer or 1] + ([next_size(answer)] if answer and answer < cap else [])
    due = [micro for micro in asked if micro not in runs]
    if len(line.sizes) >= 3:  # checked
        return [micro for micro in due if not line.between(micro)]
    beyond = [micro for micro in due if not line.between(micro)]
    if beyond or due or not set(line.sizes) & set(unchecked):
        return beyond or due[:1]
    low, high = line.sizes
    halfway = snap((low + high) // 2)
    if not low < halfway < high:
        raise NotBySizes(f"no size between {low} and {high} to check the line of their runs")
    return [halfway]


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


def next_estimate(tried, capacity, low, high, width, cap):
    """search_by_estimates' next size to estimate: where the line through the sizes `tried`
    nearest the boundary reaches `capacity` (next_candidate); halfway where the last estimate did
    not halve the bracket (`width` before it); the next size up where the line says the answer
    is known; the asked batch (`cap`) first where a batch was asked for and nothing too large yet."""
    floor = snap(low or 0)  # the answer is at least this (0: not yet known)
    candidate = snap(next_candidate(tried, capacity, low, high, cap))
    if high is not None and width is not None and high - (low or 0) > width / 2:
        candidate = snap((floor + high) // 2)  # the line did not halve the bracket: bisect
    if candidate <= floor:  # the line says the answer is known: the next size confirms it
        candidate = floor + granule(floor)
    candidate = min(candidate, cap)
    if high is None and cap < MAX_MICRO_BATCH and cap not in tried:
        candidate = cap  # a batch was asked for: whether it fits whole settles the most
    return candidate
