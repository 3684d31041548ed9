"""One prediction: run a script on fake tensors, replay it as a GPU, print and record it."""
import argparse
import fcntl
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from common.atomic_write import write_json_atomically
from estimate.allocation_trace import replay
from estimate.fake_run import EstimateError, run_on_fake_tensors, world_size_from_environment
from estimate.gpu_choices import DEFAULT_GPU, GPUS, HOST_CATEGORIES_WHEN_OFFLOADED
from estimate.published import published_reserved_gb
from common.memory import model_state_bytes_per_parameter
from common.summary import model_state_words, run_words

ESTIMATE_FILE = "estimate.json"
GB = 10**9  # the study's unit
RECORD_KEY = ("script", "preset", "model", "reshard_after_forward", "device", "gpu", "world_size",
              "batch_size", "accum_steps")
PER_PARAMETER = "model state B/param"  # tables' column of model_state_bytes_per_parameter
PER_PARAMETER_NOTE = (
    f'"{PER_PARAMETER}": the parameters, gradients and optimizer state at the peak, in bytes per '
    "parameter: float32 weights with Adam hold 16 (4, 4 for the gradient, 8 for Adam's two "
    "moments), bfloat16 ones 8, and 12 and 6 at a peak that comes before the gradients exist. "
    "With N processes sharding the model, per parameter of a process's 1/N share (gathered "
    "weights add to it): divide by N for its bytes per parameter of the whole model.")


@dataclass
class Row:
    """One prediction to make: a script and its own command-line flags."""
    script: Path
    argv: list
    world_size: int = 1
    gpu: str = DEFAULT_GPU  # the GPU emulated (without --device cpu): a key of GPUS

    @property
    def label(self):
        return f"{self.script.stem} {' '.join(self.argv)}".strip()


def predict(script_path, argv, world_size=1, gpu=DEFAULT_GPU):
    """The estimate record for running `script_path` with its flags `argv` (on the GPU `gpu`, a
    key of GPUS, unless they say --device cpu); raises EstimateError."""
    run = run_on_fake_tensors(script_path, argv, world_size, gpu)
    if run.emulate_cuda:
        host = HOST_CATEGORIES_WHEN_OFFLOADED if run.offloaded else frozenset()
        peak = replay(run.training_events(), "cpu", emulate_cuda=True, host_categories=host)
        allocated, reserved = peak.allocated_bytes, peak.reserved_bytes
        breakdown, host_bytes = peak.breakdown_bytes, peak.host_bytes
        created = replay(run.trace.events[run.creation_events], "cpu", emulate_cuda=True,
                         workspaces=False)
        init_allocated, init_reserved = created.allocated_bytes, created.reserved_bytes
    else:  # the meter's own figures: what the real CPU run reports
        allocated = reserved = run.meter_result["peak_memory_bytes"]
        breakdown, host_bytes = run.meter_result["breakdown_bytes"], 0
        init_allocated = init_reserved = run.creation.peak_bytes if run.creation else 0
    return {"script": run.script, "preset": run.record["preset"], "model": run.record["model"],
            "reshard_after_forward": run.record["reshard_after_forward"],
            "device": "cuda" if run.emulate_cuda else "cpu",
            "gpu": GPUS[gpu].name if run.emulate_cuda else None,
            "world_size": run.record["world_size"], "batch_size": run.record["batch_size"],
            "accum_steps": run.record["accum_steps"], "allocated_bytes": allocated,
            "reserved_bytes": reserved, "breakdown_bytes": breakdown, "host_bytes": host_bytes,
            "parameter_count": run.meter_result["parameter_count"],
            "model_state_bytes_per_parameter": model_state_bytes_per_parameter(
                breakdown, run.meter_result["parameters_held"]),  # the device's bytes, as above
            "init_allocated_bytes": init_allocated, "init_reserved_bytes": init_reserved,
            "compiled": run.compiled}


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


def attempt(row):
    """(record, None) or (None, message): a failure never escapes, so other rows still run."""
    start = time.perf_counter()
    try:
        record = predict(row.script, row.argv, row.world_size, row.gpu)
    except Exception as error:  # noqa: BLE001 - reported as the row's outcome
        if os.environ.get("ESTIMATE_TRACEBACK"):
            traceback.print_exc()
        return None, failure_message(error, row.script, row.argv), time.perf_counter() - start
    return record, None, time.perf_counter() - start


def published_gb(record):
    """The study's figure for this record's setting, when it measured one (one GPU, article)."""
    if (record["preset"] != "article" or record["world_size"] != 1 or record["device"] != "cuda"
            or record.get("gpu", "A100") != "A100"):  # measured on one A100
        return None
    return published_reserved_gb(record["script"], record["batch_size"], record["accum_steps"])


def in_units(nbytes):
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB / 10 else f"{nbytes / 2**20:.1f} MiB"


def setting(record):
    parts = [f"batch {record['batch_size']}"]
    if record["accum_steps"] > 1:
        parts.append(f"{record['accum_steps']} micro-batches")
    if record.get("reshard_after_forward") is False:
        parts.append("gathered weights kept to backward")
    if record["world_size"] > 1:
        parts.append(f"{record['world_size']} GPUs" if record["device"] == "cuda"
                     else f"{record['world_size']} processes")
    return ", ".join(parts)


def summary(record):
    """The printed prediction for one run."""
    gpu = record["device"] == "cuda"
    what = f"{record.get('gpu') or 'GPU'} (emulated)" if gpu else "CPU (no GPU emulation)"
    lines = [f"\n== {record['script']} estimate  ({run_words(record)}, {setting(record)}, "
             f"{what}) ==",
             f"peak memory allocated  {in_units(record['allocated_bytes'])}"
             + ("   (as torch.cuda.max_memory_allocated)" if gpu else "   (as MemoryMeter counts)"),
             f"peak memory reserved   {in_units(record['reserved_bytes'])}"
             + ("   (as torch.cuda.max_memory_reserved)" if gpu else "   (the CPU caches nothing)"),
             "  at the peak: " + " | ".join(f"{name.replace('_', ' ')} {in_units(value)}"
                                            for name, value in record["breakdown_bytes"].items())]
    lines.append("  " + model_state_words(record["model_state_bytes_per_parameter"],
                                          record["parameter_count"], record["world_size"]))
    if record["host_bytes"]:
        lines.append(f"  offloaded to host memory: {in_units(record['host_bytes'])}")
    lines.append(f"peak memory of creation {in_units(record['init_allocated_bytes'])}"
                 + ("   (allocated on the GPU while the model is built, per process)" if gpu
                    else "   (as measure_creation counts)"))
    if record.get("compiled"):
        lines.append("--compile: predicted for the eager run (the model ran uncompiled here);\n"
                     "  torch.compile fuses operations and chooses what backward keeps, so a "
                     "compiled run's\n  activations and temporaries differ: a compiled run "
                     "measures its own")
    published = published_gb(record)
    if published:
        lines.append(f"  the study measured {published:.2f} GB reserved: ratio "
                     f"{record['reserved_bytes'] / GB / published:.2f}")
    return "\n".join(lines)


def save_records(results_dir, records):
    """Merge `records` into results_dir/estimate.json (same script and setting: replaced)."""
    path = Path(results_dir) / ESTIMATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)  # concurrent estimates: one updates at a time
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        try:
            existing = json.loads(path.read_text())
            existing = existing if isinstance(existing, list) else []
        except (OSError, ValueError):
            existing = []
        keys = {tuple(record.get(name) for name in RECORD_KEY) for record in records}
        kept = [record for record in existing if isinstance(record, dict)
                and tuple(record.get(name) for name in RECORD_KEY) not in keys]
        write_json_atomically(path, kept + list(records))
    finally:
        os.close(directory)  # closing releases the lock
    return path


def estimate(script, argv):
    """`NN_script.py --estimate [flags]`: predict that run, print it, update estimate.json."""
    argv = sys.argv[1:] if argv is None else list(argv)
    results = argparse.ArgumentParser(add_help=False)
    results.add_argument("--results-dir", default="results")
    results_dir = results.parse_known_args(argv)[0].results_dir
    try:
        world_size = world_size_from_environment()
    except Exception as error:  # noqa: BLE001
        raise SystemExit(f"error: {failure_message(error, script)}")
    record, problem, seconds = attempt(Row(Path(script), argv, world_size))
    if problem:
        raise SystemExit(f"error: cannot estimate {Path(script).name}: {problem}")
    print(summary(record))
    print(f"record                 {save_records(results_dir, [record])}  ({seconds:.1f} s)")
    return record


