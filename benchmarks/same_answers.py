"""Benchmark: the same `python -m estimate` questions asked of a commit and of this checkout, their
answers compared byte for byte: a change that should move no figure (a reorganisation of
estimate/, a faster search) is checked on what a user sees.

  python benchmarks/same_answers.py --ref a7c4c96              # every question
  python benchmarks/same_answers.py --ref a7c4c96 --only llama  # the questions named so
  python benchmarks/same_answers.py --ref 89770c6 --now b3a41f0 --at-once  # two commits, together

The questions, each on a few steps: the table with no GPU emulated (tiny, --device cpu) and the
article table; for small models of the architecture matrix (tests/support/architecture_matrix.py,
written to a temporary folder; Llama and BERT twelve blocks deep, so that their estimates run
by probes of their blocks), --gpu-memory's table, search and stack, asked again with another
capacity or GPU (the first ask's runs kept), the stack alone on two GPUs, two workers at once;
and BERT-large's stack from docs/models/. Each side asks them in order in fresh processes with
a folder of kept runs of its own (ESTIMATE_CACHE), as one user would; the commit is checked out
into a temporary worktree (git worktree add) and run with this Python, and so is --now's commit
where one is given; --at-once asks both sides together, one process each (both then share the
machine, so their seconds compare with each other only). Compared: standard output
and error, the exit status and the estimate.json written, with what a clock decides left out
(the wall-time line, an estimate's seconds). It prints the seconds each side took and the lines
that differ; it only measures and prints.
"""
import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the matrix's configs and their tokenizer

from support.architecture_matrix import write_model  # noqa: E402

DEEP = 12  # blocks: the fewest periods the estimate by blocks takes (estimate/shortcuts/blocks.py)
MODELS = {"llama": ("Llama", DEEP), "gpt2": ("GPT-2", None), "bert": ("BERT", DEEP),
          "vit": ("ViT", None)}
TEXT = ["--seq-len", "32", "--batch-size", "8"]
LLAMA = ["--model", "{llama}", "--task", "causal-lm", *TEXT, "--steps", "04", "05h", "07"]
BERT = ["--model", "{bert}", *TEXT, "--steps", "03", "05c", "08"]
QUESTIONS = {  # name: the arguments of python -m estimate ({name}: that model's folder)
    "cpu-table": ["--preset", "tiny", "--device", "cpu", "--steps", "01", "04", "05c", "07"],
    "article-table": ["--steps", "01", "03", "05", "07"],
    "llama": [*LLAMA, "--gpu-memory", "120MiB"],
    "llama-again": [*LLAMA, "--gpu-memory", "90MiB", "--quiet"],
    "llama-stack-2-gpus": [*LLAMA, "--gpu-memory", "60MiB", "--stack-only", "--world-size", "2"],
    "gpt2-two-workers": ["--model", "{gpt2}", *TEXT, "--gpu-memory", "80MiB", "--steps", "03", "04",
                         "07", "--jobs", "2", "--quiet"],
    "bert": [*BERT, "--gpu-memory", "100MiB"],
    "bert-again-h100": [*BERT, "--gpu-memory", "60MiB", "--gpu", "h100"],
    "vit": ["--model", "{vit}", "--batch-size", "8", "--gpu-memory", "40MiB", "--steps", "01", "04",
            "09"],
    "vit-stack-2-gpus": ["--model", "{vit}", "--batch-size", "8", "--gpu-memory", "30MiB",
                         "--stack-only", "--world-size", "2"],
    "bert-large-stack": ["--model", "docs/models/bert-large-uncased", "--seq-len", "512",
                         "--batch-size", "16", "--gpu-memory", "24GB", "--stack-only"],
}
CLOCK = [(re.compile(r"^wall time .*$", re.M), "wall time (left out)"),
         (re.compile(r"\(\d+\.\d s\)"), "(seconds)")]  # an estimate's own time


def models(folder):
    """{name: folder} of MODELS' configs, written under `folder`."""
    written = {}
    for name, (architecture, blocks) in MODELS.items():
        path = write_model(folder / name, architecture)
        if blocks:
            config = json.loads((path / "config.json").read_text())
            key = "n_layer" if "n_layer" in config else "num_hidden_layers"
            (path / "config.json").write_text(json.dumps({**config, key: blocks}))
        written[name] = str(path)
    return written


def without_clock(text):
    for pattern, words in CLOCK:
        text = pattern.sub(words, text)
    return text


def ask(root, arguments, kept, results):
    """(seconds, {what: text}) of one question asked in `root`."""
    jobs = [] if "--jobs" in arguments else ["--jobs", "1"]  # one at a time: lines in order
    command = [sys.executable, "-m", "estimate", *arguments, *jobs, "--results-dir", str(results)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True,
                          env={**os.environ, "ESTIMATE_CACHE": str(kept)})
    seconds = time.perf_counter() - start
    written = results / "estimate.json"
    texts = {"stdout": done.stdout, "stderr": done.stderr,
             "estimate.json": written.read_text() if written.exists() else ""}
    return seconds, {"status": str(done.returncode),  # each side's results folder named alike
                     **{what: without_clock(text.replace(str(results), "RESULTS"))
                        for what, text in texts.items()}}


def ask_all(root, names, folder, paths, label, side):
    """{question: (seconds, answers)} for `root` (printed as `label`), in order, its runs kept and
    its results written in folders of its own, named by its `side` (`paths`: MODELS' folders,
    shared)."""
    found = {}
    for name in names:
        arguments = [word.format(**paths) for word in QUESTIONS[name]]
        results = folder / f"results-{side}" / name
        if results.exists():
            shutil.rmtree(results)
        results.mkdir(parents=True)
        found[name] = ask(root, arguments, folder / f"kept-{side}", results)
        print(f"  {label}: {name}: {found[name][0]:.1f} s", flush=True)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the commit whose answers are the reference")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="the questions whose names start so (default: all)")
    parser.add_argument("--now", metavar="COMMIT",
                        help="the commit whose answers are compared (default: this checkout)")
    parser.add_argument("--at-once", action="store_true",
                        help="ask both sides together, one process each, instead of one after the other")
    args = parser.parse_args()
    names = [name for name in QUESTIONS if not args.only or name.startswith(tuple(args.only))]
    with tempfile.TemporaryDirectory() as parent:
        parent = Path(parent)
        paths, trees = models(parent / "models"), []
        try:
            for label, commit in (("reference", args.ref), ("now", args.now)):
                trees.append(parent / label if commit else ROOT)
                if commit:
                    subprocess.run(["git", "worktree", "add", "--detach", str(trees[-1]), commit],
                                   cwd=ROOT, check=True, capture_output=True)
            sides = [(tree, names, parent, paths, label, side) for tree, label, side in
                     zip(trees, (args.ref, args.now or "this checkout"), ("reference", "now"))]
            with ThreadPoolExecutor(2 if args.at_once else 1) as pool:
                before, now = pool.map(lambda side: ask_all(*side), sides)
        finally:
            for tree in trees:
                if tree != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                                   capture_output=True)
    print(f"\n| question | {args.ref} | {args.now or 'now'} | status | stdout | stderr | estimate.json |\n"
          "|---|---:|---:|---|---|---|---|")
    differ = []
    for name in names:
        (old, reference), (new, answers) = before[name], now[name]
        same = {what: reference[what] == answers[what] for what in answers}
        differ += [(name, what) for what, alike in same.items() if not alike]
        print(f"| {name} | {old:.0f} s | {new:.0f} s | " + " | ".join(
            "same" if same[what] else "DIFFERENT" for what in answers)
            + " |" + ("" if reference["status"] == "0" else f" (exit {reference['status']})"))
    for name, what in differ:
        lines = difflib.unified_diff(before[name][1][what].splitlines(), now[name][1][what].splitlines(),
                                     f"{args.ref}: {name} {what}", f"now: {name} {what}", lineterm="")
        print("\n" + "\n".join(list(lines)[:80]))
    print(f"\n{len(names) - len({name for name, _ in differ})} of {len(names)} questions answered "
          "alike")


if __name__ == "__main__":
    main()
