"""The numbers a tour leaves behind, read from its JSON files into rows; anything missing is None.

A results directory holds one record per numbered script (written by the script itself; the
tour keeps the combined script's run with the whole stack as 10_combined_stack.json), tour.json
(written by `python -m tour`: which steps ran, in what order, and how each ended) and
estimate.json (written by `python -m estimate`; estimate/records.py reads it). Records from other
versions of the scripts may lack fields or hold nulls; every reader here turns those into None
instead of failing.
"""
import json
import math
from dataclasses import dataclass, field

from common.breakdown import BREAKDOWN_KEYS
from estimate.records import breakdown_of, finite, whole_number

TOUR_FILE = "tour.json"
RECORD_PATTERN = "[0-9][0-9]_*.json"  # the numbered scripts' records
STACK_SUFFIX = "_stack"  # 10_combined_stack: the tour's run of 10_combined.py with the whole stack
Z_95 = 1.959964  # the standard normal's 97.5th percentile: a two-sided 95% interval

# What results/<script>.json holds (common/summary.py's report writes it), one home: field, when
# it is there, what it means. docs/development.md lists these (tested); "always" fields are in
# every record.
RECORD_FIELDS = {
    "script": ("always", "the script's name, 04_grad_accum"),
    "preset": ("always", "tiny, tiny-text, article or imdb"),
    "model": ("always", "--model's name or directory, or null for the preset's model"),
    "reshard_after_forward": ("always", "07-09's --reshard-after-forward, else null"),
    "device": ("always", "cpu or cuda"),
    "world_size": ("always", "processes"),
    "batch_size": ("always", "samples per optimizer step, over all processes"),
    "accum_steps": ("always", "micro-batches per optimizer step"),
    "peak_memory_bytes": ("always", "the tracked peak of the first two optimizer steps "
                          "(the highest over processes)"),
    "breakdown_bytes": ("always", "what fills that peak: parameters, gradients, "
                        "optimizer_state, activations, temporaries"),
    "parameter_count": ("always", "the model's parameters"),
    "trainable_parameter_count": ("always", "those training updates (fewer where weights are "
                                  "frozen: 07a's LoRA trains adapters and the head)"),
    "model_state_bytes_per_parameter": ("always", "parameters, gradients and optimizer state at "
                                        "the peak per parameter (of a process's share)"),
    "tracked_steps": ("always", "optimizer steps the meter tracked"),
    "memory_counted_by": ("always", "MemTracker, or the allocator's events under --compile"),
    "peak_without_scratch_bytes": ("under --compile", "the allocator's peak without the scratch "
                                   "space an operation frees before it returns, which MemTracker "
                                   "and --estimate do not count (the highest over processes)"),
    "cuda_max_allocated_bytes": ("on CUDA", "torch.cuda.max_memory_allocated over the whole run "
                                 "(the highest over processes)"),
    "cuda_max_reserved_bytes": ("on CUDA", "torch.cuda.max_memory_reserved, likewise"),
    "cuda_steps_max_allocated_bytes": ("on CUDA", "torch.cuda.max_memory_allocated over the "
                                       "tracked steps alone: the window --estimate predicts"),
    "cuda_steps_max_reserved_bytes": ("on CUDA", "torch.cuda.max_memory_reserved, likewise"),
    "predicted_gpu": ("--check-estimate", "the GPU the estimate emulated, for the one the run had"),
    "predicted_allocated_bytes": ("--check-estimate", "the estimate's allocated peak of the same run"),
    "predicted_reserved_bytes": ("--check-estimate", "the estimate's reserved peak"),
    "measured_over_predicted_allocated": ("--check-estimate", "cuda_steps_max_allocated_bytes / "
                                          "predicted_allocated_bytes"),
    "measured_over_predicted_reserved": ("--check-estimate", "likewise, reserved"),
    "estimate_problem": ("--check-estimate, when the estimate failed", "what went wrong"),
    "rank_peak_memory_bytes": ("several processes", "each process's tracked peak"),
    "rank_cuda_max_allocated_bytes": ("several processes on CUDA", "each process's allocated peak"),
    "rank_cuda_max_reserved_bytes": ("several processes on CUDA", "each process's reserved peak"),
    "rank_cuda_steps_max_allocated_bytes": ("several processes on CUDA", "likewise, tracked steps"),
    "rank_cuda_steps_max_reserved_bytes": ("several processes on CUDA", "likewise, tracked steps"),
    "init_peak_memory_bytes": ("always", "the peak while the model was created, on the device"),
    "init_host_peak_memory_bytes": ("always", "the same in host memory (on a CPU, the device figure again)"),
    "rank_init_peak_memory_bytes": ("several processes", "each process's creation peak"),
    "train_seconds": ("always", "training time, less the two tracked steps"),
    "task": ("always", "classification, or causal-lm (--task): what the model learns"),
    "data": ("always",
             "preset: the preset's data set; synthetic: random samples of its shapes (--data)"),
    "test_accuracy": ("always",
                      "accuracy on the test split, 0 to 1 (null under causal-lm or --data synthetic)"),
    "test_samples": ("always", "how many test samples that accuracy counts (null under causal-lm)"),
    "test_loss": ("under causal-lm",
                  "the mean next-token loss on the test split, in nats (not with --data synthetic)"),
    "test_perplexity": ("under causal-lm", "exp(test_loss)"),
    "test_tokens": ("under causal-lm", "how many predicted tokens that loss averages"),
    "steps": ("always", "optimizer steps taken"),
    "epochs": ("always", "--epochs"),
    "seed": ("always", "--seed"),
    "torch_version": ("always", "torch.__version__"),
    "losses": ("always", "the training loss of each optimizer step"),
    "final_lr": ("always", "the learning rate after the last step"),
}


def shown(value, spec, suffix=""):
    """`value` formatted with `spec`, or "n/a" when missing: how tables and charts show a gap."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def in_units(value, unit):
    """`value` divided by `unit` (bytes by MIB, a fraction by 0.01 for percent), or None."""
    return None if value is None else value / unit


def wilson_interval(proportion, trials, z=Z_95):
    """The Wilson score interval (low, high) around a proportion measured over `trials` samples.

    Chosen over the textbook normal interval p +/- z*sqrt(p(1-p)/n) because that one collapses to
    zero width at 0% and 100% and can leave [0, 1]; Wilson's stays inside [0, 1] and keeps a
    sensible width at the extremes, which is where accuracies on small test sets often sit.
    """
    z2_over_n = z * z / trials
    centre = (proportion + z2_over_n / 2) / (1 + z2_over_n)
    half_width = (z / (1 + z2_over_n)
                  * math.sqrt(proportion * (1 - proportion) / trials + z2_over_n / (4 * trials)))
    # it always contains the proportion; the clamps only undo float rounding at 0% and 100%
    return (max(0.0, min(proportion, centre - half_width)),
            min(1.0, max(proportion, centre + half_width)))


def read_json(path):
    """(contents, None), or (None, why it could not be read)."""
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"no {path.name}"
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return None, f"unreadable {path.name}: {error}"


@dataclass
class StepRow:
    """One numbered script's outcome: measurements in bytes, seconds and fractions, or None."""
    script: str
    ok: bool = True
    error: str | None = None           # one line, for the table
    error_lines: list = field(default_factory=list)  # the end of its stderr, for the details
    preset: str | None = None
    device: str | None = None
    world_size: int | None = None
    peak_bytes: float | None = None
    breakdown_bytes: dict = field(default_factory=lambda: dict.fromkeys(BREAKDOWN_KEYS))
    train_seconds: float | None = None
    test_accuracy: float | None = None
    test_samples: int | None = None  # how many test samples the accuracy was measured on
    test_loss: float | None = None  # --task causal-lm: the next-token loss, in place of accuracy
    test_perplexity: float | None = None
    model_state_bytes_per_parameter: float | None = None  # see common.memory
    switches: list | None = None  # 10_combined.py's switches the tour passed (tour.json)
    measured_allocated_bytes: float | None = None  # on a GPU: cuda_steps_max_allocated_bytes
    predicted_allocated_bytes: float | None = None  # --check-estimate's prediction of it

    def processes(self):
        """"2 processes, cpu" for a step run in several processes (and on which device), else ""."""
        if not self.world_size or self.world_size < 2:
            return ""
        return f"{self.world_size} processes" + (f", {self.device}" if self.device else "")

    def accuracy_interval(self):
        """The 95% interval (low, high) of the test accuracy, or None without accuracy or count.

        An accuracy from a few hundred images is itself uncertain; without the interval a reader
        cannot tell a real change of accuracy between steps from the luck of the test draw.
        """
        if self.test_accuracy is None or not 0 <= self.test_accuracy <= 1 or not self.test_samples:
            return None
        return wilson_interval(self.test_accuracy, self.test_samples)


def step_row(script, record, outcome=None):
    """Join a script's record (a dict, or None if it wrote none) with how its tour step ended."""
    outcome = outcome or {}
    record = record if isinstance(record, dict) else {}
    world_size = whole_number(record, "world_size")
    test_samples = whole_number(record, "test_samples")
    return StepRow(
        script=script,
        ok=outcome.get("status", "ok") == "ok",
        error=outcome.get("error"),
        error_lines=list(outcome.get("error_lines") or []),
        preset=record.get("preset"),
        device=record.get("device"),
        world_size=world_size or None,
        peak_bytes=finite(record.get("peak_memory_bytes")),  # the highest over processes
        breakdown_bytes=breakdown_of(record),
        train_seconds=finite(record.get("train_seconds")),
        test_accuracy=finite(record.get("test_accuracy")),
        test_samples=test_samples if test_samples and test_samples > 0 else None,
        test_loss=finite(record.get("test_loss")),
        test_perplexity=finite(record.get("test_perplexity")),
        model_state_bytes_per_parameter=finite(record.get("model_state_bytes_per_parameter")),
        measured_allocated_bytes=finite(record.get("cuda_steps_max_allocated_bytes")),
        predicted_allocated_bytes=finite(record.get("predicted_allocated_bytes")),
        switches=([str(word) for word in outcome["switches"]]
                  if isinstance(outcome.get("switches"), list) else None),
    )


def read_tour(results_dir):
    """tour.json as a dict, or None when the directory holds no (readable) tour."""
    tour, _ = read_json(results_dir / TOUR_FILE)
    return tour if isinstance(tour, dict) else None


def load_step_rows(results_dir):
    """One row per step of the tour in `results_dir`, in the order it ran.

    Without tour.json (scripts run by hand), one row per record found, in script order. A step the
    tour saw succeed whose record cannot be read is shown as failed, with the reason.
    """
    tour = read_tour(results_dir)
    if tour is None:
        outcomes = [{"script": path.stem} for path in sorted(results_dir.glob(RECORD_PATTERN))]
    else:
        outcomes = [step for step in tour.get("steps", [])
                    if isinstance(step, dict) and "script" in step]
    rows = []
    for outcome in outcomes:
        record, problem = read_json(results_dir / f"{outcome['script']}.json")
        row = step_row(outcome["script"], record, outcome)
        if row.ok and problem:
            row.ok, row.error = False, problem
        rows.append(row)
    return rows
