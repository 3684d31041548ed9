"""The documents stay true: every command README.md and docs/ quote is checked, and every
relative link resolves.

A quoted command is checked as its program would read it: its own main() runs until the
program's command line is read and checked (a numbered script's parse_args, the tour's and the
estimate's), then stops, and a file it names must exist. Those that finish in seconds (`--help`,
estimates without GPU emulation) run.
"""
import contextlib
import importlib
import io
import re
import shlex
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

import tour.code_tables as code_tables
from conftest import ROOT
from steps import STEPS, import_script, step_id
from tour.publish import documents, embedded, embeds
from tour.report import ESTIMATE_TABLE, TOUR_TABLE

README = ROOT / "README.md"
DOCUMENTS = documents()
GENERATED = {ROOT / "docs" / name for name in (TOUR_TABLE, ESTIMATE_TABLE)}  # not chapters
PROGRAM = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?(python3?|torchrun)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_]*|(0N|NNx?)_\S+|\{\S+\})$")  # DIR, NNx_script.py, {true,false}
SCRATCH = Path(tempfile.gettempdir()) / "docs-check"  # the --results-dir of a checked command
# the README's set-up-to-result commands, from a fresh machine with only Python
SETUP = ["python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && "
         ".venv/bin/python -m tour",
         "python3 -m venv .venv && .venv/bin/pip install -r requirements-dev.txt && "
         ".venv/bin/python -m pytest -q"]


def fenced_lines(text):
    return [line for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL)
            for line in block.splitlines()]


def quoted_commands(text):
    """Every command in `text`: lines of fenced code blocks and inline code spans (which may
    wrap onto the next line) that start a Python program, each part of an `&&` chain apart,
    comments removed."""
    found = []
    outside = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", outside)
             if "\n\n" not in span]
    for snippet in fenced_lines(text) + spans:
        for part in snippet.split("&&"):
            part = part.split("  #")[0].split(" # ")[0].strip().rstrip("\\").strip()
            if PROGRAM.match(part):
                found.append(part)
    return found


class Stopped(Exception):
    """Raised where a checked program would go on to train, estimate or write: its command
    line has been read and checked."""


@contextlib.contextmanager
def stopping_at(module, name, after):
    """Make `module.name` stop the program (Stopped): once it has returned (`after`), or
    instead of running."""
    real = getattr(module, name)

    def stop(*args, **kwargs):
        raise Stopped(real(*args, **kwargs) if after else None)

    setattr(module, name, stop)
    try:
        yield
    finally:
        setattr(module, name, real)


@cache
def script_module(path):
    """The numbered script at `path` as a module of its own, for its main()."""
    return import_script(path, prefix="docs_check")


# python -m PROGRAM: the module whose main() reads its command line, the function that main()
# calls once the command line is checked, and whether that function checks it too
MODULES = {"estimate": ("estimate.command", "model_flags", True),  # reads --model and the preset
           "tour": ("tour.runner", "parse_args", True),
           "tour.report": ("tour.report", "write_report", False),
           "tour.code_tables": ("tour.code_tables", "tables", False)}


def program_of(words):
    """What `words` (a command after python or torchrun) runs: ("script", path), ("-m",
    module), ("file", path) or (None, why not)."""
    if words[0] == "-m":
        return ("-m", words[1]) if words[1] in MODULES else (None, f"no module {words[1]} here")
    path = ROOT / words[0]
    if not words[0].endswith(".py") or not path.is_file():
        return None, f"no file {words[0]}"
    return ("script", path) if step_id(path.name) in STEPS else ("file", path)


def read_command_line(kind, target, argv):
    """Run the program's own main() on `argv` until its command line is checked; returns the
    program's complaint (its exit status and its last line on stderr), or None."""
    if kind == "script":
        module, stop, after = script_module(target), "parse_args", True
        if "--device" not in argv and "--estimate" not in argv:
            argv += ["--device", "cpu"]  # the quoted command may be meant for a GPU
        argv = [word if word != "cuda" else "cpu" for word in argv]
    else:
        name, stop, after = MODULES[target]
        module = importlib.import_module(name)
    if kind == "script" or target == "estimate":
        argv += ["--results-dir", str(SCRATCH)]
    errors = io.StringIO()
    with contextlib.ExitStack() as context:
        if target == "tour.report":  # it reads the directory the tour wrote: one made for it
            context.enter_context(contextlib.chdir(context.enter_context(
                tempfile.TemporaryDirectory())))
            for word in [word for word in argv if not word.startswith("-")][:1] or ["results"]:
                Path(word).mkdir(parents=True, exist_ok=True)
        context.enter_context(contextlib.redirect_stderr(errors))
        context.enter_context(contextlib.redirect_stdout(io.StringIO()))
        context.enter_context(stopping_at(module, stop, after))
        try:
            module.main(argv)
        except Stopped:
            return None
        except SystemExit as exit:
            said = errors.getvalue().strip().splitlines() or [str(exit.code)]
            return f"its program stops (exit status {exit.code}): {said[-1]}"
    return f"its main() returned before calling {stop}: this check no longer knows where it stops"


def program_words(command):
    """The words of `command` after its program (python or torchrun) and torchrun's own flags."""
    words = shlex.split(command)
    while "=" in words[0]:  # WORLD_SIZE=4 python ...
        words = words[1:]
    if words[0] == "torchrun":
        return [word for word in words[1:] if not word.startswith("--nproc_per_node")
                and not word.startswith("--standalone")]
    return words[1:]


def problem_with(command):
    """Why `command` would not run as quoted, or None."""
    words = program_words(command)
    if any(PLACEHOLDER.match(word) for word in words):
        return None  # a pattern (python NNx_script.py, --model DIR), not a command to run
    if not words or words[0] == "-m" and words[1] in ("pytest", "venv", "pip"):
        return None  # a program named in passing, or the set-up commands
    if words[0] == "-c":
        return None
    kind, target = program_of(words)
    if kind is None:
        return target
    if kind == "file":
        return None  # a benchmark: it exists
    argv = [word for word in words[2 if kind == "-m" else 1:] if word not in ("--help", "-h")]
    return read_command_line(kind, target, argv)


def test_the_readme_quotes_the_set_up_commands_as_they_run():
    """The two commands from a fresh machine to a result, each its own fenced block, and the
    check reads the main command's last part as a command of the tour."""
    assert [line for line in fenced_lines(README.read_text()) if line in SETUP] == SETUP
    assert quoted_commands(f"```bash\n{SETUP[0]}\n```\n") == [
        "python3 -m venv .venv", ".venv/bin/python -m tour"]
    assert problem_with(".venv/bin/python -m tour") is None


def test_the_documents_quote_every_program_the_check_reads():
    """Scripts alone and under torchrun, the estimate and the tour: if the pattern that finds
    commands stopped finding one kind, its commands would go unchecked."""
    commands = [command for document in DOCUMENTS
                for command in quoted_commands(document.read_text())]
    programs = {program_of(words) for command in commands
                if len(words := program_words(command)) >= 2}
    assert {("-m", "estimate"), ("-m", "tour")} <= programs
    assert {step_id(target.name) for kind, target in programs if kind == "script"} >= {
        "03", "04", "05g", "07", "07a"}
    assert any(command.startswith("torchrun") and "07_fsdp.py" in command for command in commands)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_quoted_command_parses(document):
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
                    " [there](#nowhere) and `python 03_bf16.py --bogus`, `python\n04_grad_accum.py"
                    " --acum-steps 4` wrapped\n")
    assert broken_links(page) == ["docs/nowhere.md", "#nowhere"]
    assert quoted_commands(page.read_text()) == [
        "python 03_bf16.py --bogus", "python 04_grad_accum.py --acum-steps 4"]


def test_the_check_reads_each_command_with_its_own_programs_parser():
    """What a script's own parse_args call gives it decides: 05g trains --task causal-lm only,
    07a takes LoRA's flags and 06 does not; the estimate's --model is read, the tour's --steps
    selected, and the tour's report takes one directory."""
    refused = problem_with("python 05g_chunked_loss.py --task classification")
    assert "this script trains --task causal-lm only" in refused
    assert problem_with("python 05g_chunked_loss.py --preset tiny-text") is None
    assert problem_with("python 07a_lora.py --lora-rank 4 --preset tiny-text") is None
    assert "--lora-rank" in problem_with("python 06_on_device_init.py --lora-rank 4")
    assert "--reshard-after-forward" in problem_with("python 06_on_device_init.py "
                                                     "--reshard-after-forward false")
    assert problem_with("python -m estimate --model docs/models/llama-3.2-1b --task causal-lm") is None
    assert "docs/models/nowhere" in problem_with("python -m estimate --model docs/models/nowhere")
    assert "42" in problem_with("python -m tour --steps 42")
    assert problem_with("python -m tour.report results/tiny-text") is None
    assert "unrecognized arguments" in problem_with("python -m tour.report results docs")


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


def test_the_readme_shows_the_tour_tables_steps_and_links_the_whole_table():
    """The steps 01-09 and the combined script's rows, without the branches (whose rows would
    push the landing page past its 200 lines), and a link to the whole table."""
    assert [(path.relative_to(ROOT).as_posix(), selection) for path, selection, _ in embeds(README)] == [
        (f"docs/{TOUR_TABLE}", "without branches")]
    [(_, _, shown)] = embeds(README)
    steps = [line.split("|")[1].strip() for line in shown.splitlines()[2:] if line.startswith("|")]
    assert steps and not any("branch of" in step for step in steps)
    assert f"docs/{TOUR_TABLE}" in LINK.findall(README.read_text())


def test_the_readme_is_a_landing_page_that_links_every_chapter():
    """At most 200 lines: results go to the chapters, the README keeps a paragraph each."""
    assert len(README.read_text().splitlines()) <= 200
    linked = {(ROOT / target.partition("#")[0]).resolve()
              for target in LINK.findall(README.read_text())}
    chapters = set((ROOT / "docs").glob("*.md")) - GENERATED
    assert chapters and chapters <= linked, sorted(path.name for path in chapters - linked)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_table_between_markers_is_the_one_published(document):
    """The tour's and the estimate's tables are written by --publish (tour/publish.py), never by
    hand: what an embed holds is what publishing makes of its source."""
    for source, selection, shown in embeds(document):
        assert shown == embedded(source.read_text(), selection), (
            f"{source.relative_to(ROOT)}: written by publishing (tour/publish.py), not by hand")


def test_the_record_fields_documented_are_those_a_run_writes():
    from tour.records import RECORD_FIELDS
    chapter = (ROOT / "docs" / "development.md").read_text()
    section = chapter.split("<!-- record fields -->")[1].split("<!-- /record fields -->")[0]
    listed = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.MULTILINE)
    assert listed == [(name, present) for name, (present, _) in RECORD_FIELDS.items()]


@pytest.mark.parametrize("marker", list(code_tables.BLOCKS))
def test_each_table_of_the_code_is_the_one_its_maker_gives(marker):
    """What a copy needs, each script's tests, 10's switches, its refusals and each script's
    switch set: written by --publish (tour/code_tables.py), never by hand."""
    document, make = code_tables.BLOCKS[marker]
    assert code_tables.shown(marker) == make(), f"{document}'s {marker}: run python -m tour.code_tables"


def test_the_readme_gives_the_range_of_what_a_copy_needs():
    readme = " ".join((ROOT / "README.md").read_text().split())
    rows = code_tables.copy_needs().splitlines()[2:]
    counts = [int(line.split(" | ")[1].replace(",", "")) for line in rows]
    assert f"{min(counts):,} to {max(counts):,} lines" in readme


CITED = re.compile(r"(?<![\w/.])((?:tests|common|estimate|tour|benchmarks|docs)/[\w/.-]*\w"
                   r"\.(?:py|md|png|json))")


def test_every_repository_path_the_documents_and_sources_cite_exists():
    """A path named in a chapter, a docstring or a comment (tests/support/rounding.py) that a move
    left behind; results/ is what runs write. (This file's own examples of broken ones aside.)"""
    ours = [path for pattern in ("*.py", "*.md") for path in ROOT.rglob(pattern)
            if not any(part.startswith(".") or part == "results"
                       for part in path.relative_to(ROOT).parts)]
    missing = {(path.relative_to(ROOT).as_posix(), cited) for path in ours
               if path != Path(__file__).resolve()
               for cited in CITED.findall(path.read_text()) if not (ROOT / cited).exists()}
    assert missing == set()
