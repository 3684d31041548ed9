"""Predict a training run's peak GPU memory on a machine without a GPU, in seconds.

  python 03_bf16.py --preset article --batch-size 16 --estimate   # that exact run, on one GPU
  WORLD_SIZE=4 python 07_fsdp.py --preset article --estimate       # sharded over 4 processes
  python -m common.estimate             # every numbered script at the article preset: one table
  python -m common.estimate --preset tiny --device cpu   # no GPU emulation (see below)

Each prediction runs the script's own main() for two optimizer steps (a run's peak falls within
them) on fake tensors, which have shapes but no data, under the script's own MemoryMeter
(PyTorch's MemTracker; FSDPMemTracker for sharded steps); only the helpers that need data, a
network or other processes are stood in for (common/fake_run.py). So a change to a script
changes its prediction. The order in which the run allocated and freed its tensors is then
replayed through a model of the CUDA caching allocator (common/gpu_model.py, which also lists
every choice a GPU makes differently from the CPU) to give what `torch.cuda.max_memory_allocated`
and `max_memory_reserved` would report, with a breakdown at the allocated peak.

--device cpu switches the GPU emulation off: the CPU's own kernels and optimizer defaults, bytes
counted exactly as MemoryMeter counts them on the CPU, and reserved = allocated. On the tiny
preset that equals the peak a real `--device cpu --max-steps 2 --epochs 1` run measures.

Distributed steps (07 on) run as rank 0 of a fake process group: WORLD_SIZE processes for a
script's own --estimate (1 if unset, as `python 07_fsdp.py` alone), --world-size for the table.
Both write results/estimate.json (--results-dir): one record per script and setting, updated
in place, so a single script's estimate keeps the others' records.
"""
import argparse
import fcntl
import gc
import json
import multiprocessing
import os
import re
import resource
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ESTIMATE_FILE = "estimate.json"
GB = 10**9  # the study's unit
RECORD_KEY = ("script", "preset", "device", "world_size", "batch_size", "accum_steps")
STEPS_PLANNED = 9  # the repository's steps are 01 to 09


@dataclass
class Row:
    """One prediction to make: a script and its own command-line flags."""
    script: Path
    argv: list
    world_size: int = 1

    @property
    def label(self):
        return f"{self.script.stem} {' '.join(self.argv)}".strip()


def predict(script_path, argv, world_size=1):
    """The estimate record for running `script_path` with its flags `argv`; raises EstimateError."""
    from common.fake_run import run_on_fake_tensors
    from common.gpu_model import HOST_CATEGORIES_WHEN_OFFLOADED
    from common.memory_trace import replay

    run = run_on_fake_tensors(script_path, argv, world_size)
    if run.emulate_cuda:
        host = HOST_CATEGORIES_WHEN_OFFLOADED if run.offloaded else frozenset()
        peak = replay(run.trace.events, "cpu", emulate_cuda=True, host_categories=host)
        allocated, reserved = peak.allocated_bytes, peak.reserved_bytes
        breakdown, host_bytes = peak.breakdown_bytes, peak.host_bytes
    else:  # the meter's own figure: what the real CPU run reports
        allocated = reserved = run.meter_result["peak_memory_bytes"]
        breakdown, host_bytes = run.meter_result["breakdown_bytes"], 0
    return {"script": run.script, "preset": run.record["preset"],
            "device": "cuda" if run.emulate_cuda else "cpu",
            "world_size": run.record["world_size"], "batch_size": run.record["batch_size"],
            "accum_steps": run.record["accum_steps"], "allocated_bytes": allocated,
            "reserved_bytes": reserved, "breakdown_bytes": breakdown, "host_bytes": host_bytes}


def failure_message(error, script):
    """One paragraph for a failed estimate: what went wrong and where."""
    from common.fake_run import EstimateError
    if isinstance(error, EstimateError):
        return str(error)
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
        record = predict(row.script, row.argv, row.world_size)
    except Exception as error:  # noqa: BLE001 - reported as the row's outcome
        if os.environ.get("ESTIMATE_TRACEBACK"):
            traceback.print_exc()
        return None, failure_message(error, row.script), time.perf_counter() - start
    return record, None, time.perf_counter() - start


def published_gb(record):
    """The study's figure for this record's setting, when it measured one (one GPU, article)."""
    from common.published import published_reserved_gb
    if record["preset"] != "article" or record["world_size"] != 1 or record["device"] != "cuda":
        return None
    return published_reserved_gb(record["script"], record["batch_size"], record["accum_steps"])


def in_units(nbytes):
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB / 10 else f"{nbytes / 2**20:.1f} MiB"


def setting(record):
    parts = [f"batch {record['batch_size']}"]
    if record["accum_steps"] > 1:
        parts.append(f"{record['accum_steps']} micro-batches")
    if record["world_size"] > 1:
        parts.append(f"{record['world_size']} GPUs" if record["device"] == "cuda"
                     else f"{record['world_size']} processes")
    return ", ".join(parts)


def summary(record):
    """The printed prediction for one run."""
    gpu = record["device"] == "cuda"
    what = "GPU (emulated)" if gpu else "CPU (no GPU emulation)"
    lines = [f"\n== {record['script']} estimate  (preset {record['preset']}, {setting(record)}, "
             f"{what}) ==",
             f"peak memory allocated  {in_units(record['allocated_bytes'])}"
             + ("   (as torch.cuda.max_memory_allocated)" if gpu else "   (as MemoryMeter counts)"),
             f"peak memory reserved   {in_units(record['reserved_bytes'])}"
             + ("   (as torch.cuda.max_memory_reserved)" if gpu else "   (the CPU caches nothing)"),
             "  at the peak: " + " | ".join(f"{name.replace('_', ' ')} {in_units(value)}"
                                            for name, value in record["breakdown_bytes"].items())]
    if record["host_bytes"]:
        lines.append(f"  offloaded to host memory: {in_units(record['host_bytes'])}")
    published = published_gb(record)
    if published:
        lines.append(f"  the study measured {published:.2f} GB reserved: ratio "
                     f"{record['reserved_bytes'] / GB / published:.2f}")
    return "\n".join(lines)


def save_records(results_dir, records):
    """Merge `records` into results_dir/estimate.json (same script and setting: replaced)."""
    from common.files import write_json_atomically
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
    from common.fake_run import world_size_from_environment
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


def numbered_scripts():
    return sorted(ROOT.glob("[0-9][0-9]_*.py"))


def is_distributed(script):
    """Steps that join a process group (07 on): they take a world size."""
    return "init_distributed" in script.read_text()


def default_accum_steps(script):
    """The --accum-steps default a script gives parse_args (1 when it has no such flag)."""
    found = re.search(r"accum_steps=(\d+)", script.read_text())
    return int(found.group(1)) if found else 1


def rows_for(script, preset, device, world_size):
    """The script's default setting, plus every other setting the study published for it."""
    from common.presets import get_preset
    from common.published import STUDY_RESERVED_GB
    base = ["--preset", preset, "--device", device]
    distributed = is_distributed(script)
    rows = [Row(script, base, world_size if distributed else 1)]
    default = (get_preset(preset).batch_size, default_accum_steps(script))
    if preset == "article" and device == "cuda" and not distributed:
        for (name, batch_size, accum_steps) in STUDY_RESERVED_GB:
            if name != script.stem or (batch_size, accum_steps) == default:
                continue
            flags = ["--batch-size", str(batch_size)]
            if accum_steps != default[1]:
                flags += ["--accum-steps", str(accum_steps)]
            rows.append(Row(script, base + flags))
    return rows


def select_scripts(names):
    """The numbered scripts matching `names` (prefixes such as 03), or all; notes for the rest."""
    scripts, notes = numbered_scripts(), []
    if names:
        chosen = []
        for name in names:
            matches = [script for script in scripts if script.name.startswith(name)]
            if not matches:
                have = ", ".join(script.name[:2] for script in scripts)
                notes.append(f"{name}: no numbered script starts with {name!r} (have: {have})")
            chosen += [match for match in matches if match not in chosen]
        return chosen, notes
    present = {int(script.name[:2]) for script in scripts}
    notes += [f"{number:02d}: no script in this checkout yet, skipped"
              for number in range(1, STEPS_PLANNED + 1) if number not in present]
    return scripts, notes


def run_rows(rows, jobs):
    """Each row's (record, problem, seconds), in order; up to `jobs` rows at a time."""
    if jobs <= 1 or len(rows) <= 1:
        return [report_progress(done, rows[done], attempt(row), len(rows))
                for done, row in enumerate(rows)]
    import common.fake_run  # noqa: F401 - imported once here, shared by the forked workers
    import transformers.models.vit.modeling_vit  # noqa: F401
    gc.freeze()  # the imported objects never become garbage: keep them out of the collector's way
    outcomes = [None] * len(rows)
    # fork: the workers share the imports; the longest rows start first
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        pending = {pool.submit(attempt, rows[index]): index for index in
                   sorted(range(len(rows)), key=lambda index: -expected_work(rows[index]))}
        for done, future in enumerate(as_completed(pending)):
            index = pending[future]
            try:
                outcome = future.result()
            except Exception as error:  # noqa: BLE001 - a worker that died takes only its rows
                outcome = (None, f"the estimating process stopped: {error}", 0.0)
            outcomes[index] = report_progress(done, rows[index], outcome, len(rows))
    return outcomes


def expected_work(row):
    """Rough cost of a row, to start the longest first: forward and backward passes run."""
    accum = row.argv[row.argv.index("--accum-steps") + 1] if "--accum-steps" in row.argv else None
    passes = int(accum) if accum else default_accum_steps(row.script)
    return passes * (2 if is_distributed(row.script) else 1)  # sharding doubles the operators


def report_progress(done, row, outcome, total):
    record, problem, seconds = outcome
    state = f"{in_units(record['allocated_bytes'])} allocated" if record else "failed"
    print(f"[{done + 1}/{total}] {row.label}: {state} ({seconds:.1f} s)", flush=True)
    return outcome


def table(rows, outcomes):
    """The Markdown table of all predictions, with the study's figure where there is one."""
    lines = ["| script | setting | allocated | reserved | study (reserved) | ratio |",
             "|---|---|---:|---:|---:|---:|"]
    for row, (record, problem, _) in zip(rows, outcomes):
        if record is None:
            flags = " ".join(row.argv) + (f", {row.world_size} processes" if row.world_size > 1 else "")
            lines.append(f"| {row.script.stem} | {flags} | failed (see the note) | | | |")
            continue
        published = published_gb(record)
        ratio = f"{record['reserved_bytes'] / GB / published:.2f}" if published else ""
        lines.append(f"| {record['script']} | {setting(record)} | "
                     f"{in_units(record['allocated_bytes'])} | {in_units(record['reserved_bytes'])} | "
                     f"{f'{published:.2f} GB' if published else ''} | {ratio} |")
    return "\n".join(lines)


def resources_used():
    """CPU seconds of this process and its finished workers, and the peak resident memory (GB)
    of this process and of the largest worker (Linux reports ru_maxrss in KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime
    return cpu_seconds, own.ru_maxrss * 1024 / GB, workers.ru_maxrss * 1024 / GB


def parse_table_args(argv):
    from common.cli import positive_int
    from common.presets import PRESETS
    parser = argparse.ArgumentParser(
        prog="python -m common.estimate", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="article",
                        help="default: article (the study's ViT-L/16 setting)")
    parser.add_argument("--world-size", type=positive_int, default=4,
                        help="processes (GPUs) for the distributed steps, 07 on (default: 4)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: predict a GPU (default); cpu: no emulation, as a CPU run counts")
    parser.add_argument("--scripts", nargs="+", metavar="NN",
                        help="only these steps, e.g. --scripts 01 03 (default: all)")
    parser.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                        help="estimates run at once, one process each (default: 2)")
    parser.add_argument("--results-dir", default="results", help="where estimate.json goes")
    return parser.parse_args(argv)


def main(argv=None):
    """`python -m common.estimate`: every numbered script, one table; returns the exit status."""
    start = time.perf_counter()
    args = parse_table_args(argv)
    scripts, notes = select_scripts(args.scripts)
    if not scripts:
        raise SystemExit("error: nothing to estimate.\n" + "\n".join(f"  {note}" for note in notes))
    rows = [row for script in scripts
            for row in rows_for(script, args.preset, args.device, args.world_size)]
    outcomes = run_rows(rows, args.jobs)
    records = [record for record, _, _ in outcomes if record]
    print("\n" + table(rows, outcomes))
    for row, (_, problem, _) in zip(rows, outcomes):
        if problem:
            notes.append(f"{row.label}: {problem}")
    for note in notes:
        print(f"note: {note}")
    if records:
        print(f"records: {save_records(args.results_dir, records)}")
    cpu_seconds, own, workers = resources_used()
    print(f"wall time {time.perf_counter() - start:.1f} s (CPU {cpu_seconds:.1f} s, "
          f"{args.jobs} at a time); peak memory (RSS) {own:.2f} GB in this process"
          + (f", {workers:.2f} GB in the largest worker" if workers else ""))
    return 1 if any(problem for _, problem, _ in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
