"""The estimate by blocks: the script run on the model cut to a few periods of its blocks (three
probes), and the whole model's run written from them (synthesis.py writes its trace).

A decoder or encoder is an embedding, blocks that repeat with a period (1 for most; ModernBERT
alternates global and local attention every third layer: its `layer_types` repeat every 3) and
a head. Two optimizer steps on fake tensors spend most of their time in the blocks, so the
estimate runs the same script three times on the model cut to a few periods of blocks (a, a+1
and a+2), and writes the allocation trace of N from them, replayed through the caching
allocator as a whole run's is: the same bytes, the same segments. What is not written comes
from the probes: the parameter count grows by the same number per period (checked on the three).

What no probe shows, the check cannot: a setting that changes a block only beyond the fifth
period (an index list or a threshold, as Qwen3-MoE's `mlp_only_layers` or DeepSeek's
`first_k_dense_replace`) would be missed, so only the architectures the tests check by blocks
(ARCHITECTURES_BY_BLOCKS) are estimated so; every other runs whole.
"""
import copy
from functools import partial

from estimate.collector import frozen
from estimate.fake.run import run_on_fake_tensors
from estimate.shortcuts.sizes import canonical
from estimate.shortcuts.synthesis import NotByBlocks, extend, extend_at_another_size

# the probes' periods of blocks, tried in turn: the first block is unlike the others, and under
# FSDP the last too (it gathers no next block's weights ahead), so a sharded model repeats from 3
PROBES = ((2, 3, 4), (3, 4, 5))
SHARDED_PROBES = ((3, 4, 5),)
FEWEST_PERIODS = 12  # a model with fewer periods runs whole: the probes would save little
# the model types tests/estimate/test_blocks.py checks by blocks against the whole run
ARCHITECTURES_BY_BLOCKS = {"bert", "roberta", "distilbert", "deberta-v2", "modernbert", "gpt2",
                           "llama", "mistral", "qwen2", "bloom", "vit"}


def per_layer_lists(config):
    """The config's settings with one entry per block (transformers' `layer_types`)."""
    count = config.num_hidden_layers
    return {name: value for name, value in vars(config).items()
            if isinstance(value, list) and len(value) == count}


def period_of(config):
    """The fewest blocks after which every per-block setting repeats."""
    count = config.num_hidden_layers
    lists = per_layer_lists(config).values()
    for period in range(1, count + 1):
        if all(value[index] == value[index % period] for value in lists
               for index in range(count)):
            return period
    return count


def cut_for_probe(config, periods_kept):
    """(periods of the whole model, blocks of the whole model, `config` cut to `periods_kept`
    periods and what is left over), or NotByBlocks where the model is too short to gain."""
    if config.model_type not in ARCHITECTURES_BY_BLOCKS:
        raise NotByBlocks(f"{config.model_type} is not among the architectures checked by blocks")
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or count < 1:
        raise NotByBlocks("the model's config has no num_hidden_layers")
    period = period_of(config)
    periods, rest = divmod(count, period)
    if periods < max(FEWEST_PERIODS, periods_kept + 1):
        raise NotByBlocks(f"{periods} periods of blocks: too few to gain from probes")
    return periods, count, cut_to(config, periods_kept * period + rest)


def cut_to(config, blocks):
    """A copy of `config` with its first `blocks` blocks (and their per-block settings)."""
    cut = copy.deepcopy(config)
    for name, value in per_layer_lists(config).items():
        setattr(cut, name, value[:blocks])
    cut.num_hidden_layers = blocks
    return cut


CREATION, TRAINING = ("creation",), ("training",)  # where creation's events start and end


def linear(values, periods, total):
    """A count that grows by the same step per period (checked on the probes), at `total`."""
    steps = {later - earlier for earlier, later in zip(values, values[1:])}
    if len(steps) != 1:
        raise NotByBlocks("a count does not grow by the same step per period")
    return values[0] + steps.pop() * (total - periods[0])


def marked(run):
    """A probe's events with CREATION and TRAINING where model creation's events start and end,
    each run of consecutive frees in the order of its storages (sizes.canonical: the same
    replay in any order; autocast frees its cache of cast weights in the order of a hash table
    of their addresses, which no count of blocks repeats)."""
    events, start, stop = run.trace.events, run.creation_events.start, run.creation_events.stop
    return canonical([*events[:start], CREATION, *events[start:stop], TRAINING, *events[stop:]])


def run_by_blocks(script_path, argv, world_size, gpu, any_batch_size, sharded=False, made=None):
    """A FakeRun of the whole model, written from runs of the model cut to a few periods of its
    blocks (its trace, creation's part of it and the parameter counts); NotByBlocks where the
    model does not repeat so, or is too short to gain. `sharded`: the script shards the model
    (FSDP), whose probes start at 3 periods. `made`: {periods: FakeRun} of probes already run
    (run_at_another_size's, where its rules did not hold), not run again."""
    with frozen():  # once for all the probes, not once each
        return by_blocks(script_path, argv, world_size, gpu, any_batch_size, sharded, made)


def by_blocks(script_path, argv, world_size, gpu, any_batch_size, sharded, made=None):
    """run_by_blocks' work, the garbage collector frozen."""
    runs, failed = dict(made or {}), None
    for periods in SHARDED_PROBES if sharded else PROBES:
        for count in periods:
            if count not in runs:
                runs[count] = run_on_fake_tensors(script_path, argv, world_size, gpu,
                                                  any_batch_size,
                                                  cut=partial(cut_for_probe, periods_kept=count))
                if runs[count].blocks is None:
                    raise NotByBlocks("the script created no model from a config")
        try:
            events = extend([marked(runs[count]) for count in periods], periods,
                            runs[periods[0]].periods)
        except NotByBlocks as problem:
            failed = problem
            continue
        break
    else:
        raise failed
    counted = [runs[count].meter_result for count in periods]
    counts = {name: linear([found[name] for found in counted], periods, runs[periods[0]].periods)
              for name in ("parameter_count", "parameters_held")}
    # what another micro-batch size needs to be written from fewer probes: the two smaller
    # probes' traces here, whose rules the largest has checked (run_at_another_size)
    learned = {"periods": list(periods), "counts": counts,
               "traces": [marked(runs[count]) for count in periods[:2]]}
    whole = written(runs[periods[-1]], events, counts, [runs[count].blocks[1] for count in periods])
    whole.learned = learned
    return whole


def written(run, events, counts, probes):
    """`run`, a probe, made the whole model's FakeRun: `events` (marked), the parameter
    `counts`, the blocks of the `probes` that stood for it."""
    start, stop = events.index(CREATION), events.index(TRAINING)
    total = run.blocks[0]
    run.trace.events = [event for event in events if event not in (CREATION, TRAINING)]
    run.trace.phases = None  # (the memory snapshot runs the whole model: --exact)
    run.creation_events = slice(start, stop - 1)
    run.meter_result = {"peak_memory_bytes": None, "breakdown_bytes": None,  # (a CPU run's: runs whole)
                        **counts}
    run.blocks = (total, probes)
    run.cut = None
    return run


def run_at_another_size(script_path, argv, world_size, gpu, any_batch_size, learned, *, one_probe):
    """A FakeRun of the whole model as run_by_blocks writes it, from runs at this micro-batch
    size and what `learned` (a KeptRun's, of the same script and flags at another size) keeps of
    its probes: their traces, whose rules name each storage by its place, not its bytes
    (synthesis.extend_at_another_size). With `one_probe`, the middle probe alone runs, and what
    checks it is the line of sizes the search draws through it and a run that checked itself
    (shortcuts/sizes.py, search/grid.py); else the two smaller probes run, the smallest the check.
    NotByBlocks where the rules do not hold at this size, with the probes run (`probes`:
    {periods: FakeRun})."""
    periods = learned["periods"]
    counts = periods[1:2] if one_probe else periods[:2]
    runs = {}
    with frozen():
        for count in counts:
            runs[count] = run_on_fake_tensors(script_path, argv, world_size, gpu, any_batch_size,
                                              cut=partial(cut_for_probe, periods_kept=count))
            if runs[count].blocks is None:
                raise NotByBlocks("the script created no model from a config")
    middle = runs[periods[1]]
    try:
        events = extend_at_another_size(learned["traces"], periods, middle.periods, marked(middle),
                                        None if one_probe else marked(runs[periods[0]]))
    except NotByBlocks as problem:
        problem.probes = runs  # for run_by_blocks, which runs the others
        raise
    return written(middle, events, dict(learned["counts"]), [run.blocks[1] for run in runs.values()])
