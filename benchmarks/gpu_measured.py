"""Benchmark: each script's measured GPU memory beside its prediction, over the same two steps.

  python benchmarks/gpu_measured.py measure DIR [--jobs 4]      # on a machine with a CUDA GPU
  python benchmarks/gpu_measured.py compare DIR [--gpu h100]    # anywhere: predicts, then prints
  python benchmarks/gpu_measured.py measure DIR --at-scale      # the studies' models, no network
  python benchmarks/gpu_measured.py checked DIR --at-scale      # the records' own predictions

measure  runs every single-device script (07-09 as a group of one) for two optimizer steps on
         tiny, and on tiny-text under --task causal-lm (the scripts that train it), with
         --device cuda; each record (DIR/<preset>/<script>.json) holds the allocator's peaks over
         the two tracked steps (`cuda_steps_max_*`, the window the estimate predicts) beside the
         whole run's. 01, 04 and 05c on tiny also write PyTorch's memory snapshot of those
         steps (DIR/snapshots/). Each run's output goes to DIR/logs/. Several run at once
         (--jobs): each process's allocator figures are its own.
compare  runs `--estimate --gpu GPU` for the same commands here (no GPU needed) and prints
         Markdown: measured allocated and reserved, predicted, and measured / predicted.
checked  prints the same table from the predictions the runs made beside themselves
         (--check-estimate, which --at-scale adds), with the GPU each emulated.
--at-scale  the studies' settings instead, on data drawn at random (--data synthetic) and models
         made from their configs (docs/models/): ViT-L/16 at batch 64 (01, 02, 03, 04, 05c, 06),
         Llama-3.2-1B at 8 x 2,048 tokens (04, 05c, 05h, --task causal-lm), BERT-large at 512
         tokens, batch 16 (01, 04), and Llama-3.2-1B on one packed text of 65,536 tokens (10
         with the stack that fits it on 24 GB); each with --check-estimate, so the record holds
         the prediction made beside it.

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


AT_SCALE = {  # the studies' models on random data of their shapes: no download
    "vit-large": ["--preset", "article", "--model", "docs/models/vit-large-patch16-224",
                  "--data", "synthetic", "--batch-size", "64"],
    "llama-1b": ["--preset", "tiny-text", "--task", "causal-lm", "--model", "docs/models/llama-3.2-1b",
                 "--seq-len", "2048", "--batch-size", "8", "--data", "synthetic"],
    "bert-large": ["--preset", "tiny-text", "--model", "docs/models/bert-large-uncased",
                   "--seq-len", "512", "--batch-size", "16", "--data", "synthetic"],
    # a long sequence: one packed text of 65,536 tokens
    "llama-1b-64k": ["--preset", "tiny-text", "--task", "causal-lm", "--model", "docs/models/llama-3.2-1b",
                     "--seq-len", "65536", "--batch-size", "1", "--pack", "--data", "synthetic"],
}
AT_SCALE_STEPS = {"vit-large": ("01", "02", "03", "04", "05c", "06", "10"),
                  "llama-1b": ("04", "05c", "05h", "10"), "bert-large": ("01", "04"),
                  "llama-1b-64k": ("10",)}
# 10_combined.py runs the stack's answer, computed beforehand on the CPU (docs/combined.md): the
# chain's prefix up to the link named, in micro-batches of batch / accumulation steps. ViT-L/16's
# is how low one GPU goes (python -m estimate --preset article --batch-size 64 --gpu-memory 0.7GB
# --stack-only: 0.66 GB); Llama-3.2-1B's the 24 GB answer (... --gpu-memory 24GB: 17.35 GB)
AT_SCALE_STACKS = {"vit-large": ("classification", "gradients to host", 64),
                   "llama-1b": ("causal-lm", "bf16", 8)}


# 10_combined.py at a long length runs the stack that fits it, from the --longest-sequence walk
# (docs/causal-lm.md: Llama-3.2-1B on 24 GB, its prefix up to full checkpointing reaches 72,704
# tokens: python -m estimate --model docs/models/llama-3.2-1b --task causal-lm --batch-size 1
# --gpu-memory 24GB --longest-sequence)
AT_SCALE_LONG = {"llama-1b-64k": ["--loss", "fused", "--checkpointing", "full", "--mlp-tiles", "auto"]}


def stack_flags(setting):
    """10_combined.py's switches for `setting`'s stack (AT_SCALE_STACKS)."""
    from estimate.stack import argv_of, prefixes
    task, name, accum_steps = AT_SCALE_STACKS[setting]
    switches = next(switches for link, switches, _ in prefixes(task) if link.name == name)
    return [*argv_of(switches), "--accum-steps", str(accum_steps)]


def runs(at_scale=False):
    """(preset, step id) for each script that trains the preset's task in one process; or the
    studies' settings (AT_SCALE)."""
    if at_scale:
        return [(setting, step) for setting, steps in AT_SCALE_STEPS.items() for step in steps]
    return [(preset, step.id) for preset in PRESETS for step in STEPS.values()
            if step.trains("causal-lm" if preset == "tiny-text" else "classification")]


def command(preset, step_id, results, extra=()):
    flags = AT_SCALE.get(preset) or PRESETS[preset]
    if preset in AT_SCALE_STACKS and step_id == "10":  # the stack's answer
        flags = [*flags, *stack_flags(preset)]
    if preset in AT_SCALE_LONG and step_id == "10":  # the long sequence's stack
        flags = [*flags, *AT_SCALE_LONG[preset]]
    return [sys.executable, str(STEPS[step_id].path), *flags, *TWO_STEPS,
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


def measure(folder, jobs, at_scale=False):
    commands = []
    for preset, step_id in runs(at_scale):
        extra = ["--device", "cuda"] + (["--check-estimate"] if at_scale else [])
        if preset == "tiny" and step_id in SNAPSHOTS:
            (folder / "snapshots").mkdir(parents=True, exist_ok=True)
            extra += ["--memory-snapshot", str(folder / "snapshots" / f"{step_id}.pickle")]
        commands.append((f"{preset}-{step_id}", command(preset, step_id, folder / preset, extra)))
    done = run_all(commands, jobs, folder / "logs")
    failed = [label for label, (code, _) in done.items() if code]
    print(f"{len(done) - len(failed)} of {len(done)} runs passed" +
          (f"; failed: {', '.join(failed)}" if failed else ""))


def predicted(folder, gpu, jobs, at_scale=False):
    """{(preset, step id): the estimate's record}, each predicted in a folder of its own."""
    commands = [(f"{preset}-{step_id}-estimate",
                 command(preset, step_id, folder / "predicted" / f"{preset}-{step_id}",
                         ["--estimate", "--gpu", gpu])) for preset, step_id in runs(at_scale)]
    run_all(commands, jobs, folder / "predicted" / "logs")
    found = {}
    for preset, step_id in runs(at_scale):
        path = folder / "predicted" / f"{preset}-{step_id}" / "estimate.json"
        if path.is_file():
            found[preset, step_id] = json.loads(path.read_text())[-1]
    return found


def compare(folder, gpu, jobs, at_scale=False):
    estimates = predicted(folder, gpu, jobs, at_scale)
    print(f"\n| preset | script | measured allocated / reserved (MiB) | predicted ({gpu}) | "
          "measured / predicted | whole run reserved |")
    print("|---|---|---:|---:|---:|---:|")
    for preset, step_id in runs(at_scale):
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


def checked(folder, at_scale=False):
    """The table of `compare`, from each record's own --check-estimate fields."""
    print("\n| setting | script | measured allocated / reserved (MiB) | predicted | "
          "measured / predicted | whole run reserved |")
    print("|---|---|---:|---:|---:|---:|")
    for preset, step_id in runs(at_scale):
        path = folder / preset / f"{STEPS[step_id].name}.json"
        record = json.loads(path.read_text()) if path.is_file() else {}
        if "predicted_allocated_bytes" not in record:
            why = record.get("estimate_problem", "no record") if record else "no record"
            print(f"| {preset} | {step_id} | {why} | | | |")
            continue
        window = "cuda_steps_max_allocated_bytes" in record  # absent: no step was taken
        allocated = record["cuda_steps_max_allocated_bytes" if window else "cuda_max_allocated_bytes"]
        reserved = record["cuda_steps_max_reserved_bytes" if window else "cuda_max_reserved_bytes"]
        note = "" if window else " (whole run: the loss scaler skipped the tracked steps)"
        print(f"| {preset} | {step_id} | {allocated / MIB:.1f} / {reserved / MIB:.1f}{note} | "
              f"{record['predicted_allocated_bytes'] / MIB:.1f} / "
              f"{record['predicted_reserved_bytes'] / MIB:.1f} | "
              f"{allocated / record['predicted_allocated_bytes']:.3f} / "
              f"{reserved / record['predicted_reserved_bytes']:.3f} | "
              f"{record['cuda_max_reserved_bytes'] / MIB:.1f} |")
    emulated = {json.loads(path.read_text()).get("predicted_gpu") for path in folder.glob("*/*.json")}
    print(f"\npredicted for: {'; '.join(sorted(filter(None, emulated)))}")


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["measure", "compare", "checked"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--jobs", type=int,
                        help="runs at a time (default: 4; 1 with --at-scale, whose runs each fill "
                             "tens of GB: near the GPU's limit the allocator frees its cache and "
                             "the reserved figures fall)")
    parser.add_argument("--gpu", default="h100", help="the GPU the estimate emulates (compare)")
    parser.add_argument("--at-scale", action="store_true",
                        help="the studies' models and batches on random data (AT_SCALE)")
    args = parser.parse_args()
    start = time.perf_counter()
    args.jobs = args.jobs or (1 if args.at_scale else 4)
    if args.part == "measure":
        measure(args.folder, args.jobs, args.at_scale)
    elif args.part == "checked":
        checked(args.folder, args.at_scale)
    else:
        compare(args.folder, args.gpu, args.jobs, args.at_scale)
    print(f"\n{args.part}: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
