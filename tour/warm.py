"""A CPU tour's single-process steps, started warm: each step's script runs in a child forked
from one Python that has already imported what the scripts import (PyTorch, transformers,
datasets, torchmetrics, common/: tour/preload.py), not in a fresh Python that
imports it all again. Those imports take about 8 s of a tiny step's 12-15 s on 2 cores; the
step's own training time does not include them either way.

The Python that forks is multiprocessing's fork server: a process of its own, started once, with
a single thread (the tour's threads never fork). Its child runs the script as `python SCRIPT
ARGS` would, as __main__, with the script's folder first on sys.path, the step's environment and
working directory, in a session of its own (the tour ends a step with its process group), its
standard output and error into files that the tour prints when it ends. Linux only: elsewhere
(macOS's frameworks are not safe to fork) each step starts a fresh Python.

A step the tour runs alone, with its output streaming (a sharded step), starts warm too, its
standard output the tour's and its standard error a pipe the tour reads as it comes. A sharded
step's `python -m torch.distributed.run ARGS` is torchrun itself, with the same arguments, in the
forked child, and its processes forked from that child (torchrun's --run-path --start-method
fork) instead of each a fresh Python: about 9 s less of each sharded step's 40 s on 2 cores.
"""
import atexit
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOADED = ["tour.preload"]  # what the fork server imports before it forks: SCRIPTS_MODULES
SCRIPTS_MODULES = [  # `common` first: its import silences library warnings the others would print
    "common", "torch", "transformers", "datasets",
    "torchmetrics.classification",  # (common/evaluate.py imports it at the first evaluation)
    "common.cli", "common.data", "common.distributed", "common.evaluate", "common.launch",
    "common.memory", "common.model", "common.presets", "common.progress", "common.quirks",
    "common.summary",
    "transformers.models.vit.modeling_vit",    # the tiny preset's model
    "transformers.models.bert.modeling_bert",  # tiny-text's
    "bitsandbytes",  # 05a, 05j, 07b
]
# multiprocessing starts and reaps the children of the fork server, and reads their exit
# statuses, from whichever thread asks: one at a time, or two threads could read one status
STATUSES = threading.Lock()


def available():
    return sys.platform == "linux"


def server_environment():
    """What the fork server starts with besides the tour's environment: OpenMP's threads, started
    in each child, sleep while they wait (two steps share the cores; OpenMP reads it as PyTorch
    loads it, in the server); the repository on its path, whatever the working directory."""
    path = os.environ.get("PYTHONPATH")
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), *([path] if path else [])])}


def start_server(preload):
    """Start the fork server and wait for it to be ready, importing the scripts' modules if
    `preload` (the tour's own scripts; a stand-in's imports are its own). Once a process: a
    server already started is kept as it is. Returns how many of SCRIPTS_MODULES a child forked
    from it finds not imported (each step then imports those itself), or None where it cannot
    start (each step then starts a fresh Python)."""
    multiprocessing.set_forkserver_preload(PRELOADED if preload else [])
    before = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "PYTHONPATH")}
    os.environ.update(server_environment())
    try:
        multiprocessing.forkserver.ensure_running()
        ready = multiprocessing.get_context("forkserver").Process(target=count_not_imported)
        with STATUSES:
            ready.start()
            ready.join()
        return ready.exitcode if ready.exitcode is not None and ready.exitcode >= 0 else None
    except (OSError, EOFError):
        return None
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def count_not_imported():
    """In a child of the fork server: exits with how many of SCRIPTS_MODULES it has not imported."""
    sys.exit(sum(name not in sys.modules for name in SCRIPTS_MODULES))


TORCHRUN = ["-m", "torch.distributed.run"]


def starts_warm(argv):
    """Whether WarmStep runs `argv`: [python, script, *args], or torchrun's
    [python, -m, torch.distributed.run, *args]."""
    return argv[1] != "-m" or argv[1:3] == TORCHRUN


class PassedDescriptor:
    """One of the tour's file descriptors, handed to the fork server's child, which receives its
    own copy of it (a number) as it starts."""

    def __init__(self, descriptor):
        self.descriptor = descriptor

    def __reduce__(self):  # (pickled as the child starts: multiprocessing sends the server a copy)
        return received, (multiprocessing.reduction.DupFd(self.descriptor),)


def received(passed):
    return passed.detach()


class WarmStep:
    """`argv` (starts_warm) running in a child of the fork server: what the tour reads of a
    subprocess.Popen (pid, communicate, wait; stderr where `live`; with-block). Its standard output
    and error go to files the tour reads when it ends, or where `live` (a step run alone) as a
    Popen(stdout=None, stderr=PIPE, text=True) of the tour's would: to the tour's standard output,
    and to a pipe the tour reads as it comes (.stderr). Raises OSError or EOFError where the
    server is gone."""

    def __init__(self, argv, cwd, env, live=False):
        read, write = os.pipe() if live else (None, None)
        self.folder = Path(tempfile.mkdtemp(prefix="tour-step-"))
        self.outputs = self.folder / "stdout", self.folder / "stderr"
        self.stderr = None
        outputs = ([PassedDescriptor(1), PassedDescriptor(write)] if live
                   else [str(path) for path in self.outputs])
        context = multiprocessing.get_context("forkserver")
        self.process = context.Process(target=run_as_main, args=(
            [str(arg) for arg in argv[1:]], str(cwd), dict(env), *outputs))
        try:
            with STATUSES:
                self.process.start()
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            if live:
                os.close(read)
            raise
        finally:
            if live:
                os.close(write)  # (the child has its own: the pipe ends when it and its children do)
        if live:
            self.stderr = open(read, errors="replace")
        self.pid = self.process.pid

    def wait(self):
        multiprocessing.connection.wait([self.process.sentinel])  # (without the lock)
        with STATUSES:
            self.process.join()
        try:  # what it started and left running ends with it, as with the server gone
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
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
        if self.stderr is not None:
            self.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_as_main(argv, cwd, env, stdout, stderr):
    """In the fork server's child: run `argv` (WarmStep's, less the python) as `python *argv`
    would, in `cwd` with the environment `env`, its output into `stdout` and `stderr` (each a
    file's path, or a descriptor the tour passed), written as it comes; the child's exit status is
    the script's (an exception: its traceback, then 1)."""
    os.setsid()  # a process group of its own, ended whole (and no Ctrl-C of the terminal's)
    for descriptor, target, name in ((1, stdout, "stdout"), (2, stderr, "stderr")):
        opened = target if isinstance(target, int) else os.open(
            target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, descriptor)
        os.close(opened)
        stream = io.TextIOWrapper(io.FileIO(descriptor, "w", closefd=False), write_through=True,
                                  encoding=getattr(sys, name).encoding,
                                  errors=getattr(sys, name).errors)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    os.chdir(cwd)
    for name in server_environment().keys() - env.keys():
        os.environ.pop(name, None)
    os.environ.update(env)
    # as in a fresh Python: its processes started as the system's default starts them (the
    # child of a fork server would start its own by a fork server too)
    multiprocessing.set_start_method(None, force=True)
    if argv[:2] == TORCHRUN:
        ended_as_python_ends(launch_forked, argv[2:])
    else:
        ended_as_python_ends(run_path, *argv)


def ended_as_python_ends(run, *args):
    """run(*args) in a forked process, and end as a Python process ends: an exception's traceback
    printed, then exit status 1 (SystemExit as it is: multiprocessing exits with its code, or
    prints its message, then 1); its threads waited for, then the handlers its modules registered
    run (the server's imports' among them, as a fresh Python's would be)."""
    try:
        run(*args)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        threading._shutdown()
        atexit._run_exitfuncs()


def run_path(script, *args):
    """Run `script` as __main__, as `python script *args` would (its folder first on the path;
    PyTorch's threads as many as OMP_NUM_THREADS says, which OpenMP read before this process
    forked)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch
        torch.set_num_threads(int(threads))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def launch_forked(args):
    """torchrun `args` in this process, its processes forked from it: torchrun runs each as
    `--run-path` does (runpy in the same interpreter), here as run_forked does."""
    from torch.distributed import run as torchrun
    torchrun.run_script_path = run_forked  # (what config_from_args gives --run-path's processes)
    sys.argv = ["torchrun", *args]
    torchrun.main(["--run-path", "--start-method", "fork", *args])


def run_forked(script, *args):
    """One of torchrun's processes, forked from it: run_path, and the rest as a fresh `python -u
    script *args` that torchrun started would: the signals' default handlers (not torchrun's,
    which this process inherits), and its end (ended_as_python_ends: torchrun's wrapper would
    keep an exception for its own report, and a forked process leaves without the rest)."""
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ended_as_python_ends(run_path, script, *args)
