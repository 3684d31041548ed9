"""Benchmark: the tables of docs/combined.md's "The stack: what fits" section, from runs of 10_combined.py.

  python benchmarks/stack_tables.py [chain] [stacks] [article] [--jobs 2]

chain    each prefix of the stack's chain (estimate/stack.py) as a run of 10_combined.py on
         tiny-text under --task causal-lm on this CPU, CPU_STEPS optimizer steps of batch 32 (in 4
         micro-batches where the prefix accumulates): peak, model state per parameter, training
         time, test loss; beside its predicted peak for Llama-3.2-1B at 2,048 tokens on one A100
         (batch 8; accumulating prefixes in micro-batches of 1, as the stack's walk tries them)
stacks   the stack `python -m estimate --stack-only` picks for Llama-3.2-1B and Llama-3.1-8B at
         2,048 tokens, batch 8, on one 24 GB GPU, one 80 GB GPU and eight 80 GB GPUs
article  the study's setting (ViT-L/16, article preset) on one A100: each prefix's predicted
         peak at batch 64 in micro-batches of 1 (the optimizer stepped in backward takes the
         batch at once), with --offload too, and at batch 16 in 4 micro-batches

It prints Markdown and the wall time of each part; nothing is written to results/.
"""
import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimate import stack  # noqa: E402
from estimate.command import main as estimate_main  # noqa: E402
from estimate.question import Question  # noqa: E402
from estimate.records import GB, MIB  # noqa: E402
from steps import STEPS  # noqa: E402

COMBINED = STEPS["10"].path
MODELS = {"Llama-3.2-1B": ROOT / "docs/models/llama-3.2-1b",
          "Llama-3.1-8B": ROOT / "docs/models/llama-3.1-8b"}
LLM = ["--task", "causal-lm", "--seq-len", "2048"]
GPUS = (("one 24 GB GPU", "24GB", 1), ("one 80 GB GPU", "80GB", 1), ("eight 80 GB GPUs", "80GB", 8))
LM_BATCH, CPU_ACCUM_STEPS, CPU_STEPS = 8, 4, 4  # tiny-text's causal-lm steps take seconds each on a CPU


def chain_rows(task):
    """(link, switches) for each prefix of the chain that `task` runs."""
    return [(link, switches) for link, switches, _ in stack.prefixes(task) if switches is not None]


def accumulates(switches):
    return ("--optimizer-in-backward", True) not in switches


def predicted(argv, micro, world=1):
    """The predicted A100 reserved bytes of 10_combined.py with `argv` in micro-batches of
    `micro` per process (two of them when the run accumulates, which peak as any number of
    them do: estimate/question.py), and None; or None and why not."""
    accumulates = "--optimizer-in-backward" not in argv
    record, problem, _ = Question(COMBINED, argv, world, "a100", accumulates).answer(micro)
    return (record["reserved_bytes"], None) if record else (None, problem)


def measured(switches, results_dir):
    """The record of a CPU run of 10_combined.py on tiny-text under causal-lm with `switches`."""
    accum = ["--accum-steps", str(CPU_ACCUM_STEPS)] if accumulates(switches) else []
    command = [sys.executable, str(COMBINED), "--preset", "tiny-text", "--task", "causal-lm",
               "--device", "cpu", "--max-steps", str(CPU_STEPS), "--results-dir", str(results_dir), *accum,
               *stack.argv_of(switches)]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((Path(results_dir) / "10_combined.json").read_text())


def chain_table(runs=True):
    model = ["--model", str(MODELS["Llama-3.2-1B"]), *LLM, "--device", "cuda"]
    lines = ["| prefix (adds) | CPU peak, tiny-text | model state per parameter | "
             f"time of steps 3-{CPU_STEPS} | test loss | predicted A100 peak, Llama-3.2-1B |",
             "|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as results_dir:
        for link, switches in chain_rows("causal-lm"):
            record = measured(switches, results_dir) if runs else None
            micro = 1 if accumulates(switches) else LM_BATCH
            reserved, problem = predicted([*model, *stack.argv_of(switches)], micro)
            cells = ("| not run (--predicted-only) " * 4 if record is None else
                     f"| {record['peak_memory_bytes'] / MIB:.2f} MiB "
                     f"| {record['model_state_bytes_per_parameter']:.2f} "
                     f"| {record['train_seconds']:.1f} s | {record['test_loss']:.3f} ")
            lines.append(f"| {link.name} (`{' '.join(stack.argv_of(link_switches(link))) or 'defaults'}`) "
                         f"{cells}| {f'{reserved / GB:.2f} GB' if reserved else problem} |")
    return "\n".join(lines)


def link_switches(link):
    return [(flag, value) for flag, value in link.sets if value is not stack.REMOVE]


def stacks_table(jobs):
    lines = ["| model | GPUs | the stack | its command | adapters |", "|---|---|---|---|---|"]
    for name, directory in MODELS.items():
        for words, size, world in GPUS:
            argv = ["--model", str(directory), *LLM, "--batch-size", str(LM_BATCH), "--gpu-memory",
                    size, "--stack-only", "--jobs", str(jobs), "--results-dir", tempfile.gettempdir()]
            if world > 1:
                argv += ["--world-size", str(world)]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                estimate_main(argv)
            text = printed.getvalue().splitlines()
            answer = next(line for line in text if line.startswith("The stack:"))
            command = text[text.index(answer) + 1].strip() if "fits batch" in answer else ""
            adapters = next((line for line in text if line.startswith("with adapters")), "")
            lines.append(f"| {name} | {words} | {answer.removeprefix('The stack: ')} "
                         f"| `{command.replace(str(directory), 'MODEL')}` "
                         f"| {adapters.removeprefix('with adapters (they train something else): ')} |")
            print(f"  {name}, {words}: done", file=sys.stderr, flush=True)
    return "\n".join(lines)


def article_table():
    model = ["--preset", "article", "--device", "cuda"]
    lines = ["| prefix | batch 64, micro-batches of 1 | batch 16, 4 micro-batches of 4 |",
             "|---|---:|---:|"]
    least = {}
    for link, switches in chain_rows("classification"):
        argv = [*model, *stack.argv_of(switches)]
        together = "" if accumulates(switches) else " (the batch at once)"
        cells = []
        for batch, micro in ((64, 1), (16, 4)):
            reserved, problem = predicted(argv, micro if together == "" else batch)
            cells.append(f"{reserved / GB:.3f} GB{together}" if reserved else f"failed: {problem}")
            if reserved and reserved < least.get(batch, (float("inf"),))[0]:
                least[batch] = (reserved, link.name)
        lines.append(f"| {link.name} | {' | '.join(cells)} |")
    lines += ["", *(f"least at batch {batch}: {reserved / GB:.3f} GB ({name})"
                    for batch, (reserved, name) in least.items())]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", choices=["chain", "stacks", "article"],
                        default=["chain", "stacks", "article"])
    parser.add_argument("--jobs", type=int, default=2, help="estimates at once (stacks)")
    parser.add_argument("--predicted-only", action="store_true",
                        help="chain: the predicted column only, without the CPU runs")
    args = parser.parse_args()
    for part in args.parts:
        start = time.perf_counter()
        text = {"chain": lambda: chain_table(not args.predicted_only), "article": article_table,
                "stacks": lambda: stacks_table(args.jobs)}[part]()
        print(f"\n### {part}\n\n{text}\n\n({part}: {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
