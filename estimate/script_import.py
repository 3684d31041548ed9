"""Importing a numbered script: its name starts with a digit, so `import` cannot name it (what
each step is: steps.py)."""
import importlib.util
from pathlib import Path


def import_script(path, prefix="script"):
    """A fresh module object of the script at `path`, under a name no import uses."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_{prefix}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
