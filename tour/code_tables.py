"""The tables docs/ shows of the code itself, made from it: what a copy of each script needs of
common/, each script's tests, the combined script's switches, its refusals and each script's
switch set. Each lies between markers in its document (BLOCKS); --publish writes them all again
with the tour's tables, and a test checks each is what its maker gives.

  python -m tour.code_tables            # write them again (what --publish also does)
  python -m tour.code_tables --print    # print them instead
"""
import argparse
import ast
import re
import sys
from pathlib import Path

from common.atomic_write import write_text_atomically
from steps import STEPS, import_script

ROOT = Path(__file__).resolve().parents[1]
BAR = "\\|"  # a | inside a table's cell


# ---- what a copy needs ---------------------------------------------------------------------

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


def copy_needs():
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


# ---- each script's tests -------------------------------------------------------------------

NAMED = re.compile(r"""["'](\d\d[a-z]?)["']""")  # a test module names a script by its id
EVERY = re.compile(r"\bSTEPS\b(?!\[)")  # the registry gone over, not one entry of it


def covering():
    """({step id: [test modules naming it]}, [test modules going over every step]): a module
    covers a script when it names the script's id as a string ("05c", as script_path, run_script
    and the runs fixtures take it), and every script when it goes over steps.py's registry."""
    named, every = {step: [] for step in STEPS}, []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        source, name = path.read_text(), path.relative_to(ROOT).as_posix()
        if EVERY.search(source):
            every.append(name)
        for step in sorted(set(NAMED.findall(source)) & set(STEPS)):
            named[step].append(name)
    return named, every


def script_tests():
    named, every = covering()
    lines = ["| script | its own tests (besides those of every script) |", "| --- | --- |"]
    lines += [f"| {STEPS[step].name} | {', '.join(f'`{name}`' for name in files) or '(none)'} |"
              for step, files in named.items()]
    lines.append(f"| every script | {', '.join(f'`{name}`' for name in every)} |")
    return "\n".join(lines)


# ---- the combined script's switches, refusals and each script's set -------------------------

def combined():
    return import_script(STEPS["10"].path, prefix="tables")


def steps_named(steps):
    """"05c, 09" for ("05c", "09")."""
    return steps if isinstance(steps, str) else ", ".join(steps)


def switches():
    """One row a switch of 10's SWITCHES: its flag and values, what it does (its --help), the
    step of each value, and the stack's group of each value its chain may set."""
    rows = ["| switch | what it does | from | the stack's group |", "|---|---|---|---|"]
    for switch in combined().SWITCHES:
        options = switch.options
        values = options.get("choices") or options.get("metavar")
        shown = (f"`{switch.flag} {BAR.join(map(str, values))}`" if isinstance(values, (list, dict))
                 else f"`{switch.flag} {values}`" if values
                 else f"`{switch.flag}`" if options.get("action") else f"`{switch.flag} N`")
        if switch.flag == "--checkpointing":
            shown = f"`--checkpointing {BAR.join(['none', 'full', 'selective', 'offloaded', 'budget:F'])}`"
        made = "; ".join(steps_named(steps) if value in (True, "N") else f"{value}: {steps_named(steps)}"
                         for value, steps in switch.steps.items())
        groups = "; ".join(group.split(":")[0] if value is True else f"{value}: {group.split(':')[0]}"
                           for value, group in (switch.groups or {}).items())
        rows.append(f"| {shown} | {options['help'].replace('|', '/')} | {made} | {groups} |")
    return "\n".join(rows)


def refusals():
    """One line a refusal of 10's REFUSALS, in its order: the conditions, then why (a reason
    said at the time, from the settings: its gist)."""
    lines = []
    for *conditions, why in combined().REFUSALS:
        words = [condition.doc for condition in conditions]
        named = words[0] + "".join(f" {word}" if word.startswith("without ") else f" with {word}"
                                   for word in words[1:])
        lines.append(f"- `{named}`: {why if isinstance(why, str) else why.__doc__}.")
    return "\n".join(lines)


def how_it_runs(step):
    if step.sharded:
        return ("alone (a group of one) or under torchrun" if "--offload" in step.switches
                else "under torchrun (or alone with `WORLD_SIZE=1`)")
    return "alone (compiled)" if step.compiles else "alone"


def script_switches():
    """Each script's switch set (steps.py's `switches`, and --task where it trains one only)."""
    rows = ["| script | switches | run |", "|---|---|---|"]
    for step in STEPS.values():
        if not step.combined:
            words = " ".join([*step.switches, *(["--task", step.task] if step.task else [])])
            rows.append(f"| {step.name} | {f'`{words}`' if words else '(none)'} | {how_it_runs(step)} |")
    return "\n".join(rows)


# ---- where each lies, and writing them ---------------------------------------------------------

BLOCKS = {"copy needs": ("docs/development.md", copy_needs),
          "script tests": ("docs/development.md", script_tests),
          "switches": ("docs/combined.md", switches),
          "refusals": ("docs/combined.md", refusals),
          "script switches": ("docs/combined.md", script_switches)}


def shown(marker, root=ROOT):
    """What the document of `marker` holds between its markers now."""
    document = (root / BLOCKS[marker][0]).read_text()
    return document.split(f"<!-- {marker} -->\n")[1].split(f"\n<!-- /{marker} -->")[0]


def tables():
    """{marker: the table its maker gives now}."""
    return {marker: make() for marker, (_, make) in BLOCKS.items()}


def write(made=None, root=ROOT):
    """Each table (`made`, or made now) written into its document between its markers; returns
    the documents that changed."""
    made = made or tables()
    changed = []
    for marker, (document, _) in BLOCKS.items():
        path = root / document
        text = path.read_text()
        new = text.replace(f"<!-- {marker} -->\n{shown(marker, root)}\n<!-- /{marker} -->",
                           f"<!-- {marker} -->\n{made[marker]}\n<!-- /{marker} -->")
        if new != text:
            write_text_atomically(path, new)
            changed.append(document)
    return sorted(set(changed))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--print", action="store_true", help="print them instead of writing them")
    asked = parser.parse_args(argv)
    made = tables()
    if asked.print:
        for marker, table in made.items():
            print(f"{BLOCKS[marker][0]}, {marker}:\n{table}\n")
        return
    print("wrote " + (", ".join(write(made)) or "nothing: every table is as its code gives it"))


if __name__ == "__main__":
    main()
