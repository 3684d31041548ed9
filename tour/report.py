"""The tour's report: markdown tables and the two charts, built from a results directory's JSON.

  python -m tour.report [results]   # rebuild tour.md, tour.png, estimate.md, estimate.png

`python -m tour` calls this after its steps; run it alone to rebuild the report from records
already there (for instance after rerunning one script by hand). Every file is written to a
temporary name and renamed, so a reader never sees half a table or half an image.
"""
import argparse
import sys
from pathlib import Path

from common.atomic_write import write_text_atomically
from common.breakdown import BREAKDOWN_KEYS, MODEL_STATE_KEYS
from estimate.records import (
    ESTIMATE_FILE,
    MIB,
    PER_PARAMETER,
    PER_PARAMETER_NOTE,
    estimate_table,
    load_estimates,
    markdown_table,
    unpredicted_study_figures,
)
from steps import STEPS, step_id, with_parent
from tour.charts import estimate_figure, save_png, tour_figure
from tour.machine import machine_line
from tour.records import STACK_SUFFIX, in_units, load_step_rows, read_tour, shown

TOUR_TABLE, TOUR_CHART = "tour-table.md", "tour-chart.png"
ESTIMATE_TABLE, ESTIMATE_CHART = "estimate-table.md", "estimate-chart.png"
REPORT_FILES = (TOUR_TABLE, TOUR_CHART, ESTIMATE_TABLE, ESTIMATE_CHART)
ERROR_CELL_CHARS = 160  # the full error lines go below the table


def cell(text):
    """`text` made safe for one markdown table cell: one line, no column breaks, not too long."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= ERROR_CELL_CHARS else text[:ERROR_CELL_CHARS - 3] + "..."


WHOLE_STACK = " (whole stack)"


def step_name(row):
    """The table's step cell: "05a_adamw_8bit (branch of 04)", "07_fsdp (2 processes, cpu)",
    "10_combined (whole stack)"."""
    name = (f"{row.script.removesuffix(STACK_SUFFIX)}{WHOLE_STACK}"
            if row.script.endswith(STACK_SUFFIX) else with_parent(row.script))
    return name + (f" ({row.processes()})" if row.processes() else "")


def script_of(step_cell):
    """The record a table's step cell shows (step_name read back): "10_combined_stack" for
    "10_combined (whole stack)"."""
    stem = step_cell.strip().split(" ", 1)[0]
    return stem + STACK_SUFFIX if WHOLE_STACK in step_cell else stem


def entry(row):
    """The row's step in steps.py, or None for a script it does not list."""
    return STEPS.get(step_id(row.script))


COMBINED_NOTE = "The combined script (10), one process each run: "  # how its paragraph starts


def combined_note(rows):
    """What the combined script's rows ran: its switches, as tour.json says them."""
    runs = [row for row in rows if row.switches is not None and getattr(entry(row), "combined", False)]
    if not runs:
        return ""
    said = [f"{step_name(row)}: " + (f"`{' '.join(row.switches)}`" if row.switches else
                                     "no switch (03's bfloat16 run, created on its device as 06)")
            for row in runs]
    return (COMBINED_NOTE + "; ".join(said)
            + (". The whole stack: every switch of the estimate's chain (estimate/stack.py) that "
               "one run combines" if any(row.switches for row in runs) else "") + ".\n")


def baseline_peak(rows):
    """01's peak, which the other steps are compared with, if 01 ran and measured one."""
    return next((row.peak_bytes for row in rows if row.script.startswith("01_") and row.ok
                 and row.peak_bytes), None)


def status(row):
    return "ok" if row.ok else cell(f"failed: {row.error or 'unknown error'}")


def interval_cell(row):
    """The accuracy's 95% interval in percent, "93.1-97.4%", or "n/a" without a test count."""
    interval = row.accuracy_interval()
    if interval is None:
        return "n/a"
    low, high = (100 * bound for bound in interval)
    return f"{low:.1f}-{high:.1f}%"


def interval_note(rows):
    """What the interval column means, and what one test sample weighs when the steps agree on it.

    Accuracies of a few hundred samples differ by chance from step to step; the note says how
    much, so that a reader does not take a point or two for an effect of the step.
    """
    counts = {row.test_samples for row in rows if row.accuracy_interval() is not None}
    samples = (f"{next(iter(counts))} test samples, so one sample is "
               f"{100 / next(iter(counts)):.2f} percentage points"
               if len(counts) == 1 else "each step's test samples")
    return ('"95% interval": the Wilson score interval of the test accuracy measured on '
            f"{samples}: the accuracies on unseen samples of the same kind that this measurement "
            "is consistent with, at 95% confidence. Where two steps' intervals overlap, the "
            "difference between their accuracies is not evidence that the step changed accuracy: "
            "another draw of test samples could reverse it. n/a: the record does not say how many "
            "samples were tested.\n")


LOSS_NOTE = ('--task causal-lm: "test loss" is the mean next-token cross-entropy (nats) over '
             "the test split's predicted tokens, padding left out; \"perplexity\" is exp(loss). "
             "A model drawn from scratch starts near ln(vocabulary): 10.33 for 30,522 tokens.\n")


def tour_table(rows):
    """A line per step: peak memory, ratio to 01, breakdown (all MiB), time, accuracy with its
    95% interval, status."""
    baseline = baseline_peak(rows)
    state = len(MODEL_STATE_KEYS)  # the breakdown's first columns; bytes per parameter after them
    categories = [key.replace("_", " ") for key in BREAKDOWN_KEYS]
    losses = any(row.test_loss is not None for row in rows)  # --task causal-lm
    checked = any(row.predicted_allocated_bytes is not None for row in rows)  # a GPU's tour
    header = ["step", "peak MiB", "vs 01", *categories[:state], PER_PARAMETER, *categories[state:],
              *(["GPU allocated MiB", "predicted MiB", "measured / predicted"] if checked else []),
              "training time", *(["test loss", "perplexity"] if losses
                                 else ["test accuracy", "95% interval"]), "status"]
    lines = []
    for row in rows:
        score = ([shown(row.test_loss, ".4f"), shown(row.test_perplexity, ",.1f")] if losses
                 else [shown(in_units(row.test_accuracy, 0.01), ".1f", "%"), interval_cell(row)])
        ratio = row.peak_bytes / baseline if baseline and row.peak_bytes is not None else None
        mebibytes = [shown(in_units(row.breakdown_bytes[key], MIB), ",.2f")
                     for key in BREAKDOWN_KEYS]
        lines.append([step_name(row),
                      shown(in_units(row.peak_bytes, MIB), ",.2f"),
                      shown(ratio, ".2f", "x"),
                      *mebibytes[:state], shown(row.model_state_bytes_per_parameter, ".2f"),
                      *mebibytes[state:],
                      *(gpu_check_cells(row) if checked else []),
                      shown(row.train_seconds, ".1f", " s"),
                      *score,
                      status(row)])
    return markdown_table(header, lines, "l" + "r" * (len(header) - 2) + "l")


def gpu_check_cells(row):
    """On a GPU with --check-estimate: the allocator's peak over the tracked steps, the
    estimate's prediction of it, and their ratio."""
    measured, predicted = row.measured_allocated_bytes, row.predicted_allocated_bytes
    ratio = measured / predicted if measured is not None and predicted else None
    return [shown(in_units(measured, MIB), ",.2f"), shown(in_units(predicted, MIB), ",.2f"),
            shown(ratio, ".3f")]


def error_details(title, error_lines):
    return f"### {title}\n\n```text\n" + "\n".join(error_lines) + "\n```\n"


def estimate_note(estimate_outcome):
    """One line on how this tour's GPU estimate ended."""
    if not estimate_outcome:
        return ""
    state = estimate_outcome.get("status")
    if state == "ok":
        return (f"GPU memory prediction for the article preset: see {ESTIMATE_TABLE} and "
                f"{ESTIMATE_CHART}.\n")
    if state == "skipped":
        return f"GPU memory prediction: skipped ({estimate_outcome.get('error') or 'n/a'}).\n"
    return f"GPU memory prediction: failed: {cell(estimate_outcome.get('error') or 'n/a')}\n"


SYNCHRONIZING_NOTE = (" and ".join(step.id for step in STEPS.values() if step.synchronizes)
                      + " on a GPU: their training times include a wait for the GPU per "
                      "parameter in every optimizer step (bitsandbytes 0.50 synchronizes after "
                      "each update; torch.optim.Adafactor reads numbers back with .item()), not a "
                      "cost of storing less optimizer state.\n")


def synchronizes(row):
    """Whether the row's step has an optimizer that waits for the GPU (steps.py says which)."""
    return getattr(entry(row), "synchronizes", False)


def tour_markdown(rows, tour=None):
    """tour.md: what was measured and how, the table, and the end of each failed step's stderr."""
    tour = tour or {}
    presets = sorted({row.preset for row in rows if row.preset})
    devices = sorted({row.device for row in rows if row.device})
    parts = ["# The tour: peak memory, training time and test accuracy per step\n",
             f"Preset {', '.join(presets) or 'n/a'}, device {', '.join(devices) or 'n/a'}. "
             "Peak memory: the tensors alive at the peak of the first two optimizer steps "
             "(the largest over processes), MiB = 2^20 bytes; \"vs 01\" divides it by "
             "01_baseline's. Training time leaves out those two measured steps. "
             + PER_PARAMETER_NOTE + "\n"]
    flags = tour.get("passed_flags") or []
    shortened = [f"{flag} {value}" for flag, value in zip(flags[::2], flags[1::2])
                 if flag in ("--max-steps", "--epochs")]  # not --preset or --device
    if shortened:
        parts.append(f"Quick run ({' '.join(shortened)}): training time and test "
                     "accuracy are not those of full training.\n")
    if any(isinstance(step, dict) and step.get("beside") for step in tour.get("steps") or []):
        parts.append("Single-process steps ran two at a time (a CPU tour without --publish): "
                     "their training times include sharing the cores; `python -m tour "
                     "--one-at-a-time` (or `--publish`) runs each alone.\n")
    launch = tour.get("sharded_launch")
    if isinstance(launch, dict) and launch.get("reason") and any(row.processes() for row in rows):
        parts.append(f"Sharded steps (07 on): {launch['reason']}.\n")
    if any(row.test_loss is not None for row in rows):
        parts.append(LOSS_NOTE)
    else:
        parts.append(interval_note(rows))
    parts.append(tour_table(rows) if rows else "No steps ran.\n")
    parts.append(machine_paragraph(tour))
    parts.append(combined_note(rows))
    if "cuda" in devices and any(synchronizes(row) for row in rows):
        parts.append(SYNCHRONIZING_NOTE)
    estimate_outcome = tour.get("estimate")
    parts.append(estimate_note(estimate_outcome))
    failures = [(row.script, row.error_lines) for row in rows if row.error_lines]
    if estimate_outcome and estimate_outcome.get("error_lines"):
        failures.append(("estimate", estimate_outcome["error_lines"]))
    if failures:
        parts.append("## Errors (the end of each failed step's stderr)\n")
        parts.extend(error_details(title, lines) for title, lines in failures)
    return "\n".join(part for part in parts if part)


def machine_paragraph(tour):
    """The line under a table that names the machine the tour recorded in tour.json, or ""."""
    line = machine_line((tour or {}).get("machine"))
    return f"{line}\n" if line else ""


def estimate_markdown(estimates, tour=None):
    """estimate.md: the predictions, each beside the study's figure for the same setting, and
    the machine of the tour (tour.json) that made them."""
    parts = ["# Predicted peak GPU memory of training\n",
             "Predicted on fake tensors by `python -m estimate`, without a GPU: allocated "
             "as `torch.cuda.max_memory_allocated`, reserved as `torch.cuda.max_memory_reserved`; "
             "GB = 10^9 bytes, MiB = 2^20. \"study\" is the 2023 study's published "
             "`max_memory_reserved` for the same script and setting (one A100, PyTorch 2.1 "
             "nightly), only for predictions of that GPU. \"creation\" is the "
             "GPU memory allocated while the model is built, per process (05 builds it in "
             "float32 in host memory, so its GPU figure equals 06's; 07-09 build it on the meta "
             "device and allocate only their shards, offloaded ones in host memory, and stage "
             "each whole parameter on the GPU in turn for its broadcast). "
             + PER_PARAMETER_NOTE + " Here the GPU's bytes: what 08-09 offload is not counted; "
             "\"activations\" is the activations' part of the allocated peak.\n",
             estimate_table(estimates), machine_paragraph(tour)]
    missing = unpredicted_study_figures(estimates)
    if missing:
        parts.append("Published by the study but not predicted here: " + "; ".join(
            f"{script} at batch {batch}" + (f", {accum} micro-batches" if accum > 1 else "")
            + f": {gb:.2f} GB" for (script, batch, accum), gb in missing.items()) + ".\n")
    return "\n".join(part for part in parts if part)


def write_report(results_dir):
    """Write the report files into `results_dir`; returns what to print (tables and notes)."""
    results_dir = Path(results_dir)
    rows = load_step_rows(results_dir)
    tour = read_tour(results_dir)
    tour_text = tour_markdown(rows, tour)
    write_text_atomically(results_dir / TOUR_TABLE, tour_text)
    save_png(tour_figure(rows), results_dir / TOUR_CHART)
    estimates, problem = load_estimates(results_dir)
    if not estimates:
        problem = problem or f"{ESTIMATE_FILE} holds no predictions"
        return tour_text + f"\nGPU estimate chart skipped: {problem}.\n"
    estimate_text = estimate_markdown(estimates, tour)
    write_text_atomically(results_dir / ESTIMATE_TABLE, estimate_text)
    save_png(estimate_figure(estimates), results_dir / ESTIMATE_CHART)
    return tour_text + "\n" + estimate_text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", nargs="?", default="results",
                        help="the directory with the JSON records (default: results)")
    args = parser.parse_args(argv)
    if not Path(args.results_dir).is_dir():
        parser.error(f"{args.results_dir} is not a directory; run `python -m tour` first")
    print(write_report(args.results_dir))


if __name__ == "__main__":
    sys.exit(main())
