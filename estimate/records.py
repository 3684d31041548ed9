"""Estimate records: what `python -m estimate` and a script's `--estimate` write to estimate.json,
and the one way they are read back, compared with the study and shown (the estimate's table, the
tour's estimate.md and its chart), and sizes in words.

A record is a dict (estimate/predict.py makes it). Records of other versions may lack fields or
hold nulls: they read as None, shown as "n/a".
"""
import fcntl
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic_write import write_json_atomically
from common.breakdown import BREAKDOWN_KEYS
from steps import with_parent

ESTIMATE_FILE = "estimate.json"
KEPT = Path("results") / ESTIMATE_FILE  # python -m estimate's (its --results-dir): said on Ctrl-C
GB = 10**9   # the study published decimal gigabytes
MIB = 2**20
PER_PARAMETER = "model state B/param"  # tables' column of model_state_bytes_per_parameter
PER_PARAMETER_NOTE = (
    f'"{PER_PARAMETER}": the parameters, gradients and optimizer state at the peak, in bytes per '
    "parameter: float32 weights with Adam hold 16 (4, 4 for the gradient, 8 for Adam's two "
    "moments), bfloat16 ones 8, and 12 and 6 at a peak that comes before the gradients exist. "
    "With N processes sharding the model, per parameter of a process's 1/N share (gathered "
    "weights add to it): divide by N for its bytes per parameter of the whole model.")

# a record replaces an older one with the same values of these
RECORD_KEY = ("script", "preset", "model", "reshard_after_forward", "device", "gpu", "world_size",
              "batch_size", "accum_steps")
# where the study measured: the article preset on one A100 (records from before --gpu: an A100)
STUDY_SETTING = {"preset": "article", "world_size": 1, "device": "cuda", "gpu": "A100"}
# The study's published peak-memory figures, for comparison only (never fitted to): each its
# `torch.cuda.max_memory_reserved()` on an A100 with a PyTorch 2.1 nightly, one epoch of
# torchvision's ViT-L/16 on CIFAR-10 at 224 px, in GB, from the study's own logs (published_gb
# says when a prediction is compared with one): (script, batch size, accumulation steps) -> GB
STUDY_RESERVED_GB = {
    ("01_baseline", 64, 1): 26.84,
    ("02_mixed_precision", 64, 1): 18.21,
    ("03_bf16", 64, 1): 13.82,
    ("03_bf16", 16, 1): 5.69,
    ("04_grad_accum", 16, 4): 3.91,
    ("05_sgd_cosine", 16, 4): 2.02,  # the study's headline, "about 2 GB": SGD, 4 micro-batches
}


def finite(value):
    """`value` if it is a finite number, else None (missing, null, NaN, text, a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def whole_number(record, name):
    """`record[name]` as an int, or None when it is missing or not a finite number."""
    value = finite(record.get(name))
    return int(value) if value is not None else None


def breakdown_of(record):
    """A record's `breakdown_bytes` with every category present: a number, or None if missing."""
    breakdown = record.get("breakdown_bytes")
    breakdown = breakdown if isinstance(breakdown, dict) else {}
    return {key: finite(breakdown.get(key)) for key in BREAKDOWN_KEYS}


def in_study_setting(record):
    """Whether a record (or the settings of one to make) is of the study's own setting."""
    return all(record.get(name, "A100" if name == "gpu" else None) == value
               for name, value in STUDY_SETTING.items())


def published_gb(record):
    """The study's max_memory_reserved (GB) for this record's setting, or None: only a record of
    the study's own setting (STUDY_SETTING) at a batch and accumulation it published."""
    if not in_study_setting(record):
        return None
    return STUDY_RESERVED_GB.get((record.get("script"), record.get("batch_size"),
                                  record.get("accum_steps") or 1))


def size_text(nbytes):
    """Bytes in words: "26.50 GB" (10^9, the study's unit) from a tenth of one, else "12.3 MiB";
    "n/a" when missing."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB / 10 else f"{nbytes / MIB:.1f} MiB"


@dataclass
class Estimate:
    """One record as read back: bytes as the GPU (or the CPU, under --device cpu) counts them,
    None where the record does not say, and the study's figure for its setting if any."""
    script: str
    preset: str | None = None
    device: str | None = None
    world_size: int | None = None
    batch_size: int | None = None
    accum_steps: int | None = None
    reshard_after_forward: bool | None = None
    allocated_bytes: float | None = None
    reserved_bytes: float | None = None
    published_gb: float | None = None
    breakdown_bytes: dict = field(default_factory=lambda: dict.fromkeys(BREAKDOWN_KEYS))
    init_allocated_bytes: float | None = None  # model creation's peak, per process
    model_state_bytes_per_parameter: float | None = None  # the device's, at the peak

    def setting(self, separator=", "):
        """The run predicted, in words: "batch 16, 4 micro-batches, 4 GPUs"."""
        parts = ["batch n/a" if self.batch_size is None else f"batch {self.batch_size}"]
        if self.accum_steps and self.accum_steps > 1:
            parts.append(f"{self.accum_steps} micro-batches")
        if self.reshard_after_forward is False:
            parts.append("gathered weights kept to backward")
        if self.world_size and self.world_size > 1:
            parts.append(f"{self.world_size} processes" if self.device == "cpu"
                         else f"{self.world_size} GPUs")
        return separator.join(parts)

    def ratio(self):
        """Predicted reserved over the study's figure, or None where there is none."""
        if self.reserved_bytes is None or not self.published_gb:
            return None
        return self.reserved_bytes / GB / self.published_gb


def read_estimate(record):
    """An Estimate from one record (a dict)."""
    reshard = record.get("reshard_after_forward")
    return Estimate(
        script=str(record.get("script", "?")), preset=record.get("preset"),
        device=record.get("device"), world_size=whole_number(record, "world_size"),
        batch_size=whole_number(record, "batch_size"),
        accum_steps=whole_number(record, "accum_steps"),
        reshard_after_forward=reshard if isinstance(reshard, bool) else None,
        allocated_bytes=finite(record.get("allocated_bytes")),
        reserved_bytes=finite(record.get("reserved_bytes")), published_gb=published_gb(record),
        breakdown_bytes=breakdown_of(record),
        init_allocated_bytes=finite(record.get("init_allocated_bytes")),
        model_state_bytes_per_parameter=finite(record.get("model_state_bytes_per_parameter")))


def load_estimates(results_dir):
    """(Estimates from results_dir/estimate.json, None), or (None, why there are none)."""
    path = Path(results_dir) / ESTIMATE_FILE
    try:
        records = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no {ESTIMATE_FILE}"
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return None, f"unreadable {ESTIMATE_FILE}: {error}"
    if not isinstance(records, list):
        return None, f"{ESTIMATE_FILE} holds no list of records"
    return [read_estimate(record) for record in records if isinstance(record, dict)], None


def save_records(results_dir, records):
    """Merge `records` into results_dir/estimate.json (same RECORD_KEY: replaced)."""
    path = Path(results_dir) / ESTIMATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)  # concurrent estimates: one updates at a time
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        try:
            existing = json.loads(path.read_text())
            existing = existing if isinstance(existing, list) else []
        except (OSError, ValueError):
            existing = []
        keys = {tuple(record.get(name) for name in RECORD_KEY) for record in records}
        kept = [record for record in existing if isinstance(record, dict)
                and tuple(record.get(name) for name in RECORD_KEY) not in keys]
        write_json_atomically(path, kept + list(records))
    finally:
        os.close(directory)  # closing releases the lock
    return path


def markdown_table(header, rows, align):
    """A Markdown table; `align` has one character per column: "l" or "r"."""
    rule = ["---:" if side == "r" else "---" for side in align]
    return "\n".join("| " + " | ".join(line) + " |" for line in [header, rule, *rows]) + "\n"


def estimate_table(estimates, others=()):
    """The Markdown table of predictions, each beside the study's figure for its setting where
    it published one; `others`: (script, setting, what) rows of estimates not made (failed, or
    not run on fake tensors), which the notes explain."""
    header = ["script", "setting", "allocated", "reserved", "study (reserved)", "reserved / study",
              "creation", PER_PARAMETER, "activations"]
    rows = [[with_parent(estimate.script), estimate.setting(),
             size_text(estimate.allocated_bytes), size_text(estimate.reserved_bytes),
             "" if estimate.published_gb is None else f"{estimate.published_gb:.2f} GB",
             "" if estimate.ratio() is None else f"{estimate.ratio():.2f}",
             size_text(estimate.init_allocated_bytes),
             "n/a" if estimate.model_state_bytes_per_parameter is None
             else f"{estimate.model_state_bytes_per_parameter:.2f}",
             size_text(estimate.breakdown_bytes["activations"])] for estimate in estimates]
    rows += [[with_parent(script), setting, what, *[""] * 6] for script, setting, what in others]
    return markdown_table(header, rows, "llrrrrrrr")


def unpredicted_study_figures(estimates):
    """The study's figures for settings none of `estimates` predicts: {(script, batch, accum): GB}."""
    predicted = {(estimate.script, estimate.batch_size, estimate.accum_steps or 1)
                 for estimate in estimates if estimate.published_gb is not None}
    return {setting: gb for setting, gb in STUDY_RESERVED_GB.items() if setting not in predicted}
