"""The registry (steps.py): every numbered script is an entry and every entry a script; a branch
starts from the parent of its step."""
from conftest import ROOT, script_path
from steps import STEPS, step_id, with_parent


def test_a_branch_starts_from_the_parent_of_its_step():
    """05a is another choice at step 05: like 05 it starts from 04, and says so in the tables.
    A branch may instead start from an earlier branch of its step (05d from 05c)."""
    for step in STEPS.values():
        if step.is_branch:
            main_line = STEPS[step.id[:2]]
            earlier_branch = (step.parent[:2] == step.id[:2] and step.parent < step.id
                              and STEPS[step.parent].is_branch)
            assert step.parent == main_line.parent or earlier_branch, step
            assert step.sharded == main_line.sharded or not step.sharded
    assert step_id(script_path("05a").name) == "05a"
    assert with_parent("05a_adamw_8bit.py") == "05a_adamw_8bit (branch of 04)"
    assert with_parent("05_sgd_cosine") == "05_sgd_cosine"


def test_every_numbered_script_is_registered_and_every_entry_has_its_script():
    on_disk = sorted(ROOT.glob("[0-9][0-9]*_*.py"))
    assert on_disk == sorted(step.path for step in STEPS.values())
