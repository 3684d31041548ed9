"""What a fake run leaves for the prediction: its allocation trace and the few counts beside it.

A prediction is a fake run (fake_run.py, or the probes of probes.py) and a replay of its trace
through the caching allocator for the GPU asked (predict.py). The run is the slow part (seconds);
the replay takes milliseconds. A KeptRun holds what the replay and the record need, so that it
can be kept on disk (cache.py) and replayed for every GPU whose properties the run did not read
differently (gpu_read), for every --gpu-memory, and written for other micro-batch sizes
(sizes.py).
"""
from dataclasses import dataclass, field, fields


@dataclass
class KeptRun:
    script: str
    emulate_cuda: bool
    record: dict                # what the script reported: preset, model, world size, batch, ...
    events: list                # the training steps' allocation events (allocation_trace.py)
    creation: list              # model creation's events
    parameter_count: int
    parameters_held: int
    offloaded: bool = False     # FSDP keeps the sharded state in host memory
    compiled: bool = False
    compiled_eagerly: bool = False
    fused: bool = True          # compiled: pointwise operations fused (compiled.py)
    unfused_events: list = None  # compiled: the training events with nothing fused (the bound)
    batch_bytes: int = 0
    blocks: list = None         # [blocks of the model, [blocks of each probe]] (blocks.py)
    cpu_figures: dict = None    # without GPU emulation: the meter's own peak, breakdown, creation
    gpu_read: dict = field(default_factory=dict)  # what the run read of its GPU (gpu_choices.ReadGpu)
    size_choices: list = field(default_factory=list)  # choices made by the micro-batch's size
    phases: list = None         # each training event's part of the step (a whole run's only)

    def to_dict(self):
        return {item.name: getattr(self, item.name) for item in fields(self)}

    @classmethod
    def from_dict(cls, values):
        known = {item.name for item in fields(cls)}
        kept = cls(**{name: value for name, value in values.items() if name in known})
        kept.events, kept.creation = as_events(kept.events), as_events(kept.creation)
        if kept.unfused_events is not None:
            kept.unfused_events = as_events(kept.unfused_events)
        return kept


def as_events(items):
    """Events as the trace holds them (tuples), from JSON's lists."""
    return [tuple(item) for item in items]


def from_fake_run(run, unfused_run=None, fused=True):
    """The KeptRun of a FakeRun (fake_run.py); `unfused_run`: the same compiled run with nothing
    fused, for the bound above a compiled prediction."""
    cpu = None
    if not run.emulate_cuda:
        cpu = {"peak_bytes": run.meter_result["peak_memory_bytes"],
               "breakdown_bytes": run.meter_result["breakdown_bytes"],
               "creation_peak_bytes": run.creation.peak_bytes if run.creation else 0,
               "unfused_peak_bytes": unfused_run and unfused_run.meter_result["peak_memory_bytes"]}
    return KeptRun(
        script=run.script, emulate_cuda=run.emulate_cuda, record=dict(run.record),
        events=list(run.training_events()), creation=list(run.trace.events[run.creation_events]),
        parameter_count=run.meter_result["parameter_count"],
        parameters_held=run.meter_result["parameters_held"], offloaded=run.offloaded,
        compiled=run.compiled, compiled_eagerly=run.compiled_eagerly, fused=fused,
        unfused_events=list(unfused_run.training_events()) if unfused_run else None,
        batch_bytes=run.batch_bytes, blocks=run.blocks and [run.blocks[0], list(run.blocks[1])],
        cpu_figures=cpu, gpu_read=dict(run.gpu_read.read) if run.gpu_read else {},
        size_choices=sorted(set(run.size_choices)),
        phases=run.training_phases() if run.trace.phases else None)
