"""The tour: each numbered script in order on one preset, the GPU estimate, then the report.

  python -m tour                  # all steps, then results/tour.md, tour.png, estimate.png
  python -m tour --preset tiny-text   # the same steps on text, into results/tiny-text/
  python -m tour --steps 01 03 --max-steps 2 --epochs 1 --skip-estimate   # a quick look
  python -m tour --publish docs   # also copy the tables and charts to docs/, and write the
                                  # tables the README and docs/ embed (tour/publish.py)
  python -m tour --publish docs --steps 05a   # run 05a alone and publish its rows into the
                                  # tables docs/ holds, the other rows kept (tour/partial.py)

The combined script (10) runs last, twice, as one process: with no switch, and with the whole
stack (estimate/stack.py's chain up to --offload); the second's record is 10_combined_stack.json.
Steps from 07 on shard across processes and run under torchrun: with 2 GPUs or more, one
process per GPU (at most --nproc, and as many as the preset's batch splits over); with one GPU,
one process on it for the GPU presets (article, imdb) and 2 CPU processes (gloo) for the CPU
ones; with none, 2 CPU processes. The choice is printed and shown in the table.
In a CPU tour (no GPU, or --device cpu) the single-process steps run two at a time, the next
starting as soon as either ends (each prints its output when it ends); their training times then
include sharing the cores, as the table says. On Linux with no GPU each of them is forked from
one Python that has imported what the scripts import (tour/warm.py), not started as a Python of
its own that imports it all again (about 8 s of a tiny step's 12-15), and so is each sharded
step's torchrun, which forks its processes from itself (about 9 s of a sharded step's 40); and
the GPU estimate runs from the start beside them, at the lowest priority, on the cores the steps
leave idle (a step importing, one slot free at the end of a run of steps, the sharded steps'
waits for each other), its output printed when it ends. --publish and --one-at-a-time run each
step alone, with its output streaming as it runs. A step that fails
(non-zero exit, or no JSON record) is shown as failed in the table with the end of its stderr,
and the others still run; the command then exits with status 1.

With --publish DIR and --steps, the steps named run as the whole tour runs them, their estimate
rows with them, and only their rows are published: each replaces its row in the tables DIR holds
(or joins them in the tour's order), the other rows stay as they were, a row made on another
machine than the rest is marked, and the charts are drawn again (tour/partial.py). Where a step
fails, nothing is published.

Everything is first written to a fresh directory inside --results-dir and moved in at the end, so
an interrupted run leaves the previous results as they were, a table is never half-written, and a
record from an earlier run is never read as this run's.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tour.code_tables as code_tables
import tour.warm as warm
from common.atomic_write import write_json_atomically
from common.cli import add_shared_flags, positive_int
from common.presets import PRESETS, for_task
from estimate.command import processes_for
from estimate.records import ESTIMATE_FILE
from estimate.stack import whole_stack
from steps import STEPS, UnknownStep, select, step_of
from tour.machine import this_machine
from tour.partial import Refused, publish_rows, read_table
from tour.publish import is_published, publish, publish_problem
from tour.records import STACK_SUFFIX, TOUR_FILE, read_json
from tour.report import ESTIMATE_CHART, ESTIMATE_TABLE, REPORT_FILES, TOUR_CHART, TOUR_TABLE, write_report

ROOT = Path(__file__).resolve().parents[1]
CPU_PROCESSES = 2  # without 2 GPUs the sharded steps run as this many CPU processes
DEFAULT_PRESET = "tiny"
ESTIMATE_MODULE = "estimate"
STEP_TIMEOUT = 3 * 3600  # seconds; an article-preset step on one GPU takes well under an hour
ERROR_LINES = 20  # how much of a failed step's stderr the report keeps
TRACEBACK_START = "Traceback (most recent call last):"
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")     # what torchrun may put before a child's lines
TORCHRUN_LOG_LINE = re.compile(r"^[EWIF]\d{4} ")   # torchrun's own log lines ("E1121 23:17:57 ...")
ARGPARSE_ERROR = re.compile(r"^\S+: error: ")      # "01_baseline.py: error: argument --epochs: ..."
LOWEST_PRIORITY = 19  # the estimate's nice value in a CPU tour (Background)
RUNNING = set()  # the steps' processes running now (two side by side), ended together on Ctrl-C
STOPPING = threading.Event()  # set on Ctrl-C: a step starting beside another is ended at once
PRINTING = threading.Lock()  # two steps side by side print their outputs one after the other


@dataclass
class Command:
    """One thing the tour runs: a step's script, or the estimate."""
    name: str            # what the progress lines call it: "03_bf16.py", "estimate"
    argv: list           # the program and its arguments
    output: str          # the file it must leave in the results directory
    record_name: str     # the name tour.json gives it
    switches: tuple = ()  # 10_combined.py's switches it passes (tour.json says them)
    written: str | None = None  # where it writes `output`, when elsewhere (the tour moves it)


def tour_steps(names, task):
    """The steps --steps `names` picks (steps.select), or with none every step and branch, then
    the combined script, which steps.select picks only when named."""
    chosen = select(names, task)
    return chosen if names else [*chosen, *(step for step in STEPS.values() if step.combined)]


def step_scripts(steps, scripts_dir=None):
    """The scripts of `steps` (selected by steps.select), or, with `scripts_dir`, their stand-ins
    there (NN_anything.py; the tests' fakes), for the steps that have one."""
    if scripts_dir is None:
        return [step.path for step in steps]
    return [script for step in steps
            for script in sorted(Path(scripts_dir).resolve().glob(f"{step.id}_*.py"))]


@dataclass
class Launch:
    """How the sharded steps start: `processes` under torchrun, each on `device`."""
    processes: int
    device: str
    reason: str


def sharded_launch(gpu_count, nproc=None, device="auto", preset=DEFAULT_PRESET, split=(64, 4)):
    """The processes and device for steps 07 on, on a machine with `gpu_count` visible GPUs,
    for a preset whose batch is `split` = (batch size, micro-batches per process).

    One process per GPU, at most `nproc`, and as many as the batch splits over (each process
    takes an equal number of equal micro-batches). Without a GPU, or with --device cpu, CPU
    processes (gloo, 2 by default) show the same technique; so do they with one GPU for the
    presets sized for a CPU. With one GPU a GPU preset runs its sharded steps as one process on
    it (a group of one: nothing is split, offload and checkpointing still act), since on the CPU
    ViT-L or BLOOM-560m would train until the step's time-out.
    """
    batch_size, accum_steps = split
    if device == "cuda" and gpu_count == 0:
        raise ValueError("--device cuda with no GPU visible: use --device auto or cpu")
    gpus = f"{gpu_count} GPU{'s' if gpu_count != 1 else ''} visible"
    if device == "cpu" or gpu_count == 0 or (gpu_count == 1 and device == "auto"
                                             and not PRESETS[preset].gpu):
        why = "--device cpu" if device == "cpu" else f"{gpus}; sharding needs one per process"
        kind, wanted = "CPU", nproc or CPU_PROCESSES
    elif gpu_count == 1:
        return Launch(1, "cuda", f"{gpus}: 1 process on it (a group of one: nothing is split; "
                                 f"offload and checkpointing still act)")
    else:
        why, kind, wanted = gpus, "GPU", min(gpu_count, nproc) if nproc else gpu_count
    processes = processes_for(batch_size, accum_steps, wanted)
    fewer = ("" if processes == wanted else f" (of {wanted}: batch {batch_size} in {accum_steps} "
             f"micro-batches per process splits evenly over at most {processes})")
    if kind == "CPU":
        return Launch(processes, "cpu", f"{why}: {processes} CPU processes{fewer}")
    return Launch(processes, "cuda", f"{why}: {processes} processes, one per GPU{fewer}")


def script_command(script, results_dir, passed_flags, launch):
    """A step's script; the combined script is two of them (combined_commands)."""
    if step_of(script).sharded:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",  # a free port
                    f"--nproc_per_node={launch.processes}"]
        passed_flags = [*passed_flags, "--device", launch.device]
        if launch.device == "cpu":  # CPU processes (tiny presets on one GPU): nothing to check
            passed_flags = [flag for flag in passed_flags if flag != "--check-estimate"]
    else:
        launcher = [sys.executable]
    command = [*launcher, str(script), "--results-dir", str(results_dir), *passed_flags]
    return Command(script.name, command, f"{script.stem}.json", script.stem)


def combined_commands(script, results_dir, passed_flags, launch, task):
    """The combined script twice: with no switch, and with the whole stack for `task` (one
    process each: steps.py says it is not sharded). The second writes into a folder of its own,
    and the tour keeps its record beside the first one's as NN_name_stack.json."""
    switches = tuple(whole_stack(task))
    stack = f"{script.stem}{STACK_SUFFIX}"
    apart = script_command(script, results_dir / stack, [*passed_flags, *switches], launch)
    return [script_command(script, results_dir, passed_flags, launch),
            Command(f"{script.name} {' '.join(switches)}", apart.argv, f"{stack}.json", stack,
                    switches, written=f"{stack}/{apart.output}")]


def estimate_command(results_dir, steps=None):
    """The GPU estimate (article preset), of every step or of the scripts `steps` names."""
    command = [sys.executable, "-m", ESTIMATE_MODULE, "--results-dir", str(results_dir),
               *(["--steps", *steps] if steps else [])]
    return Command("estimate", command, ESTIMATE_FILE, "estimate")


def estimated_scripts(names, task):
    """The scripts of the estimate table that --steps `names` picks (all for None), in its order:
    every step and branch the estimate can run, as python -m estimate makes its table."""
    return [step.name for step in select(names, task) if not step.combined and not step.by_hand]


def whole_tour_rows(task, scripts_dir=None):
    """The rows of the whole tour's table, by record name, in its order: where a partial
    publish puts its rows."""
    whole = argparse.Namespace(scripts=step_scripts(tour_steps(None, task), scripts_dir),
                               passed_flags=[], launch=Launch(1, "cpu", ""), task=task)
    return [command.record_name for command in tour_commands(whole, Path())]


def error_line_index(lines):
    """Index of the last line that states an error: an exception (the first unindented line after
    a traceback) or an argparse error. torchrun's ChildFailedError is passed over: it says only that
    a child failed, after the child's own traceback. None when no line looks like either."""
    found, in_traceback = None, False
    for index, line in enumerate(lines):
        if line.startswith(TRACEBACK_START):
            in_traceback = True
        elif in_traceback and line.strip() and not line[0].isspace():
            in_traceback = False
            if "ChildFailedError" not in line:
                found = index
        elif ARGPARSE_ERROR.match(line):
            found = index
    return found


def error_excerpt(stderr_lines):
    """(the line that names a failed step's error, the end of its stderr up to and including it)."""
    lines = [RANK_PREFIX.sub("", line) for line in stderr_lines]
    end = error_line_index(lines)
    if end is None:  # e.g. sys.exit("message"): its last line with words
        with_words = [index for index, line in enumerate(lines) if re.search(r"\w", line)]
        if not with_words:
            return None, []
        end = stop = with_words[-1]
    else:  # a message may span several lines, up to a blank one or the launcher's own output
        stop = end
        while (stop + 1 < len(lines) and lines[stop + 1].strip()
               and not lines[stop + 1].startswith(TRACEBACK_START)
               and not TORCHRUN_LOG_LINE.match(lines[stop + 1])):
            stop += 1
    return lines[end].strip(), lines[max(0, stop + 1 - ERROR_LINES):stop + 1]


def stream_stderr(process):
    """Pass the process's stderr through as it comes; return its lines."""
    lines = []
    for line in process.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        lines.append(line.rstrip("\n"))
    return lines


def kill_process_group(process):
    """End the step and everything it started (torchrun's workers too)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        if isinstance(process, warm.WarmStep):  # a child not yet in a group of its own
            try:
                os.kill(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def started(command, env, slots, warm_start=False):
    """The step's process, in a process group of its own, so that a hung step is ended with all
    its workers: a fresh Python, or a child of the fork server (tour/warm.py) beside another in
    slots that start warm, or alone where `warm_start`."""
    if (slots.warm if slots is not None else warm_start) and warm.starts_warm(command.argv):
        try:
            return warm.WarmStep(command.argv, ROOT, env, live=slots is None)
        except (OSError, EOFError):  # the fork server is gone: a fresh Python
            pass
    process = subprocess.Popen(command.argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                               stdout=None if slots is None else subprocess.PIPE,
                               errors="replace", start_new_session=True)
    if isinstance(slots, Background):
        lowest_priority(process.pid)
    return process


def lowest_priority(pid):
    """Lower the process's priority (and that of the workers it forks) to the lowest, where the
    system allows: its nice value, and on Linux its session's (each step runs in a session of its
    own, and where sessions are scheduled as groups, autogroup, a nice value counts only within
    its session: /proc/PID/autogroup's counts among them; the kernel takes one such change in a
    tenth of a second from a user)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, LOWEST_PRIORITY)
    except (AttributeError, OSError):  # (no priorities here, or not allowed)
        return
    autogroup = Path(f"/proc/{pid}/autogroup")
    for _ in range(20):
        try:
            autogroup.write_text(str(LOWEST_PRIORITY))
            return
        except BlockingIOError:  # (another change within the last tenth of a second)
            time.sleep(0.1)
        except OSError:  # (no autogroup scheduling here)
            return


def run_command(command, results_dir, position, timeout=STEP_TIMEOUT, slots=None,
                environment=None, warm_start=False):
    """Run one Command with its output streaming through; returns its outcome for tour.json.
    With `slots` (a Slots: it runs in one of two, beside other steps; or the Background) its
    output is kept and printed whole when it ends, so that two steps' lines do not interleave.
    `environment`: its environment (by default os.environ, read as it starts). `warm_start`
    (without slots): forked from the fork server (tour/warm.py)."""
    beside = None
    if slots is None:
        print(f"\n{position} {command.name} ...", flush=True)
    else:
        slots.start(command.name, position)
    start = time.perf_counter()
    env = {**(environment or os.environ), "PYTHONUNBUFFERED": "1"}  # (its lines in order)
    if slots is not None or warm_start:  # threads that wait for their turn sleep instead of
        # spinning on the cores the other step's threads need (as in the fork server: warm.py)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with started(command, env, slots, warm_start) as process:
        RUNNING.add(process)
        if STOPPING.is_set():  # Ctrl-C came while it started, beside another step
            kill_process_group(process)
        stopped = threading.Event()  # by the watchdog, at --step-timeout
        watchdog = threading.Timer(timeout, lambda: stopped.set() or kill_process_group(process))
        if isinstance(slots, Background):
            slots.watch(watchdog)  # from when the steps have ended, not from the tour's start
        else:
            watchdog.start()
        try:
            if slots is None:
                stderr_lines, stdout = stream_stderr(process), ""
            else:
                stdout, stderr = process.communicate()
                stderr_lines = stderr.splitlines()
            returncode = process.wait()
        except BaseException:  # Ctrl-C or an error here: leave no step running behind us
            kill_process_group(process)
            raise
        finally:
            watchdog.cancel()
            RUNNING.discard(process)
            if slots is not None:
                beside = ", ".join(slots.end(command.name)) or None
    if STOPPING.is_set():  # ended by Ctrl-C beside another step: nothing to report
        raise KeyboardInterrupt
    seconds = time.perf_counter() - start
    if command.written and (results_dir / command.written).is_file():
        os.replace(results_dir / command.written, results_dir / command.output)
    timed_out = stopped.is_set() and returncode != 0
    _, unreadable = read_json(results_dir / command.output)
    error_line, error_lines = error_excerpt(stderr_lines)
    if timed_out:
        error = f"timed out after {timeout:g} s (--step-timeout) and was stopped"
    elif returncode != 0:
        error = f"exit status {returncode}: {error_line or 'no error message'}"
    elif unreadable:
        error, error_lines = f"exit status 0 but {unreadable}", []
    else:
        error, error_lines = None, []
    ended = (f"{position} {command.name} {'ok' if error is None else 'FAILED, ' + error} "
             f"({seconds:.1f} s)")
    with PRINTING:  # one step's lines together, the other's before or after them
        if slots is not None:  # its whole output, then how it ended
            print(f"\n{position} {command.name} (ran beside {beside or 'no other step'}):",
                  flush=True)
            sys.stdout.write(stdout)
            sys.stdout.flush()
            sys.stderr.write("".join(f"{line}\n" for line in stderr_lines))
            sys.stderr.flush()
        print(ended, flush=True)
    return {"script": command.record_name, "switches": list(command.switches),
            "returncode": returncode, "beside": beside,
            "wall_seconds": round(seconds, 1), "status": "ok" if error is None else "failed",
            "error": error, "error_lines": error_lines}


class Background:
    """Where the estimate runs in a CPU tour: beside the steps from the tour's start, at the
    lowest priority (lowest_priority), so that it takes the cores only while the steps leave
    them idle (a step loading, one slot free at the end of a run of steps, the sharded steps'
    waits for each other); its output printed whole when it ends; its --step-timeout counted
    from when the steps have ended (steps_ended). Slots' interface."""
    warm = False

    def __init__(self):
        self.lock = threading.Lock()
        self.watchdog, self.ended = None, False

    def start(self, name, position):
        with PRINTING:
            print(f"\n{position} {name} ... (in the background from the start, at the lowest "
                  "priority: on the cores the steps leave idle)", flush=True)

    def end(self, name):
        return ["the steps, at the lowest priority"]

    def watch(self, watchdog):
        with self.lock:
            self.watchdog = watchdog
            if self.ended:
                watchdog.start()

    def steps_ended(self):
        with self.lock:
            self.ended = True
            if self.watchdog is not None:
                self.watchdog.start()


class Slots:
    """Two slots that single-process steps take in turn, and which steps ran at the same time
    as which: a step's neighbours are those running when it starts and those that start while
    it runs. The first two are announced together, each later one as it starts."""

    def __init__(self, first_two, warm_start=False):
        self.warm = warm_start  # its steps forked warm (tour/warm.py), not each a fresh Python
        self.lock = threading.Lock()
        self.running = {}  # name: the names seen running beside it so far
        self.first_two = first_two

    def start(self, name, position):
        with self.lock:
            for others in self.running.values():
                others.append(name)
            self.running[name] = list(self.running)
            if name not in self.first_two:  # (not inside another step's output)
                neighbours = ", ".join(self.running[name])
                with PRINTING:
                    print(f"\n{position} {name} ..." + (f" (beside {neighbours})" if neighbours
                                                          else ""), flush=True)

    def end(self, name):
        with self.lock:
            return self.running.pop(name)


def run_side_by_side(commands, results_dir, positions, timeout, warm_start=False):
    """Single-process steps in two slots: the first two start together and each later one as
    soon as a slot frees, in order, so that a long step never holds a short one's core idle;
    `warm_start`: each forked from the fork server (tour/warm.py). Their outcomes, in order."""
    STOPPING.clear()
    first_two = [command.name for command in commands[:2]]
    print("".join(f"\n{position} {name} ... (beside {other})" for position, name, other in
                  zip(positions, first_two, reversed(first_two))), flush=True)
    slots = Slots(first_two, warm_start)

    def run(command, position):
        if STOPPING.is_set():  # Ctrl-C before its turn: never started
            raise KeyboardInterrupt
        return run_command(command, results_dir, position, timeout, slots)

    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            futures = [pool.submit(run, command, position)
                       for command, position in zip(commands, positions)]
            return [future.result() for future in futures]
        except BaseException:  # Ctrl-C here: end the steps running; the others never start
            STOPPING.set()
            for process in list(RUNNING):
                kill_process_group(process)
            raise


def runs_alone(command):
    """True for what the tour never runs beside another step in its slots: the sharded steps
    (their processes take every core) and the estimate (its own workers do; a CPU tour runs it
    in the background instead, at the lowest priority: Background)."""
    return command.argv[1:3] == ["-m", "torch.distributed.run"] or command.name == "estimate"


def run_commands(commands, results_dir, total, timeout, side_by_side, warm_start=False,
                 preload=True):
    """Run `commands` in order, numbered from 1 of `total`; with `side_by_side`, each run of
    consecutive single-process steps on two slots (run_side_by_side); with `warm_start` every
    step forked from the fork server (tour/warm.py: a sharded step's torchrun too, and its
    processes from it), which with `preload` imports the scripts' modules first. Their
    outcomes, in order."""
    outcomes, index = [], 0
    positions = [f"[{number}/{total}]" for number in range(1, len(commands) + 1)]
    if warm_start and commands:  # (a CPU tour: its estimate runs in the background, not here)
        warm_start = fork_server_started(preload)
    while index < len(commands):
        end = index
        while side_by_side and end < len(commands) and not runs_alone(commands[end]):
            end += 1
        if end - index >= 2:
            outcomes += run_side_by_side(commands[index:end], results_dir, positions[index:end],
                                         timeout, warm_start)
            index = end
        else:
            outcomes.append(run_command(commands[index], results_dir, positions[index], timeout,
                                        warm_start=warm_start))
            index += 1
    return outcomes


def fork_server_started(preload):
    """Start the fork server (tour/warm.py), saying so, and how long it took; False where it
    could not start."""
    print("\nstarting one Python that imports what the scripts import, from which each step "
          "is forked (a sharded step's torchrun, and its processes from it) ...", flush=True)
    start = time.perf_counter()
    not_imported = warm.start_server(preload)
    if not_imported is None:
        print("it could not start: each step starts a Python of its own", flush=True)
        return False
    print(f"ready ({time.perf_counter() - start:.1f} s)" + (
        f"; {not_imported} of the scripts' modules did not import in it, so each step imports "
        "them itself" if preload and not_imported else ""), flush=True)
    return True


def move_results(staging, results_dir, responsible_for):
    """Move this run's files into `results_dir`, each by an atomic rename, the table last; remove
    the files this run was responsible for but did not produce, so none of them is left stale."""
    produced = sorted((path for path in staging.iterdir() if path.is_file()),
                      key=lambda path: path.name == TOUR_TABLE)
    for path in produced:
        os.replace(path, results_dir / path.name)
    for name in set(responsible_for) - {path.name for path in produced}:
        (results_dir / name).unlink(missing_ok=True)


def parse_args(argv=None, scripts_dir=None):
    """The tour's flags; `args.scripts` are the scripts --steps selects (steps.select), or with
    `scripts_dir` their stand-ins there (the tests' fakes)."""
    parser = argparse.ArgumentParser(prog="python -m tour", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_flags(parser, ["--preset", "--task"], {
        "--preset": (DEFAULT_PRESET, f"{DEFAULT_PRESET}; tiny-text: the steps on text, without "
                                     "the GPU estimate"),
        "--task": ("classification", "classification; causal-lm: the scripts that train it")})
    parser.add_argument("--results-dir", type=Path,
                        help="where the records, tables and charts go (default: results, or "
                             "results/PRESET for another preset than tiny, results/PRESET-causal-lm "
                             "under --task causal-lm)")
    parser.add_argument("--steps", nargs="+", metavar="NN",
                        help="run only these steps, e.g. --steps 01 03 (default: all, and "
                             "10, the combined script, twice: with no switch and the whole "
                             "stack); with --publish, publish only their rows")
    add_shared_flags(parser, ["--max-steps", "--epochs"])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="passed to every script (auto: each script's own choice, and the "
                             "sharded steps on the GPUs, or on 2 CPU processes as said above)")
    parser.add_argument("--nproc", type=positive_int, metavar="N",
                        help="at most this many processes for the sharded steps (default: one per "
                             f"GPU, else {CPU_PROCESSES} on the CPU)")
    parser.add_argument("--skip-estimate", action="store_true",
                        help="do not run the GPU estimate (python -m estimate)")
    parser.add_argument("--step-timeout", type=positive_int, default=STEP_TIMEOUT, metavar="S",
                        help=f"stop a step that runs longer than this (default: {STEP_TIMEOUT} s)")
    parser.add_argument("--publish", type=Path, metavar="DIR",
                        help="also copy the tables and charts to DIR and write the tables the "
                             "README and docs/ embed from them; runs each step alone. With "
                             "--steps, only those steps' rows: each replaces its row in the "
                             "tables DIR holds, or joins them in the tour's order; the other rows "
                             "stay, a row made on another machine is marked, the charts are drawn "
                             "again. docs/, docs/text and docs/causal-lm take only their own "
                             "preset and task, without --max-steps, --epochs or --skip-estimate")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="run each step alone, so that its training time is that of a run "
                             "with the machine to itself (the default with --publish or on a GPU; "
                             "a CPU tour, with no GPU or --device cpu, otherwise runs two "
                             "single-process steps at a time)")
    args = parser.parse_args(argv)
    try:
        for_task(PRESETS[args.preset], args.task)
        args.scripts = step_scripts(tour_steps(args.steps, args.task), scripts_dir)
    except UnknownStep as problem:
        parser.error(f"--steps: {problem}")
    except ValueError as problem:
        parser.error(str(problem))
    if not args.scripts:
        parser.error(f"no script of the steps selected in {scripts_dir}")
    if args.results_dir is None:
        args.results_dir = Path("results") / ("" if args.preset == DEFAULT_PRESET else args.preset)
        if args.task != "classification":
            args.results_dir = Path("results") / f"{args.preset}-{args.task}"
    args.passed_flags = [*(["--preset", args.preset] if args.preset != DEFAULT_PRESET else []),
                         *(["--task", args.task] if args.task != "classification" else []),
                         *(["--max-steps", str(args.max_steps)] if args.max_steps else []),
                         *(["--epochs", str(args.epochs)] if args.epochs else []),
                         *(["--device", args.device] if args.device != "auto" else [])]
    import torch  # only here: the rest of the tour runs without it
    if args.device != "cpu" and torch.cuda.is_available():  # each run checks its estimate
        args.passed_flags.append("--check-estimate")
    # a CPU tour runs two single-process steps at a time: each trains on few cores for a few
    # seconds, after seconds of starting Python and importing, which two overlap
    args.side_by_side = not (args.one_at_a_time or args.publish or args.device == "cuda"
                             or (args.device == "auto" and torch.cuda.is_available()))
    # the steps forked from one Python that has imported what they import (tour/warm.py), on
    # Linux, with no GPU that a forked process could not use and for a preset that loads its
    # data in the process (the GPU presets load theirs in worker processes)
    args.warm_start = (args.side_by_side and warm.available() and not torch.cuda.is_available()
                       and not PRESETS[args.preset].gpu)
    if args.publish is not None:  # checked before the first step, as the scripts check --results-dir
        from common.cli import unwritable
        problem = unwritable(str(args.publish))
        if problem:
            parser.error(problem.replace("--results-dir", "--publish", 1))
        problem = publish_problem(args.publish, args.preset, args.task, shortened=bool(
            args.max_steps or args.epochs or args.skip_estimate))
        if problem:
            parser.error(problem)
    # --steps into a directory that holds a tour: its rows merged into the tables there
    args.merging = bool(args.publish and args.steps and (args.publish / TOUR_TABLE).is_file())
    try:
        for name in (TOUR_TABLE, ESTIMATE_TABLE) if args.merging else ():
            if (args.publish / name).is_file():  # a table that cannot take rows: said now
                read_table(args.publish / name)
    except Refused as refusal:
        parser.error(str(refusal))
    sharded = [script for script in args.scripts if step_of(script).sharded]
    split = (PRESETS[args.preset].batch_size, step_of(sharded[0]).accum_steps if sharded else 1)
    try:
        args.launch = sharded_launch(torch.cuda.device_count(), args.nproc, args.device,
                                     args.preset, split)
    except ValueError as error:
        parser.error(str(error))
    return args


def tour_commands(args, results_dir):
    """What the tour runs for `args` (parse_args), in order, each writing into `results_dir`: a
    command per step, two for the combined script; the estimate apart (estimate_of)."""
    return [command for script in args.scripts for command in (
        combined_commands(script, results_dir, args.passed_flags, args.launch, args.task)
        if step_of(script).combined else
        [script_command(script, results_dir, args.passed_flags, args.launch)])]


def estimate_of(args, results_dir):
    """The GPU estimate the tour runs after its steps, or None (no_estimate_reason says why).
    Publishing some steps' rows, the estimate of those steps alone, or of every step where the
    directory keeps no estimate records yet: its estimate chart is drawn from them all."""
    if no_estimate_reason(args):
        return None
    if not args.merging or not (args.publish / ESTIMATE_FILE).is_file():
        return estimate_command(results_dir)
    return estimate_command(results_dir, estimated_scripts(args.steps, args.task))


def no_estimate_reason(args):
    """Why the tour runs no estimate (for the table's note), or None when it runs one."""
    if args.skip_estimate:
        return "--skip-estimate"
    if not PRESETS[args.preset].tour_estimate or args.task != "classification":
        return ("the tour's GPU estimate predicts the image steps (article preset); for text, "
                "python -m estimate --preset imdb"
                + (f" --task {args.task}" if args.task != "classification" else ""))
    if args.merging and not estimated_scripts(args.steps, args.task):
        return "none of the steps named has a row in the estimate table"
    return None


def main(argv=None, scripts_dir=None):
    """Run the tour; returns the exit status (1 if any step failed). `scripts_dir` holds the
    numbered scripts (the tests point it at stand-ins)."""
    args = parse_args(argv, scripts_dir)
    results_dir = args.results_dir.resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tour-", dir=results_dir))
    machine = this_machine()  # named under the tables: the CPU, its cores, bfloat16 arithmetic
    try:
        commands = tour_commands(args, staging)
        if any(step_of(script).sharded for script in args.scripts):
            print(f"sharded steps: {args.launch.reason}", flush=True)
        estimate = estimate_of(args, staging)
        total = len(commands) + (estimate is not None)
        if args.side_by_side and sum(not runs_alone(command) for command in commands) > 1:
            print("single-process steps run two at a time (a CPU tour without --publish): their "
                  "training times include sharing the cores; --one-at-a-time or --publish runs "
                  "each alone", flush=True)
        STOPPING.clear()  # (set by an earlier tour's Ctrl-C in this process)
        with ThreadPoolExecutor(max_workers=1) as background:
            # a CPU tour's estimate from the start, on the cores the steps leave idle (Background)
            early, beside = estimate is not None and args.side_by_side, Background()
            try:
                if early:  # (its environment read here: the fork server's start changes it)
                    estimating = background.submit(run_command, estimate, staging,
                                                   f"[{total}/{total}]", args.step_timeout,
                                                   beside, dict(os.environ))
                outcomes = run_commands(commands, staging, total, args.step_timeout,
                                        args.side_by_side, args.warm_start,
                                        preload=scripts_dir is None)
                if early:  # and how long the tour waited for it once the steps had ended
                    beside.steps_ended()
                    steps_ended = time.perf_counter()
                    estimate_outcome = estimating.result()
                    estimate_outcome["waited_seconds"] = round(time.perf_counter() - steps_ended, 1)
            except BaseException:  # Ctrl-C: the estimate too ends at once
                STOPPING.set()
                for process in list(RUNNING):
                    kill_process_group(process)
                raise
        if estimate is not None and not early:
            estimate_outcome = run_command(estimate, staging, f"[{total}/{total}]", args.step_timeout)
        elif estimate is None:
            estimate_outcome = {"script": "estimate", "status": "skipped",
                                "error": no_estimate_reason(args)}
        write_json_atomically(staging / TOUR_FILE, {
            "steps": outcomes, "estimate": estimate_outcome, "passed_flags": args.passed_flags,
            "sharded_launch": vars(args.launch), "machine": machine})
        report_text = write_report(staging)
        report_names = [name for name in REPORT_FILES if (staging / name).is_file()]
        responsible_for = [TOUR_FILE, TOUR_TABLE, TOUR_CHART, *(command.output for command in commands)]
        if estimate is not None:
            responsible_for += [ESTIMATE_FILE, ESTIMATE_TABLE, ESTIMATE_CHART]
        move_results(staging, results_dir, responsible_for)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    print("\n" + report_text)
    print(f"written to {results_dir}/: {', '.join(report_names)}")
    failed = [outcome["script"] for outcome in [*outcomes, estimate_outcome]
              if outcome["status"] == "failed"]
    if args.merging and failed:  # a published row replaced by a failure would help nobody
        print(f"not published into {args.publish}/: {', '.join(failed)} failed, so its tables "
              "keep the rows they had")
    elif args.merging:
        try:
            publish_rows(results_dir, args.publish, whole_tour_rows(args.task, scripts_dir),
                         estimated_scripts(None, args.task),
                         estimated_scripts(args.steps, args.task) if estimate else [])
        except Refused as refusal:
            print(f"not published into {args.publish}/: {refusal}", file=sys.stderr)
            return 1
    elif args.publish:  # with the estimate's records, from which a later --steps draws its chart
        publish(results_dir, [*report_names, *([ESTIMATE_FILE] if ESTIMATE_TABLE in report_names
                                                else [])], args.publish)
    if args.publish and not failed and is_published(args.publish):
        # and the tables docs/ shows of the code (a new step's rows in them too): tour/code_tables.py
        written = code_tables.write()
        print(f"and the tables of the code in {', '.join(written)}" if written else
              "the tables of the code in docs/ are as the code gives them")
    if failed:
        print(f"failed: {', '.join(failed)} (see the table)")
    return 1 if failed else 0

