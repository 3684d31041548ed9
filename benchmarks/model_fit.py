"""Benchmark: "will it fit?" as a user asks it, timed to the answer on screen and to the whole
output, beside the same questions asked of an earlier commit on the same machine, back to back.

  python benchmarks/model_fit.py                        # every question, this checkout alone
  python benchmarks/model_fit.py --baseline 87444bb     # each also asked of that commit, first
  python benchmarks/model_fit.py --only bert            # the README's BERT-large questions

The questions (the configs in docs/models/: nothing is downloaded), with their targets on 2 cores
(the answer on screen; the whole output):

  bert             the README's example, first time (nothing kept)                    20 s; 90 s
  bert-again       the same with another --gpu-memory (40GB), the first ask's runs kept   5 s
  bert-again-h100  the same with another --gpu (h100), the runs kept                     5 s
  llama-1b         Llama-3.2-1B, table + search + stack, 8 x 2,048 tokens, 24GB          90 s
  llama-8b         Llama-3.1-8B --stack-only, 8 x 2,048 tokens, 24GB                     15 s
  llama-8b-8-gpus  the same on 8 x 80GB (--world-size 8 --stack-only)                    30 s
  llama-70b-8-gpus Llama-3.1-70B on 8 x 80GB (--world-size 8 --stack-only)               60 s

Each question runs in a fresh process with a folder of kept runs of its own (ESTIMATE_CACHE), as a
new user's would be; the "again" questions reuse the first ask's folder. The answer's time is when
its first line ("The stack: ...") reached standard output, the whole's when the process ended.
--baseline REF checks REF out into a temporary worktree (git worktree add) and asks it the same
questions in the same way, just before this checkout, so both figures share the machine's state.
The answers (the stack's command, the table of what fits) are compared: a different answer is
printed. It prints the CPU (lscpu's model name, and whether it has AVX-512 BF16) and the load
average beside each figure: time depends on the machine and on what else runs on it. It only
measures and prints.
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
QUESTIONS = {  # name: (arguments of python -m estimate, target seconds to the answer, to the
    # whole output (None: the answer is the whole), the kept folder's name)
    "bert": ([*BERT, "--gpu-memory", "24GB"], 20, 90, "bert"),
    "bert-again": ([*BERT, "--gpu-memory", "40GB"], 5, None, "bert"),
    "bert-again-h100": ([*BERT, "--gpu-memory", "24GB", "--gpu", "h100"], 5, None, "bert"),
    "llama-1b": (["--model", "docs/models/llama-3.2-1b", *LLAMA, "--gpu-memory", "24GB"], None, 90,
                 "llama-1b"),
    "llama-8b": (["--model", "docs/models/llama-3.1-8b", *LLAMA, "--gpu-memory", "24GB",
                  "--stack-only"], 15, None, "llama-8b"),
    "llama-8b-8-gpus": (["--model", "docs/models/llama-3.1-8b", *LLAMA, "--gpu-memory", "80GB",
                         "--world-size", "8", "--stack-only"], 30, None, "llama-8b-8"),
    "llama-70b-8-gpus": (["--model", "docs/models/llama-3.1-70b", *LLAMA, "--gpu-memory", "80GB",
                          "--world-size", "8", "--stack-only"], 60, None, "llama-70b-8"),
}
GROUPS = {"bert": ("bert", "bert-again", "bert-again-h100"), "llama-1b": ("llama-1b",),
          "llama-8b": ("llama-8b",), "llama-8b-8-gpus": ("llama-8b-8-gpus",),
          "llama-70b-8-gpus": ("llama-70b-8-gpus",)}


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
    """(seconds to the answer's first line, seconds in all, load average before, the answer's
    lines) of one question in `root`."""
    arguments = QUESTIONS[question][0]
    with tempfile.TemporaryDirectory() as results:
        command = [sys.executable, "-m", "estimate", *arguments, "--results-dir", results]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as errors:
            process = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=errors,
                                       text=True, env={**os.environ, "ESTIMATE_CACHE": str(kept)})
            lines, answered = [], None
            for line in process.stdout:  # as it comes: the answer's moment
                if answered is None and line.startswith("The stack"):
                    answered = time.perf_counter() - start
                lines.append(line)
            status = process.wait()
            seconds = time.perf_counter() - start
            errors.seek(0)
            said = errors.read()
    output = "".join(lines)
    if status:
        print((output + said)[-3000:])
        raise SystemExit(f"exit status {status}: {' '.join(command)} (in {root})")
    if answered is None:  # no line began with the answer's words: what came instead, as it came
        print(f"  no line began \"The stack\" ({question}); the first lines of standard output:\n"
              + "".join(f"    {line!r}\n" for line in lines[:8]) + f"  standard error's end: {said[-800:]!r}")
    answer = [line.strip() for line in output.splitlines()
              if line.startswith(("The stack", "  python", "  torchrun", "with adapters"))
              or re.match(r"\| \d\d", line)]
    return answered if answered is not None else seconds, seconds, load, answer


def ask_all(root, groups, label):
    """{question: (seconds to the answer, in all, load, answer)} for `root`, each group with a kept
    folder of its own."""
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for group in groups:
            for question in GROUPS[group]:
                kept = Path(folder) / QUESTIONS[question][3]
                found[question] = ask(root, question, kept)
                answered, seconds, load, _ = found[question]
                print(f"  {label}: {question}: the answer at {answered:.1f} s, all in {seconds:.1f} s "
                      f"(load average {load:.2f})", flush=True)
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
    print("\n| question | target: answer; all | " + (f"{args.baseline}: answer; all | " if before else "")
          + "now: answer; all | met? |\n|---|---:|" + ("---:|" if before else "") + "---:|---|")
    for question, (answered, seconds, _, _) in now.items():
        _, to_answer, to_all, _ = QUESTIONS[question]
        targets = "; ".join(f"{target} s" if target else "-" for target in (to_answer, to_all))
        old = f" {before[question][0]:.1f} s; {before[question][1]:.1f} s |" if before else ""
        met = (to_answer is None or answered <= to_answer) and (to_all is None or seconds <= to_all)
        print(f"| {question} | {targets} |{old} {answered:.1f} s; {seconds:.1f} s | "
              f"{'yes' if met else 'no'} |")
    if before:
        for question, (_, _, _, answer) in now.items():
            if sorted(answer) != sorted(before[question][3]):
                print(f"\n{question}: the answers differ\n  before: "
                      + "\n          ".join(before[question][3]) + "\n  now:    "
                      + "\n          ".join(answer))

if __name__ == "__main__":
    main()
