"""The stack's walk: the first prefix of the chain (estimate/stack.py) whose run fits, searched for
its largest micro-batch, and the adapters' answers beside it.

With several GPUs (--world-size N above 1) the walk weighs sharding against one GPU by time.
A step's seconds (step_time, costs.py) are the plain step of the tokens one GPU runs (batch/N
of them when sharded), what its switches add, priced as the one-GPU links price them, and when
sharded the interconnect's bytes: the weights all-gathered and the gradients reduce-scattered each
micro-batch, (N-1)/N of 2 bytes a parameter each, twice gathered under ZeRO-3 (FSDP's default)
and once under ZeRO-2 (--reshard-after-forward false). SHARDED_CHAIN's links (each a whole
switch set: Adam exact first, then with the switches 10_combined.py takes beside sharding, in
GROUPS' order) are tried cheapest first; a sharded fit keeps SHARDED_MARGIN of the GPU free.
The first that fits is searched and priced at the micro-batches it needs; a later sharded link
whose step could cost less (priced at one micro-batch a GPU, its least) is tried too, and the
cheaper kept. Then the one-GPU chain: its first prefix that fits in fewer seconds a step than
that answer replaces it; a prefix that cannot (priced before its estimate) is not estimated.
Where no sharded link fits, the chain is walked as with one GPU. The printed chain gives each
link's seconds, and the answer says why it won.
"""
from dataclasses import dataclass, field
from functools import partial

from estimate.output import in_order, size_text, took_text
from estimate.question import Question
from estimate.search.costs import chain_seconds, least, parts_text, sharded_links, step_time
from estimate.search.fit import Fit, accumulation_for, search
from estimate.search.grid import bytes_per_sample
from estimate.stack import ACTIVATION_FLAGS, ADAPTERS, SHARDED_MARGIN, Link, argv_of, prefixes, resident_bytes


@dataclass
class Answer:
    """The stack found: the prefix that fits, its search, and every prefix tried."""
    link: Link | None = None
    switches: list = field(default_factory=list)
    fit: Fit | None = None
    world_size: int = 1
    parameters: int = 0  # the model's, from the first estimate (for the cost model)
    tried: list = field(default_factory=list)  # (link, switches, notes, reserved or problem)
    search: tuple = ()  # search()'s arguments for the prefix that fits
    host_bytes: int = 0  # the host memory a process of the answer holds (--offload's shards)
    why: str = ""  # why it and not the other chain, where sharding was weighed against one GPU
    estimated: int = 0  # the prefixes estimated, and those whose estimate failed (their problems)
    failures: list = field(default_factory=list)


def walk(script, base_argv, batch_size, world_size, capacity, task, gpu, report=print, jobs=1,
         searched=True, costs=None, parameters=0, host_capacity=None):
    """The first prefix of CHAIN whose run fits `batch_size` in `capacity`, searched (unless not
    `searched`) for its largest micro-batch per GPU, up to the batch; `base_argv`: the model's
    flags without --batch-size. With `world_size` above 1, SHARDED_CHAIN's links first (a fit
    keeping SHARDED_MARGIN free), and with `costs` (a Costs: the chain ordered by it) the
    quicker of the sharded answer and a one-GPU prefix (the module's docstring), the sharded
    answer searched to price it. Up to `jobs` prefixes are estimated at a time, in order; with
    the model's `parameters`, a prefix whose resident_bytes exceed its room is not."""
    run = Walk(script, base_argv, batch_size, world_size, capacity, gpu, report, jobs, host_capacity,
               Answer(parameters=parameters))
    chain = prefixes(task, costs and chain_seconds(costs.parameters, costs.tokens,
                                                   (costs.layers, costs.hidden, costs.vocabulary)))
    sharded = ([(link, list(link.sets), []) for link in sharded_links(costs, world_size)
                if task == "causal-lm" or not link.causal_lm_only] if world_size > 1 else [])
    if costs is None or not sharded:  # nothing to weigh: the first that fits, in order
        found = run.first_fit([*sharded, *chain])
        return run.answered(found and run.candidate(found, searched))
    found = run.first_fit(sharded)
    if found is None:  # no sharded link fits: the one-GPU chain, as on one GPU
        found = run.first_fit(chain)
        best = found and run.candidate(found, searched)
        if best:
            best["why"] = (f"no sharded link fits in {size_text(run.room(world_size))} "
                           f"({SHARDED_MARGIN:.0%} of --gpu-memory kept free)")
        return run.answered(best)
    best = run.candidate(found, True, costs)
    for link, switches, notes in sharded[after(sharded, found[0]):]:  # quicker in fewer micro-batches?
        if link.group != best["link"].group or least(costs, switches, world_size) >= best["total"]:
            break  # the rest cannot be quicker: ordered by their least
        other = run.first_fit([(link, switches, notes)])
        other = other and run.candidate(other, True, costs)
        if other and other["total"] < best["total"]:
            report(f"[stack] {link.name}: {other['total']:.3g} s a step, under {best['link'].name}'s "
                   f"{best['total']:.3g} s at the micro-batches each fits")
            best = other
    sharded_best, rest = best, chain

    def slower(link, switches):  # a one-GPU prefix that cannot be quicker is not estimated
        seconds = least(costs, switches, run.world(link))
        return seconds >= sharded_best["total"] and (
            f"not estimated: its step takes {seconds:.3g} s at the least, not under "
            f"{sharded_best['link'].name}'s {sharded_best['total']:.3g} s")
    while rest:  # the one-GPU chain's first prefix that fits in less time
        found = run.first_fit(rest, slower)
        if found is None:
            break
        other = run.candidate(found, True, costs)
        if other["total"] < best["total"]:
            best = other
            break
        report(f"[stack] {found[0].name}: fits, but its step takes {other['total']:.3g} s at the "
               f"micro-batches it fits, not under {best['total']:.3g} s")
        rest = rest[after(rest, found[0]):]
    best["why"] = why(best, sharded_best, chain, costs, world_size)
    return run.answered(best)


def after(entries, link):
    """The index past `link` in `entries` ((link, switches, notes))."""
    return next(index for index, (other, _, _) in enumerate(entries) if other is link) + 1


def why(best, sharded, chain, costs, world_size):
    """The answer's reason, when the sharded answer was weighed against the one-GPU chain."""
    def on(world):
        return f"on each of {world} GPUs" if world > 1 else "on one GPU"
    said = f"{best['total']:.3g} s a step {on(best['world_size'])} ({parts_text(best['seconds'], costs)})"
    if best is not sharded:
        return (f"{said}, against {sharded['total']:.3g} s for {sharded['link'].name} "
                f"{on(world_size)} ({parts_text(sharded['seconds'], costs)})")
    steps = [(least(costs, switches, world_size if link.sharded else 1), link.name,
              world_size if link.sharded else 1) for link, switches, _ in chain if switches is not None]
    seconds, name, world = min(steps)
    quicker = sum(1 for step, _, _ in steps if step < best["total"])
    return said + "; " + (f"every prefix of the one-GPU chain takes longer (the quickest: {name}, "
                          f"{seconds:.3g} s {on(world)})" if not quicker else
                          f"none of the {quicker} prefixes of the one-GPU chain that could take less "
                          "fits in less")


class Walk:
    """One walk's question, and its answer as it goes (answer.tried: each prefix tried)."""

    def __init__(self, script, base_argv, batch_size, world_size, capacity, gpu, report, jobs,
                 host_capacity, answer):
        self.script, self.base_argv, self.batch_size = script, base_argv, batch_size
        self.world_size, self.capacity, self.gpu = world_size, capacity, gpu
        self.report, self.jobs, self.host_capacity, self.answer = report, jobs, host_capacity, answer

    def world(self, link):
        return self.world_size if link.sharded else 1

    def room(self, world):
        """What a run on `world` GPUs may reserve: --gpu-memory, less SHARDED_MARGIN when sharded."""
        return int(self.capacity * (1 - SHARDED_MARGIN)) if world > 1 else self.capacity

    def planned(self, entries, slower=None):
        """Each entry (link, switches, notes) with its plan: (its Question, the micro-batch) to
        estimate, or the words why not (None: skipped by the task)."""
        plans = []
        for link, switches, notes in entries:
            world = self.world(link)
            floor = switches is not None and resident_bytes(switches, self.answer.parameters, world)
            if switches is None:
                plan = None
            elif slower and slower(link, switches):
                plan = slower(link, switches)
            elif floor > self.room(world):
                plan = ("not estimated: its weights, gradients and optimizer state alone hold "
                        f"{size_text(floor)}")
            else:
                accumulates = ("--optimizer-in-backward", True) not in switches
                plan = (Question(self.script, [*self.base_argv, *argv_of(switches)], world,
                                 self.gpu, accumulates),
                        1 if accumulates else self.batch_size // world)
            plans.append((link, switches, notes, plan))
        return plans

    def first_fit(self, entries, slower=None):
        """The first of `entries` whose run fits, as (link, switches, record, plan), or None;
        estimated up to `jobs` at a time, in order; `slower(link, switches)`: the words why one
        is not estimated, or False. Each is reported and added to answer.tried."""
        plans = self.planned(entries, slower)
        outcomes = in_order(answered, [plan for *_, plan in plans if isinstance(plan, tuple)],
                            self.jobs, lambda: "during the stack's walk: no stack")
        for link, switches, notes, plan in plans:
            if not isinstance(plan, tuple):  # skipped by the task, its floor or its time (words)
                self.answer.tried.append((link, switches, notes, plan))
                if plan:
                    self.report(f"[stack] {link.name}: {plan}")
                continue
            question, micro = plan
            world = question.world_size
            record, problem, took = next(outcomes)
            reserved = record and record["reserved_bytes"]
            self.answer.parameters = self.answer.parameters or (record or {}).get("parameter_count", 0)
            self.answer.tried.append((link, switches, notes, reserved if record else problem))
            self.answer.estimated += 1
            self.answer.failures += [] if record else [f"{link.name}: {problem}"]
            room = (f" of {size_text(self.room(world))} (--gpu-memory less the sharded margin, "
                    f"{SHARDED_MARGIN:.0%})" if world > 1 else "")
            self.report(f"[stack] {link.name}: " + (f"{size_text(reserved)} reserved at micro-batch "
                                                    f"{micro}{room}" if record else f"failed: {problem}")
                        + f" ({took_text(took)})")
            if record is None or reserved > self.room(world) or self.batch_size % world:
                continue
            host = record["host_bytes"] * world  # the processes of one machine
            if self.host_capacity is not None and host > self.host_capacity:
                self.report(f"[stack] {link.name}: needs {size_text(host)} of host memory, above "
                            f"--host-memory ({size_text(self.host_capacity)})")
                self.answer.tried[-1] = (link, switches, notes, f"needs {size_text(host)} of host memory")
                continue
            outcomes.close()  # the later prefixes are not needed: their estimates stop
            return link, switches, record, plan
        return None

    def candidate(self, found, searched, costs=None):
        """A prefix that fits as an answer: its search's arguments, its Fit where `searched`, and
        with `costs` its step's seconds at the micro-batches it fits."""
        link, switches, record, (question, micro) = found
        world = question.world_size
        task = (question, self.room(world), {micro: (record["allocated_bytes"], record["reserved_bytes"])},
                self.batch_size // world, bytes_per_sample(record, micro))
        best = {"link": link, "switches": switches, "world_size": world, "search": task,
                "host_bytes": record["host_bytes"], "fit": None}
        if searched:
            best["fit"] = settle(("search", task), self.batch_size)
        if costs and best["fit"]:
            best["seconds"] = step_time(costs, switches, world, micro_batches(best["fit"]))
            best["total"] = sum(best["seconds"].values())
        return best

    def answered(self, best):
        """The answer, made of the candidate `best` (None: none fits)."""
        for name in ("link", "switches", "world_size", "search", "host_bytes", "fit", "why"):
            if best and name in best:
                setattr(self.answer, name, best[name])
        return self.answer


def micro_batches(fit):
    """The micro-batches a GPU runs a step, as command() splits the batch."""
    if not fit.accumulates:
        return 1
    return (fit.largest and accumulation_for(fit)) or fit.batch_size // fit.world_size


def answered(plan):
    """A plan's (question, micro-batch) answer (a worker process is sent this function by name)."""
    question, micro = plan
    return question.answer(micro)


def settle(task, batch_size):
    """The Fit of a search task: ("search", search()'s arguments), or ("adapter", (question,
    capacity, label)), estimated at micro-batch 1 first (its problem if that fails);
    module-level, for the worker processes."""
    kind, arguments = task
    if kind == "search":
        fit = search(*arguments)
        fit.batch_size, fit.world_size = batch_size, arguments[0].world_size
        return fit
    question, capacity, label = arguments
    record, problem, seconds = question.answer(1)
    print(f"[stack] {label}: "
          + (size_text(record["reserved_bytes"]) if record else "failed") + f" ({took_text(seconds)})",
          flush=True)
    if record is None:
        return problem
    known = {1: (record["allocated_bytes"], record["reserved_bytes"])}
    fit = (search(question, capacity, known, batch_size, bytes_per_sample(record, 1))
           if record["reserved_bytes"] <= capacity else Fit(question.name, True, tried=known))
    fit.batch_size, fit.world_size, fit.capacity = batch_size, 1, capacity
    return fit


def answer_all(script, base_argv, batch_size, world_size, capacity, task, gpu, jobs=1, report=print,
               costs=None, parameters=0, host_capacity=None, answered=None):
    """The stack (walk, its chain ordered and weighed by `costs`, its prefixes floored by
    `parameters`) and the adapters' answers, their searches up to `jobs` at a time; the stack's
    answer, searched, is given to `answered` as soon as it is known, before the adapters' end."""
    answer = walk(script, base_argv, batch_size, world_size, capacity, task, gpu, report, jobs,
                  searched=False, costs=costs, parameters=parameters, host_capacity=host_capacity)
    activation = activation_switches(answer)
    switch_sets = [[*activation, *adapter] for adapter in ADAPTERS]
    tasks = [("adapter", (Question(script, [*base_argv, *argv_of(switches)], 1, gpu, True), capacity,
                          " ".join(argv_of(switches)))) for switches in switch_sets]
    unsearched = answer.link is not None and answer.fit is None  # a weighed answer was searched
    if unsearched:
        tasks.insert(0, ("search", answer.search))
    results = in_order(partial(settle, batch_size=batch_size), tasks, jobs,
                       lambda: "during the stack's searches: no stack")
    if unsearched:  # (the first task: the adapters' go on beside it)
        answer.fit = next(results)
    if answered:
        answered(answer)
    fits = list(results)
    adapter_answers = [(switches, None, fit) if isinstance(fit, str) else (switches, fit, None)
                       for switches, fit in zip(switch_sets, fits)]
    return answer, adapter_answers


def activation_switches(answer):
    """The answer's activation switches (the last prefix's when none fits), for the adapters."""
    switches = answer.switches or next((sw for link, sw, _, _ in reversed(answer.tried)
                                        if sw is not None and not link.sharded), [])
    return [(flag, value) for flag, value in switches if flag in ACTIVATION_FLAGS]
