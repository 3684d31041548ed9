"""The stack: the first prefix of estimate/stack.py's chain of 10_combined.py's switches that fits."""
import os
import shlex
from unittest import mock

import pytest

import estimate.fit
from conftest import script_path
from estimate import stack
from estimate.fit import granule
from estimate.predict import attempt
from estimate.records import size_text
from estimate.table import main as table_main
from steps import import_script

BATCH = 8
BASE = ["--preset", "tiny-text", "--task", "causal-lm", "--device", "cuda"]
COMBINED = script_path("10")


@pytest.fixture(scope="module")
def combined():
    return import_script(COMBINED, prefix="stack_test")


def parsed(combined, words, world_size=1):
    """10_combined.py's own parsing of a printed command, and its refusal (None: it trains)."""
    launch = ["python", "10_combined.py"] if world_size == 1 else [
        "torchrun", f"--nproc_per_node={world_size}", "10_combined.py"]
    assert words[:len(launch)] == launch
    env = {"WORLD_SIZE": str(world_size)} if world_size > 1 else {}
    with mock.patch.dict(os.environ, env):
        if world_size == 1:
            os.environ.pop("WORLD_SIZE", None)
        args = combined.parse_args(combined.__doc__, words[len(launch):], accum_steps=1,
                                   flags=combined.switches)
        return args, combined.refusal(args)


@pytest.fixture(scope="module")
def estimated_once():
    """Each row estimated once for this module's walks and searches (a second walk repeats the
    first one's prefixes)."""
    made = {}

    def cached(row):
        key = (str(row.script), tuple(row.argv), row.world_size, row.gpu)
        if key not in made:
            made[key] = attempt(row)
        return made[key]
    with mock.patch.object(stack, "attempt", cached), mock.patch.object(estimate.fit, "attempt", cached):
        yield


@pytest.fixture(scope="module")
def every_prefix(estimated_once):
    """The walk with room for nothing: every prefix estimated once, none fits."""
    return stack.walk(COMBINED, BASE, BATCH, 1, 1, "causal-lm", "a100", report=lambda _: None)


def test_no_link_is_dropped_silently_and_every_prefix_trains(combined):
    for task in ("causal-lm", "classification"):
        before = {}
        for link, switches, notes in stack.prefixes(task):
            if switches is None:
                continue
            now = dict(switches)
            for flag, value in before.items():
                if now.get(flag) != value:  # replaced or taken out: the chain says so
                    assert any(stack.flag_text(flag, value) in note for note in notes), (link, flag)
            words = ["python", "10_combined.py", "--task", task,
                     *stack.argv_of(switches)]
            _, refused = parsed(combined, words)
            assert refused is None, (link.name, refused)
            before = now


def test_classification_skips_the_chunked_loss_with_a_note():
    links = stack.prefixes("classification")
    chunked = [(link, switches, notes) for link, switches, notes in links
               if link.name == "chunked loss"]
    assert chunked and chunked[0][1] is None and "skipped" in chunked[0][2][0]
    assert all(("--loss", "chunked") not in (switches or []) for _, switches, _ in links)
    text = stack.chain_text("classification", 10**6, 1024, (2, 64, 1000), 1)
    assert "chunked loss skipped: --task classification" in text


def test_a_size_below_everything_says_none_fits_and_names_the_nearest(every_prefix):
    assert every_prefix.fit is None
    last_link, _, _, last_reserved = every_prefix.tried[-1]
    assert last_link.name == "offload" and isinstance(last_reserved, int)
    text = stack.stack_text(every_prefix, [], BATCH, 1, "1B", [])
    assert "no prefix fits" in text and "offload" in text and size_text(last_reserved) in text


def test_a_size_between_two_prefixes_picks_the_first_that_fits(every_prefix, combined):
    reserved = [value for _, switches, _, value in every_prefix.tried if switches is not None]
    links = [link for link, switches, _, _ in every_prefix.tried if switches is not None]
    lower = next(value for value in reserved if value < reserved[0])  # a prefix that saves
    size = (lower + reserved[0]) // 2
    expected = next(index for index, value in enumerate(reserved) if value <= size)
    assert expected > 0
    answer = stack.walk(COMBINED, BASE, BATCH, 1, size, "causal-lm", "a100",
                        report=lambda _: None)
    assert answer.link is links[expected]
    fit = answer.fit
    assert fit.largest >= 1 and fit.tried[fit.largest][1] <= size
    if not fit.capped:  # the next size the answer could take does not fit
        assert min(nbytes for micro, (_, nbytes) in fit.tried.items()
                   if micro > fit.largest) > size
        assert fit.largest + granule(fit.largest) in fit.tried or not fit.problem
    model = ["--preset", "tiny-text", "--task", "causal-lm"]
    words = shlex.split(stack.command(model, BATCH, answer.switches, fit, 1))
    args, refused = parsed(combined, words)
    assert refused is None and args.batch_size == BATCH
    assert BATCH // args.accum_steps <= fit.largest  # the micro-batch it runs fits
    for flag, value in answer.switches:
        assert getattr(args, flag[2:].replace("-", "_")) == value
    text = stack.stack_text(answer, model, BATCH, size, "SIZE", [])
    assert " ".join(words) in text and links[expected].name in text


def test_a_sharded_command_parses_under_torchrun(combined):
    switches = dict(stack.prefixes("causal-lm")[-1][1])
    fit = stack.Fit("10_combined", True, batch_size=BATCH, world_size=2, largest=2)
    words = shlex.split(stack.command(["--task", "causal-lm"], BATCH, list(switches.items()),
                                      fit, 2))
    args, refused = parsed(combined, words, world_size=2)
    assert refused is None and args.offload and args.accum_steps == 2


def test_stack_only_needs_gpu_memory(capsys):
    with pytest.raises(SystemExit):
        table_main(["--stack-only"])
    assert "--stack-only answers --gpu-memory" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["classification", "causal-lm"])
def test_the_whole_stack_is_every_switch_until_a_link_takes_one_out(task, combined):
    """What the tour runs 10_combined.py with: every earlier link's switch, in one process."""
    words = stack.whole_stack(task)
    links = [link for link, switches, _ in stack.prefixes(task) if switches is not None]
    stop = next(number for number, link in enumerate(links)
                if any(value is stack.REMOVE for _, value in link.sets))
    assert {flag for link in links[:stop] for flag, _ in link.sets} == {
        word for word in words if word.startswith("--")}
    assert "--checkpointing offloaded" in " ".join(words)  # the later link's value, not 05c's
    assert ("--loss" in words) is (task == "causal-lm")
    # the link after would take some of them out: no single run goes further
    assert {flag for flag, value in links[stop].sets if value is stack.REMOVE} & set(words)
    _, refused = parsed(combined, ["python", "10_combined.py", "--task", task, *words])
    assert refused is None
