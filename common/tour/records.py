"""The numbers a tour leaves behind, read from its JSON files into rows; anything missing is None.

A results directory holds one record per numbered script (written by the script itself), tour.json
(written by `python -m common.tour`: which steps ran, in what order, and how each ended) and
estimate.json (written by `python -m common.estimate`). Records from other versions of the scripts
may lack fields or hold nulls; every reader here turns those into None instead of failing.
"""
import json
import math
from dataclasses import dataclass, field

from common.memory import BREAKDOWN_KEYS
from common.estimate.published import published_reserved_gb

TOUR_FILE = "tour.json"
ESTIMATE_FILE = "estimate.json"
RECORD_PATTERN = "[0-9][0-9]_*.json"  # the numbered scripts' records
MIB = 2**20  # the tour's measurements
GB = 10**9   # the study published decimal gigabytes


def finite(value):
    """`value` if it is a finite number, else None (missing, null, NaN, text, a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def shown(value, spec, suffix=""):
    """`value` formatted with `spec`, or "n/a" when missing: how tables and charts show a gap."""
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def in_units(value, unit):
    """`value` divided by `unit` (bytes by MIB, a fraction by 0.01 for percent), or None."""
    return None if value is None else value / unit


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


def step_row(script, record, outcome=None):
    """Join a script's record (a dict, or None if it wrote none) with how its tour step ended."""
    outcome = outcome or {}
    record = record if isinstance(record, dict) else {}
    breakdown = record.get("breakdown_bytes")
    breakdown = breakdown if isinstance(breakdown, dict) else {}
    world_size = finite(record.get("world_size"))
    return StepRow(
        script=script,
        ok=outcome.get("status", "ok") == "ok",
        error=outcome.get("error"),
        error_lines=list(outcome.get("error_lines") or []),
        preset=record.get("preset"),
        device=record.get("device"),
        world_size=int(world_size) if world_size else None,
        peak_bytes=finite(record.get("peak_memory_bytes")),  # the highest over processes
        breakdown_bytes={key: finite(breakdown.get(key)) for key in BREAKDOWN_KEYS},
        train_seconds=finite(record.get("train_seconds")),
        test_accuracy=finite(record.get("test_accuracy")),
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


@dataclass
class EstimateRow:
    """One predicted setting: bytes as a GPU would count them, and the study's figure if any."""
    script: str
    preset: str | None
    world_size: int | None
    batch_size: int | None
    accum_steps: int | None
    allocated_bytes: float | None
    reserved_bytes: float | None
    published_gb: float | None  # the study's max_memory_reserved for this exact setting

    def setting(self, separator=", "):
        """The run this prediction is for, in words: "batch 16, 4 micro-batches, 4 GPUs"."""
        parts = [f"batch {shown(self.batch_size, 'd')}"]
        if self.accum_steps and self.accum_steps > 1:
            parts.append(f"{self.accum_steps} micro-batches")
        if self.world_size and self.world_size > 1:
            parts.append(f"{self.world_size} GPUs")
        return separator.join(parts)


def estimate_row(record):
    def whole(name):
        value = finite(record.get(name))
        return int(value) if value is not None else None

    script = str(record.get("script", "?"))
    preset, world_size = record.get("preset"), whole("world_size")
    batch_size, accum_steps = whole("batch_size"), whole("accum_steps")
    single_gpu_article = preset in (None, "article") and world_size in (None, 1)
    published = (published_reserved_gb(script, batch_size, accum_steps or 1)
                 if single_gpu_article else None)
    return EstimateRow(script=script, preset=preset, world_size=world_size, batch_size=batch_size,
                       accum_steps=accum_steps,
                       allocated_bytes=finite(record.get("allocated_bytes")),
                       reserved_bytes=finite(record.get("reserved_bytes")), published_gb=published)


def load_estimate_rows(results_dir):
    """(rows, None) from estimate.json, or (None, why there are none)."""
    records, problem = read_json(results_dir / ESTIMATE_FILE)
    if problem:
        return None, problem
    if not isinstance(records, list):
        return None, f"{ESTIMATE_FILE} holds no list of records"
    return [estimate_row(record) for record in records if isinstance(record, dict)], None
