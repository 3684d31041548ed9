"""The stack: the first prefix of estimate/stack.py's chain of 10_combined.py's switches that fits."""
import argparse
import os
import shlex
from unittest import mock

import pytest

import estimate.fit
from conftest import script_path
from estimate import stack
from estimate.command import main as table_main
from estimate.fit import granule
from estimate.predict import attempt
from estimate.records import size_text
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
    env = {"WORLD_SIZE": str(world_size), "RANK": "0"} if world_size > 1 else {}  # torchrun's
    with mock.patch.dict(os.environ, env):
        if world_size == 1:
            os.environ.pop("WORLD_SIZE", None)
        args = combined.parse_args(combined.__doc__, words[len(launch):],
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


# GPT-2's cost model at 8,192 tokens, batch 8: the host's optimizer moves fewer bytes a step than
# activation offloading, so it comes first in their group
MANY_TOKENS = stack.chain_seconds(1.24e8, 8 * 8192, (12, 768, 50257))
HOST_FIRST = ["optimizer on the host", "gradients to host", "activation offloading"]


def test_the_cost_model_orders_the_links_within_their_group_and_says_so():
    usual = [link.name for link in stack.ordered()]
    assert usual == [link.name for link in stack.CHAIN]
    reordered = stack.ordered(MANY_TOKENS)
    assert [link.name for link in reordered if link.group == 3] == HOST_FIRST
    assert [link.group for link in reordered] == sorted(link.group for link in stack.CHAIN)
    for earlier, later in zip(reordered, reordered[1:]):
        if earlier.group == later.group:
            assert MANY_TOKENS[earlier.name] <= MANY_TOKENS[later.name]
    text = stack.chain_text("causal-lm", 1.24e8, 8 * 8192, (12, 768, 50257), 1)
    assert f"orders {HOST_FIRST[0]}, {HOST_FIRST[1]} and {HOST_FIRST[2]} otherwise" in text
    assert "otherwise" not in stack.chain_text("causal-lm", 8.03e9, 8 * 2048, (32, 4096, 128256), 1)


@pytest.mark.parametrize("seconds", [None, MANY_TOKENS], ids=["usual", "reordered"])
def test_no_link_is_dropped_silently_and_every_prefix_trains(combined, seconds):
    for task in ("causal-lm", "classification"):
        before = {}
        for link, switches, notes in stack.prefixes(task, seconds):
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


def test_classification_skips_the_fused_loss_with_a_note():
    links = stack.prefixes("classification")
    fused = [(link, switches, notes) for link, switches, notes in links
             if link.name == "fused loss"]
    assert fused and fused[0][1] is None and "skipped" in fused[0][2][0]
    assert all(("--loss", "fused") not in (switches or []) for _, switches, _ in links)
    text = stack.chain_text("classification", 10**6, 1024, (2, 64, 1000), 1)
    assert "fused loss skipped: --task classification" in text


def test_a_size_below_everything_says_none_fits_and_names_the_nearest(every_prefix):
    assert every_prefix.fit is None
    last_link, _, _, last_reserved = every_prefix.tried[-1]
    assert last_link.name == "offload" and isinstance(last_reserved, int)
    text = stack.stack_text(every_prefix, [], BATCH, 1, "1B", [])
    assert "no prefix fits" in text and "offload" in text and size_text(last_reserved) in text


@pytest.fixture(scope="module")
def between(every_prefix):
    """(a size between the first prefix's peak and a lower one's, the links, the index of the
    first link that fits it)."""
    reserved = [value for _, switches, _, value in every_prefix.tried if switches is not None]
    links = [link for link, switches, _, _ in every_prefix.tried if switches is not None]
    lower = next(value for value in reserved if value < reserved[0])  # a prefix that saves
    size = (lower + reserved[0]) // 2
    expected = next(index for index, value in enumerate(reserved) if value <= size)
    assert expected > 0
    return size, links, expected


def test_a_size_between_two_prefixes_picks_the_first_that_fits(between, combined):
    size, links, expected = between
    answer = stack.walk(COMBINED, BASE, BATCH, 1, size, "causal-lm", "a100",
                        report=lambda _: None)
    assert answer.link is links[expected]
    fit = answer.fit
    assert fit.largest >= 1 and fit.tried[fit.largest][1] <= size
    assert max(fit.tried) <= BATCH  # the search stops at the asked batch
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
    shown = max(micro for micro, (_, nbytes) in fit.tried.items()
                if nbytes <= size and micro <= fit.largest)
    assert f"{size_text(fit.tried[shown][1])} reserved at micro-batch {shown}" in text  # its peak


def test_two_workers_answer_as_one_does(between, every_prefix):
    """The walk and the searches in two worker processes (the rows the module estimated are
    the workers' too, forked with the cache): the same stack as one process finds."""
    size, links, expected = between
    alone = stack.walk(COMBINED, BASE, BATCH, 1, size, "causal-lm", "a100", report=lambda _: None)
    answer, adapters = stack.answer_all(COMBINED, BASE, BATCH, 1, size, "causal-lm", "a100", jobs=2,
                                        report=lambda _: None)
    assert answer.link is links[expected] and answer.switches == alone.switches
    assert (answer.fit.largest, answer.fit.capped) == (alone.fit.largest, alone.fit.capped)
    assert [switches[-1][0] for switches, _, _ in adapters] == ["--lora-rank", "--qlora"]
    for switches, fit, problem in adapters:  # each with the answer's activation switches
        assert set(stack.activation_switches(answer)) <= set(switches)
        assert (fit is None) != (problem is None)


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


def test_a_prefix_whose_weights_and_state_exceed_the_gpu_is_not_estimated(every_prefix):
    parameters = every_prefix.parameters
    assert parameters > 0
    for link, switches, _, reserved in every_prefix.tried:
        if isinstance(reserved, int):  # the floor is under what the estimate found
            floor = stack.resident_bytes(switches, parameters)
            assert floor <= reserved, link.name
            assert floor >= (0 if link.sharded else stack.WEIGHT_BYTES * parameters), link.name
    answer = stack.walk(COMBINED, BASE, BATCH, 1, 1, "causal-lm", "a100", report=lambda _: None,
                        parameters=parameters)  # 1 byte: every floor but --offload's is above
    said = {link.name: value for link, switches, _, value in answer.tried if switches is not None}
    assert isinstance(said.pop("offload"), int)
    assert all(value.startswith("not estimated: its weights and optimizer state alone hold")
               for value in said.values())


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


def test_4bit_adamw_takes_8bits_place_on_the_gpu_and_gives_it_back_on_the_host():
    """On the GPU the 4-bit state holds half the 8-bit one's bytes; on the host, where its bytes
    no longer count, the chain goes back to 8-bit AdamW, whose CPU step is the quicker."""
    links = {link.name: (dict(switches), notes) for link, switches, notes in stack.prefixes("causal-lm")
             if switches is not None}
    four_bit, notes = links["4-bit AdamW"]
    assert four_bit["--optimizer"] == "adamw-4bit" and notes == ["replaces --optimizer adamw-8bit"]
    assert stack.resident_bytes(four_bit.items(), 10**9) < stack.resident_bytes(
        links["8-bit AdamW"][0].items(), 10**9)
    on_host, notes = links["optimizer on the host"]
    assert on_host["--optimizer"] == "adamw-8bit" and "replaces --optimizer adamw-4bit" in notes[0]


def test_the_4bit_links_bytes_a_parameter_are_those_05js_step_moves():
    """COST's bytes for 4-bit AdamW's step: every input and output of its operators, counted
    under a dispatch mode for a weight of 2^22 bfloat16 elements, within a tenth."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Traffic(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = {id(leaf): leaf for leaf in tree_leaves((args, kwargs, out))
                       if torch.is_tensor(leaf) and leaf.numel() > 16}  # not the code tables
            self.moved += sum(tensor.nbytes for tensor in tensors.values())
            return out

    script = import_script(script_path("05j"), prefix="stack_test")
    weight = torch.nn.Parameter(torch.zeros(1 << 22, dtype=torch.bfloat16))
    optimizer = script.AdamW4bit([weight], lr=1e-3)
    weight.grad = torch.randn_like(weight)
    optimizer.step()  # the states made
    with Traffic() as traffic:
        optimizer.step()
    counted = traffic.moved / weight.numel()
    assert abs(counted - stack.COST["adamw_4bit_bytes_per_parameter"]) < 0.1 * counted, counted


def test_the_answer_comes_first_and_quiet_prints_it_alone(tmp_path, capsys, monkeypatch):
    """--gpu-memory: the stack and its command before the tables; --quiet: those lines alone
    (asked again: the runs kept from the first ask)."""
    from estimate.command import main
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))
    flags = ["--preset", "tiny", "--steps", "04", "--gpu-memory", "1GB", "--results-dir",
             str(tmp_path), "--jobs", "1"]
    assert main(flags) == 0
    loud = capsys.readouterr().out
    assert loud.index("The stack:") < loud.index("| script |")
    (tmp_path / "estimate.json").unlink()
    assert main([*flags, "--quiet"]) == 0
    quiet = capsys.readouterr().out.strip().splitlines()
    assert (tmp_path / "estimate.json").exists()  # the records are written all the same
    assert quiet[0].startswith("The stack: bf16 fits batch 64")
    assert quiet[1].strip().startswith("python 10_combined.py --preset tiny --batch-size 64")
    assert len(quiet) == 3 and quiet[2].startswith("with adapters")


def test_each_link_sets_switches_of_10_that_a_script_trains_with(combined):
    """The chain is the estimate's (its links are not one a step), but each switch it sets is
    one 10_combined.py declares, with a value it takes, that some step's switch set (steps.py)
    trains with; a switch it takes out is one of 10's."""
    from steps import STEPS
    from support.tags import switch_pairs
    trained = {pair for step in STEPS.values() for pair in switch_pairs(step.switches)}
    declared = argparse.ArgumentParser()
    combined.switches(declared)
    for link in stack.CHAIN:
        for flag, value in link.sets:
            assert flag in declared._option_string_actions, f"link {link.name!r}: 10 has no {flag}"
            if value is not stack.REMOVE:
                combined.parse_args("", [flag] if value is True else [flag, value],
                                    flags=combined.switches)  # a value 10 takes
                assert (flag, value) in trained, \
                    f"link {link.name!r}: {flag} {value} is no step's switch (steps.py)"


def test_on_several_gpus_the_stack_shards_first_keeping_adam_exact(combined):
    """--world-size 2: the first prefix is 10 under torchrun, every process holding half the
    weights, gradients and Adam's state; its command trains (10's own checks, as torchrun's
    process 0) and shards; one sample a process is the whole batch: nothing to search."""
    answer = stack.walk(COMBINED, BASE, 2, 2, 10**12, "causal-lm", "a100", report=lambda _: None)
    assert answer.link.name == "FSDP" and answer.world_size == 2 and answer.switches == []
    assert answer.fit.largest == 1 and answer.fit.capped
    shown = [word for word in BASE if word not in ("--device", "cuda")]  # as the answer prints it
    words = shlex.split(stack.command(shown, 2, answer.switches, answer.fit, answer.world_size))
    args, problem = parsed(combined, words, world_size=2)
    assert problem is None and "--optimizer" not in words
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "0"}):
        assert combined.launched_sharded(args)
    one_gpu = stack.walk(COMBINED, BASE, 2, 1, 10**12, "causal-lm", "a100", report=lambda _: None)
    assert one_gpu.link.name == "bf16" and one_gpu.world_size == 1


def test_an_offloaded_answer_states_the_host_memory_it_needs(every_prefix):
    """--offload keeps the shards and Adam's state in host memory: the answer says how much, a
    process and for the processes of a machine."""
    *_, reserved = every_prefix.tried[-1]  # offload's, at micro-batch 1
    answer = stack.walk(COMBINED, BASE, BATCH, 2, reserved, "causal-lm", "a100",
                        report=lambda _: None, parameters=10**12)  # every other floor above
    assert answer.link.name == "offload" and answer.host_bytes > 0
    text = stack.stack_text(answer, [], BATCH, reserved, "SIZE", [])
    assert f"host memory: {size_text(answer.host_bytes)} a process" in text
    assert f"{size_text(2 * answer.host_bytes)} for the 2 on one machine" in text
    smaller = stack.walk(COMBINED, BASE, BATCH, 2, reserved, "causal-lm", "a100", report=lambda _: None,
                         parameters=10**12, host_capacity=2 * answer.host_bytes - 1)
    assert smaller.link is None and smaller.tried[-1][3].startswith("needs ")


def test_host_memory_needs_gpu_memory(capsys):
    with pytest.raises(SystemExit):
        table_main(["--host-memory", "64GB"])
    assert "--host-memory limits the stack's answer to --gpu-memory" in capsys.readouterr().err
