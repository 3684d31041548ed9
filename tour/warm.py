"""A CPU tour's single-process steps, started warm: each step's script runs in a child forked
from one Python that has already imported what the scripts import (PyTorch, transformers,
datasets, scikit-learn, torchmetrics, common/: tour/preload.py), not in a fresh Python that
imports it all again. Those imports take about 8 s of a tiny step's 12-15 s on 2 cores; the
step's own training time does not include them either way.

The Python that forks is multiprocessing's fork server: a process of its own, started once, with
a single thread (the tour's threads never fork). Its child runs the script as `python SCRIPT
ARGS` would, as __main__, with the script's folder first on sys.path, the step's environment and
working directory, in a session of its own (the tour ends a step with its process group), its
standard output and error into files that the tour prints when it ends. Linux only: elsewhere
(macOS's frameworks are not safe to fork) each step starts a fresh Python.
"""
import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

PRELOADED = ["tour.preload"]  # what the fork server imports before it forks: SCRIPTS_MODULES
SCRIPTS_MODULES = [  # `common` first: its import silences library warnings the others would print
    "common", "torch", "transformers", "datasets", "sklearn.datasets",
    "torchmetrics.classification",  # (common/evaluate.py imports it at the first evaluation)
    "common.cli", "common.data", "common.distributed", "common.evaluate", "common.launch",
    "common.memory", "common.model", "common.presets", "common.progress", "common.quirks",
    "common.summary",
    "transformers.models.vit.modeling_vit",    # the tiny preset's model
    "transformers.models.bert.modeling_bert",  # tiny-text's
    "bitsandbytes",  # 05a, 05j, 07b
]
SERVER_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}  # read as PyTorch loads OpenMP, in the server


def available():
    return sys.platform == "linux"


def start_server(preload):
    """Start the fork server, importing the scripts' modules if `preload` (the tour's own scripts;
    a stand-in's imports are its own). Once a process: a server already started is kept as it
    is. Its OpenMP threads, started in each child, sleep while they wait (two steps share the
    cores): set as the server starts, since OpenMP reads it as PyTorch loads it there."""
    multiprocessing.set_forkserver_preload(PRELOADED if preload else [])
    before = {name: os.environ.get(name) for name in SERVER_ENVIRONMENT}
    for name, value in SERVER_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)


class WarmStep:
    """A script `argv` = [python, script, *args] running in a child of the fork server: what the
    tour reads of a subprocess.Popen (pid, communicate, wait; with-block)."""

    def __init__(self, argv, cwd, env):
        self.folder = Path(tempfile.mkdtemp(prefix="tour-step-"))
        self.outputs = self.folder / "stdout", self.folder / "stderr"
        context = multiprocessing.get_context("forkserver")
        self.process = context.Process(target=run_as_main, args=(
            str(argv[1]), [str(arg) for arg in argv[2:]], str(cwd), dict(env),
            *map(str, self.outputs)))
        self.process.start()
        self.pid = self.process.pid

    def wait(self):
        self.process.join()
        return self.process.exitcode  # as Popen's: negative for a signal

    def communicate(self):
        """(its standard output, its standard error), once it has ended."""
        self.wait()
        return tuple(path.read_text(errors="replace") if path.is_file() else ""
                     for path in self.outputs)

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_as_main(script, args, cwd, env, stdout_path, stderr_path):
    """In the fork server's child: run `script` as `python script *args` would, in `cwd` with
    the environment `env`, its output into the two files; the child's exit status is the
    script's (an exception: its traceback, then 1)."""
    os.setsid()  # a process group of its own, ended whole (and no Ctrl-C of the terminal's)
    for descriptor, path in ((1, stdout_path), (2, stderr_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, descriptor)
        os.close(opened)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise  # (multiprocessing exits with its code; a message is printed, then 1)
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        # what a Python ending normally runs: the handlers its modules registered (those the
        # server's imports registered among them, as a fresh Python's imports would have)
        atexit._run_exitfuncs()
