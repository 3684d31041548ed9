"""What a copy of each script needs of common/: the modules it imports, in turn, and their
lines. docs/development.md shows the table this prints, and a test checks that it is this one.

  python tests/support/copy_needs.py    # the table, as docs/development.md holds it
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository, for steps.py

from steps import STEPS  # noqa: E402


def imported_by(path, every_import=True):
    """The modules `path` imports: everywhere in it, or only at its top; packages outside this
    repository by their top-level name, the Python standard library left out."""
    found = set()
    nodes = ast.walk(ast.parse(path.read_text())) if every_import else ast.parse(path.read_text()).body
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {name if name.startswith("common.") else name.split(".")[0] for name in found
            if name.split(".")[0] not in sys.stdlib_module_names}


def common_imported(modules):
    """`modules` and every common/ module they import at their top, in turn (the package's own
    __init__ runs first: what it imports too)."""
    found, todo = set(), [name for name in modules if name.startswith("common.")]
    todo += ["common.__init__"] if todo else []
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            path = ROOT / "common" / f"{name.removeprefix('common.')}.py"
            todo += [other for other in imported_by(path, every_import=False)
                     if other.startswith("common.")]
    return found - {"common.__init__"}


def lines_of(modules):
    return sum(len((ROOT / "common" / f"{name.removeprefix('common.')}.py").read_text().splitlines())
               for name in modules | {"common.__init__"})


def table():
    """Each script: the lines of common/ its copy runs on (the modules it imports at its top, in
    turn; --compile's and --model's modules are imported only when asked for)."""
    lines = ["| script | lines of common/ | modules beyond 01's |", "| --- | ---: | --- |"]
    first = None
    for step in STEPS.values():
        needed = common_imported(imported_by(step.path, every_import=False))
        if step.compiles:  # 05k: always compiled, so compiled_memory is always imported
            needed |= common_imported({"common.compiled_memory"})
        first = needed if first is None else first
        beyond = ", ".join(f"`{name.removeprefix('common.')}`" for name in sorted(needed - first))
        lines.append(f"| {step.name} | {lines_of(needed):,} | {beyond} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
