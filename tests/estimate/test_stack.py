"""The stack: the first prefix of estimate/stack.py's chain of 10_combined.py's switches that fits."""
import argparse
import os
import shlex
from dataclasses import replace
from unittest import mock

import pytest

import estimate.question
from conftest import script_path
from estimate import stack
from estimate.command import main as table_main
from estimate.command import parse_size
from estimate.output import size_text
from estimate.predict import attempt
from estimate.search import answers, walk
from estimate.search import costs as cost_model
from estimate.search.fit import Fit
from estimate.search.grid import granule
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
                                   flags=combined.own_flags)
        return args, combined.refusal(args)


@pytest.fixture(scope="module")
def estimated_once():
    """Each row estimated once for this module's walks and searches (a second walk repeats the
    first one's prefixes)."""
    made = {}

    def cached(row, learned=None):
        key = (str(row.script), tuple(row.argv), row.world_size, row.gpu)
        if key not in made:
            made[key] = attempt(row, learned)
        return made[key]
    with mock.patch.object(estimate.question, "attempt", cached):
        yield


@pytest.fixture(scope="module")
def every_prefix(estimated_once):
    """The walk with room for nothing: every prefix estimated once, none fits."""
    return walk.walk(COMBINED, BASE, BATCH, 1, 1, "causal-lm", "a100", report=lambda _: None)


# GPT-2's cost model at 8,192 tokens, batch 8: the host's optimizer moves fewer bytes a step than
# activation offloading, so it comes first in their group
MANY_TOKENS = cost_model.chain_seconds(1.24e8, 8 * 8192, (12, 768, 50257))
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
    text = answers.chain_text("causal-lm", 1.24e8, 8 * 8192, (12, 768, 50257), 1)
    # (GPT-2's 768 wide matrices: GaLore's SVDs cost less than 4-bit AdamW's step, first too)
    assert (f"orders 8-bit GaLore, 4-bit AdamW, {HOST_FIRST[0]}, {HOST_FIRST[1]} and {HOST_FIRST[2]} "
            "otherwise") in text
    assert "otherwise" not in answers.chain_text("causal-lm", 8.03e9, 8 * 2048, (32, 4096, 128256), 1)


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
    text = answers.chain_text("classification", 10**6, 1024, (2, 64, 1000), 1)
    assert "fused loss skipped: --task classification" in text


def test_a_size_below_everything_says_none_fits_and_names_the_nearest(every_prefix):
    assert every_prefix.fit is None
    last_link, _, _, last_reserved = every_prefix.tried[-1]
    assert last_link.name == "offload" and isinstance(last_reserved, int)
    text = answers.stack_text(every_prefix, [], BATCH, 1, "1B", [])
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
    answer = walk.walk(COMBINED, BASE, BATCH, 1, size, "causal-lm", "a100",
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
    words = shlex.split(answers.command(model, BATCH, answer.switches, fit, 1))
    args, refused = parsed(combined, words)
    assert refused is None and args.batch_size == BATCH
    assert BATCH // args.accum_steps <= fit.largest  # the micro-batch it runs fits
    for flag, value in answer.switches:
        assert getattr(args, flag[2:].replace("-", "_")) == value
    text = answers.stack_text(answer, model, BATCH, size, "SIZE", [])
    assert " ".join(words) in text and links[expected].name in text
    shown = max(micro for micro, (_, nbytes) in fit.tried.items()
                if nbytes <= size and micro <= fit.largest)
    assert f"{size_text(fit.tried[shown][1])} reserved at micro-batch {shown}" in text  # its peak


def test_two_workers_answer_as_one_does(between, every_prefix):
    """The walk and the searches in two worker processes (the rows the module estimated are
    the workers' too, forked with the cache): the same stack as one process finds."""
    size, links, expected = between
    alone = walk.walk(COMBINED, BASE, BATCH, 1, size, "causal-lm", "a100", report=lambda _: None)
    answer, adapters = walk.answer_all(COMBINED, BASE, BATCH, 1, size, "causal-lm", "a100", jobs=2,
                                        report=lambda _: None)
    assert answer.link is links[expected] and answer.switches == alone.switches
    assert (answer.fit.largest, answer.fit.capped) == (alone.fit.largest, alone.fit.capped)
    assert [switches[-1][0] for switches, _, _ in adapters] == ["--lora-rank", "--qlora"]
    for switches, fit, problem in adapters:  # each with the answer's activation switches
        assert set(walk.activation_switches(answer)) <= set(switches)
        assert (fit is None) != (problem is None)


def test_a_sharded_command_parses_under_torchrun(combined):
    switches = dict(stack.prefixes("causal-lm")[-1][1])
    fit = Fit("10_combined", True, batch_size=BATCH, world_size=2, largest=2)
    words = shlex.split(answers.command(["--task", "causal-lm"], BATCH, list(switches.items()),
                                      fit, 2))
    args, refused = parsed(combined, words, world_size=2)
    assert refused is None and args.offload and args.accum_steps == 2


def test_stack_only_needs_gpu_memory(capsys):
    with pytest.raises(SystemExit):
        table_main(["--stack-only"])
    assert "--stack-only answers --gpu-memory" in capsys.readouterr().err


def test_a_prefix_whose_weights_gradients_and_state_exceed_the_gpu_is_not_estimated(every_prefix):
    parameters = every_prefix.parameters
    assert parameters > 0
    for link, switches, _, reserved in every_prefix.tried:
        if isinstance(reserved, int):  # the floor is under what the estimate found
            floor = stack.resident_bytes(switches, parameters)
            assert floor <= reserved, link.name
            assert floor >= (0 if link.sharded else stack.WEIGHT_BYTES * parameters), link.name
    answer = walk.walk(COMBINED, BASE, BATCH, 1, 1, "causal-lm", "a100", report=lambda _: None,
                        parameters=parameters)  # 1 byte: every floor but --offload's is above
    said = {link.name: value for link, switches, _, value in answer.tried if switches is not None}
    assert isinstance(said.pop("offload"), int)
    assert all(value.startswith("not estimated: its weights, gradients and optimizer state alone hold")
               for value in said.values())


def test_a_link_that_steps_after_backward_counts_its_gradients_in_its_floor():
    """8-bit GaLore holds every gradient whole until its step (2 bytes a parameter beside the
    weights' 2 and its 0.5 of state): in room for 3.5 bytes a parameter it is not estimated, as
    Llama-3.1-8B's was on 24 GB (41.84 GB when estimated); stepped in backward, it is."""
    parameters = 10**6
    run = walk.Walk(COMBINED, BASE, BATCH, 1, int(3.5 * parameters), "a100", None, 1, None,
                    walk.Answer(parameters=parameters))
    plans = {link.name: plan for link, _, _, plan in run.planned(stack.prefixes("causal-lm"))}
    assert plans["8-bit GaLore"] == ("not estimated: its weights, gradients and optimizer state "
                                     f"alone hold {size_text(int(4.5 * parameters))}")
    assert isinstance(plans["optimizer in backward"], tuple)  # (its question, its micro-batch)
    assert isinstance(plans["gradients to host"], tuple)
    # ZeRO-2's whole weights exist at the end of forward, before its micro-batch's gradient
    # shards: whole weights and the shards of weights and Adam's state, no gradients
    zero2 = next(link for link in stack.SHARDED_CHAIN if link.name == "FSDP ZeRO-2")
    assert stack.resident_bytes(zero2.sets, 8 * parameters, 8) == 16 * parameters + 6 * parameters


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


def causal_lm_links():
    """{link name: (its switches, as a dict; its notes)} of the causal-lm chain's prefixes."""
    return {link.name: (dict(switches), notes) for link, switches, notes in stack.prefixes("causal-lm")
            if switches is not None}


def test_4bit_adamw_takes_8bits_place_on_the_gpu_and_gives_it_back_on_the_host():
    """On the GPU the 4-bit state holds half the 8-bit one's bytes; on the host, where its bytes
    no longer count, the chain goes back to 8-bit AdamW, whose CPU step is the quicker."""
    links = causal_lm_links()
    four_bit, notes = links["4-bit AdamW"]
    assert four_bit["--optimizer"] == "adamw-4bit" and notes == ["replaces --optimizer adamw-8bit"]
    assert stack.resident_bytes(four_bit.items(), 10**9) < stack.resident_bytes(
        links["8-bit AdamW"][0].items(), 10**9)
    on_host, notes = links["optimizer on the host"]  # (after 8-bit GaLore, which replaced 4-bit)
    assert on_host["--optimizer"] == "adamw-8bit" and "replaces --optimizer galore-8bit" in notes[0]


def test_8bit_galore_holds_less_than_4bit_adamw_and_pays_for_its_svds():
    """Its floor is below 4-bit AdamW's (the moments of a quarter of each block matrix's rank, in a
    byte each); its seconds are the two products of each projection every step and an SVD of
    every block matrix each --galore-gap steps, which for Llama-3.1-8B cost more than 4-bit
    AdamW's step, so it comes after it, and replaces it."""
    links = causal_lm_links()
    galore, notes = links["8-bit GaLore"]
    assert galore["--optimizer"] == "galore-8bit" and notes == ["replaces --optimizer adamw-4bit"]
    assert stack.resident_bytes(galore.items(), 10**9) < stack.resident_bytes(
        links["4-bit AdamW"][0].items(), 10**9)
    parameters, hidden = 8.03e9, 4096
    seconds = cost_model.chain_seconds(parameters, 8 * 2048, (32, hidden, 128256))
    assert seconds["8-bit GaLore"] == pytest.approx(parameters * hidden * (
        1 / stack.COST["gpu_flops"] + 26 / stack.COST["galore_gap"] / stack.COST["svd_flops"]))
    assert seconds["8-bit GaLore"] > seconds["4-bit AdamW"]
    costs = cost_model.Costs(parameters, 8 * 2048, 32, hidden, 128256)
    assert cost_model.step_time(costs, galore.items())["GaLore's projections"] == seconds["8-bit GaLore"]


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
    """--gpu-memory: the stack and its command are printed before the adapters' runs and the first
    row of the table are estimated; --quiet: the answer's lines alone, and no row of the table is
    computed (asked again: the runs kept from the first ask)."""
    from estimate import command
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))
    flags = ["--preset", "tiny", "--steps", "04", "--gpu-memory", "1GB", "--results-dir",
             str(tmp_path), "--jobs", "1"]
    rows_run = []

    def run_rows(rows, jobs):  # what the output holds when the table's rows start
        rows_run.append((len(rows), capsys.readouterr().out))
        return table_rows(rows, jobs)
    table_rows = command.run_rows
    monkeypatch.setattr(command, "run_rows", run_rows)
    assert command.main(flags) == 0
    (count, before_rows), = rows_run
    assert count == 4 and "[1/4]" not in before_rows  # 04, 04a, 04b, 04c
    assert before_rows.index("The stack: bf16 fits batch 64") < before_rows.index(
        "[stack] --lora-rank 8:") < before_rows.index("with adapters")
    rest = capsys.readouterr().out
    assert rest.startswith("[1/4] 04") and "The stack:" not in rest and "| script |" in rest
    (tmp_path / "estimate.json").unlink()
    assert command.main([*flags, "--quiet"]) == 0
    quiet = capsys.readouterr().out.strip().splitlines()
    assert len(rows_run) == 1 and not (tmp_path / "estimate.json").exists()  # no row computed
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
    # and what a script trains under a flag of its own, which 10's table gives it (04c's
    # --galore-8bit: tests/scripts/test_galore.py checks 10's galore-8bit against it, to the byte)
    trained.add(("--optimizer", "galore-8bit"))
    declared = argparse.ArgumentParser()
    combined.own_flags(declared)
    for link in stack.CHAIN:
        for flag, value in link.sets:
            assert flag in declared._option_string_actions, f"link {link.name!r}: 10 has no {flag}"
            if value is not stack.REMOVE:
                combined.parse_args("", [flag] if value is True else [flag, value],
                                    flags=combined.own_flags)  # a value 10 takes
                assert (flag, value) in trained, \
                    f"link {link.name!r}: {flag} {value} is no step's switch (steps.py)"


def test_each_links_group_is_the_one_10_gives_the_switches_it_sets(combined):
    """10_combined.py's SWITCHES give each value the chain may set its group in the stack
    (Switch.groups, in GROUPS' words); a link's group is the latest of those of the values it
    sets (the optimizer on the host sets 8-bit AdamW, inexact, and is priced by its bytes over
    PCIe), the first where it sets none (bf16, the default; sharding alone, whose
    --reshard-after-forward 10 gives no group). Every value a link of CHAIN sets has a group in
    10; each disagreement is named."""
    records = {switch.flag: switch for switch in combined.SWITCHES}
    wrong = []
    for chain in (stack.CHAIN, stack.SHARDED_CHAIN):
        for link in chain:
            groups = []
            for flag, value in link.sets:
                if value is stack.REMOVE:
                    continue
                given = (records[flag].groups or {}).get(value)
                if given is None:
                    if chain is stack.CHAIN:
                        wrong.append(f"link {link.name!r} sets {stack.flag_text(flag, value)}, "
                                     "which 10's SWITCHES give no group")
                elif given not in stack.GROUPS:
                    wrong.append(f"10 gives {stack.flag_text(flag, value)} the group {given!r}, "
                                 "which is none of estimate/stack.py's GROUPS")
                else:
                    groups.append(stack.GROUPS.index(given))
            if link.group != max(groups, default=0):
                wrong.append(f"link {link.name!r} is in group {stack.GROUPS[link.group]!r}, but 10 "
                             f"gives what it sets {stack.GROUPS[max(groups, default=0)]!r}")
    assert not wrong, "; ".join(wrong)


def test_on_several_gpus_the_stack_shards_first_keeping_adam_exact(combined):
    """--world-size 2: the first prefix is 10 under torchrun, every process holding half the
    weights, gradients and Adam's state (ZeRO-2 first: fewer bytes over the interconnect); its
    command trains (10's own checks, as torchrun's process 0) and shards; one sample a process is
    the whole batch: nothing to search."""
    answer = walk.walk(COMBINED, BASE, 2, 2, 10**12, "causal-lm", "a100", report=lambda _: None)
    assert answer.link is stack.SHARDED_CHAIN[0] and answer.world_size == 2
    assert answer.switches == [("--reshard-after-forward", "false")]
    assert answer.fit.largest == 1 and answer.fit.capped
    shown = [word for word in BASE if word not in ("--device", "cuda")]  # as the answer prints it
    words = shlex.split(answers.command(shown, 2, answer.switches, answer.fit, answer.world_size))
    args, problem = parsed(combined, words, world_size=2)
    assert problem is None and "--optimizer" not in words and args.reshard_after_forward is False
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "0"}):
        assert combined.launched_sharded(args)
    one_gpu = walk.walk(COMBINED, BASE, 2, 1, 10**12, "causal-lm", "a100", report=lambda _: None)
    assert one_gpu.link.name == "bf16" and one_gpu.world_size == 1


def test_each_sharded_link_trains_under_torchrun(combined):
    for link in stack.SHARDED_CHAIN:
        words = ["torchrun", "--nproc_per_node=2", "10_combined.py", "--task", "causal-lm",
                 *stack.argv_of(link.sets)]
        _, refused = parsed(combined, words, world_size=2)
        assert refused is None, (link.name, refused)
        assert link.sharded and all(value is not stack.REMOVE for _, value in link.sets)


def test_an_offloaded_answer_states_the_host_memory_it_needs(every_prefix):
    """--offload keeps the shards and Adam's state in host memory: the answer says how much, a
    process and for the processes of a machine."""
    *_, reserved = every_prefix.tried[-1]  # offload's, at micro-batch 1 of one process
    # sharded over 2 it keeps the margin, and each process holds more than a group of one (the
    # reduce-scatter's buffers beside the last unit's whole gradient); every other link's floor
    # is above this room
    size = int(2 * reserved / (1 - stack.SHARDED_MARGIN)) + 1
    answer = walk.walk(COMBINED, BASE, BATCH, 2, size, "causal-lm", "a100",
                        report=lambda _: None, parameters=10**12)  # every other floor above
    assert answer.link.name == "offload" and answer.host_bytes > 0
    text = answers.stack_text(answer, [], BATCH, size, "SIZE", [])
    assert f"host memory: {size_text(answer.host_bytes)} a process" in text
    assert f"{size_text(2 * answer.host_bytes)} for the 2 on one machine" in text
    smaller = walk.walk(COMBINED, BASE, BATCH, 2, size, "causal-lm", "a100", report=lambda _: None,
                         parameters=10**12, host_capacity=2 * answer.host_bytes - 1)
    assert smaller.link is None and smaller.tried[-1][3].startswith("needs ")


def test_host_memory_needs_gpu_memory(capsys):
    with pytest.raises(SystemExit):
        table_main(["--host-memory", "64GB"])
    assert "--host-memory limits the stack's answer to --gpu-memory" in capsys.readouterr().err


# The cost model between GPUs, on stand-ins: Llama-3.1-8B's size and shape at 8 x 2,048 tokens
LLAMA_8B = cost_model.Costs(8.03e9, 8 * 2048, 32, 4096, 128256)
ZERO_2, ZERO_3 = (next(link for link in stack.SHARDED_CHAIN if link.name == name)
                  for name in ("FSDP ZeRO-2", "FSDP ZeRO-3"))


def test_the_interconnect_carries_n_minus_1_over_n_of_the_weights_bytes_each_micro_batch():
    """ZeRO-3 gathers the bfloat16 weights twice a micro-batch and reduce-scatters the gradients
    (6 bytes a parameter), ZeRO-2 gathers once (4): two thirds of the time; each GPU moves
    (N-1)/N of them, at the stated bandwidth; one GPU moves none."""
    def wire(costs, link, world, micro_batches=1):
        return cost_model.step_time(costs, link.sets, world, micro_batches).get("interconnect", 0)
    for world in (2, 4, 8, 64):
        moved = {link: wire(LLAMA_8B, link, world) * LLAMA_8B.interconnect * world / (world - 1)
                 for link in (ZERO_2, ZERO_3)}
        assert moved[ZERO_3] == pytest.approx(6 * LLAMA_8B.parameters)
        assert moved[ZERO_2] == pytest.approx(4 * LLAMA_8B.parameters)
        assert wire(LLAMA_8B, ZERO_3, world, 4) == pytest.approx(4 * wire(LLAMA_8B, ZERO_3, world))
    assert wire(LLAMA_8B, ZERO_3, 1) == 0
    slower = replace(LLAMA_8B, interconnect=LLAMA_8B.interconnect / 10)
    assert wire(slower, ZERO_3, 8) == pytest.approx(10 * wire(LLAMA_8B, ZERO_3, 8))
    assert [link.name for link in cost_model.sharded_links(LLAMA_8B, 8)][:2] == ["FSDP ZeRO-2", "FSDP ZeRO-3"]


@pytest.mark.parametrize("world", [2, 8])
def test_a_sharded_step_is_the_one_gpu_step_of_its_tokens_plus_the_interconnect(world):
    """A sharded link is priced by the one-GPU links' own terms for the same switches, on
    batch/N of the tokens (a sharded step of 4-bit AdamW on 1/N of the weights), plus the
    interconnect: adding a link to SHARDED_CHAIN prices it."""
    share = cost_model.Costs(LLAMA_8B.parameters, LLAMA_8B.tokens // world, 32, 4096, 128256)
    one_gpu = {link.sets: link for link in stack.CHAIN}
    for link in [*stack.SHARDED_CHAIN, *(link for link in stack.CHAIN if not link.sharded)]:
        switches = [(flag, value) for flag, value in link.sets if value is not stack.REMOVE]
        sharded = cost_model.step_time(LLAMA_8B, switches, world)
        wire = sharded.pop("interconnect")
        alone = cost_model.step_time(share, switches, 1)
        if link.sets in one_gpu:  # what the switches add is that link's seconds on the share
            added = sum(alone.values()) - alone["compute"]
            links = [one_gpu[link.sets]] + (  # offloading recomputes too, as the link it replaces
                [one_gpu[(("--checkpointing", "full"),)]] if link.name == "activation offloading" else [])
            assert added == pytest.approx(sum(cost_model.step_seconds(each, share.parameters, share.tokens,
                                                                 32, 4096, 128256) for each in links))
        if "4-bit step" in alone:
            alone["4-bit step"] /= world
        assert wire > 0 and sharded == pytest.approx(alone)


def on_stand_ins(reserved, costs, world_size, capacity, batch_size=8, largest=None):
    """walk.walk with stand-ins for the estimates and the search: a row reserves
    reserved(argv, world) bytes at any micro-batch, and its search finds largest(argv, world)
    samples a GPU (default: the whole share); (the answer, the lines it reported)."""
    said = []

    def attempt(row, learned=None):
        return ({"reserved_bytes": reserved(row.argv, row.world_size), "allocated_bytes": 0,
                 "parameter_count": int(costs.parameters), "host_bytes": 0}, None, 0.0)

    def search(question, room, known, cap, per_sample):
        return Fit(question.name, question.accumulates, capacity=room, tried=dict(known),
                   largest=largest(question.base_argv, question.world_size) if largest else cap)
    with mock.patch.object(estimate.question, "attempt", attempt), mock.patch.object(walk, "search", search):
        answer = walk.walk(COMBINED, BASE, batch_size, world_size, capacity, "causal-lm", "a100",
                            report=said.append, costs=costs)
    return answer, said


def test_sharding_is_answered_where_quicker_and_one_gpu_where_the_interconnect_is_slow():
    """Every prefix fits: on NVLink-class bandwidth ZeRO-2 over 8 GPUs is the quickest, and no
    one-GPU prefix is estimated (none could be quicker); at 1 MB/s one GPU running the whole batch
    is the quicker, and the answer says both seconds."""
    fast, said = on_stand_ins(lambda argv, world: 1, LLAMA_8B, 8, 10**12)
    assert fast.link is ZERO_2 and fast.world_size == 8
    sharded_seconds = sum(cost_model.step_time(LLAMA_8B, ZERO_2.sets, 8).values())
    assert f"{sharded_seconds:.3g} s a step on each of 8 GPUs" in fast.why
    assert "every prefix of the one-GPU chain takes longer" in fast.why
    skipped = [value for link, switches, _, value in fast.tried if link in stack.CHAIN and switches]
    assert skipped and all(value.startswith("not estimated: its step takes") for value in skipped)
    slow_wire = replace(LLAMA_8B, interconnect=1e6)
    slow, said = on_stand_ins(lambda argv, world: 1, slow_wire, 8, 10**12)
    assert slow.link.name == "bf16" and slow.world_size == 1
    one_gpu = sum(cost_model.step_time(slow_wire, [], 1).values())
    zero_2 = sum(cost_model.step_time(slow_wire, ZERO_2.sets, 8).values())
    assert one_gpu < zero_2
    assert slow.why.startswith(f"{one_gpu:.3g} s a step on one GPU")
    assert f"{zero_2:.3g} s for FSDP ZeRO-2" in slow.why
    text = answers.stack_text(slow, [], 8, 10**12, "SIZE", [])
    assert f"why: {slow.why}" in text and "python 10_combined.py" in text


def test_zero3_is_answered_where_zero2_fits_only_in_more_micro_batches():
    """ZeRO-2 is tried first (its least step is quicker), but where it fits micro-batches of 1
    and ZeRO-3 the whole share, ZeRO-3's one micro-batch moves fewer bytes: it is answered."""
    def largest(argv, world):
        return 1 if "--reshard-after-forward" in argv else 8
    answer, said = on_stand_ins(lambda argv, world: 1, LLAMA_8B, 8, 10**12, batch_size=64,
                                largest=largest)
    assert answer.link is ZERO_3 and walk.micro_batches(answer.fit) == 1
    zero_2 = sum(cost_model.step_time(LLAMA_8B, ZERO_2.sets, 8, 8).values())
    zero_3 = sum(cost_model.step_time(LLAMA_8B, ZERO_3.sets, 8, 1).values())
    assert zero_3 < zero_2
    assert f"FSDP ZeRO-3: {zero_3:.3g} s a step, under FSDP ZeRO-2's {zero_2:.3g} s" in "\n".join(said)


def test_zero3_is_answered_where_zero2_holds_too_much():
    """ZeRO-2 keeps every block's gathered weights until backward: where that does not fit,
    the walk goes on to ZeRO-3, sharded all the same."""
    def reserved(argv, world):
        return 2 * 10**12 if "--reshard-after-forward" in argv else 10**9
    answer, said = on_stand_ins(reserved, LLAMA_8B, 8, 10**11)
    assert answer.link is ZERO_3 and answer.world_size == 8 and answer.switches == []


def test_a_sharded_fit_keeps_the_sharded_margin_free():
    """Each run reserves the same bytes: in --gpu-memory a little above them, a sharded link
    does not fit (SHARDED_MARGIN of it is kept free: the estimate leaves out what the collectives
    hold) while one GPU does; with the margin's room, sharding fits, and both say so."""
    reserved = 70 * 10**9
    tight = int(reserved / (1 - stack.SHARDED_MARGIN)) - 10**6  # the margin eats into it
    assert reserved < tight
    answer, said = on_stand_ins(lambda argv, world: reserved, LLAMA_8B, 8, tight)
    assert answer.world_size == 1 and answer.link.name == "bf16"
    assert "no sharded link fits" in answer.why and f"{stack.SHARDED_MARGIN:.0%}" in answer.why
    room = int(tight * (1 - stack.SHARDED_MARGIN))
    assert f"[stack] FSDP ZeRO-2: {size_text(reserved)} reserved at micro-batch 1 of {size_text(room)} " \
           f"(--gpu-memory less the sharded margin, {stack.SHARDED_MARGIN:.0%})" in "\n".join(said)
    roomy = tight + 2 * 10**6
    answer, _ = on_stand_ins(lambda argv, world: reserved, LLAMA_8B, 8, roomy)
    assert answer.link is ZERO_2 and answer.fit.capacity == int(roomy * (1 - stack.SHARDED_MARGIN))
    text = answers.stack_text(answer, [], 8, roomy, "SIZE", [])
    assert f"keeps {stack.SHARDED_MARGIN:.0%} of it free when sharded" in text


def test_the_interconnect_flag_prices_the_sharded_links(tmp_path, monkeypatch):
    """--interconnect RATE reaches the cost model: the printed chain states it, and its sharded
    steps take longer at a slower one."""
    from estimate import command
    asked = {}

    def answer_all(*arguments, costs=None, **options):
        asked["costs"] = costs
        return walk.Answer(), []
    monkeypatch.setattr(walk, "answer_all", answer_all)
    flags = ["--preset", "tiny-text", "--task", "causal-lm", "--gpu-memory", "80GB", "--world-size",
             "8", "--results-dir", str(tmp_path)]
    chains = {}
    for rate in ("200GB/s", "100GB/s"):
        args = command.parse_table_args([*flags, "--interconnect", rate])
        chains[rate], _ = command.the_stack(args, command.model_flags(args))
        assert asked["costs"].interconnect == parse_size(rate[:-2])
    assert "interconnect 100 GB/s" in chains["100GB/s"] and "interconnect 200 GB/s" in chains["200GB/s"]
    first = [[line for line in chains[rate].splitlines() if "1. FSDP ZeRO-2" in line][0]
             for rate in ("200GB/s", "100GB/s")]
    assert first[0] != first[1]


@pytest.mark.parametrize("words, said", [
    (["--interconnect", "100Gb/s"], "a lower-case b counts bits"),
    (["--interconnect", "fast"], "expected bytes a second"),
    (["--interconnect", "-5GB/s"], "expected bytes a second"),
    (["--interconnect", "0GB/s"], "expected bytes a second"),
])
def test_a_bad_interconnect_is_refused_in_one_line(words, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        table_main(["--gpu-memory", "80GB", "--world-size", "8", *words,
                    "--results-dir", str(tmp_path / "out")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and last.startswith("python -m estimate: error: --interconnect")
    assert said in last and not any((tmp_path / "out").glob("*"))  # nothing written


@pytest.mark.parametrize("words, said", [
    (["--interconnect", "100GB/s"], "add it and --world-size N"),
    (["--gpu-memory", "80GB", "--interconnect", "100GB/s"], "add --world-size N"),
])
def test_the_interconnect_needs_sharded_gpus_to_price(words, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        table_main([*words, "--results-dir", str(tmp_path / "out")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "--interconnect" in last and said in last
