"""The estimate by blocks, its trace: the trace of a model of N repeated blocks written from the
traces of runs with a few of them (blocks.py makes those runs, the probes of a, a+1 and a+2
periods):

1. the trace of a+1 periods is the trace of a with, at a few places, one unit more: a block's
   forward, its backward, its parameters' share of each optimizer operation. `insertions`
   finds them by walking both traces (events compared by kind, bytes, device and category);
2. around each place the unit repeats: a region of M copies. Every event is then either in a
   region (which copy, where in it) or fixed. Each free, resize or relabel refers to a storage
   allocated earlier; `learn` finds, for each such event of the two smaller probes, the rule
   that names its storage in both: a fixed storage, or a copy counted from the region's start or end, or
   from the event's own copy, the same way round or mirrored (backward frees the last block's
   first). Where no rule holds for a region, its unit may start a few events late (alike in
   size, not in meaning): the region then starts earlier, an event at a time, while its copies
   stay alike;
3. `synthesise` writes the trace with any number of copies per region from those rules. It is
   checked first on the largest probe, which the rules were not learned from: if that is not
   the probe's own trace, event for event, the estimate runs the whole model instead.
"""
from collections import defaultdict

from estimate.replay.trace import ALLOC, FREE, LABEL, RESIZE
from estimate.shortcuts import sizes

MOST_MOVES = 64  # events by which extend moves regions' starts in all, each move a learn (ms)
MOST_TRIES = 512  # places insertions tries in all (a unit may be followed closely by another)


class NotByBlocks(Exception):
    """The model or its trace does not repeat as the estimate by blocks needs: run it whole."""


def signature(event, sizes):
    """An event as compared between traces: what it does, not which storage it names."""
    kind = event[0]
    if kind == ALLOC:
        return event[0], event[2], event[3], event[4]
    if kind == FREE:
        return kind, sizes.get(event[1])
    if kind == RESIZE:
        return kind, event[2]
    if kind == LABEL:
        return kind, event[2]
    return event


def signatures(events):
    sizes, found = {}, []
    for event in events:
        if event[0] == ALLOC:
            sizes[event[1]] = (event[2], event[4])
        found.append(signature(event, sizes))
    return found


def insertions(shorter, longer, agree=16):
    """[(position in `longer`, length)]: the runs of events `longer` has beyond `shorter`, each a
    repetition of the events just before it, after which both go on alike (for `agree` events
    at least, or to the end, or up to the next such run: a unit's copy in the optimizer's state
    and another in its temporaries' frees may lie a few events apart). NotByBlocks if the
    traces differ otherwise. extend() checks the units found on the largest probe, event for
    event, so a wrong choice shows there and the model runs whole."""
    budget, tries, failed = len(longer) - len(shorter), MOST_TRIES, set()

    def agreeing(i, j):  # events alike from shorter[i] and longer[j] on (up to `agree`)
        count = 0
        while count < agree and i + count < len(shorter) and j + count < len(longer) \
                and shorter[i + count] == longer[j + count]:
            count += 1
        return count

    def search(i, j):  # the places from shorter[i] and longer[j] on, or None
        nonlocal tries
        tries -= 1
        if tries < 0:
            raise NotByBlocks("the larger probe's trace has too many ways to be the smaller one's")
        while i < len(shorter) and j < len(longer) and shorter[i] == longer[j]:
            i, j = i + 1, j + 1
        if i == len(shorter) and j == len(longer):
            return []
        if (i, j) in failed:
            return None
        check, left = min(len(shorter) - i, agree), budget - (j - i)  # (events not yet placed)
        near = []  # lengths whose repetition agrees for fewer events: another unit follows
        for length in range(1, min(left, j) + 1):
            if longer[j - length:j] != longer[j:j + length]:
                continue
            alike = agreeing(i, j + length)
            if alike == check and (check or j + length == len(longer)):
                found = search(i, j + length)  # the usual case: one place
                if found is not None:
                    return [(j, length), *found]
            elif alike:
                near.append(length)
        for length in near:
            found = search(i, j + length)
            if found is not None:
                return [(j, length), *found]
        failed.add((i, j))
        return None

    found = search(0, 0)
    if found is None:
        raise NotByBlocks("the larger probe's trace is not the smaller one's with repeated units")
    return found


def regions(sequence, places):
    """For each inserted (position, length): (start, copies, length) of the copies of that unit
    that end where the insertion ends, as far back as they repeat."""
    found = []
    for position, length in places:
        end = position + length
        start = end - length
        while start - length >= 0 and sequence[start - length:start] == sequence[start:start + length]:
            start -= length
        found.append((start, (end - start) // length, length))
    return found


def coordinates(sequence_length, found):
    """Each event's place: ("r", region, copy, offset) or ("f", index among the fixed events)."""
    places, fixed, index = [None] * sequence_length, 0, 0
    starts = sorted((start, number, copies, length)
                    for number, (start, copies, length) in enumerate(found))
    position = 0
    for start, number, copies, length in starts:
        if start < position:
            raise NotByBlocks("repeated regions overlap")
        for index in range(position, start):
            places[index] = ("f", fixed)
            fixed += 1
        for offset in range(copies * length):
            places[start + offset] = ("r", number, offset // length, offset % length)
        position = start + copies * length
    for index in range(position, sequence_length):
        places[index] = ("f", fixed)
        fixed += 1
    return places


class Probe:
    """One probe's trace, seen as fixed events and regions of repeated units."""

    def __init__(self, events, periods, found):
        self.events, self.periods = events, periods
        self.found = found  # [(start, copies, length)] per region
        self.places = coordinates(len(events), found)
        self.allocated_at = {}  # storage -> its allocation's place
        for event, place in zip(events, self.places):
            if event[0] == ALLOC:
                self.allocated_at[event[1]] = place

    def copies(self, region):
        return self.found[region][1]

    def references(self):
        """(place of the event, place of the allocation it names) for each free, resize, label."""
        for event, place in zip(self.events, self.places):
            if event[0] in (FREE, RESIZE, LABEL):
                target = self.allocated_at.get(event[1])
                if target is None:
                    raise NotByBlocks("an event names a storage allocated before the trace")
                yield place, target


def rule_candidates(place, target, probe):
    """The rules (kind, region, shift, offset) that name `target`, a copy in a region, from
    `place` in `probe`: counted from the region's start or end, or from the event's own copy."""
    _, region, copy_index, offset = target
    last = probe.copies(region) - 1
    rules = {("first", region, copy_index, offset), ("last", region, last - copy_index, offset)}
    if place[0] == "r":
        own = place[2]
        rules |= {("same", region, copy_index - own, offset),
                  ("mirror", region, copy_index - (probe.copies(place[1]) - 1 - own), offset)}
    return rules


def source_class(place):
    """The events that share a rule: a fixed event, or an offset in a region's copies."""
    return place if place[0] == "f" else ("r", place[1], place[3])


ORDER = ("same", "mirror", "first", "last")


def copy_named(rule, place, copies):
    """The index of the copy a rule names from `place` (outside the region where it names a
    fixed event before or after it: the first block's, whose events are not a copy)."""
    kind, region, shift = rule[:3]
    if kind == "first":
        return shift
    if kind == "last":
        return copies[region] - 1 - shift
    if kind == "same":
        return place[2] + shift
    return copies[place[1]] - 1 - place[2] + shift  # mirror


def fit_rule(seen):
    """One rule for the references `seen` [(place, target, probe)] of one source class: a fixed
    storage, or a copy named as rule_candidates names them, with the fixed storages it names
    beyond the region's ends (by how far beyond); NotByBlocks if none holds in every probe."""
    targets = {target for _, target, _ in seen}
    if len(targets) == 1 and next(iter(targets))[0] == "f":
        return ("fixed", next(iter(targets))[1])
    candidates = None
    for place, target, probe in seen:
        if target[0] == "r":
            found = rule_candidates(place, target, probe)
            candidates = found if candidates is None else candidates & found
    for rule in sorted(candidates or (), key=lambda rule: (ORDER.index(rule[0]), rule[1:])):
        beyond, holds = {}, True
        for place, target, probe in seen:
            copies = [count for _, count, _ in probe.found]
            index, count = copy_named(rule, place, copies), copies[rule[1]]
            if 0 <= index < count:
                holds = target == ("r", rule[1], index, rule[3])
            else:
                edge = index if index < 0 else index - count
                holds = target[0] == "f" and beyond.setdefault(edge, target[1]) == target[1]
            if not holds:
                break
        if holds:
            return (*rule, beyond)
    raise NotByBlocks("a storage is named differently from copy to copy")


class NoRule(NotByBlocks):
    """No rule names a storage in every copy; `regions`: the regions involved (the events',
    then those of the storages they name), any of which may be the one found misaligned."""

    def __init__(self, regions):
        super().__init__("a storage is named differently from copy to copy (regions "
                         f"{', '.join(map(str, regions))})")
        self.regions = regions


def learn(probes):
    """{source class: rule} that holds in every probe, or NoRule (NotByBlocks where the failing
    events lie in no region)."""
    seen = defaultdict(list)
    for probe in probes:
        for place, target in probe.references():
            seen[source_class(place)].append((place, target, probe))
    rules = {}
    for key, found in seen.items():
        try:
            rules[key] = fit_rule(found)
        except NotByBlocks:
            regions = [key[1]] if key[0] == "r" else []
            regions += [target[1] for _, target, _ in found if target[0] == "r"]
            if not regions:
                raise
            raise NoRule(list(dict.fromkeys(regions))) from None
    return rules


def target_place(rule, place, copies):
    if rule[0] == "fixed":
        return ("f", rule[1])
    index, count = copy_named(rule, place, copies), copies[rule[1]]
    if 0 <= index < count:
        return ("r", rule[1], index, rule[3])
    edge = index if index < 0 else index - count
    if edge not in rule[4]:
        raise NotByBlocks("a rule names a copy beyond its region that no probe showed")
    return ("f", rule[4][edge])


def synthesise(template, rules, periods):
    """The events of the model with `periods` periods, from the `template` probe: each region
    with as many more copies as periods are added, storages numbered in order of allocation."""
    extra = periods - template.periods
    copies = [found_copies + extra for _, found_copies, _ in template.found]
    if min(copies) < 1:
        raise NotByBlocks("fewer periods than a region needs")
    fixed = [event for event, place in zip(template.events, template.places) if place[0] == "f"]
    units = [template.events[start:start + length] for start, _, length in template.found]
    starts = sorted(range(len(template.found)), key=lambda number: template.found[number][0])
    fixed_before = {}  # region -> fixed events before it
    for number in starts:
        start = template.found[number][0]
        fixed_before[number] = sum(1 for place in template.places[:start] if place[0] == "f")
    events, storage_of, numbers = [], {}, iter(range(10**12))

    def emit(event, place):
        if event[0] == ALLOC:
            storage = storage_of[place] = next(numbers)
            events.append((ALLOC, storage, *event[2:]))
        elif event[0] in (FREE, RESIZE, LABEL):
            target = target_place(rules[source_class(place)], place, copies)
            if target not in storage_of:
                raise NotByBlocks("a rule names a storage not yet allocated")
            events.append((event[0], storage_of[target], *event[2:]))
        else:
            events.append(event)

    done = 0
    for number in starts:
        for index in range(done, fixed_before[number]):
            emit(fixed[index], ("f", index))
        done = fixed_before[number]
        for copy_index in range(copies[number]):
            for offset, event in enumerate(units[number]):
                emit(event, ("r", number, copy_index, offset))
    for index in range(done, len(fixed)):
        emit(fixed[index], ("f", index))
    return events


def renumbered(events):
    """`events` with storages numbered in order of allocation (to compare two traces)."""
    numbers, found = {}, []
    for event in events:
        if event[0] == ALLOC:
            numbers[event[1]] = len(numbers)
        if event[0] in (ALLOC, FREE, RESIZE, LABEL):
            found.append((event[0], numbers.get(event[1]), *event[2:]))
        else:
            found.append(event)
    return found


def learned(traces, periods):
    """(the regions of the middle probe, {source class: rule}) from `traces` of `periods` (three
    consecutive counts), or NotByBlocks. The two smaller probes give the rules (each region has
    a copy more in the middle one), and the largest, written from them, is the check: event for
    event (without a third trace, the two smaller probes' rules are learned again, unchecked:
    extend_at_another_size's, which a check has passed)."""
    shapes = [signatures(events) for events in traces]
    places = insertions(shapes[0], shapes[1])
    middle = regions(shapes[1], places)
    if len(traces) > 2 and [(copies + 1, length) for _, copies, length in middle] != [
            (copies, length) for _, copies, length in regions(shapes[2], insertions(shapes[1], shapes[2]))]:
        raise NotByBlocks("the regions do not grow by one copy per period")
    # the smallest probe's regions: the middle one's, one copy fewer, before the units inserted
    shifts = [sum(length for _, length in places[:number]) for number in range(len(places))]
    moved = [0] * len(middle)  # events each region starts earlier than found (below)
    while True:
        found = [(start - back, copies, length) for (start, copies, length), back in zip(middle, moved)]
        smallest = [(start - shift, copies - 1, length)
                    for (start, copies, length), shift in zip(found, shifts)]
        template = Probe(traces[1], periods[1], found)
        try:
            rules = learn([Probe(traces[0], periods[0], smallest), template])
            break
        except NoRule as problem:
            # a found region's unit may start where its events repeat but their meaning does
            # not: Adafactor's step for Llama ends each copy with the next block's first
            # temporaries, and the last copy with the final norm's, alike in size. The first
            # region involved that can starts an event earlier, its copies still alike
            number = next((number for number in problem.regions
                           if moved[number] + 1 < found[number][2]
                           and movable(shapes[1], found, number)
                           and movable(shapes[0], smallest, number)), None)
            if number is None or sum(moved) >= MOST_MOVES:
                raise
            moved[number] += 1
    if len(traces) > 2 and synthesise(template, rules, periods[2]) != renumbered(traces[2]):  # check
        raise NotByBlocks("the largest probe is not what the smaller ones predict")
    return found, rules


def extend(traces, periods, total):
    """The events of `total` periods from `traces` of `periods` (three consecutive counts), or
    NotByBlocks (learned)."""
    found, rules = learned(traces, periods)
    return synthesise(Probe(traces[1], periods[1], found), rules, total)


def extend_at_another_size(traces, periods, total, middle, smallest):
    """The events of `total` periods at another micro-batch size, from the middle probe's trace
    at that size (`middle`) and the rules `traces` (the two smaller probes' at the size they ran,
    where the largest checked them) give. The rules name storages by place, not by bytes, so
    they hold at any size where the events do: `middle` must make the same events as there but
    for their bytes, each copy of a region alike; the byte counts come from `middle`, a copy's
    from its region's first. With `smallest` (else None), the smaller probe's trace at this
    size, the check: it must be what the rules write from `middle` with a period fewer, event for
    event (a byte count that grows with the periods and the size together, hidden at the first
    size by rounding, shows there unless the rounding hides it in both probes here too).
    Without it, the line of sizes (sizes.Family) through a run checked by itself, this one and a
    third is what shows such a count. Else NotByBlocks."""
    found, rules = learned(traces, periods)
    if not sizes.alike(sizes.canonical(middle), sizes.canonical(traces[1])):
        raise NotByBlocks("the middle probe makes other events at this size")
    shape = signatures(middle)
    for start, copies, length in found:
        unit = shape[start:start + length]
        if any(shape[start + copy * length:start + (copy + 1) * length] != unit
               for copy in range(1, copies)):
            raise NotByBlocks("a region's copies differ at this size")
    template = Probe(middle, periods[1], found)
    if smallest is not None and sizes.canonical(synthesise(template, rules, periods[0])) != sizes.canonical(
            renumbered(smallest)):  # the check (frees of a run in one order, as sizes.py's)
        raise NotByBlocks("the smallest probe at this size is not what the middle one predicts")
    return synthesise(template, rules, total)


def movable(sequence, found, number):
    """Whether region `number` of `found` [(start, copies, length)] in `sequence` can start an
    event earlier: after the end of the region before it, its copies still alike (the event
    before it is the last of its unit)."""
    start, _, length = found[number]
    before = max((begin + copies * size for begin, copies, size in found if begin < start),
                 default=0)
    return start - 1 >= before and sequence[start - 1] == sequence[start + length - 1]
