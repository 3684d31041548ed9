"""docs/combined.md's table of switches and its list of refusals, made from 10_combined.py's own
records (SWITCHES, REFUSALS): a test checks that the chapter shows these.

  python tests/support/switch_tables.py    # both, as docs/combined.md holds them
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository, for steps.py

from steps import STEPS, import_script  # noqa: E402

BAR = "\\|"  # a | inside a table's cell


def combined():
    return import_script(STEPS["10"].path, prefix="tables")


def steps_named(steps):
    """"05c, 09" for ("05c", "09")."""
    return steps if isinstance(steps, str) else ", ".join(steps)


def switches():
    """One row a switch: its flag and values, what it does (its --help), the step of each value,
    and the stack's group of each value its chain may set."""
    rows = ["| switch | what it does | from | the stack's group |", "|---|---|---|---|"]
    for switch in combined().SWITCHES:
        options = switch.options
        values = options.get("choices") or options.get("metavar")
        shown = (f"`{switch.flag} {BAR.join(map(str, values))}`" if isinstance(values, (list, dict))
                 else f"`{switch.flag} {values}`" if values
                 else f"`{switch.flag}`" if options.get("action") else f"`{switch.flag} N`")
        if switch.flag == "--checkpointing":
            shown = "`--checkpointing none\\|full\\|selective\\|offloaded\\|budget:F`"
        made = "; ".join(f"{value}: {steps_named(steps)}" if value not in (True, "N") else steps_named(steps)
                         for value, steps in switch.steps.items())
        groups = "; ".join(f"{value}: {group.split(':')[0]}" if value is not True else group.split(":")[0]
                           for value, group in (switch.groups or {}).items())
        rows.append(f"| {shown} | {options['help'].replace('|', '/')} | {made} | {groups} |")
    return "\n".join(rows)


def refusals():
    """One line a refusal of REFUSALS, in its order: the conditions, then why."""
    module = combined()
    lines = []
    for *conditions, why in module.REFUSALS:
        words = [condition.doc for condition in conditions]
        named = words[0] + "".join(f" {word}" if word.startswith("without ") else f" with {word}"
                                   for word in words[1:])
        reason = why if isinstance(why, str) else why.__doc__  # (said at the time: its gist)
        lines.append(f"- `{named}`: {reason}.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(switches())
    print()
    print(refusals())
