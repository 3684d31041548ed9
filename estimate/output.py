"""What python -m estimate shows while its work goes and as it ends, and the worker processes the
work goes in: a line per estimate made, a bar over the scripts searched, sizes and times in
words, the table of the rows. The searches (estimate/search/) take their words and workers
from here.

The workers are forked (they share the parent's imports), and Ctrl-C stops them as a whole: they
ignore it, the parent ends them and says how far it got.
"""
import io
import multiprocessing
import resource
import shutil
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, redirect_stdout

from estimate.collector import frozen
from estimate.records import GB, estimate_table, read_estimate, size_text


def took_text(seconds):
    """How long an estimate took, in words (attempt's None: it was kept from an earlier one)."""
    return "kept from an earlier estimate" if seconds is None else f"{seconds:.1f} s"


def report_progress(done, row, outcome, total):
    record, problem, seconds = outcome
    state = f"{size_text(record['allocated_bytes'])} allocated" if record else "failed"
    print(f"[{done + 1}/{total}] {row.label}: {state} ({took_text(seconds)})", flush=True)
    return outcome


def rows_table(rows, outcomes, not_estimated=()):
    """The Markdown table of all predictions, with the study's figure where there is one, a row
    for each that failed and for each step in `not_estimated` (the notes say why)."""
    made = [read_estimate(record) for record, _, _ in outcomes if record is not None]
    failed = [(row.script.stem, " ".join(row.argv)
               + (f", {row.world_size} processes" if row.world_size > 1 else ""),
               "failed (see the note)")
              for row, (record, _, _) in zip(rows, outcomes) if record is None]
    not_run = [(step.name, "", "not estimated (see the note)") for step in not_estimated]
    return estimate_table(made, [*failed, *not_run])


class ProgressBar:
    """Work done of `total`: on a terminal one line redrawn ([#####.....] 5/10 and the last
    item's words), elsewhere a line per item."""

    def __init__(self, total, what, stream=None):
        self.total, self.what, self.done = total, what, 0
        self.stream = stream or sys.stdout
        self.terminal = self.stream.isatty()

    def advance(self, words):
        self.done += 1
        if not self.terminal:
            print(f"[{self.done}/{self.total}] {words}", file=self.stream, flush=True)
            return
        width = 24
        filled = width * self.done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {self.what}: {words}"
        columns = shutil.get_terminal_size().columns
        print("\r" + line[:columns - 1].ljust(columns - 1), end="", file=self.stream, flush=True)

    def close(self):
        if self.terminal and self.done:
            print(file=self.stream, flush=True)


def print_whole(text, stream=None):
    """Print `text`, of one line or several, and its newline in one write: line-buffered
    (whole_lines), print(text) writes a newline inside it at once and its last apart."""
    print(text + "\n", end="", file=stream or sys.stdout, flush=True)


@contextmanager
def whole_lines():
    """While inside, each line printed to this process's own standard output and error (a
    terminal or a pipe) goes out in one write, the workers' and ours. Unbuffered
    (PYTHONUNBUFFERED=1, python -u, as Docker images and the tour set it), print() writes its
    words and its newline apart, and the lines of processes printing at once land inside each
    other: "...(2.9 s)The stack: ...", an answer no longer at the start of its line.
    Line-buffered, a line is written whole (text of several lines: print_whole)."""
    streams = [stream for stream in (sys.stdout, sys.stderr)
               if stream in (sys.__stdout__, sys.__stderr__) and isinstance(stream, io.TextIOWrapper)
               and stream.write_through]
    for stream in streams:
        stream.reconfigure(write_through=False, line_buffering=True)
    try:
        yield
    finally:
        for stream in streams:
            try:  # (it flushes first: a closed pipe must not hide what ended the work)
                stream.reconfigure(write_through=True, line_buffering=False)
            except OSError:
                pass


@contextmanager
def worker_pool(jobs, interrupted):
    """A pool of `jobs` forked workers (they share the parent's imports, which the collector
    then leaves alone), printing whole lines beside ours (whole_lines). On Ctrl-C the workers
    are killed and the run stops with the message `interrupted()` returns (called then, so it
    can say what was done)."""
    with frozen(collect=False), whole_lines():  # imported objects never become garbage: out
        # of the collector's way (estimate/collector.py)
        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                                   initializer=signal.signal,
                                   initargs=(signal.SIGINT, signal.SIG_IGN))
        try:
            yield pool
        except KeyboardInterrupt:
            stop(pool)  # mid-estimate: a worker ignoring Ctrl-C would finish its row first
            raise SystemExit(f"\ninterrupted (Ctrl-C) {interrupted()}") from None
        except BrokenProcessPool:
            stop(pool)
            raise SystemExit(f"error: a worker process died (killed: by the system when memory "
                             f"ran out, most often), {interrupted()}. Run again with --jobs 1: "
                             "one estimate at a time holds the least memory") from None
        pool.shutdown()


def stop(pool):
    """End the pool's workers now, and drop what they had not started."""
    for worker in list((getattr(pool, "_processes", None) or {}).values()):
        worker.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def in_order(function, items, jobs, interrupted):
    """function(item) for each of `items`, yielded in their order while up to `jobs` workers
    compute the next ones ahead; closing the generator early stops the work still to do."""
    if jobs <= 1 or len(items) <= 1:
        yield from map(function, items)
        return
    with worker_pool(jobs, interrupted) as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            for future in futures:
                yield future.result()
        finally:
            if not all(future.done() for future in futures):
                stop(pool)


def resources_used():
    """CPU seconds of this process and its finished workers, and the peak resident memory (GB)
    of this process and of the largest worker (Linux reports ru_maxrss in KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime
    return cpu_seconds, own.ru_maxrss * 1024 / GB, workers.ru_maxrss * 1024 / GB


@contextmanager
def quiet_while_working(quiet):
    """With --quiet, what the work prints while inside (a row's line, the search's bar, the
    stack's prefixes) goes nowhere, in this process and in the workers it starts."""
    if not quiet:
        yield
        return
    with redirect_stdout(io.StringIO()):
        yield
