"""Benchmark: each script's measured GPU memory beside its prediction, over the same two steps.

  python benchmarks/gpu_measured.py measure DIR [--jobs 4]      # on a machine with a CUDA GPU
  python benchmarks/gpu_measured.py compare DIR [--gpu h100]    # anywhere: predicts, then prints

measure  runs every single-device script (07-09 as a group of one) for two optimizer steps on
         tiny, and on tiny-text under --task causal-lm (the scripts that train it), with
         --device cuda; each record (DIR/<preset>/<script>.json) holds the allocator's peaks over
         the two tracked steps (`cuda_steps_max_*`, the window the estimate predicts) beside the
         whole run's. 01, 04 and 05c on tiny also write PyTorch's memory snapshot of those
         steps (DIR/snapshots/). Each run's output goes to DIR/logs/. Several run at once
         (--jobs): each process's allocator figures are its own.
compare  runs `--estimate --gpu GPU` for the same commands here (no GPU needed) and prints
         Markdown: measured allocated and reserved, predicted, and measured / predicted.

It only measures and prints: no test depends on it.
"""
import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from steps import STEPS  # noqa: E402

PRESETS = {"tiny": ["--preset", "tiny"], "tiny-text": ["--preset", "tiny-text", "--task", "causal-lm"]}
TWO_STEPS = ["--epochs", "1", "--max-steps", "2"]
SNAPSHOTS = ("01", "04", "05c")  # on tiny
MIB = 2**20


def runs():
    """(preset, step id) for each script that trains the preset's task in one process."""
    return [(preset, step.id) for preset in PRESETS for step in STEPS.values()
            if step.trains("causal-lm" if preset == "tiny-text" else "classification")]


def command(preset, step_id, results, extra=()):
    return [sys.executable, str(STEPS[step_id].path), *PRESETS[preset], *TWO_STEPS,
            "--results-dir", str(results), *extra]


def run_all(commands, jobs, logs):
    """Run (label, argv) pairs, `jobs` at a time; {label: (return code, seconds)}."""
    logs.mkdir(parents=True, exist_ok=True)

    def one(item):
        label, argv = item
        start = time.perf_counter()
        with open(logs / f"{label}.log", "w") as log:
            code = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=900).returncode
        seconds = time.perf_counter() - start
        print(f"{label:<22} exit {code}  {seconds:6.1f} s", flush=True)
        return label, (code, seconds)

    with ThreadPoolExecutor(jobs) as pool:
        return dict(pool.map(one, commands))


def measure(folder, jobs):
    commands = []
    for preset, step_id in runs():
        extra = ["--device", "cuda"]
        if preset == "tiny" and step_id in SNAPSHOTS:
            (folder / "snapshots").mkdir(parents=True, exist_ok=True)
            extra += ["--memory-snapshot", str(folder / "snapshots" / f"{step_id}.pickle")]
        commands.append((f"{preset}-{step_id}", command(preset, step_id, folder / preset, extra)))
    done = run_all(commands, jobs, folder / "logs")
    failed = [label for label, (code, _) in done.items() if code]
    print(f"{len(done) - len(failed)} of {len(done)} runs passed" +
          (f"; failed: {', '.join(failed)}" if failed else ""))


def predicted(folder, gpu, jobs):
    """{(preset, step id): the estimate's record}, each predicted in a folder of its own."""
    commands = [(f"{preset}-{step_id}-estimate",
                 command(preset, step_id, folder / "predicted" / f"{preset}-{step_id}",
                         ["--estimate", "--gpu", gpu])) for preset, step_id in runs()]
    run_all(commands, jobs, folder / "predicted" / "logs")
    found = {}
    for preset, step_id in runs():
        path = folder / "predicted" / f"{preset}-{step_id}" / "estimate.json"
        if path.is_file():
            found[preset, step_id] = json.loads(path.read_text())[-1]
    return found


def compare(folder, gpu, jobs):
    estimates = predicted(folder, gpu, jobs)
    print(f"\n| preset | script | measured allocated / reserved (MiB) | predicted ({gpu}) | "
          "measured / predicted | whole run reserved |")
    print("|---|---|---:|---:|---:|---:|")
    for preset, step_id in runs():
        path = folder / preset / f"{STEPS[step_id].name}.json"
        record = json.loads(path.read_text()) if path.is_file() else {}
        estimate = estimates.get((preset, step_id))
        if "cuda_steps_max_reserved_bytes" not in record or estimate is None:
            why = "no GPU record" if estimate else "no estimate"
            print(f"| {preset} | {step_id} | {why} | | | |")
            continue
        allocated, reserved = (record["cuda_steps_max_allocated_bytes"],
                               record["cuda_steps_max_reserved_bytes"])
        print(f"| {preset} | {step_id} | {allocated / MIB:.1f} / {reserved / MIB:.1f} | "
              f"{estimate['allocated_bytes'] / MIB:.1f} / {estimate['reserved_bytes'] / MIB:.1f} | "
              f"{allocated / estimate['allocated_bytes']:.3f} / "
              f"{reserved / estimate['reserved_bytes']:.3f} | "
              f"{record['cuda_max_reserved_bytes'] / MIB:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["measure", "compare"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--gpu", default="h100", help="the GPU the estimate emulates (compare)")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.part == "measure":
        measure(args.folder, args.jobs)
    else:
        compare(args.folder, args.gpu, args.jobs)
    print(f"\n{args.part}: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
