"""The numbered scripts, one entry each: what a step is, in one place.

A step NN is its parent, step NN-1, plus one technique; a branch NNx (05a_adamw_8bit.py) is
another choice at step NN, so it starts from the same parent, and its diff against that parent
shows its own technique. Each marks the lines its technique adds with its tag (`# FSDP: ...`).
Steps from 07 on shard the model and run as one process per device under torchrun.

Adding a step or a branch means adding its script, NN[x]_name.py, and its entry below; the tour,
the estimate table and the tests (its diff, its tag, the README's list of tags) take it from here.
"""
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Step:
    id: str                 # "04", "05a": the script's name up to its first "_"
    tag: str | None         # the comment tag on the lines it adds (01 adds none)
    parent: str | None      # the step it starts from, whose diff shows its technique
    sharded: bool = False   # one process per device under torchrun (a group of one alone)

    @property
    def path(self):
        """The script's file, found by its id (NN_*.py)."""
        found = sorted(ROOT.glob(f"{self.id}_*.py"))
        if len(found) != 1:
            raise FileNotFoundError(f"steps.py names step {self.id}, and {len(found)} files "
                                    f"match {self.id}_*.py in {ROOT}: keep exactly one")
        return found[0]

    @property
    def is_branch(self):
        return not self.id.isdigit()

    @property
    def accum_steps(self):
        """The --accum-steps default the script gives parse_args (1 when it has no such flag)."""
        found = re.search(r"accum_steps=(\d+)", self.path.read_text())
        return int(found.group(1)) if found else 1

    @property
    def task(self):
        """The only task the script trains, as it tells parse_args (05g: "causal-lm"), or None
        when it trains any (--task)."""
        found = re.search(r'task="([\w-]+)"', self.path.read_text())
        return found.group(1) if found else None

    def trains(self, task):
        """Whether the script trains `task` ("classification" or "causal-lm")."""
        return self.task in (None, task)


STEPS = {step.id: step for step in [
    Step("01", None, None),
    Step("02", "mixed precision", "01"),
    Step("03", "bf16-true", "02"),
    Step("04", "gradient accumulation", "03"),
    Step("04a", "optimizer in backward", "03"),
    Step("04b", "stochastic rounding", "03"),
    Step("05", "plain SGD", "04"),
    Step("05a", "8-bit AdamW", "04"),
    Step("05b", "Adafactor", "04"),
    Step("05c", "checkpointing on one device", "04"),
    Step("05d", "selective checkpointing", "05c"),
    Step("05e", "activation offloading", "05c"),
    Step("05f", "Adam on the host", "04"),
    Step("05g", "chunked loss", "04"),
    Step("06", "on-device init", "05"),
    Step("07", "FSDP", "06", sharded=True),
    Step("07a", "LoRA", "06"),
    Step("07b", "QLoRA", "07a"),
    Step("08", "offload", "07", sharded=True),
    Step("09", "checkpointing", "08", sharded=True),
]}


def step_id(name):
    """"05a" for 05a_adamw_8bit.py (or its stem, or a path to it)."""
    return Path(name).name.split("_", 1)[0]


def step_of(name):
    """The entry of the script called `name` (a file name, stem or path)."""
    step = STEPS.get(step_id(name))
    if step is None:
        raise KeyError(f"{Path(name).name}: no step {step_id(name)!r} in steps.py; a new "
                       "script needs its entry there")
    return step


def scripts():
    """Every step's and branch's file, in the tour's order (a branch beside its step)."""
    return sorted(step.path for step in STEPS.values())


def with_parent(name):
    """The script's name, and for a branch its parent: "05a_adamw_8bit (branch of 04)"."""
    step = STEPS.get(step_id(name))
    stem = Path(name).stem
    return f"{stem} (branch of {step.parent})" if step is not None and step.is_branch else stem
