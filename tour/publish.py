"""Publishing a tour (--publish DIR): its report files copied into DIR, then every table that
README.md and the chapters in docs/ embed from those files written again from the copies.

A document embeds a published table between markers, the path relative to the document, whole
or a selection of its rows (SELECTIONS):

  <!-- table: docs/tour-table.md -->  ...  <!-- /table -->
  <!-- table: docs/tour-table.md, without branches -->  ...  <!-- /table -->

What lies between them is the table's header and rows, and the lines under the table that name
the machines that made them (tour/machine.py): written by publishing, never by hand (a test checks
that each embed is what `embedded` makes of its source).

docs/ holds one tour of each kind (PUBLISHED), each made by the tour of its preset and task at
its full length with its estimate; --publish into one of them refuses a tour of another preset or
task, a shortened training or no estimate, which would leave a published table short of rows or
unlike the rest of it. With --steps NN the tour publishes only those steps' rows into the tables
DIR holds (tour/partial.py); without, the whole report.
"""
import re
from pathlib import Path

from common.atomic_write import atomic_path, write_text_atomically
from steps import STEPS, step_id
from tour.machine import cell_mark, marked_line, read_machine_line
from tour.report import script_of

ROOT = Path(__file__).resolve().parents[1]
# the directories the tours publish into, and the preset and task of the tour each holds:
#   python -m tour --publish docs
#   python -m tour --preset tiny-text --publish docs/text
#   python -m tour --preset tiny-text --task causal-lm --publish docs/causal-lm
PUBLISHED = {"docs": ("tiny", "classification"),
             "docs/text": ("tiny-text", "classification"),
             "docs/causal-lm": ("tiny-text", "causal-lm")}
EMBED = re.compile(r"(?P<start><!-- table: (?P<source>\S+?)(?:, (?P<selection>[^>]*?))? -->\n)"
                   r"(?P<shown>.*?)(?P<end><!-- /table -->)", flags=re.DOTALL)


def is_branch_row(step_cell):
    step = STEPS.get(step_id(script_of(step_cell)))
    return step is not None and step.is_branch


# an embed's selection (the words after the source's path) -> which rows, by their step cell
SELECTIONS = {None: lambda step_cell: True,
              "without branches": lambda step_cell: not is_branch_row(step_cell)}


def documents(root=ROOT):
    """The documents that may embed a published table: the README and the chapters."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def table_span(lines):
    """(start, end): the first Markdown table among `lines` is lines[start:end]."""
    start = next((index for index, line in enumerate(lines) if line.startswith("|")), len(lines))
    end = next((index for index in range(start, len(lines)) if not lines[index].startswith("|")),
               len(lines))
    return start, end


def table_lines(markdown):
    """The lines of the first Markdown table in `markdown`: its header, its rule, its rows."""
    lines = markdown.splitlines()
    start, end = table_span(lines)
    return lines[start:end]


def machines_under(markdown):
    """{mark: line} for the lines right under the first table in `markdown` that name the
    machines of its rows, in their order: "" for the unmarked rows' ("Made on ..."), "¹" for
    those marked ¹ ("¹ Made on ...")."""
    lines = markdown.splitlines()
    machines = {}
    for line in lines[table_span(lines)[1]:]:
        read = read_machine_line(line)
        if line and read is None:
            break
        if read:
            machines[read[0]] = read[1]
    return machines


def step_cell(row_line):
    """A table row's first cell: "05a_adamw_8bit (branch of 04)"."""
    return row_line.split("|")[1].strip()


def embedded(source_text, selection=None):
    """What an embed of the published table `source_text` holds: the header and the rows that
    `selection` keeps, then the lines naming the machines that made those rows, where the table
    names them (one, unless rows from other machines were published into it, each marked)."""
    if selection not in SELECTIONS:
        raise ValueError(f"no selection {selection!r} of a table's rows; there are: "
                         + ", ".join(repr(name) for name in SELECTIONS if name))
    lines = table_lines(source_text)
    kept = lines[:2] + [line for line in lines[2:] if SELECTIONS[selection](step_cell(line))]
    marks = {cell_mark(step_cell(line)) for line in kept[2:]}
    machines = [marked_line(mark, line) for mark, line in machines_under(source_text).items()
                if mark in marks]
    return "\n".join(kept) + "\n" + ("\n" + "\n\n".join(machines) + "\n" if machines else "")


def embeds(document):
    """(the file an embed in `document` shows, its selection, what it holds now), for each."""
    return [((document.parent / match["source"]).resolve(), match["selection"], match["shown"])
            for match in EMBED.finditer(document.read_text())]


def refresh_embeds(published, among=None):
    """Write again every embed, in `among` (default: documents()), of one of the files
    `published`; returns the documents that changed."""
    published = {Path(path).resolve() for path in published}
    changed = []
    for document in documents() if among is None else among:
        text = document.read_text()

        def filled(match):
            source = (document.parent / match["source"]).resolve()
            if source not in published:
                return match[0]
            return match["start"] + embedded(source.read_text(), match["selection"]) + match["end"]

        new = EMBED.sub(filled, text)
        if new != text:
            write_text_atomically(document, new)
            changed.append(document)
    return changed


def publish(results_dir, names, publish_dir, among=None):
    """Copy the report files `names` from `results_dir` to `publish_dir`, each atomically, then
    write again the embeds of them in the documents (`among`, default: documents())."""
    publish_dir = Path(publish_dir)
    for name in names:
        with atomic_path(publish_dir / name) as tmp:
            tmp.write_bytes((Path(results_dir) / name).read_bytes())
    print(f"copied {', '.join(names)} to {publish_dir}/")
    changed = refresh_embeds([publish_dir / name for name in names], among)
    if changed:
        print(f"and wrote their tables into {', '.join(shown_path(path) for path in changed)}")


def shown_path(path):
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def is_published(publish_dir):
    """Whether `publish_dir` is one of the repository's published directories (PUBLISHED)."""
    return any(Path(publish_dir).resolve() == (ROOT / directory).resolve() for directory in PUBLISHED)


def publish_problem(publish_dir, preset, task, shortened):
    """Why --publish `publish_dir` refuses this tour (None if it does not): a directory of
    PUBLISHED takes only a tour of its own preset and task, at full length with its estimate
    (`shortened`: --max-steps, --epochs or --skip-estimate given); with --steps, that tour's rows
    alone are published."""
    target = Path(publish_dir).resolve()
    for directory, (its_preset, its_task) in PUBLISHED.items():
        if target != (ROOT / directory).resolve():
            continue
        if (preset, task) != (its_preset, its_task) or shortened:
            return (f"--publish {publish_dir}: {directory}/ holds the whole tour of --preset "
                    f"{its_preset} --task {its_task}, which the README and docs/ quote: run it "
                    "with those, without --max-steps, --epochs or --skip-estimate (--steps NN "
                    "publishes those steps' rows alone)")
    return None
