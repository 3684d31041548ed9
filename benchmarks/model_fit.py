"""Benchmark: one estimate of a model from its config, and the table with the --gpu-memory search.

  python benchmarks/model_fit.py                       # Llama-3.2-1B as a language model
  python benchmarks/model_fit.py --model docs/models/bert-large-uncased --task classification \\
      --seq-len 512 --batch-size 16 --gpu-memory 24GB  # BERT-large, as docs/estimator.md

Times, each as the command a user types (a fresh process, imports included):

1. one estimate: `python 04_grad_accum.py --model M --task T --seq-len S --batch-size 1
   --accum-steps 1 --estimate` (target: at most 10 s on 2 cores);
2. the table and the search over every step and branch: `python -m estimate --model M --task T
   --seq-len S --batch-size B --gpu-memory G` (target: at most 2 minutes on 2 cores).

The default model is Llama-3.2-1B (1.24B parameters, 128,256-token vocabulary; its published
config is docs/models/llama-3.2-1b/config.json, so nothing is downloaded) at 2,048 tokens. It
only prints: time depends on the machine and on what else runs on it, so the load average is
printed beside it.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"estimate": 10, "search": 120}  # seconds on 2 cores


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
    parser.add_argument("--model", default="docs/models/llama-3.2-1b")
    parser.add_argument("--task", default="causal-lm", choices=["classification", "causal-lm"])
    parser.add_argument("--seq-len", default="2048")
    parser.add_argument("--batch-size", default="8", help="of the table and the search")
    parser.add_argument("--gpu-memory", default="80GB")
    args = parser.parse_args()
    shape = ["--model", args.model, "--task", args.task, "--seq-len", args.seq_len]
    with tempfile.TemporaryDirectory() as results:
        runs = {
            "estimate": [sys.executable, "04_grad_accum.py", *shape, "--batch-size", "1",
                         "--accum-steps", "1", "--estimate", "--results-dir", results],
            "search": [sys.executable, "-m", "estimate", *shape, "--batch-size", args.batch_size,
                       "--gpu-memory", args.gpu_memory, "--results-dir", results],
        }
        for name, command in runs.items():
            seconds, status, lines = timed(command)
            if status != 0:
                print("\n".join(lines[-20:]))
                raise SystemExit(f"{name}: exit status {status}")
            shown = [line for line in lines
                     if line.startswith(("peak memory", "record", "searching", "wall time"))]
            print("\n".join(f"  {line}" for line in shown))
            met = "target met" if seconds <= TARGETS[name] else "target NOT met"
            print(f"  {name}: {seconds:.1f} s wall (target {TARGETS[name]} s: {met})\n")


if __name__ == "__main__":
    main()
