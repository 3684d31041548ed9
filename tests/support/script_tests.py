"""The tests of each script, read from the tests' sources: a test module covers a script when it
names the script's id as a string ("05c", as script_path, run_script and the runs fixtures take
it), and every script when it goes over steps.py's registry (STEPS). docs/development.md shows
the table this prints, and a test checks that it is this one.

  python tests/support/script_tests.py    # the table, as docs/development.md holds it
"""
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS.parent))  # the repository, for steps.py

from steps import STEPS  # noqa: E402

NAMED = re.compile(r"""["'](\d\d[a-z]?)["']""")
EVERY = re.compile(r"\bSTEPS\b(?!\[)")  # the registry gone over, not one entry of it


def test_modules():
    return sorted(path for path in TESTS.rglob("test_*.py"))


def covering():
    """({step id: [test modules naming it]}, [test modules going over every step])."""
    named, every = {step: [] for step in STEPS}, []
    for path in test_modules():
        source, name = path.read_text(), path.relative_to(TESTS.parent).as_posix()
        if EVERY.search(source):
            every.append(name)
        for step in sorted(set(NAMED.findall(source)) & set(STEPS)):
            named[step].append(name)
    return named, every


def table():
    named, every = covering()
    lines = ["| script | its own tests (besides those of every script) |", "| --- | --- |"]
    lines += [f"| {STEPS[step].name} | {', '.join(f'`{name}`' for name in files) or '(none)'} |"
              for step, files in named.items()]
    lines.append(f"| every script | {', '.join(f'`{name}`' for name in every)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
