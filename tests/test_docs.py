"""The documents stay true: every command README.md and docs/ quote is checked, and every
relative link resolves.

A quoted command is checked as its program would read it: a numbered script's flags go through
the script's own parse_args, `python -m estimate` and `python -m tour` through theirs, and a file
it names must exist. Those that finish in seconds (`--help`, estimates without GPU emulation) run.
"""
import re
import shlex
import subprocess
import sys

import pytest

from common.cli import parse_args
from conftest import ROOT
from estimate.table import parse_table_args
from steps import STEPS, step_id
from tour import runner as tour

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAM = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?(python3?|torchrun)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_]*|NN\S*)$")  # DIR, NAME_OR_DIR, NNx_script.py


def quoted_commands(text):
    """Every command in `text`: lines of fenced code blocks and inline code spans that start a
    Python program, each part of an `&&` chain apart, comments removed."""
    found = []
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    for snippet in [line for block in blocks for line in block.splitlines()] + spans:
        for part in snippet.split("&&"):
            part = part.split("  #")[0].split(" # ")[0].strip().rstrip("\\").strip()
            if PROGRAM.match(part):
                found.append(part)
    return found


def problem_with(command):
    """Why `command` would not run as quoted, or None."""
    words = shlex.split(command)
    while "=" in words[0]:  # WORLD_SIZE=4 python ...
        words = words[1:]
    if words[0] == "torchrun":
        words = [word for word in words[1:] if not word.startswith("--nproc_per_node")
                 and not word.startswith("--standalone")]
    else:
        words = words[1:]
    if any(PLACEHOLDER.match(word) for word in words):
        return None  # a pattern (python NNx_script.py, --model DIR), not a command to run
    if not words or words[0] == "-m" and words[1] in ("pytest", "venv", "pip"):
        return None  # a program named in passing, or the set-up commands
    if words[0] == "-c":
        return None
    try:
        if words[:2] == ["-m", "estimate"]:
            parse_table_args([*words[2:], "--results-dir", "/tmp/docs-check"])
        elif words[:2] == ["-m", "tour"] or words[:2] == ["-m", "tour.report"]:
            if words[1] == "tour":
                tour.parse_args(words[2:])
        elif words[0].endswith(".py"):
            path = ROOT / words[0]
            if not path.is_file():
                return f"no file {words[0]}"
            step = STEPS.get(step_id(path.name))
            if step is not None:
                flags = [word for word in words[1:] if word != "--help"]
                if "--device" not in flags:
                    flags += ["--device", "cpu"]  # the quoted command may be meant for a GPU
                flags = [word if word != "cuda" else "cpu" for word in flags]
                parse_args("", [*flags, "--results-dir", "/tmp/docs-check"],
                           accum_steps=step.accum_steps if step.accum_steps > 1 else None,
                           sharded=step.sharded)
        else:
            return f"not a program this check knows: {words[:2]}"
    except SystemExit as stop:
        return f"its program stops: exit status {stop.code}"
    return None


def test_the_documents_quote_commands():
    assert len([command for document in DOCUMENTS
                for command in quoted_commands(document.read_text())]) > 20


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_quoted_command_parses(document, capsys):
    problems = {command: problem_with(command) for command in quoted_commands(document.read_text())}
    assert {command: problem for command, problem in problems.items() if problem} == {}


def anchors(text):
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces
    as hyphens."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def broken_links(document):
    broken = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path) if path else document
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(target)
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_resolves(document):
    assert broken_links(document) == []


def test_the_check_finds_a_broken_command_and_a_broken_link(tmp_path):
    assert problem_with("python 04_grad_accum.py --acum-steps 4") is not None  # misspelt flag
    assert problem_with("python -m estimate --gpu p100") is not None
    assert problem_with("python 10_missing.py") == "no file 10_missing.py"
    assert problem_with("torchrun --nproc_per_node=2 07_fsdp.py --reshard-after-forward maybe")
    page = tmp_path / "page.md"
    page.write_text("# A page, its title\n\nsee [the chapter](docs/nowhere.md), [here](#a-page-its-title),"
                    " [there](#nowhere) and `python 03_bf16.py --bogus`\n")
    assert broken_links(page) == ["docs/nowhere.md", "#nowhere"]
    assert quoted_commands(page.read_text()) == ["python 03_bf16.py --bogus"]


def quick(command):
    return all(marker in command for marker in ("--estimate", "--device cpu")) or "--help" in command


@pytest.mark.timeout(600)
def test_the_commands_that_finish_in_seconds_run(tmp_path):
    commands = sorted({command for document in DOCUMENTS
                       for command in quoted_commands(document.read_text()) if quick(command)})
    assert commands
    for command in commands:
        words = shlex.split(command)
        if words[0] == "torchrun":
            continue  # its --help is torchrun's own
        words = [sys.executable if words[0].startswith(("python", ".venv")) else words[0],
                 *words[1:]]
        if "--help" not in words:
            words += ["--results-dir", str(tmp_path)]
        done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stderr[-2000:])


TABLE = re.compile(r"<!-- table: (\S+) -->\n(.*?)<!-- /table -->", flags=re.DOTALL)


def shown_tables(document):
    """(the file a table between markers says it comes from, its rows), for each such table."""
    return [(document.parent / source, [line for line in shown.splitlines() if line.startswith("|")])
            for source, shown in TABLE.findall(document.read_text())]


def test_the_readme_shows_the_tour_table():
    assert [path.relative_to(ROOT).as_posix() for path, _ in shown_tables(ROOT / "README.md")] == [
        "docs/tour.md"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_table_between_markers_is_the_one_published(document):
    """The tour's and the estimate's tables are written by --publish, never by hand."""
    for source, rows in shown_tables(document):
        published = [line for line in source.read_text().splitlines() if line.startswith("|")]
        assert rows == published, source


def test_the_record_fields_documented_are_those_a_run_writes():
    from common.summary import RECORD_FIELDS
    chapter = (ROOT / "docs" / "development.md").read_text()
    section = chapter.split("<!-- record fields -->")[1].split("<!-- /record fields -->")[0]
    listed = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.MULTILINE)
    assert listed == [(name, present) for name, (present, _) in RECORD_FIELDS.items()]
