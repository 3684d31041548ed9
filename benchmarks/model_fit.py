"""Benchmark: "will it fit?" in seconds. One estimate, the table with the --gpu-memory search, and
the stack search, each timed as a user runs it, beside the same work with --exact (every block
and every micro-batch run, as before the estimate by blocks), which must give the same bytes.

  python benchmarks/model_fit.py                     # Llama-3.2-1B and Llama-3.1-8B, 2,048 tokens
  python benchmarks/model_fit.py --only estimate     # the single estimates only (a minute)
  python benchmarks/model_fit.py --no-exact          # without the --exact figures (much faster)

Targets on 2 cores: the imports of an estimate within 2 s; one estimate of Llama-3.1-8B within
3 s after them; the table plus the --gpu-memory search within 30 s for Llama-3.2-1B and 45 s for
Llama-3.1-8B; the stack search (--stack-only) of Llama-3.1-8B within 60 s. It prints; time
depends on the machine and on what else runs on it, so the load average is printed beside it.
The configs are the published ones, in docs/models/: nothing is downloaded. Each figure is a
first ask, with no estimate kept from before; the table's and the stack's are followed by the
same model asked again for a 40GB GPU, with the estimates of the first ask kept (cache.py).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"Llama-3.2-1B": "docs/models/llama-3.2-1b", "Llama-3.1-8B": "docs/models/llama-3.1-8b"}
SHAPE = ["--task", "causal-lm", "--seq-len", "2048"]
TARGETS = {("imports", None): 2, ("estimate", "Llama-3.1-8B"): 3,
           ("search", "Llama-3.2-1B"): 30, ("search", "Llama-3.1-8B"): 45,
           ("stack", "Llama-3.1-8B"): 60}
# one estimate in a fresh process: its imports timed apart from the prediction
ONE_ESTIMATE = """
import json, sys, time
start = time.perf_counter()
from estimate.predict import predict
from steps import STEPS
import transformers.models.llama.modeling_llama
imported = time.perf_counter()
record = predict(STEPS["04"].path, sys.argv[2:], exact=sys.argv[1] == "exact")
done = time.perf_counter()
print(json.dumps({"imports": imported - start, "estimate": done - imported, "record": record}))
"""


def verdict(seconds, key):
    target = TARGETS.get(key)
    if target is None:
        return ""
    return f" (target {target} s: {'met' if seconds <= target else 'NOT met'})"


def run(command, kept="0"):
    """(wall seconds, stdout) of `command` run from the repository; exits on a failure. `kept`:
    ESTIMATE_CACHE, "0" (every estimate computed, as on a first ask) or the folder of kept ones."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "ESTIMATE_CACHE": kept})
    seconds = time.perf_counter() - start
    if done.returncode:
        print((done.stdout + done.stderr)[-3000:])
        raise SystemExit(f"exit status {done.returncode}: {' '.join(command)}")
    return seconds, done.stdout, load


def estimates(name, folder, exact):
    """The single estimate of 04 at batch 1, as quick and as --exact."""
    flags = ["--model", folder, *SHAPE, "--batch-size", "1", "--accum-steps", "1"]
    found = {}
    for how in ("quick", "exact") if exact else ("quick",):
        _, out, load = run([sys.executable, "-c", ONE_ESTIMATE, how, *flags])
        found[how] = json.loads(out.strip().splitlines()[-1])
        found[how]["load"] = load
    quick = found["quick"]
    print(f"{name}: one estimate (04, batch 1, 2,048 tokens), load average {quick['load']:.2f}")
    print(f"  imports    {quick['imports']:.1f} s" + verdict(quick["imports"], ("imports", None)))
    print(f"  estimate   {quick['estimate']:.1f} s" + verdict(quick["estimate"], ("estimate", name))
          + f", from blocks {quick['record']['blocks']}")
    if exact:
        whole = found["exact"]
        same = all(quick["record"][key] == whole["record"][key] for key in
                   ("allocated_bytes", "reserved_bytes", "breakdown_bytes", "init_reserved_bytes"))
        print(f"  --exact    {whole['estimate']:.1f} s: the same bytes: {same}")


def searches(name, folder, exact, what):
    """The table plus the --gpu-memory search, or the stack search alone, as quick and --exact."""
    flags = [*SHAPE, "--model", folder, "--batch-size", "8", "--gpu-memory", "80GB"]
    if what == "stack":
        flags.append("--stack-only")
    lines = {}
    label = {"search": "the table and the --gpu-memory search", "stack": "the stack search"}[what]
    for how in ("quick", "exact") if exact else ("quick",):
        with tempfile.TemporaryDirectory() as results, tempfile.TemporaryDirectory() as kept:
            command = [sys.executable, "-m", "estimate", *flags, "--results-dir", results,
                       *(["--exact"] if how == "exact" else [])]
            seconds, out, load = run(command, kept if how == "quick" else "0")
            lines[how] = [line for line in out.splitlines() if line.startswith("|")]
            print(f"{name}: {label} ({how}): {seconds:.0f} s wall, load average {load:.2f}"
                  + (verdict(seconds, (what, name)) if how == "quick" else ""))
            if how == "quick":  # the same model asked again, for another GPU: estimates kept
                again = [word.replace("80GB", "40GB") for word in command]
                seconds, _, load = run(again, kept)
                print(f"  asked again with --gpu-memory 40GB: {seconds:.0f} s wall, load average "
                      f"{load:.2f} (the estimates of the first ask kept: estimate/cache.py)")
    if exact:
        print(f"  the same tables as --exact: {lines['quick'] == lines['exact']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["estimate", "search", "stack"])
    parser.add_argument("--no-exact", action="store_true", help="leave out the --exact figures")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; python {sys.version.split()[0]}\n")
    for name, folder in MODELS.items():
        if args.only in (None, "estimate"):
            estimates(name, folder, not args.no_exact)
    for what in ("search", "stack"):
        if args.only not in (None, what):
            continue
        for name, folder in MODELS.items():
            if (what, name) in TARGETS:
                searches(name, folder, not args.no_exact, what)


if __name__ == "__main__":
    main()
