"""Benchmark: the estimate of a 300M-parameter model from its config, and the --gpu-memory search.

  python benchmarks/model_fit.py [--model docs/models/bert-large-uncased] [--gpu-memory 24GB]

Times, each as the command a user types (a fresh process, imports included):

1. one estimate at batch 16: `python 03_bf16.py --model M --seq-len 512 --batch-size 16
   --estimate` (target: at most 15 s on 2 cores);
2. the search over every step and branch: `python -m estimate --model M --seq-len 512
   --batch-size 16 --gpu-memory 24GB` (target: at most 2 minutes on 2 cores).

The default model is BERT-large (335M parameters; its architecture is in
docs/models/bert-large-uncased/config.json, so nothing is downloaded). It only prints: time
depends on the machine and on what else runs on it, so the load average is printed beside it.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"estimate": 15, "search": 120}  # seconds on 2 cores


def timed(command):
    """(wall seconds, exit status, last lines printed) of `command`, run from the repository."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    print(f"$ {' '.join(command[1:])}\n  load average before: {load:.2f}")
    return seconds, done.returncode, (done.stdout + done.stderr).strip().splitlines()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="docs/models/bert-large-uncased")
    parser.add_argument("--gpu-memory", default="24GB")
    args = parser.parse_args()
    shape = ["--model", args.model, "--seq-len", "512", "--batch-size", "16"]
    with tempfile.TemporaryDirectory() as results:
        runs = {
            "estimate": [sys.executable, "03_bf16.py", *shape, "--estimate",
                         "--results-dir", results],
            "search": [sys.executable, "-m", "estimate", *shape,
                       "--gpu-memory", args.gpu_memory, "--results-dir", results],
        }
        for name, command in runs.items():
            seconds, status, lines = timed(command)
            if status != 0:
                print("\n".join(lines[-20:]))
                raise SystemExit(f"{name}: exit status {status}")
            shown = [line for line in lines if line.startswith(("peak memory", "| 0", "wall time"))]
            print("\n".join(f"  {line}" for line in shown))
            met = "target met" if seconds <= TARGETS[name] else "target NOT met"
            print(f"  {name}: {seconds:.1f} s wall (target {TARGETS[name]} s: {met})\n")


if __name__ == "__main__":
    main()
