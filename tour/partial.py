"""Publishing some steps' rows (python -m tour --publish DIR --steps NN): the rows of the steps
that ran merged into the tables DIR holds, every other row kept byte for byte.

What a merge does to each table (the tour's, and the estimate's where DIR holds one):
- each step that ran replaces its rows (one in the tour table; one per setting in the estimate
  table), or joins the table in the tour's order (steps.py's) if it had none; the rows of scripts
  the tour no longer runs are dropped;
- "vs 01" divides a row's peak by 01's: a new row's ratio is the run's own where 01 ran with it,
  else its peak over 01's as the table shows both; a rerun of 01 that changes its shown peak
  computes every other row's ratio again from the shown peaks, so that none is left against the
  old 01;
- a row made on another machine than the unmarked rows carries a mark after its step, and a line
  under the table names that machine (tour/machine.py); a mark stays while rows of its machine
  remain, and a table whose rows all come from one machine again has one unmarked line.

The charts are drawn again for the merged tables: the tour's from the merged table itself, which
shows every number that chart draws (each peak and its breakdown, times, accuracies and their
intervals: the chart's labels then round the table's figures, not the records'), with the marks
on its steps and the machines at its foot; the estimate's from the estimate records kept beside
its table (estimate.json), since that table does not show the breakdown its bars stack. A
directory published before it kept them gets them from an estimate of every step (the runner
asks for one: about a minute on 2 idle cores, and the estimate's numbers do not depend on the
CPU). Either way the records of the rows kept must make exactly those rows, or the merge is
refused: a chart never shows other numbers than its table.

Nothing is written unless every table merges; Refused says why, in one line.
"""
import re
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from common.atomic_write import atomic_path, write_json_atomically, write_text_atomically
from common.breakdown import BREAKDOWN_KEYS
from estimate.records import ESTIMATE_FILE, MIB, estimate_table, read_estimate
from steps import STEPS, step_id
from tour.charts import estimate_figure, save_png, tour_figure
from tour.machine import (
    UNRECORDED,
    cell_mark,
    machine_line,
    mark_number,
    marked_line,
    nth_mark,
    read_machine_line,
    without_mark,
)
from tour.publish import machines_under, refresh_embeds, shown_path, step_cell, table_lines, table_span
from tour.records import StepRow, read_json, read_tour, shown
from tour.report import COMBINED_NOTE, ESTIMATE_CHART, ESTIMATE_TABLE, TOUR_CHART, TOUR_TABLE, script_of

PROCESSES = re.compile(r"\((?P<count>\d+) processes(?:, (?P<device>\w+))?\)")  # "(2 processes, cpu)"
PRESET_LINE = re.compile(r"^Preset (?P<presets>[^,]*), device (?P<devices>[^.]*)\.")


class Refused(Exception):
    """Why a partial publish writes nothing, in one line that says what to do."""


def row_cells(line):
    """A row's cells as the report wrote them ("| a | b |" -> ["a", "b"]; "\\|" stays in its cell)."""
    return line[2:-2].split(" | ")


def row_line(cells):
    return "| " + " | ".join(cells) + " |"


@dataclass
class Row:
    key: str      # the record a tour row shows ("10_combined_stack"), an estimate row's script
    line: str     # the row as the report writes it, without a mark
    machine: str  # the line naming the machine that made it (UNRECORDED where the table names none)
    new: bool = False  # made by this run


@dataclass
class Table:
    """A table file in parts: writing it back changes only the rows and lines merging changed."""
    path: Path
    above: list    # the lines above the table
    header: list   # its header line and rule
    rows: list     # Rows
    machines: dict  # {mark: the line naming that machine}: "" for the unmarked rows
    below: list    # the lines after those under the table that name machines

    def text(self, rows=None, below=None):
        """The file with `rows` (Rows, default its own), marked as their machines need, the
        lines naming those machines under the table, then `below` (default its own)."""
        rows = self.rows if rows is None else rows
        marks = machine_marks(rows, self.machines)
        named = [] if set(marks) == {UNRECORDED} else [  # a table that never named its machine
            marked_line(mark, machine)
            for machine, mark in sorted(marks.items(), key=lambda item: mark_number(item[1]))]
        return "\n".join([*self.above, *self.header,
                          *(marked_row(row.line, marks[row.machine]) for row in rows),
                          "", *(part for line in named for part in (line, "")),
                          *(self.below if below is None else below)])


def read_table(path, new_machine=None):
    """The table in the file at `path` as a Table; with `new_machine` (this run's report), each
    row made now on that machine. Refused where a row's mark names no machine."""
    path = Path(path)
    lines = path.read_text().split("\n")
    start, end = table_span(lines)
    if end - start < 2:
        raise Refused(f"{shown_path(path)} holds no table: publish the whole tour into its directory")
    machines, index = {}, end
    while index < len(lines) and (not lines[index] or read_machine_line(lines[index])):
        if lines[index]:
            mark, line = read_machine_line(lines[index])
            machines[mark] = line
        index += 1
    machines.setdefault("", UNRECORDED)
    rows = []
    for line in lines[start + 2:end]:
        mark = cell_mark(step_cell(line))
        if mark not in machines:
            raise Refused(f"{shown_path(path)}: the row of {script_of(step_cell(line))} is marked "
                          f"{mark}, but no line under the table starts '{mark} Made on': publish "
                          "the whole tour into its directory")
        rows.append(Row(script_of(step_cell(line)), marked_row(line, ""),
                        new_machine or machines[mark], new=new_machine is not None))
    return Table(path, lines[:start], lines[start:start + 2], rows, machines, lines[index:])


def marked_row(line, mark):
    """The row with `mark` after its step ("" for none): the only change marking makes."""
    cells = row_cells(line)
    cells[0] = without_mark(cells[0]) + (f" {mark}" if mark else "")
    return row_line(cells)


def machine_marks(rows, published):
    """{machine line: its mark} for the machines of `rows`: none when one machine made them all;
    else each keeps its mark in `published` ({mark: line}, the table as it was), and a machine
    new to the table is unmarked if no row is, else takes the first free mark."""
    machines = list(dict.fromkeys(row.machine for row in rows))
    if len(machines) <= 1:
        return dict.fromkeys(machines, "")
    marks = {line: mark for mark, line in published.items() if line in machines}
    for machine in machines:
        if machine not in marks:
            marks[machine] = ("" if "" not in marks.values() else
                              next(nth_mark(n) for n in count(1) if nth_mark(n) not in marks.values()))
    return marks


def merged(table, new_rows, order):
    """(the rows of `table` with `new_rows` in place of those of the same keys, in `order`: the
    keys of the whole tour's rows; the keys of rows dropped, no longer among them)."""
    new_keys = {row.key for row in new_rows}
    by_key = {}
    for row in [row for row in table.rows if row.key not in new_keys] + new_rows:
        by_key.setdefault(row.key, []).append(row)
    strays = new_keys - set(order)
    if strays:  # a run's own rows are the tour's: this is a fault, not a user's mistake
        raise Refused(f"{', '.join(sorted(strays))}: no row of the whole tour, so no place in it")
    return ([row for key in order for row in by_key.get(key, [])],
            [key for key in by_key if key not in order])


def same_columns(published, new):
    """Refused unless the run's table has the published one's columns."""
    if published.header != new.header:
        theirs, ours = row_cells(published.header[0]), row_cells(new.header[0])
        differ = [name for name in dict.fromkeys(theirs + ours) if (name in theirs) != (name in ours)]
        raise Refused(f"{shown_path(published.path)}'s columns are not this run's "
                      f"({', '.join(differ) or 'in another order'}): its rows and these cannot share "
                      "one table; publish the whole tour into its directory")


def same_device(published, new):
    """Refused when the run's rows were made on a device (cpu, cuda) the table's were not."""
    said = [next((match for line in table.above if (match := PRESET_LINE.match(line))), None)
            for table in (published, new)]
    if all(said) and not set(said[1]["devices"].split(", ")) <= set(said[0]["devices"].split(", ")):
        raise Refused(f"{shown_path(published.path)} was made on {said[0]['devices']}, these rows on "
                      f"{said[1]['devices']}: pass --device {said[0]['devices'].split(', ')[0]}, "
                      "or publish the whole tour")


def number(cell, suffix=""):
    """A figure as a table shows it ("1,234.56", "3.1 s", "94.7%"), or None for "n/a"."""
    try:
        return float(cell.removesuffix(suffix).replace(",", ""))
    except ValueError:
        return None


def ratios_again(rows, header, published_rows):
    """Make "vs 01" right for the merged `rows` (see the module's docstring), in place."""
    names = row_cells(header)
    peak, ratio, status = names.index("peak MiB"), names.index("vs 01"), names.index("status")

    def baseline(rows):  # 01's peak as shown, where 01 ran well (report.baseline_peak's rule)
        cells = next((row_cells(row.line) for row in rows if row.key.startswith("01_")), None)
        if cells is None or cells[status] != "ok":
            return None
        return number(cells[peak]) or None  # none, or 0: nothing to divide by

    before, after = baseline(published_rows), baseline(rows)
    ran_01 = any(row.new and row.key.startswith("01_") for row in rows)
    for row in rows:
        if (row.new and not ran_01) or (not row.new and after != before):
            cells = row_cells(row.line)
            shown_peak = number(cells[peak])
            cells[ratio] = shown(shown_peak / after if shown_peak is not None and after else None,
                                 ".2f", "x")
            row.line = row_line(cells)


@dataclass
class TableRow(StepRow):
    """A published tour table's row read back for its chart: the figures as the table shows them."""
    interval: tuple | None = None  # the accuracy's 95% interval, as the table shows it
    mark: str = ""  # the mark of a row made on another machine than the unmarked ones

    def accuracy_interval(self):
        return self.interval


def chart_rows(header, lines):
    """TableRows of the tour table's rows `lines` (marked), by the names of its columns."""
    column = {name: index for index, name in enumerate(row_cells(header))}
    rows = []
    for line in lines:
        cells = row_cells(line)

        def cell(name):
            return cells[column[name]] if name in column else "n/a"

        processes = PROCESSES.search(cells[0])
        interval = cell("95% interval").removesuffix("%").split("-")
        status = cell("status")
        peak = mebibytes(cell("peak MiB"))
        rows.append(TableRow(
            script=script_of(cells[0]), ok=status == "ok",
            error=None if status == "ok" else status.removeprefix("failed: "),
            device=processes and processes["device"],
            world_size=int(processes["count"]) if processes else None,
            peak_bytes=peak,
            breakdown_bytes=breakdown_as_shown(
                {key: mebibytes(cell(key.replace("_", " "))) for key in BREAKDOWN_KEYS}, peak),
            train_seconds=number(cell("training time"), " s"),
            test_accuracy=in_fraction(cell("test accuracy")),
            test_loss=number(cell("test loss")), test_perplexity=number(cell("perplexity")),
            interval=(tuple(in_fraction(bound + "%") for bound in interval)
                      if len(interval) == 2 else None),
            mark=cell_mark(cells[0])))
    return rows


def breakdown_as_shown(breakdown, peak):
    """The breakdown a row shows, its largest part taking up what rounding each figure to 0.01
    MiB leaves between the parts and the peak: the chart stacks the parts to the peak, and
    would draw that remainder as memory the breakdown left out. A larger gap (a part missing, an
    older record's n/a) is left for the chart to show."""
    parts = [value for value in breakdown.values() if value is not None]
    gap = (peak or 0) - sum(parts)
    if not parts or len(parts) < len(breakdown) or abs(gap) > 0.005 * MIB * (len(parts) + 1):
        return breakdown
    largest = max(breakdown, key=lambda key: breakdown[key])
    return {**breakdown, largest: breakdown[largest] + gap}


def mebibytes(cell):
    value = number(cell)
    return None if value is None else value * MIB


def in_fraction(cell):
    value = number(cell, "%")
    return None if value is None else value / 100


def combined_note_of(table):
    return next((line for line in table.below if line.startswith(COMBINED_NOTE)), None)


def ran_combined(rows):
    return any(getattr(STEPS.get(step_id(row.key)), "combined", False) for row in rows)


def tour_merge(publish_dir, results_dir, order, machine):
    """(the merged tour table's text, its chart, the keys new to it, the keys dropped)."""
    published = read_table(Path(publish_dir) / TOUR_TABLE)
    new = read_table(Path(results_dir) / TOUR_TABLE, machine)
    same_device(published, new)
    same_columns(published, new)
    rows, dropped = merged(published, new.rows, order)
    ratios_again(rows, published.header[0], published.rows)
    below, note, old = published.below, combined_note_of(new), combined_note_of(published)
    if note and ran_combined(new.rows):  # the switches it ran with are this run's
        below = [note if line == old else line for line in below] if old else [note, "", *below]
    text = published.text(rows, below)
    machines = machines_under(text)
    figure = tour_figure(chart_rows(published.header[0], table_lines(text)[2:]),
                         [marked_line(mark, line) for mark, line in machines.items()]
                         if len(machines) > 1 else ())
    known = {row.key for row in published.rows}
    return text, figure, [row.key for row in new.rows if row.key not in known], dropped


def records_of(path):
    """The estimate records in the file at `path`, or None where it holds no list of them."""
    records, _ = read_json(Path(path))
    return ([record for record in records if isinstance(record, dict)]
            if isinstance(records, list) else None)


def estimate_merge(publish_dir, results_dir, order, named, machine):
    """(the merged estimate table's text, its records, its chart, the scripts dropped); the
    rows of the scripts `named` are this run's."""
    published = read_table(Path(publish_dir) / ESTIMATE_TABLE)
    new = read_table(Path(results_dir) / ESTIMATE_TABLE, machine)
    same_columns(published, new)
    new_rows = [row for row in new.rows if row.key in named]
    rows, dropped = merged(published, new_rows, order)
    ours = records_of(Path(results_dir) / ESTIMATE_FILE) or []
    kept = records_of(Path(publish_dir) / ESTIMATE_FILE)
    kept = ours if kept is None else kept  # none kept: this run estimated every step
    new_keys = {row.key for row in new_rows}
    records = [record for key in dict.fromkeys(row.key for row in rows)
               for record in (ours if key in new_keys else kept) if record.get("script") == key]
    made = {}
    for line in table_lines(estimate_table([read_estimate(record) for record in records]))[2:]:
        made.setdefault(script_of(step_cell(line)), []).append(line)
    shown_rows = {}
    for row in rows:
        shown_rows.setdefault(row.key, []).append(row.line)
    differ = [key for key in dict.fromkeys([*shown_rows, *made]) if shown_rows.get(key) != made.get(key)]
    if differ:
        raise Refused(f"{shown_path(published.path)}: the rows of {', '.join(differ)} are not what "
                      f"their estimate records ({ESTIMATE_FILE} beside it) make now: name those "
                      "steps too (--steps), or publish the whole tour")
    figure = estimate_figure([read_estimate(record) for record in records])
    return published.text(rows), records, figure, dropped


def copy_file(source):
    def write(path):
        with atomic_path(path) as tmp:
            tmp.write_bytes(Path(source).read_bytes())
    return write


def publish_rows(results_dir, publish_dir, order, estimate_order, estimated, among=None):
    """Merge the rows of the tour in `results_dir` into the tables in `publish_dir`, draw their
    charts again and write every embed of them (in `among`, default: the documents). `order`:
    the whole tour's rows (record names) in its order; `estimate_order`: the scripts of the whole
    estimate table in its order; `estimated`: the scripts whose estimate this run made for
    publishing. Refused, with nothing written, where a table cannot take the rows."""
    results_dir, publish_dir = Path(results_dir), Path(publish_dir)
    machine = machine_line((read_tour(results_dir) or {}).get("machine")) or UNRECORDED
    tour_text, tour_chart, added, dropped = tour_merge(publish_dir, results_dir, order, machine)
    writes = {publish_dir / TOUR_TABLE: lambda path: write_text_atomically(path, tour_text),
              publish_dir / TOUR_CHART: lambda path: save_png(tour_chart, path)}
    estimated = [script for script in estimated if script in estimate_order]
    if estimated and (results_dir / ESTIMATE_TABLE).is_file():
        if (publish_dir / ESTIMATE_TABLE).is_file():
            text, records, chart, gone = estimate_merge(publish_dir, results_dir, estimate_order,
                                                        set(estimated), machine)
            dropped += [script for script in gone if script not in dropped]
            writes[publish_dir / ESTIMATE_TABLE] = lambda path: write_text_atomically(path, text)
            writes[publish_dir / ESTIMATE_FILE] = lambda path: write_json_atomically(path, records)
            writes[publish_dir / ESTIMATE_CHART] = lambda path: save_png(chart, path)
        else:  # the first estimate this directory holds: the run's own, of every step
            for name in (ESTIMATE_TABLE, ESTIMATE_FILE, ESTIMATE_CHART):
                writes[publish_dir / name] = copy_file(results_dir / name)
    for path, write in writes.items():  # every table merged: now each file is written whole
        write(path)
    tables = [path for path in writes if path.suffix == ".md"]
    print(f"published this run's rows into {', '.join(shown_path(path) for path in tables)}"
          + (f" (new: {', '.join(added)})" if added else "")
          + (f", without the rows of {', '.join(dropped)} (no longer in the tour)" if dropped else "")
          + ", and drew their charts again")
    changed = refresh_embeds(tables, among)
    if changed:
        print(f"and wrote their tables into {', '.join(shown_path(path) for path in changed)}")
