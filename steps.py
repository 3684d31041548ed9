"""The numbered scripts, one entry each: every fact about a step lives here and nowhere else.

A step NN is its parent, step NN-1, plus one technique; a branch NNx (05a_adamw_8bit.py) is
another choice at step NN, and its diff against its parent shows its own technique. Each marks
the lines its technique adds with its tag (`# FSDP: ...`). Steps from 07 on shard the model and
run as one process per device under torchrun. The combined script (10) is no technique's diff:
it has every technique behind a switch, and `switches` says how it reproduces each script.

Adding a step or a branch means adding its script, NN[x]_name.py, and its entry below; the tour,
the estimate table and the tests (its diff, its tag, the README's list of tags) take it from here.
"""
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Step:
    id: str                 # "04", "05a": the script's name up to its first "_"
    tag: str | None         # the comment tag on the lines it adds (01 adds none)
    parent: str | None      # the step it starts from, whose diff shows its technique
    sharded: bool = False   # one process per device under torchrun (a group of one alone)
    accum_steps: int = 1    # its --accum-steps default (1: it takes no micro-batches)
    task: str | None = None  # the only task it trains (05g: "causal-lm"); None: any (--task)
    switches: tuple = ()    # the combined script's flags that train as this script does (for
    #                         a sharded step, under torchrun, or alone with WORLD_SIZE=1 set)
    restores: str | None = None  # a step whose lines it gives back (03 gives 01's back)
    removes: tuple = ()     # earlier steps whose technique it takes out on purpose
    synchronizes: bool = False  # its optimizer waits for the GPU once per parameter
    combined: bool = False  # the combined script: every technique behind a switch
    compiles: bool = False  # always compiled (05k): its estimate is a range, not the run's own
    #                         count (estimate/compiled.py), and each run spends tens of seconds
    #                         compiling on a CPU
    by_hand: str | None = None  # why the estimate cannot run it, and the rule to use instead

    @property
    def path(self):
        """The script's file, found by its id (NN_*.py)."""
        found = sorted(ROOT.glob(f"{self.id}_*.py"))
        if len(found) != 1:
            raise FileNotFoundError(f"steps.py names step {self.id}, and {len(found)} files "
                                    f"match {self.id}_*.py in {ROOT}: keep exactly one")
        return found[0]

    @property
    def name(self):
        """The script's file name without .py: "05a_adamw_8bit"."""
        return self.path.stem

    @property
    def is_branch(self):
        return not self.id.isdigit()

    def trains(self, task):
        """Whether the script trains `task` ("classification" or "causal-lm")."""
        return self.task in (None, task)


ACCUM = ("--accum-steps", "4")
STEPS = {step.id: step for step in [
    Step("01", None, None, switches=("--precision", "fp32")),
    Step("02", "mixed precision", "01", switches=("--precision", "mixed")),
    Step("03", "bf16-true", "02", restores="01", removes=("02",)),
    Step("04", "gradient accumulation", "03", accum_steps=4, switches=ACCUM),
    Step("04a", "optimizer in backward", "03", switches=("--optimizer-in-backward",)),
    Step("04b", "stochastic rounding", "03", switches=("--stochastic-rounding",)),
    Step("04c", "GaLore", "04a", switches=("--optimizer", "galore", "--optimizer-in-backward")),
    Step("05", "plain SGD", "04", accum_steps=4, switches=(*ACCUM, "--optimizer", "sgd")),
    Step("05a", "8-bit AdamW", "04", accum_steps=4, synchronizes=True,
         switches=(*ACCUM, "--optimizer", "adamw-8bit")),
    Step("05b", "Adafactor", "04", accum_steps=4, synchronizes=True,
         switches=(*ACCUM, "--optimizer", "adafactor")),
    Step("05c", "checkpointing on one device", "04", accum_steps=4,
         switches=(*ACCUM, "--checkpointing", "full")),
    Step("05d", "selective checkpointing", "05c", accum_steps=4,
         switches=(*ACCUM, "--checkpointing", "selective")),
    Step("05e", "activation offloading", "05c", accum_steps=4,
         switches=(*ACCUM, "--checkpointing", "offloaded")),
    Step("05f", "Adam on the host", "04", accum_steps=4,
         switches=(*ACCUM, "--optimizer-on-host")),
    Step("05g", "chunked loss", "04", accum_steps=4, task="causal-lm",
         switches=(*ACCUM, "--loss", "chunked")),
    Step("05h", "fused loss", "05g", accum_steps=4, task="causal-lm",
         removes=("05g",),  # its output layer run under checkpoint, a piece at a time
         switches=(*ACCUM, "--loss", "fused")),
    Step("05i", "gradients to host", "05f", accum_steps=4,
         removes=("05f",),  # its copies of every gradient after backward
         switches=(*ACCUM, "--optimizer-on-host", "--gradients-to-host")),
    Step("05j", "4-bit AdamW", "04", accum_steps=4,
         switches=(*ACCUM, "--optimizer", "adamw-4bit")),
    Step("05k", "memory budget", "04", accum_steps=4, compiles=True,
         switches=(*ACCUM, "--checkpointing", "budget:0.5")),
    Step("05l", "tiled MLP", "05e", accum_steps=4, task="causal-lm",
         switches=(*ACCUM, "--checkpointing", "offloaded", "--mlp-tiles", "auto")),
    Step("06", "on-device init", "05", accum_steps=4, switches=(*ACCUM, "--optimizer", "sgd")),
    Step("07", "FSDP", "06", sharded=True, accum_steps=4, switches=(*ACCUM, "--optimizer", "sgd")),
    Step("07a", "LoRA", "06", accum_steps=4, removes=("05",), switches=(*ACCUM, "--lora-rank", "8")),
    Step("07b", "QLoRA", "07a", accum_steps=4,
         switches=(*ACCUM, "--lora-rank", "8", "--qlora")),
    Step("08", "offload", "07", sharded=True, accum_steps=4,
         switches=(*ACCUM, "--optimizer", "sgd", "--offload")),
    Step("08a", "sequence parallel", "07", sharded=True, accum_steps=4, task="causal-lm",
         switches=(*ACCUM, "--optimizer", "sgd", "--sequence-parallel")),
    Step("09", "checkpointing", "08", sharded=True, accum_steps=4,
         switches=(*ACCUM, "--optimizer", "sgd", "--offload", "--checkpointing", "full")),
    # every technique behind a switch; it shards under torchrun (07's switches) or with --offload
    Step("10", None, None, combined=True),
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
    """Every step's and branch's file, in the tour's order (a branch beside its step); not the
    combined script, which is each of them by its switches."""
    return sorted(step.path for step in STEPS.values() if not step.combined)


class UnknownStep(ValueError):
    """Names given to --steps that match no script (its message lists those that exist), or only
    scripts of another task (its message says which --task to add)."""


def select(names, task=None):
    """The steps that `names` pick, in tour order: "3", "03", "03_bf16", "03_bf16.py" or a path
    pick step 03; a bare number also picks its step's branches (05: 05 and 05a-05l); no names
    pick every step and branch (the combined script only when named). With `task`, steps that
    do not train it are left out. Raises UnknownStep naming the scripts there are, or, when
    every step named trains another task, that task."""
    every = sorted(STEPS.values(), key=lambda step: step.id)
    chosen = set()
    for name in names or ():
        path = Path(str(name))
        token = path.stem if path.suffix == ".py" else path.name  # "4.5" is no step 04
        if token.isdigit():
            matches = [step for step in every if int(step.id[:2]) == int(token)]
        else:
            matches = [step for step in every if token in (step.id, step.name)]
        if not matches:
            raise UnknownStep(f"no script {name!r}; the scripts are: "
                              + " ".join(step.id for step in every))
        chosen.update(matches)
    picked = [step for step in every if step in chosen or not names and not step.combined]
    kept = [step for step in picked if task is None or step.trains(task)]
    if picked and not kept:
        raise UnknownStep(f"{', '.join(step.name for step in picked)} trains --task "
                          f"{picked[0].task} only: add --task {picked[0].task}")
    return kept


def with_parent(name):
    """The script's name, and for a branch its parent: "05a_adamw_8bit (branch of 04)"."""
    step = STEPS.get(step_id(name))
    stem = Path(name).stem
    return f"{stem} (branch of {step.parent})" if step is not None and step.is_branch else stem


def import_script(path, prefix="script"):
    """A fresh module object of the script at `path`, under a name no import uses (a numbered
    script's name starts with a digit, so `import` cannot name it). It is entered in sys.modules
    under that name, where torch.compile looks up the module of a function it traces (05c's
    checkpointed forward)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_{prefix}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]  # not a half-loaded script left behind
        raise
    return module
