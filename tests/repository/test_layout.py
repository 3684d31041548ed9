"""The repository's promises about its own shape.

- Each step's diff from its predecessor shows its technique: every block of lines it changes
  opens with that step's tag (docs/tour-guide.md: "Reading a diff").
- A numbered script copied with only the files the README names runs as it is.
"""
import ast
import difflib
import io
import re
import shutil
import subprocess
import sys
import tokenize

import pytest

from conftest import QUICK, ROOT, load_script, script_path
from steps import STEPS, scripts, step_id
from support.tags import TAGS, has_tag, switch_pairs
from tour.code_tables import common_imported, imported_by

# the tag each step puts on the lines it adds (steps.py; also listed in the README)


def comments(source):
    """{line number: comment text without the '#'} for every comment in `source`."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def code_lines(source):
    """The lines of `source` with the module docstring blanked (it names its own script)."""
    lines = source.splitlines()
    docstring = ast.parse(source).body[0]
    for index in range(docstring.lineno - 1, docstring.end_lineno):
        lines[index] = ""
    return lines


def is_import(line):
    return re.match(r"\s*(import |from \S+ import )", line) is not None


def untagged_blocks(before, after, step, restored=()):
    """Blocks of lines `after` changes from `before` that do not open with `step`'s tag.

    A block is a run of consecutive changed lines (blank lines and imports do not count); it
    must open with a line whose comment starts with the tag, which then covers the run.
    Lines in `restored` (a script whose lines the step gives back) need no tag.
    Returns [(line number, line)] of each failing block's first line.
    """
    tag, notes = TAGS[step], comments(after)
    old, new = code_lines(before), code_lines(after)
    changed = set()
    for kind, _, _, first, last in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if kind in ("replace", "insert"):
            changed.update(range(first, last))
    failures, covered = [], False
    for index, line in enumerate(new):
        if not line.strip() or is_import(line) or line in restored:
            continue
        if index not in changed:
            covered = False
            continue
        if has_tag(notes.get(index + 1), tag):
            covered = True
        elif not covered:
            failures.append((index + 1, line.strip()))
            covered = True  # one failure per block
    return failures


def dropped_tags(before, after, step):
    """Earlier steps' tags on lines `after` changes, that no changed line of `after` keeps."""
    old_notes, new_notes = comments(before), comments(after)
    old, new = code_lines(before), code_lines(after)
    lost = []
    for kind, old_first, old_last, first, last in difflib.SequenceMatcher(
            None, old, new, autojunk=False).get_opcodes():
        if kind == "equal":
            continue
        for earlier_step, tag in TAGS.items():
            if earlier_step >= step or earlier_step in STEPS[step].removes:
                continue
            removed = sum(has_tag(old_notes.get(n + 1), tag) for n in range(old_first, old_last))
            kept = sum(has_tag(new_notes.get(n + 1), tag) for n in range(first, last))
            if kept < removed:
                lost.append((tag, old[old_first:old_last]))
    return lost


STEP_PAIRS = [(step.parent, step.id) for step in STEPS.values() if step.parent]


@pytest.mark.parametrize("previous, step", STEP_PAIRS)
def test_every_changed_block_opens_with_its_steps_tag(previous, step):
    before, after = script_path(previous).read_text(), script_path(step).read_text()
    gives_back = STEPS[step].restores  # 03 gives 01's lines back: they need no tag of their own
    restored = set(code_lines(script_path(gives_back).read_text())) if gives_back else set()
    assert untagged_blocks(before, after, step, restored) == []


@pytest.mark.parametrize("previous, step", STEP_PAIRS)
def test_a_line_keeps_the_tag_of_the_step_that_introduced_it(previous, step):
    before, after = script_path(previous).read_text(), script_path(step).read_text()
    assert dropped_tags(before, after, step) == []


def test_the_tag_checks_catch_an_untagged_line_and_a_retagged_one():
    before, after = script_path("07").read_text(), script_path("08").read_text()
    sneaked = after.replace("    model.train()\n", "    model.train()\n    torch.set_num_threads(1)\n")
    assert untagged_blocks(before, sneaked, "08") == [(sneaked.splitlines().index(
        "    torch.set_num_threads(1)") + 1, "torch.set_num_threads(1)")]
    retagged = after.replace("  # FSDP: one process per device", "  # offload: one process per device")
    assert retagged != after and dropped_tags(before, retagged, "08")


def test_the_readme_lists_every_tag():
    readme = (ROOT / "README.md").read_text()
    for tag in TAGS.values():
        assert f"`# {tag}`" in readme, tag


COPIED = ["common"]  # what README's "Copying a script" says to copy beside the script


def test_the_readme_says_to_copy_the_script_and_common_alone():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Copying a script", 1)[1].split("\n## ", 1)[0]
    assert "Copy the script and `common/`" in " ".join(section.split())


def test_common_imports_neither_the_estimator_nor_the_tour_at_the_top():
    """So that a copy of common/ alone runs: the estimator is imported inside functions only."""
    for path in (ROOT / "common").glob("*.py"):
        tree = ast.parse(path.read_text())
        top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        names = [alias.name for node in top for alias in node.names] + [
            node.module for node in top if isinstance(node, ast.ImportFrom) and node.module]
        assert not [name for name in names if name.split(".")[0] in ("estimate", "tour")], path


def ticked(text):
    """The `names` in `text`, common/ modules as common.NAME, flags and folders left out."""
    names = re.findall(r"`([^`]+)`", text)
    return {name.replace("common/", "common.") for name in names
            if not name.startswith("--") and not name.endswith("/")}


def test_copying_a_script_lists_what_each_script_imports():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- script imports -->")[1].split("<!-- /script imports -->")[0]
    prose, table = section.split("\n| script |")
    direct, rest = prose.split("which import")
    in_turn, lazily = rest.split(";", 1)
    every = {name if name == "torch" else f"common.{name}" for name in ticked(direct)}
    extra = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for step in cells[0].split(", "):
            extra[step] = ticked(cells[1])
    imports = {step_id(path): imported_by(path) - {"estimate"}  # only under --estimate
               for path in scripts()}
    assert every == set.intersection(*imports.values())
    assert extra == {step: found - every for step, found in imports.items() if found - every}
    everything = set.union(*imports.values())
    commons = common_imported(everything)
    assert {f"common.{name}" for name in ticked(in_turn)} == commons - everything
    assert {f"common.{name}" for name in ticked(lazily)} == {
        f"common.{path.stem}" for path in (ROOT / "common").glob("*.py")} - commons - {"common.__init__"}
    packages = {name for name in everything if not name.startswith("common.")}
    required = re.findall(r"^([\w-]+)==", (ROOT / "requirements.txt").read_text(), flags=re.MULTILINE)
    assert packages <= set(required)


def copy_with(tmp_path, script, folders=COPIED):
    target = tmp_path / "project"
    target.mkdir()
    shutil.copyfile(script_path(script), target / script_path(script).name)
    for folder in folders:
        shutil.copytree(ROOT / folder, target / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return target


def run_copy(target, script, *flags, python=()):
    name = script_path(script).name
    return subprocess.run([sys.executable, *python, name, *flags], cwd=target, capture_output=True,
                          text=True, timeout=300, env={"PATH": "", "HOME": str(target)})


@pytest.mark.parametrize("script", ["04", "09"])
def test_a_copied_script_runs_with_only_common_beside_it(script, tmp_path):
    """And on a preset it imports only what it needs: not --model's module (nor the tables of
    every architecture that it imports), nor --compile's."""
    target = copy_with(tmp_path, script)
    done = run_copy(target, script, *QUICK, "--device", "cpu", "--results-dir", "results",
                    python=["-X", "importtime"])  # every module imported, on standard error
    assert done.returncode == 0, done.stderr[-3000:]
    assert (target / "results" / f"{script_path(script).stem}.json").is_file()
    imported = re.findall(r"^import time:.*\| +([\w.]+)$", done.stderr, flags=re.MULTILINE)
    assert "common.model" in imported  # the check sees common/'s modules
    assert not {"common.any_model", "common.compiled_memory"} & set(imported)


def test_a_copy_without_the_estimator_says_what_estimate_needs(tmp_path):
    target = copy_with(tmp_path, "04")
    done = run_copy(target, "04", "--estimate")
    assert done.returncode == 2
    assert "the folder estimate/" in done.stderr and "Traceback" not in done.stderr


def test_a_copy_without_the_compiled_memory_module_says_what_compile_needs(tmp_path):
    target = copy_with(tmp_path, "04")
    (target / "common" / "compiled_memory.py").unlink()  # a copy that left it out
    done = run_copy(target, "04", "--compile", "--device", "cpu")
    assert done.returncode == 2
    assert "common/compiled_memory.py" in done.stderr and "Traceback" not in done.stderr


def test_the_quick_subset_has_a_test_of_each_claim_it_names():
    """`pytest -m quick` (tests/conftest.py's QUICK_SUBSET): every start of a test id it lists is
    the start of a collected test's id, and those alone are marked."""
    from conftest import QUICK_SUBSET
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "quick",
                           "-p", "no:xdist", "-o", "addopts="], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    for claim, starts in QUICK_SUBSET.items():
        for start in starts:
            assert any(test.startswith(start) for test in collected), f"{claim}: {start}"
    assert all(any(test.startswith(start) for starts in QUICK_SUBSET.values() for start in starts)
               for test in collected)


# The places that repeat a step's facts from steps.py, checked against it (a technique is
# written in three places: its script, its steps.py entry, its block in 10_combined.py)

def markdown_rows(text, header):
    """The cells of each row of the table whose header line starts with `header`."""
    lines = text.split(header, 1)[1].splitlines()[2:]
    table = lines[:next((index for index, line in enumerate(lines) if not line.startswith("|")), len(lines))]
    return [[cell.strip() for cell in line.strip().strip("|").replace("\\|", "\0").split("|")]
            for line in table]


def test_the_readmes_table_of_steps_agrees_with_steps_py():
    found = {}
    for cells in markdown_rows((ROOT / "README.md").read_text(), "| step (parent) |"):
        step, _, parent = cells[0].partition(" (")
        found[step.split()[0]] = (parent.rstrip(")") or None, cells[2].strip("`").removeprefix("# ") or None)
    expected = {step.id: (step.parent, step.tag) for step in STEPS.values() if not step.combined}
    assert found == expected, "README's table of steps: step: (parent, tag) differ from steps.py"


def test_the_combined_chapters_tables_agree_with_steps_py():
    chapter = (ROOT / "docs" / "combined.md").read_text()
    by_script = {cells[0]: cells[1] for cells in markdown_rows(chapter, "| script | switches |")}
    expected = {step.name: " ".join([*step.switches, *(["--task", step.task] if step.task else [])])
                for step in STEPS.values() if not step.combined}
    assert {name: switches.strip("`") if switches != "(none)" else ""
            for name, switches in by_script.items()} == expected, \
        "docs/combined.md's switches of each script differ from steps.py's"
    # each switch a step adds to its parent's is in the row of that switch, naming the step
    origin = {cells[0]: cells[2] for cells in markdown_rows(chapter, "| switch | what it does |")}
    for step in STEPS.values():
        parent = STEPS[step.parent].switches if step.parent else ()
        for flag, value in set(switch_pairs(step.switches)) - set(switch_pairs(parent)):
            [row] = [row for row in origin if row.strip("`").split()[0] == flag]
            assert step.id in origin[row], f"docs/combined.md: the row of {flag} does not name {step.id}"


def test_a_techniques_flags_are_declared_in_its_script_not_in_common(tmp_path):
    """04's --accum-steps, 07's --reshard-after-forward, 07a's --lora-*, 05k's --memory-budget:
    each in its script's own_flags (10's: its switches), so a diff shows the flag and a copy
    carries it; common/cli.py's parser holds only the flags every script shares."""
    import argparse

    from common.cli import parse_args
    common = set()  # what common/cli.py declared before a script's own flags
    parse_args("", ["--results-dir", str(tmp_path)],
               flags=lambda parser: common.update(parser._option_string_actions))
    declared = {}
    for step in STEPS.values():
        own = argparse.ArgumentParser(add_help=False)
        getattr(load_script(step.id), "own_flags", lambda parser: None)(own)  # (01-03, 04b: none)
        declared[step.id] = set(own._option_string_actions)
    assert "--accum-steps" in declared["04"] and "--reshard-after-forward" in declared["07"]
    assert {"--lora-rank", "--lora-alpha", "--lora-targets"} <= declared["07a"]
    assert "--memory-budget" in declared["05k"]
    assert {step: flags & common for step, flags in declared.items() if flags & common} == {}
