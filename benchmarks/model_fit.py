"""Benchmark: "will it fit?" as a user asks it, timed, beside the same questions asked of an
earlier commit on the same machine, back to back.

  python benchmarks/model_fit.py                        # every question, this checkout alone
  python benchmarks/model_fit.py --baseline 7b34ca2     # each also asked of that commit, first
  python benchmarks/model_fit.py --only bert            # the README's BERT-large questions

The questions (the configs in docs/models/: nothing is downloaded), with their targets on 2 cores:

  bert        the README's example, first time (nothing kept)                         60 s
  bert-again  the same with another --gpu-memory (40GB), then another --gpu (h100),
              the first ask's runs kept                                                 10 s each
  llama-1b    Llama-3.2-1B, table + search + stack, 8 x 2,048 tokens, 24GB              90 s
  llama-8b    Llama-3.1-8B --stack-only, 8 x 2,048 tokens, 24GB                         20 s

Each question runs in a fresh process with a folder of kept runs of its own (ESTIMATE_CACHE), as a
new user's would be; the "again" questions reuse the first ask's folder. --baseline REF checks
REF out into a temporary worktree (git worktree add) and asks it the same questions in the same
way, just before this checkout, so both figures share the machine's state. The answers (the
stack's command, the table of what fits) are compared: a different answer is printed. It prints
the CPU (lscpu's model name, and whether it has AVX-512 BF16) and the load average beside each
figure: time depends on the machine and on what else runs on it. It only measures and prints.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BERT = ["--model", "docs/models/bert-large-uncased", "--seq-len", "512", "--batch-size", "16"]
LLAMA = ["--task", "causal-lm", "--seq-len", "2048", "--batch-size", "8"]
QUESTIONS = {  # name: (arguments of python -m estimate, target seconds, the kept folder's name)
    "bert": ([*BERT, "--gpu-memory", "24GB"], 60, "bert"),
    "bert-again": ([*BERT, "--gpu-memory", "40GB"], 10, "bert"),
    "bert-again-h100": ([*BERT, "--gpu-memory", "24GB", "--gpu", "h100"], 10, "bert"),
    "llama-1b": (["--model", "docs/models/llama-3.2-1b", *LLAMA, "--gpu-memory", "24GB"], 90,
                 "llama-1b"),
    "llama-8b": (["--model", "docs/models/llama-3.1-8b", *LLAMA, "--gpu-memory", "24GB",
                  "--stack-only"], 20, "llama-8b"),
}
GROUPS = {"bert": ("bert", "bert-again", "bert-again-h100"), "llama-1b": ("llama-1b",),
          "llama-8b": ("llama-8b",)}


def processor():
    """The CPU's model name and whether it has bfloat16 arithmetic (AVX-512 BF16 or AMX)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        text = ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("Model name")), "unknown CPU")
    bf16 = "avx512_bf16" in text or "amx_bf16" in text
    return f"{name}, {os.cpu_count()} cores, {'with' if bf16 else 'without'} bfloat16 arithmetic"


def ask(root, question, kept):
    """(wall seconds, load average before, the answer's lines) of one question in `root`."""
    arguments, _, _ = QUESTIONS[question]
    with tempfile.TemporaryDirectory() as results:
        command = [sys.executable, "-m", "estimate", *arguments, "--results-dir", results]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=root, capture_output=True, text=True,
                              env={**os.environ, "ESTIMATE_CACHE": str(kept)})
        seconds = time.perf_counter() - start
    if done.returncode:
        print((done.stdout + done.stderr)[-3000:])
        raise SystemExit(f"exit status {done.returncode}: {' '.join(command)} (in {root})")
    answer = [line.strip() for line in done.stdout.splitlines()
              if line.startswith(("The stack", "  python", "  torchrun", "with adapters"))
              or re.match(r"\| \d\d", line)]
    return seconds, load, answer


def ask_all(root, groups, label):
    """{question: (seconds, load, answer)} for `root`, each group with a kept folder of its own."""
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for group in groups:
            for question in GROUPS[group]:
                kept = Path(folder) / QUESTIONS[question][2]
                found[question] = ask(root, question, kept)
                seconds, load, _ = found[question]
                print(f"  {label}: {question}: {seconds:.1f} s (load average {load:.2f})", flush=True)
    return found


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(GROUPS), nargs="+", help="only these questions")
    parser.add_argument("--baseline", metavar="REF",
                        help="a commit asked the same questions first, on the same machine")
    args = parser.parse_args()
    groups = args.only or list(GROUPS)
    print(f"{processor()}; python {sys.version.split()[0]}")
    before = None
    if args.baseline:
        with tempfile.TemporaryDirectory() as parent:
            tree = Path(parent) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline],
                           cwd=ROOT, check=True, capture_output=True)
            try:
                before = ask_all(tree, groups, args.baseline)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                               capture_output=True)
    now = ask_all(ROOT, groups, "this checkout")
    print("\n| question | target | " + (f"{args.baseline} | " if before else "")
          + "now | met? |\n|---|---:|" + ("---:|" if before else "") + "---:|---|")
    for question, (seconds, _, answer) in now.items():
        target = QUESTIONS[question][1]
        old = f" {before[question][0]:.0f} s |" if before else ""
        print(f"| {question} | {target} s |{old} {seconds:.0f} s | "
              f"{'yes' if seconds <= target else 'no'} |")
    if before:
        for question, (_, _, answer) in now.items():
            if sorted(answer) != sorted(before[question][2]):
                print(f"\n{question}: the answers differ\n  before: "
                      + "\n          ".join(before[question][2]) + "\n  now:    "
                      + "\n          ".join(answer))


if __name__ == "__main__":
    main()
