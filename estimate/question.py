"""The question the --gpu-memory searches ask: this script, with these flags, on this many processes
and this GPU, at any micro-batch size. The fit search and the stack's walk (estimate/search/) ask
it for every figure, and reach the rest of estimate/ through nothing else but the output module
(tests/repository/test_imports.py checks it).

A Question keeps what answers it: the runs made or found for it (kept on disk by shortcuts/cache.py
with their sizes, which a later question with another capacity or GPU finds), and the line of
traces through them (shortcuts/sizes.py), from which a size between is written and replayed
instead of run. Which sizes are asked is the search's to decide (search/grid.py).

By blocks, a size after the first that the search's line of sizes checks is run as the middle
probe alone (shortcuts/blocks.py); where the runs make no line, those runs are forgotten
(unchecked), and every later one, as every answer(), runs the two smaller probes, the smallest
the check.
"""
from functools import cached_property
from pathlib import Path

from estimate.gpu_choices import DEFAULT_GPU
from estimate.predict import Row, attempt, attempt_run, compiles, from_one_probe, record_of, replayed
from estimate.shortcuts import cache
from estimate.shortcuts.sizes import SMALLEST, Family, NotBySizes, canonical, off_any_line

__all__ = ["SMALLEST", "NotBySizes", "Question"]


class Question:
    """A script and its flags (`base_argv`, without --batch-size and --accum-steps) on
    `world_size` processes and the GPU `gpu` (a key of GPUS), at micro-batches of any size: with
    `accumulates`, two micro-batches of the size a step (which peaks as any number of them does),
    else the whole batch at once. `asked`: {micro-batch: Row} whose runs stand for those sizes
    (the table's asked row, run with the flags it was asked with). `shares_texts`: every process
    reads the same texts (--sequence-parallel splits each across them), so a micro-batch is
    `micro` texts in all, not `micro` a process."""

    def __init__(self, script, base_argv, world_size=1, gpu=DEFAULT_GPU, accumulates=True, asked=None,
                 shares_texts=False):
        self.script, self.base_argv, self.world_size = Path(script), list(base_argv), world_size
        self.gpu, self.accumulates, self.asked = gpu, accumulates, dict(asked or {})
        self.texts = 1 if shares_texts else world_size  # a micro-batch's texts: `micro` times it
        self.runs = {}  # {micro-batch: KeptRun} made or found for this question
        self.line = None  # the Family of traces through the runs (draw_line)
        self.written = {}  # {micro-batch: reserved bytes} of traces written from the line
        self.checked = set()  # sizes run since the line was drawn and found on it (on_line)
        self.one_probe = True  # estimate(): later sizes from the middle probe, until unchecked()

    @property
    def name(self):
        return self.script.stem

    @property
    def compiles(self):
        """Whether the run compiles its model (predict.compiles): the table then asks no search."""
        return compiles(self.script, self.base_argv)

    def row(self, micro):
        """The row whose run has micro-batches of `micro` samples per process (in all, where the
        processes share their texts); a question of memory, so the data set's size does not
        limit it."""
        if self.accumulates:
            flags = ["--batch-size", str(2 * micro * self.texts), "--accum-steps", "2"]
        else:
            flags = ["--batch-size", str(micro * self.texts)]
        return Row(self.script, [*self.base_argv, *flags], self.world_size, self.gpu,
                   any_batch_size=True)

    def answer(self, micro):
        """(record, None, seconds) or (None, problem, seconds) at `micro`, as predict.attempt
        gives them (by blocks, from two probes where learned_for allows; no line checks it): a
        failure is an answer, not an exception."""
        return attempt(self.row(micro), learned=self.learned_for(micro))

    def learned_for(self, micro):
        """What a run of this question at another size kept of its probes, from which `micro` is
        written with fewer probes (predict.run_for), or None. Sizes below SMALLEST make other
        events (shortcuts/sizes.py): neither side of it."""
        if micro < SMALLEST:
            return None
        return next((kept.learned for size, kept in self.runs.items()
                     if kept.learned and size >= SMALLEST), None)

    def figures(self, kept):
        """(allocated, reserved) bytes of a run replayed on this question's GPU."""
        record = record_of(kept, self.gpu)
        return record["allocated_bytes"], record["reserved_bytes"]

    @cached_property
    def sizes_key(self):
        """The name the sizes run are noted under (shortcuts/cache.py): the key of the row without a size."""
        return cache.key(self.row(0), False)

    def found(self, known, cap):
        """Find the runs that need no new one: each size of `known` (its asked row's run, or
        made again where none was kept) and each an earlier question ran, up to `cap`; returns
        {micro-batch: (allocated, reserved)} of the latter. Runs written from one probe are
        left out where no other run is found for the line to go through (its check)."""
        for micro in known:
            kept, _, _ = attempt_run(self.asked.get(micro) or self.row(micro), one_probe=self.one_probe)
            if kept is not None:
                self.runs[micro] = kept
        earlier = {}
        for micro in cache.sizes_kept(self.sizes_key) if self.sizes_key else ():
            if micro not in self.runs and micro <= cap:
                kept, _, _ = attempt_run(self.row(micro), run=False, one_probe=self.one_probe)
                if kept is not None:
                    self.runs[micro] = kept
                    earlier[micro] = self.figures(kept)
        if not any(size >= SMALLEST and not from_one_probe(kept) for size, kept in self.runs.items()):
            for micro in self.from_one_probe():  # (none of the runs their line must go through)
                del self.runs[micro]
                earlier.pop(micro, None)
        return earlier

    def estimate(self, micro):
        """(allocated, reserved) at `micro` from its run, made now unless kept (by blocks, from the
        middle probe where learned_for allows, until unchecked()), and noted for later questions;
        RuntimeError with the problem where it fails."""
        learned = self.learned_for(micro)  # (none: no run here for a line to go through)
        kept, problem, _ = attempt_run(self.row(micro), learned=learned,
                                       one_probe=self.one_probe and learned is not None)
        if problem:
            raise RuntimeError(problem)
        cache.note_size(self.sizes_key, micro)
        self.runs[micro] = kept
        return self.figures(kept)

    def off_any_line(self):
        """Why no line goes through this question's runs of SMALLEST samples or more, as one of
        them shows by itself (it chose by its size, or compiled), or None: the search then runs
        no other size to find out."""
        return next(filter(None, (off_any_line(kept) for size, kept in self.runs.items()
                                  if size >= SMALLEST)), None)

    def draw_line(self):
        """The line of traces through the runs of SMALLEST samples or more; NotBySizes where the
        runs make none. The sizes written from the line before are forgotten, unless every run
        added since lies on it (on_line): the line is then the same, whichever runs it goes through."""
        line = Family({size: kept for size, kept in self.runs.items() if size >= SMALLEST})
        if self.line is None or not set(line.sizes) <= {*self.line.sizes, *self.checked}:
            self.written = {}
        self.line, self.checked = line, set()
        return self.line

    def reserved_written(self, micro):
        """The reserved bytes at `micro` of the trace written from the line, replayed (no run)."""
        if micro not in self.written:
            kept = self.line.written(micro)
            self.written[micro] = replayed(kept, kept.events, self.gpu).reserved_bytes
        return self.written[micro]

    def on_line(self, micro):
        """Whether the run at `micro` is the trace the line writes there, event for event."""
        if canonical(self.runs[micro].events) != self.line.written(micro).events:
            return False
        self.checked.add(micro)
        return True

    def from_one_probe(self):
        """The sizes whose runs were written from one probe (predict.from_one_probe)."""
        return [micro for micro, kept in self.runs.items() if from_one_probe(kept)]

    def unchecked(self):
        """The sizes whose runs were written from one probe, forgotten: no line checks them (the
        runs made none, or the search failed); every later run of this question is made from two
        probes at least."""
        self.one_probe = False
        sizes = self.from_one_probe()
        for micro in sizes:
            del self.runs[micro]
        return sizes
