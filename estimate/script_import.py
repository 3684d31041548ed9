"""Numbered scripts: importing one (its name starts with a digit, so `import` cannot name it),
and the step a name stands for.

The main line is 01_*.py to 09_*.py, each its predecessor plus one technique. A branch, NNx_*.py
(05a_adamw_8bit.py), is an alternative to step NN: like step NN it starts from step NN-1, its
parent, and its diff against the parent shows its own technique.
"""
import importlib.util
import re
from pathlib import Path


def import_script(path, prefix="script"):
    """A fresh module object of the script at `path`, under a name no import uses."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_{prefix}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_id(name):
    """"05a" for 05a_adamw_8bit.py (or its stem), "05" for 05_sgd_cosine.py."""
    return Path(name).name.split("_", 1)[0]


def branch_parent(name):
    """The step a branch starts from ("04" for 05a_adamw_8bit), or None for a main-line step."""
    step = step_id(name)
    return f"{int(step[:2]) - 1:02d}" if step[2:] else None


def with_parent(name):
    """The script's name, and for a branch its parent: "05a_adamw_8bit (branch of 04)"."""
    parent = branch_parent(name)
    return f"{Path(name).stem} (branch of {parent})" if parent else Path(name).stem


def default_accum_steps(script):
    """The --accum-steps default a script gives parse_args (1 when it has no such flag)."""
    found = re.search(r"accum_steps=(\d+)", Path(script).read_text())
    return int(found.group(1)) if found else 1
