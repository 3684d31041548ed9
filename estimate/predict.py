"""One prediction: run a script on fake tensors (whole, or by probes of its blocks) and replay it as a GPU."""
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from common.breakdown import model_state_bytes_per_parameter
from estimate import collector
from estimate.contract import EstimateError
from estimate.gpu_choices import DEFAULT_GPU, GPUS, HOST_CATEGORIES_WHEN_OFFLOADED, wants_cuda_emulation
from estimate.records import size_text
from estimate.replay.snapshot import Recorder
from estimate.replay.snapshot import write as write_snapshot
from estimate.replay.trace import replay
from estimate.shortcuts import cache
from estimate.shortcuts.cache import from_fake_run
from steps import step_of

EXACT_VARIABLE = "ESTIMATE_EXACT"  # 1: every estimate runs whole (python -m estimate --exact)


@dataclass
class Row:
    """One prediction to make: a script and its own command-line flags."""
    script: Path
    argv: list
    world_size: int = 1
    gpu: str = DEFAULT_GPU  # the GPU emulated (without --device cpu): a key of GPUS
    any_batch_size: bool = False  # the data set holds two batches of any size (the search's)
    snapshot: str | None = None  # where the predicted memory snapshot goes (--memory-snapshot)
    exact: bool = False  # every micro-batch asked is run, not two (--exact)
    unfused: bool = False  # compiled: also the peak with nothing fused (compiled.py), a second run

    @property
    def label(self):
        return f"{self.script.stem} {' '.join(self.argv)}".strip()


def predict(script_path, argv, world_size=1, gpu=DEFAULT_GPU, any_batch_size=False,
            snapshot=None, exact=False, unfused=False):
    """The estimate record for running `script_path` with its flags `argv` (on the GPU `gpu`, a
    key of GPUS, unless they say --device cpu); raises EstimateError. `any_batch_size`: the
    fake data set is as large as two batches of the size asked need. `snapshot`: a file for
    the predicted memory snapshot of the steps (and its picture beside it: replay/snapshot.py).
    `exact`: run every micro-batch asked, not two (fake/run.py's MICRO_BATCHES_RUN), and the whole
    model, not probes of a few of its blocks (shortcuts/blocks.py), to check. `unfused`: for a compiled
    run, run it again with nothing fused, for the bound above its prediction (compiled.py)."""
    row = Row(Path(script_path), list(argv), world_size, gpu, any_batch_size, snapshot, exact,
              unfused)
    return record_of(run_for(row), gpu, snapshot)


def run_for(row, learned=None, one_probe=False):
    """The fake run a row asks for, as a KeptRun (shortcuts/cache.py): by blocks where the model's
    blocks repeat, else whole; compiled, with its unfused bound where asked. `learned`: what a
    run of the same row at another micro-batch size kept of its probes (KeptRun.learned): its
    two smaller probes alone are then run at this size, where their events allow; with
    `one_probe`, the middle one alone (from_one_probe: a search's, which its line checks)."""
    if "estimate.fake.run" not in sys.modules:  # imported where a run is made: a kept run's answer
        # needs no fake tensors, no tracker. In a worker forked before it was imported, what the
        # import made is frozen for the garbage collector, as output.worker_pool froze the rest
        import estimate.fake.run  # noqa: F401
        if collector.depth:
            gc.freeze()
    from estimate.fake.run import run_on_fake_tensors
    from estimate.shortcuts.blocks import run_at_another_size, run_by_blocks
    script_path, argv, world_size, gpu = row.script, row.argv, row.world_size, row.gpu
    exact = row.exact or os.environ.get(EXACT_VARIABLE) == "1"
    run, snapshot, any_batch_size = None, row.snapshot, row.any_batch_size
    by_blocks = wants_cuda_emulation(argv) and not (exact or snapshot or compiles(script_path, argv))
    made = None  # the probes run_at_another_size ran, where its rules did not hold
    if by_blocks and learned:
        try:  # one or two probes, the rules of another size's (shortcuts/blocks.py)
            run = run_at_another_size(script_path, argv, world_size, gpu, any_batch_size, learned,
                                      one_probe=one_probe)
        except Exception as problem:  # noqa: BLE001 - NotByBlocks, or a probe's failure: all the probes
            made = getattr(problem, "probes", None)
            if os.environ.get("ESTIMATE_TRACEBACK"):
                traceback.print_exc()
    if by_blocks and run is None:
        try:  # from runs of a few periods of the model's blocks (shortcuts/blocks.py), where they repeat
            run = run_by_blocks(script_path, argv, world_size, gpu, any_batch_size,
                                sharded=shards(script_path, argv, world_size), made=made)
        except Exception:  # noqa: BLE001 - NotByBlocks, or a probe's failure: run it whole
            if os.environ.get("ESTIMATE_TRACEBACK"):
                traceback.print_exc()
            run = None
    fused = True  # compiled: the prediction fuses pointwise operations (compiled.py)
    if run is None:
        try:
            run = run_on_fake_tensors(script_path, argv, world_size, gpu, any_batch_size,
                                      every_micro_batch=exact or bool(snapshot))  # (the whole step)
        except Exception:
            if not compiles(script_path, argv):
                raise
            # a stand-in for a fused value takes no memory, and so no layout: an operation that
            # needs a layout the emulation cannot give (a view of a slice of a value laid out
            # otherwise than inductor's: compiled.py, view_of_the_bytes) stops the run. The
            # graphs then run with nothing fused, the range's upper side, said in the summary
            if os.environ.get("ESTIMATE_TRACEBACK"):
                traceback.print_exc()
            run, fused = run_on_fake_tensors(script_path, argv, world_size, gpu, any_batch_size,
                                             every_micro_batch=exact or bool(snapshot),
                                             fused=False), False
    unfused_run = None
    if row.unfused and fused and run.compiled and not run.compiled_eagerly:  # the bound above
        try:
            unfused_run = run_on_fake_tensors(script_path, argv, world_size, gpu, any_batch_size,
                                              every_micro_batch=exact or bool(snapshot),
                                              fused=False)
        except Exception:  # noqa: BLE001 - the prediction stands without its bound
            if os.environ.get("ESTIMATE_TRACEBACK"):
                traceback.print_exc()
    return from_fake_run(run, unfused_run, fused)


def replayed(kept, events, gpu, observer=None):
    """The peak of `events` (a KeptRun's) replayed as the GPU `gpu` (a key of GPUS)."""
    host = HOST_CATEGORIES_WHEN_OFFLOADED if kept.offloaded else frozenset()
    return replay(events, "cpu", emulate_cuda=True, host_categories=host, observer=observer,
                  workspace_bytes=GPUS[gpu].cublas_workspace_bytes)


def record_of(kept, gpu=DEFAULT_GPU, snapshot=None):
    """The estimate record of a KeptRun on the GPU `gpu` (a key of GPUS; ignored when the run
    was not emulated): its trace replayed through the caching allocator model, in milliseconds.
    `snapshot`: a file for the predicted memory snapshot (a whole run's KeptRun)."""
    if kept.emulate_cuda:
        recorder = Recorder() if snapshot else None
        peak = replayed(kept, kept.events, gpu, recorder)
        allocated, reserved = peak.allocated_bytes, peak.reserved_bytes
        breakdown, host_bytes = peak.breakdown_bytes, peak.host_bytes
        pinned_host_bytes = peak.pinned_host_bytes  # of it, pinned (replay/trace.py)
        created = replay(kept.creation, "cpu", emulate_cuda=True, workspaces=False)
        init_allocated, init_reserved = created.allocated_bytes, created.reserved_bytes
        if snapshot:
            record, world = kept.record, kept.record["world_size"]
            title = (f"{kept.script}, {record['preset']} preset, batch {record['batch_size']}:"
                     f" predicted on one {GPUS[gpu].name}" + (f" of {world}" if world > 1 else "")
                     + f" (peak {size_text(allocated)} allocated, {size_text(reserved)} reserved)")
            write_snapshot(snapshot, recorder, kept.phases, title)
    else:  # the meter's own figures: what the real CPU run reports
        allocated = reserved = kept.cpu_figures["peak_bytes"]
        breakdown, host_bytes = kept.cpu_figures["breakdown_bytes"], 0
        pinned_host_bytes = 0
        init_allocated = init_reserved = kept.cpu_figures["creation_peak_bytes"]
    unfused = None
    if kept.unfused_events is not None:
        unfused = (replayed(kept, kept.unfused_events, gpu).allocated_bytes if kept.emulate_cuda
                   else kept.cpu_figures["unfused_peak_bytes"])
    record = kept.record
    return {"script": kept.script, "preset": record["preset"], "model": record["model"],
            "reshard_after_forward": record["reshard_after_forward"],
            "device": "cuda" if kept.emulate_cuda else "cpu",
            "gpu": GPUS[gpu].name if kept.emulate_cuda else None,
            "world_size": record["world_size"], "batch_size": record["batch_size"],
            "accum_steps": record["accum_steps"], "allocated_bytes": allocated,
            "reserved_bytes": reserved, "breakdown_bytes": breakdown, "host_bytes": host_bytes,
            "pinned_host_bytes": pinned_host_bytes,
            "parameter_count": kept.parameter_count,
            "model_state_bytes_per_parameter": model_state_bytes_per_parameter(
                breakdown, kept.parameters_held),  # the device's bytes, as above
            "init_allocated_bytes": init_allocated, "init_reserved_bytes": init_reserved,
            "compiled": kept.compiled, "compiled_eagerly": kept.compiled_eagerly,
            "unfused_allocated_bytes": unfused if kept.fused else allocated,  # (not fused: the same)
            "fused": kept.fused, "batch_bytes": kept.batch_bytes,
            # [blocks of the model, [blocks of each probe]] where probes stood for it (shortcuts/blocks.py)
            "blocks": kept.blocks and [kept.blocks[0], kept.blocks[1]]}


def compiles(script_path, argv):
    """Whether the run compiles its model: --compile, 10's --checkpointing budget:F, or a
    script that always does (05k): its probes would not show its blocks (shortcuts/blocks.py)."""
    try:
        always = step_of(script_path).compiles
    except KeyError:
        always = False
    return always or "--compile" in argv or any("budget:" in arg for arg in argv)


def shards(script_path, argv=(), world_size=1):
    """Whether the run shards the model: steps.py's entry says so (07-09), or the combined
    script is sharded by its flags (--offload) or its processes (a copy of a script, under
    another name, has no entry: False)."""
    try:
        step = step_of(script_path)
    except KeyError:
        return False
    return step.sharded or step.combined and ("--offload" in argv or world_size > 1)


def from_one_probe(kept):
    """Whether a run was written from one probe and another size's rules (shortcuts/blocks.py,
    run_at_another_size): a size of a search, which only its line of sizes checks."""
    return bool(kept.blocks) and len(kept.blocks[1]) == 1


def failure_message(error, script, argv=()):
    """One paragraph for a failed estimate: what went wrong and where (and with which model,
    under --model: an architecture may do what fake tensors cannot, such as branching on values)."""
    if isinstance(error, EstimateError):
        return str(error)
    if "--model" in argv:
        name = argv[argv.index("--model") + 1]
        frames = traceback.extract_tb(error.__traceback__)
        frame = frames[-1] if frames else None
        where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
        return (f"--model {name}: its {type(error).__name__} on fake tensors: {error}{where}. "
                "The estimate runs the model on tensors without values; this architecture does "
                "something that needs them (or that its GPU emulation does not know). Set "
                "ESTIMATE_TRACEBACK=1 to see where")
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if Path(frame.filename) == Path(script)]
    frame = (own or frames or [None])[-1]
    where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return (f"{type(error).__name__}: {error}{where}. The script could not run on fake tensors; "
            "set ESTIMATE_TRACEBACK=1 to see the whole traceback")


def attempt(row, learned=None):
    """(record, None, seconds) or (None, message, seconds): the row's prediction or why it
    failed, and the time it took (None: its run was kept from an earlier estimate, shortcuts/cache.py); a
    failure never escapes, so other rows still run. `learned`: as run_for's."""
    kept, problem, seconds = attempt_run(row, learned=learned)
    return (record_of(kept, row.gpu, row.snapshot) if kept else None), problem, seconds


def attempt_run(row, run=True, learned=None, one_probe=False):
    """(KeptRun, None, seconds) or (None, message, seconds), as attempt: the row's fake run,
    kept from an earlier one (shortcuts/cache.py) where one still holds, else made (run_for, with
    `learned` and `one_probe`) and kept (unless not `run`: then (None, None, None)). A kept run
    written from one probe (from_one_probe) stands only where `one_probe` allows one."""
    start = time.perf_counter()
    name = cache.key(row, row.exact or os.environ.get(EXACT_VARIABLE) == "1")
    emulated = GPUS[row.gpu] if wants_cuda_emulation(row.argv) else None
    kept = name and cache.load(name, emulated)
    if kept and (one_probe or not from_one_probe(kept)):
        return kept, None, None
    if not run:
        return None, None, None
    try:
        kept = run_for(row, learned, one_probe)
    except Exception as error:  # noqa: BLE001 - reported as the row's outcome
        if os.environ.get("ESTIMATE_TRACEBACK"):
            traceback.print_exc()
        return None, failure_message(error, row.script, row.argv), time.perf_counter() - start
    if name:
        cache.keep(name, kept)
    return kept, None, time.perf_counter() - start

