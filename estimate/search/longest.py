"""`python -m estimate --gpu-memory SIZE --longest-sequence [GRANULE]`: the longest sequence that
fits, walking the stack's chain for long sequences (estimate/stack.py's LONG_CHAIN: CHAIN with
the tiled MLP, placed by the cost model), and the command that runs it.

Each prefix of the chain, cheapest first, is asked for the longest length it fits at the batch
asked (texts packed: no padding and no mask of length x length), in multiples of GRANULE tokens
(1,024 unless given). The tile count and the fused loss's pieces change with the length, so the
batch search's line of traces does not hold here: each length is estimated. An estimate's cost
grows with its operations, not its length, and peak memory grows about linearly with the length
once no tensor of length x length is made, so the search is a bisection whose next length is
where the line through the two nearest estimates crosses the GPU (regula falsi; past the
longest that fits so far, up to 64 times it), the midpoint where the line gives no length inside
the bracket; it ends where a length fits and one GRANULE more does not. A prefix is asked
first at one GRANULE past the longest found so far, and left at one estimate where that does
not fit. Past the config's positions (rotary ones) the command adds
--max-positions; a run whose host memory exceeds --host-memory does not fit. The answer: the
longest length, by the cheapest prefix that reaches it, its command, host memory and seconds a
step by the cost model (costs.py, attention's FLOPs included at the length).

With --world-size N above 1 the walk is LONG_SHARDED_CHAIN's, each link a whole switch set under
torchrun, in its order (every GPU a whole text, then each text split across the GPUs by sequence
parallelism, its checkpoints and then its weights in host memory), estimated as process 0 of N
(the batch: texts a GPU, or texts in all where each is split), keeping SHARDED_MARGIN of the GPU
free as the sharded fit does.
"""
from dataclasses import dataclass, field

from estimate.output import size_text, took_text
from estimate.question import Question
from estimate.search.costs import Costs, link_seconds, parts_text, step_time
from estimate.search.fit import without
from estimate.stack import LONG_CHAIN, LONG_SHARDED_CHAIN, SHARDED_MARGIN, argv_of, prefixes, resident_bytes

GRANULE = 1024  # tokens: the lengths asked are its multiples
LONGEST = 2 ** 24  # tokens: no length past it is asked


@dataclass(frozen=True)
class Asked:
    """What the search asks: the combined script and the model's flags (without --seq-len and
    --batch-size), the batch, the GPU and host capacities, and the model's positions (`stretches`:
    rotary, so --max-positions extends them; else none past `positions`)."""
    script: object
    model_argv: list
    batch_size: int
    capacity: int
    gpu: str
    costs: Costs
    positions: int | None = None
    stretches: bool = True
    host_capacity: int | None = None
    granule: int = GRANULE
    task: str = "causal-lm"
    world_size: int = 1
    heads: int = 1  # the model's attention heads (each text splits over GPUs that divide them)

    @property
    def room(self):
        """What a run may reserve: the GPU, less SHARDED_MARGIN on several."""
        return int(self.capacity * (1 - SHARDED_MARGIN)) if self.world_size > 1 else self.capacity


def splits_texts(switches):
    """Whether each text is split across the processes (--sequence-parallel): the batch is then
    the texts of all of them, else of each."""
    return bool(dict(switches).get("--sequence-parallel"))


@dataclass
class Found:
    """A prefix's longest length (0: none fits), its record there and the length past it that
    did not fit (its reserved bytes or problem)."""
    link: object
    switches: list
    length: int = 0
    record: dict | None = None
    past: tuple = ()  # (length, reserved bytes or the words why not)
    estimates: int = 0
    notes: list = field(default_factory=list)


def length_argv(asked, length):
    """The flags that ask for `length` tokens: --seq-len, --max-positions past the config's."""
    extend = asked.positions is not None and length > asked.positions and asked.stretches
    return ["--seq-len", str(length), *(["--max-positions", str(length)] if extend else [])]


def cap(asked):
    """The longest length that may be asked: the config's positions where they do not stretch."""
    top = LONGEST if asked.stretches or asked.positions is None else asked.positions
    return top // asked.granule * asked.granule


class LengthSearch:
    """One prefix's question at any length: each length's estimate, kept, and whether it fits."""

    def __init__(self, asked, switches, report, hint=None):
        self.asked, self.switches, self.report = asked, switches, report
        self.hint = hint  # bytes a token, as a search before found them: the line's first slope
        self.seen = {}  # {length: (record or None, reserved bytes or the words why not)}

    def fits(self, length):
        """Whether `length` fits (estimated once); reported."""
        if length not in self.seen:
            asked = self.asked
            question = Question(asked.script, [*asked.model_argv, *length_argv(asked, length),
                                               *argv_of(self.switches)], asked.world_size, asked.gpu,
                                accumulates=False, shares_texts=splits_texts(self.switches))
            record, problem, seconds = question.answer(asked.batch_size)
            if record is None:
                self.seen[length] = (None, problem)
            elif record["reserved_bytes"] > asked.room:
                self.seen[length] = (None, record["reserved_bytes"])
            elif (asked.host_capacity is not None
                  and record["host_bytes"] * asked.world_size > asked.host_capacity):  # one machine's
                self.seen[length] = (None, f"needs {size_text(record['host_bytes'] * asked.world_size)} "
                                           f"of host memory, above --host-memory")
            else:
                self.seen[length] = (record, record["reserved_bytes"])
            outcome = self.seen[length][1]
            self.report(f"[longest] {length:,} tokens: " + (
                f"{size_text(outcome)} reserved" if isinstance(outcome, int) else f"failed: {outcome}")
                + f" ({took_text(seconds)})")
        return self.seen[length][0] is not None

    def reserved(self, length):
        outcome = self.seen[length][1]
        return outcome if isinstance(outcome, int) else None

    def slope(self, low, high=None):
        """Reserved bytes a token on the line through the two estimates nearest `low` (which
        fits): the bracket's where `high` has bytes, else the last two that fit; None where
        they give no rising line."""
        points = sorted(length for length in self.seen if self.reserved(length) is not None)
        below = [length for length in points if length <= low][-2:]
        pair = (below[-1], high) if high and self.reserved(high) else tuple(below)
        if len(pair) == 2 and self.reserved(pair[1]) > self.reserved(pair[0]):
            (x0, y0), (x1, y1) = ((x, self.reserved(x)) for x in pair)
            return (y1 - y0) / (x1 - x0)
        return None

    def next_length(self, low, high, bisect=False):
        """The next length between `low` (fits) and `high` (does not, or None: not found yet):
        where the line through the nearest two estimates (or from `low` at the slope a search
        before found, where one estimate is all there is) crosses the GPU, in granules, kept off
        the bracket's ends (and under 64 times `low`); the midpoint (or 4 times `low`) where the
        line says nothing better, or `bisect` (the line has moved the same end twice running)."""
        granule, capacity = self.asked.granule, self.asked.room
        slope = self.slope(low, high) or self.hint
        guess = None
        if slope:
            guess = int(low + (capacity - self.reserved(low)) / slope) // granule * granule
        if high is None:  # 4 times longer, or as far as the line says, up to 64 times
            top = min(cap(self.asked), 4 * low if guess is None else 64 * low)
            return max(low + granule, min(top if guess is None else guess, top))
        middle = (low + high) // 2 // granule * granule
        if guess is None or bisect:
            return max(low + granule, middle)
        return min(max(guess, low + granule), high - granule)  # kept a granule inside

    def longest(self, start):
        """The longest length that fits, at least `start` (which fits), and the length past it."""
        low, high, moved = start, None, []
        while high is None or high - low > self.asked.granule:
            if high is None and low >= cap(self.asked):
                return low, None
            length = self.next_length(low, high, bisect=high is not None and moved[-2:] in (
                ["low", "low"], ["high", "high"]))
            if self.fits(length):
                low = length
                moved.append("low")
            else:
                high = length
                moved.append("high")
        return low, high


def at_length(asked):
    """The length the chain is ordered at: the config's own longest sequence (4,096 if none)."""
    return asked.positions or 4096


def links(asked):
    """[(link, switches, notes)]: each prefix of LONG_CHAIN ordered by the cost model at
    at_length, or on several GPUs each link of LONG_SHARDED_CHAIN (those that split each text
    skipped where the attention heads do not split over the GPUs: switches None)."""
    if asked.world_size > 1:
        unsplit = asked.heads % asked.world_size
        return [(link, None, [f"{asked.heads} attention heads do not split over {asked.world_size} "
                              "GPUs"]) if unsplit and splits_texts(link.sets) else (link, list(link.sets), [])
                for link in LONG_SHARDED_CHAIN]
    at = at_length(asked)
    ordering = Costs(**{**vars(asked.costs), "tokens": asked.batch_size * at, "length": at})
    seconds = {link.name: link_seconds(link, ordering) for link in LONG_CHAIN}
    return prefixes(asked.task, seconds, LONG_CHAIN)


def walk_lengths(asked, report=print):
    """[Found] for each of links() (module docstring): the longest length each fits beyond the
    longest before it, or its one estimate that did not."""
    found, best, hint = [], 0, None
    for link, switches, notes in links(asked):
        entry = Found(link, switches, notes=notes)
        found.append(entry)
        if switches is None:
            continue
        floor = resident_bytes(switches, asked.costs.parameters, asked.world_size)
        if floor > asked.room:
            entry.past = (asked.granule, "its weights, gradients and optimizer state alone hold "
                                         f"{size_text(floor)}")
            report(f"[longest] {link.name}: not estimated: {entry.past[1]}")
            continue
        first = best + asked.granule
        if first > cap(asked):
            break
        report(f"[longest] {link.name}: {' '.join(argv_of(switches)) or '(no switches)'}")
        search = LengthSearch(asked, switches, report, hint)
        if search.fits(first):
            entry.length, past = search.longest(first)
            best, hint = entry.length, search.slope(entry.length, past) or hint
            entry.record = search.seen[entry.length][0]
        else:
            past = first
        entry.past = past and (past, search.seen[past][1])
        entry.estimates = len(search.seen)
    return found


def answer_text(asked, found, shown_argv, gpu_memory, gpu_name):
    """The answer first (the longest length, its command, host memory and seconds a step), then
    the chain as walked."""
    best = max(found, key=lambda entry: entry.length)  # the first (cheapest) of the longest
    world, lines = asked.world_size, []
    where = (f"{gpu_memory} ({gpu_name} emulated) at batch {asked.batch_size}"
             + (f", on each of {world} GPUs (a batch of texts a GPU, or in all where each text is "
                f"split across them; {SHARDED_MARGIN:.0%} of each GPU kept free)" if world > 1 else ""))
    if not best.length:
        lines.append(f"No sequence of {asked.granule:,} tokens or more fits in {where}, with any "
                     f"{'link' if world > 1 else 'prefix'} of the chain.")
    else:
        record, length = best.record, best.length
        texts = asked.batch_size * (1 if splits_texts(best.switches) else world)  # the --batch-size
        costs = Costs(**{**vars(asked.costs), "tokens": texts * length, "length": length})
        parts = step_time(costs, best.switches, world)
        launch = f"torchrun --nproc_per_node={world} 10_combined.py" if world > 1 else "python 10_combined.py"
        command = " ".join([launch, *shown_argv, "--batch-size", str(texts),
                            *length_argv(asked, length), *argv_of(best.switches)])
        past = best.past and (f"; {best.past[0]:,} tokens do not fit ("
                              + (f"{size_text(best.past[1])} reserved)" if isinstance(best.past[1], int)
                                 else f"{best.past[1]})"))
        lines += [f"The longest sequence that fits in {where}, to {asked.granule:,} tokens: "
                  f"{length:,} tokens, with {best.link.name}"
                  + (":" if world > 1 else " and the links before it:"),
                  f"  {command}",
                  f"  {size_text(record['reserved_bytes'])} reserved, {size_text(record['allocated_bytes'])} "
                  f"allocated{past or ''}",
                  f"  host memory: {size_text(record['host_bytes'])}"
                  + (f" a process, {size_text(record['host_bytes'] * world)} for {world}"
                     if world > 1 else "")
                  + (f" (--host-memory {size_text(asked.host_capacity)})" if asked.host_capacity else ""),
                  f"  a step: {sum(parts.values()):.3g} s by the cost model ({parts_text(parts, costs)})"]
    lines.append(f"\nThe chain for long sequences on {world} GPUs, each link a whole switch set under "
                 "torchrun (texts packed; each link asked one granule past the longest before it):"
                 if world > 1 else
                 f"\nThe chain for long sequences, cheapest first at {at_length(asked):,} tokens "
                 "(texts packed; each prefix asked one granule past the longest before it):")
    for number, entry in enumerate(found, 1):
        sets = " ".join(argv_of([(flag, value) for flag, value in entry.link.sets
                                 if value is not None])) or "(none)"
        if entry.switches is None:
            said = "skipped: " + "; ".join(entry.notes)
        elif entry.length:
            said = f"{entry.length:,} tokens ({entry.estimates} estimates)"
        elif entry.past:
            words = entry.past[1]
            said = (f"not at {entry.past[0]:,} tokens: "
                    + (f"{size_text(words)} reserved" if isinstance(words, int) else words))
        else:
            said = "not asked: the longest length asked is reached"
        lines.append(f"  {number}. {entry.link.name}: {sets}; {said}")
    return "\n".join(lines)


def answer(args, flags, gpu_name, report=print):
    """`python -m estimate ... --gpu-memory SIZE --longest-sequence [GRANULE]`, as printed
    (`gpu_name`: the emulated GPU's, in words): the model read once (its positions, and its
    parameters and its MLPs' for the cost model, on meta)."""
    import torch

    from common.any_model import longest_sequence
    from common.cli import parse_args
    from common.model import model_class, model_config
    from steps import STEPS
    model_argv = [*without(flags, ("--seq-len", "--batch-size")), "--pack"]
    preset = parse_args("", [*model_argv, "--preset", args.preset, "--estimate"]).preset_settings
    config = model_config(preset)
    with torch.device("meta"):
        named = dict(model_class(preset)._from_config(config).named_parameters())
    costs = Costs(sum(tensor.numel() for tensor in named.values()), 0, config.num_hidden_layers,
                  config.hidden_size, getattr(config, "vocab_size", 0),
                  mlp_parameters=sum(tensor.numel() for name, tensor in named.items()
                                     if ".mlp." in name),
                  **({"interconnect": args.interconnect} if args.interconnect else {}))
    asked = Asked(STEPS["10"].path, ["--preset", args.preset, "--device", args.device, *model_argv],
                  args.batch_size or 1, args.capacity, args.gpu, costs, longest_sequence(config),
                  isinstance(getattr(config, "rope_parameters", None), dict), args.host_capacity,
                  args.longest_sequence, world_size=args.stack_world_size,
                  heads=getattr(config, "num_attention_heads", 1))
    found = walk_lengths(asked, report)
    shown = [*(["--preset", args.preset] if args.model is None else []), *model_argv]
    return answer_text(asked, found, shown, args.gpu_memory, gpu_name)
