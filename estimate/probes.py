"""The estimate by blocks, its runs: the script run on the model cut to a few periods of its
blocks (three probes), and the whole model's run written from them (blocks.py writes the trace)."""
from estimate.blocks import PROBES, SHARDED_PROBES, NotByBlocks, extend
from estimate.fake_run import collector_frozen, run_on_fake_tensors

CREATION, TRAINING = ("creation",), ("training",)  # where creation's events start and end


def linear(values, periods, total):
    """A count that grows by the same step per period (checked on the probes), at `total`."""
    steps = {later - earlier for earlier, later in zip(values, values[1:])}
    if len(steps) != 1:
        raise NotByBlocks("a count does not grow by the same step per period")
    return values[0] + steps.pop() * (total - periods[0])


def marked(run):
    """A probe's events with CREATION and TRAINING where model creation's events start and end."""
    events, start, stop = run.trace.events, run.creation_events.start, run.creation_events.stop
    return [*events[:start], CREATION, *events[start:stop], TRAINING, *events[stop:]]


def run_by_blocks(script_path, argv, world_size, gpu, any_batch_size, sharded=False):
    """A FakeRun of the whole model, written from runs of the model cut to a few periods of its
    blocks (its trace, creation's part of it and the parameter counts); NotByBlocks where the
    model does not repeat so, or is too short to gain. `sharded`: the script shards the model
    (FSDP), whose probes start at 3 periods."""
    with collector_frozen():  # once for all the probes, not once each
        return by_blocks(script_path, argv, world_size, gpu, any_batch_size, sharded)


def by_blocks(script_path, argv, world_size, gpu, any_batch_size, sharded):
    """run_by_blocks' work, the garbage collector frozen."""
    runs, failed = {}, None
    for periods in SHARDED_PROBES if sharded else PROBES:
        for count in periods:
            if count not in runs:
                runs[count] = run_on_fake_tensors(script_path, argv, world_size, gpu,
                                                  any_batch_size, probe=count)
                if runs[count].blocks is None:
                    raise NotByBlocks("the script created no model from a config")
        total = runs[periods[0]].blocks[0]
        try:
            events = extend([marked(runs[count]) for count in periods], periods,
                            runs[periods[0]].periods)
        except NotByBlocks as problem:
            failed = problem
            continue
        break
    else:
        raise failed
    start, stop = events.index(CREATION), events.index(TRAINING)
    whole = runs[periods[-1]]
    whole.trace.events = [event for event in events if event not in (CREATION, TRAINING)]
    whole.trace.phases = None  # (the memory snapshot runs the whole model: --exact)
    whole.creation_events = slice(start, stop - 1)
    counted = [runs[count].meter_result for count in periods]
    whole.meter_result = {
        "peak_memory_bytes": None, "breakdown_bytes": None,  # (a CPU run's: runs whole)
        **{name: linear([found[name] for found in counted], periods, whole.periods)
           for name in ("parameter_count", "parameters_held")}}
    whole.blocks = (total, [runs[count].blocks[1] for count in periods])
    whole.probe = None
    return whole
