"""--longest-sequence (estimate/search/longest.py): the longest sequence that fits, walking the
chain for long sequences, each prefix's length found by estimates (stood in for here: each
answer's figures are made up, so that what the search does with them can be checked); and the
command an answer prints, which 10_combined.py parses and a tiny model trains with on the CPU."""
import json
import math
import shlex

import pytest

from conftest import QUICK, run_script, script_path, unevaluated
from estimate import stack
from estimate.command import main as table_main
from estimate.search import longest
from estimate.search.costs import Costs
from estimate.stack import argv_of
from steps import import_script
from support.architecture_matrix import write_model

GRANULE = 1024


@pytest.fixture(scope="module")
def combined():
    return import_script(script_path("10"), prefix="longest_test")


def asked(capacity=80 * 10**9, positions=131072, stretches=True, host_capacity=None,
          granule=GRANULE, parameters=8 * 10**9, world_size=1, heads=32):
    return longest.Asked("10_combined.py", ["--model", "M"], 1, capacity, "a100",
                         Costs(parameters, 0, 32, 4096, 128256, mlp_parameters=parameters // 2),
                         positions, stretches, host_capacity, granule, world_size=world_size,
                         heads=heads)


def answering(monkeypatch, reserved, host=lambda length, switches: 0, world_size=1):
    """longest.Question answering with `reserved(length, switches)` bytes (and `host` host
    bytes) instead of an estimate, on `world_size` processes, each text split across them where
    --sequence-parallel is given; returns the lengths asked, by switches."""
    asked_at = []

    class Fake:
        def __init__(self, script, argv, world_size_asked, gpu, accumulates, shares_texts):
            assert world_size_asked == world_size and not accumulates
            assert shares_texts == ("--sequence-parallel" in argv)
            self.length = int(argv[argv.index("--seq-len") + 1])
            self.switches = tuple(argv[argv.index("--seq-len") + 2:])
            if "--max-positions" in argv:
                assert int(argv[argv.index("--max-positions") + 1]) == self.length
                self.switches = self.switches[2:]

        def answer(self, batch_size):
            asked_at.append((self.switches, self.length))
            value = reserved(self.length, self.switches)
            return ({"reserved_bytes": value, "allocated_bytes": value,
                     "host_bytes": host(self.length, self.switches)}, None, 0.0)

    monkeypatch.setattr(longest, "Question", Fake)
    return asked_at


def search(question, switches=()):
    found = longest.LengthSearch(question, list(switches), report=lambda _: None)
    assert found.fits(question.granule)
    return found.longest(question.granule)[0], found


@pytest.mark.parametrize("per_token, base", [(200_000, 30 * 10**9), (7_777, 10**9),
                                             (1_000_003, 70 * 10**9)])
def test_a_line_is_searched_to_its_granule_in_a_few_estimates(per_token, base, monkeypatch):
    """Memory that grows linearly with the length: the longest multiple of the granule under the
    GPU, and the next one over, in at most 6 estimates (bisection alone would take 10 or more)."""
    answering(monkeypatch, lambda length, _: base + per_token * length)
    question = asked()
    length, found = search(question)
    expected = (question.capacity - base) // per_token // GRANULE * GRANULE
    assert length == expected
    assert len(found.seen) <= 6, sorted(found.seen)


def test_steps_of_the_allocator_and_a_square_term_still_end_at_the_granule(monkeypatch):
    """Reserved memory in 2 MiB segments, and a term that grows as the length squared (what a
    mask would add): the search ends at a length that fits with the next granule over, within
    what bisection from 1,024 to 4 x 2^20 takes."""
    def reserved(length, _):
        return math.ceil((10**10 + 90_000 * length + 0.02 * length ** 2) / 2**21) * 2**21
    answering(monkeypatch, reserved)
    question = asked()
    length, found = search(question)
    assert reserved(length, ()) <= question.capacity < reserved(length + GRANULE, ())
    assert len(found.seen) <= 2 * math.log2(4 * 2**20 / GRANULE)


@pytest.mark.parametrize("world_size", [1, 8])
def test_host_memory_past_host_memory_does_not_fit(world_size, monkeypatch):
    """--host-memory is one machine's: on 8 GPUs, 8 processes' host memory."""
    answering(monkeypatch, lambda length, _: 10**9 + 1000 * length,
              host=lambda length, _: 300_000 * length, world_size=world_size)
    question = asked(host_capacity=100 * 10**9, world_size=world_size)
    length, _ = search(question)
    assert length == 100 * 10**9 // (300_000 * world_size) // GRANULE * GRANULE


def test_positions_that_do_not_stretch_bound_the_length(monkeypatch):
    answering(monkeypatch, lambda length, _: length)
    assert search(asked(positions=8192, stretches=False))[0] == 8192
    assert longest.length_argv(asked(positions=8192), 16384) == [
        "--seq-len", "16384", "--max-positions", "16384"]
    assert longest.length_argv(asked(positions=8192), 8192) == ["--seq-len", "8192"]


def test_the_walk_answers_the_cheapest_prefix_of_the_longest_and_asks_others_once(monkeypatch):
    """Each switch the chain adds lets 16 more granules fit, but the 4-bit optimizer none (and
    activation offloading lets fewer than the prefix before it): a prefix that cannot go one
    granule past the longest so far costs one estimate; the answer is the first to reach the
    longest length."""
    def reserved(length, switches):
        reach = 16 * GRANULE * (1 + len(set(switches) - {"adamw-4bit", "offloaded"}))
        return 10**10 if length <= reach else 10**12
    asked_at = answering(monkeypatch, reserved)
    found = longest.walk_lengths(asked(parameters=10**6), report=lambda _: None)
    lengths = [entry.length for entry in found]
    best = max(lengths)
    assert sorted(set(lengths) - {0}) == [length for length in lengths if length]  # each further
    for entry in found:
        if entry.switches is not None and not entry.length:
            assert entry.estimates == 1 and entry.past[1] == 10**12
    assert len(asked_at) == len(set(asked_at))  # no length estimated twice for one prefix
    text = longest.answer_text(asked(), found, ["--model", "M", "--pack"], "80GB", "A100")
    assert text.startswith("The longest sequence that fits in 80GB")
    first = found[lengths.index(best)].link.name  # the cheapest prefix of the longest
    assert f"{best:,} tokens, with {first} and the links before it" in text.splitlines()[0]


def test_a_prefix_after_the_first_draws_its_line_at_the_slope_found_before(monkeypatch):
    """Each prefix frees 3 GB more than the one before and every prefix costs the same bytes a
    token: after the first prefix, each starts from the slope found before and ends in 3
    estimates (one granule past the longest so far, the line's crossing, one granule past it),
    where 4 times the length would have been asked first."""
    question = asked(parameters=10**6)
    number = {tuple(argv_of(switches)): index for index, (_, switches, _)
              in enumerate(longest.links(question)) if switches is not None}
    answering(monkeypatch, lambda length, switches: 60 * 10**9 - 3 * 10**9 * number[switches]
              + 300_000 * length)
    found = [entry for entry in longest.walk_lengths(question, report=lambda _: None)
             if entry.switches is not None]
    assert found[0].estimates > 3
    for entry in found[1:]:
        freed = 3 * 10**9 * number[tuple(argv_of(entry.switches))]
        assert entry.length == (20 * 10**9 + freed) // 300_000 // GRANULE * GRANULE
        assert entry.estimates == 3, entry.link.name


def test_each_prefix_of_the_long_chain_is_a_switch_set_10_trains(combined):
    """The tiled MLP sits where the cost model puts it (in the exact group, by the seconds of one
    more forward of the MLPs), and the offload link keeps the fused loss and the tiles."""
    seconds = {link.name: longest.link_seconds(link, Costs(8 * 10**9, 131072, 32, 4096, 128256,
                                                           mlp_parameters=5.6 * 10**9, length=131072))
               for link in stack.LONG_CHAIN}
    chain = stack.prefixes("causal-lm", seconds, stack.LONG_CHAIN)
    names = [link.name for link, _, _ in chain]
    assert names.index("tiled MLP") < names.index("8-bit AdamW")
    assert seconds["selective checkpointing"] < seconds["tiled MLP"] < seconds["full checkpointing"]
    for link, switches, _ in chain:
        args = combined.parse_args("", ["--task", "causal-lm", *stack.argv_of(switches)],
                                   flags=combined.own_flags)
        assert combined.refusal(args) is None, link.name
    assert dict(chain[-1][1]) == {"--loss": "fused", "--checkpointing": "offloaded",
                                  "--mlp-tiles": "auto", "--offload": True}


@pytest.mark.parametrize("furthest", [stack.LONG_SHARDED_CHAIN[0].name, stack.LONG_SHARDED_CHAIN[-1].name])
def test_on_several_gpus_each_sharded_link_is_walked_and_its_command_launches_them(
        furthest, monkeypatch, combined, tmp_path):
    """--world-size 8: each link of LONG_SHARDED_CHAIN, a whole switch set, in its order,
    estimated as process 0 of 8 (each text split where --sequence-parallel is given: the Fake
    checks it), fitting the GPU less SHARDED_MARGIN; the answer's command launches 8 processes
    with the batch of all of them (the texts a GPU times 8, or 1 text split 8 ways), and 10 takes
    it under torchrun. Here 72.5 GB fits 80 GB but not the margin's 72 GB."""
    reach = {link.name: 8 * GRANULE * (4 ** number) for number, link in
             enumerate(stack.LONG_SHARDED_CHAIN)}
    last = reach[furthest]
    reach = {name: length if length <= last else 0 for name, length in reach.items()}
    split_full, split_offloaded = (link.name for link in stack.LONG_SHARDED_CHAIN[1:3])
    reach[split_offloaded] = min(reach[split_full], last)  # no further than the one before

    def reserved(length, switches):
        link = next(link for link in stack.LONG_SHARDED_CHAIN if switches == tuple(stack.argv_of(link.sets)))
        return 70 * 10**9 if length <= reach[link.name] else 72_500_000_000
    answering(monkeypatch, reserved, world_size=8)
    question = asked(world_size=8, parameters=10**6, positions=64)  # the tiny Llama's
    found = longest.walk_lengths(question, report=lambda _: None)
    assert [entry.link for entry in found] == list(stack.LONG_SHARDED_CHAIN)
    best = max(found, key=lambda entry: entry.length)
    assert best.link.name == furthest and best.length == last
    for entry in found:
        if not entry.length:  # one estimate, a granule past the longest before it
            assert entry.estimates == 1 and entry.past[1] == 72_500_000_000
    folder = write_model(tmp_path / "llama", "Llama")
    config = json.loads((folder / "config.json").read_text())  # heads that split 8 ways
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8}))
    text = longest.answer_text(question, found, ["--task", "causal-lm", "--model", str(folder),
                                                 "--pack"], "80GB", "A100")
    assert f"{last:,} tokens, with {furthest}:" in text.splitlines()[0]
    words = shlex.split(next(line for line in text.splitlines()
                             if line.strip().startswith("torchrun --nproc_per_node=8 10_combined.py")))
    split = "--sequence-parallel" in words
    assert split == furthest.startswith("sequence parallel")
    assert words[words.index("--batch-size") + 1] == ("1" if split else "8")
    assert "interconnect" in next(line for line in text.splitlines() if "a step:" in line)
    monkeypatch.setenv("RANK", "0")  # as torchrun starts process 0
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = combined.parse_args("", words[3:], flags=combined.own_flags)
    assert combined.refusal(args) is None
    (combined.check_split if split else combined.check_batch_split)(args, 8)  # what 10 checks then


def test_texts_are_not_split_over_gpus_that_do_not_divide_the_heads(monkeypatch):
    """32 heads on 6 GPUs: the links that split each text are skipped, said once; the whole-text
    link is asked."""
    asked_at = answering(monkeypatch, lambda length, _: 10**9, world_size=6)
    found = longest.walk_lengths(asked(world_size=6, granule=6 * GRANULE, positions=None),
                                 report=lambda _: None)
    assert [entry.switches is None for entry in found] == [
        longest.splits_texts(link.sets) for link in stack.LONG_SHARDED_CHAIN]
    assert all("32 attention heads do not split over 6 GPUs" in entry.notes[0]
               for entry in found if entry.switches is None)
    assert asked_at and all("--sequence-parallel" not in switches for switches, _ in asked_at)


def test_a_question_whose_texts_are_split_asks_for_the_batch_in_all():
    """Question(shares_texts=True): --sequence-parallel's processes read the same texts, so the
    batch asked is the micro-batch, not the micro-batch a process."""
    from estimate.question import Question
    for shares, expected in ((False, "16"), (True, "2")):
        argv = Question("10_combined.py", ["--sequence-parallel"] if shares else [], 8,
                        accumulates=False, shares_texts=shares).row(2).argv
        assert argv[argv.index("--batch-size") + 1] == expected


@pytest.mark.parametrize("words, said", [
    (["--longest-sequence"], "add --gpu-memory SIZE"),
    (["--gpu-memory", "80GB", "--longest-sequence"], "add --task causal-lm"),
    (["--gpu-memory", "80GB", "--longest-sequence", "0", "--task", "causal-lm"],
     "argument --longest-sequence"),
    (["--gpu-memory", "80GB", "--longest-sequence", "1020", "--task", "causal-lm", "--world-size", "8"],
     "give a granule they divide, such as 2040"),
])
def test_a_longest_sequence_question_asked_wrong_is_one_line(words, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        table_main([*words, "--results-dir", str(tmp_path)])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert said in error and "Traceback" not in error


def test_a_batch_of_one_text_is_asked_of_several_gpus(monkeypatch, tmp_path, capsys):
    """--world-size 8 --batch-size 1: one text a GPU, or one split across them, not a batch that
    must split 8 ways (the table's stack refuses that one)."""
    monkeypatch.setattr(longest, "answer", lambda args, *_, **__: f"asked of {args.stack_world_size} GPUs")
    assert table_main(["--gpu-memory", "80GB", "--longest-sequence", "--task", "causal-lm",
                       "--world-size", "8", "--batch-size", "1", "--results-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("asked of 8 GPUs")


# ---- the command an answer prints ------------------------------------------------------------

@pytest.mark.parametrize("last", ["gradients to host", "offload"])
def test_an_answers_printed_command_parses_and_its_switches_train_a_tiny_model(
        last, monkeypatch, combined, tmp_path, small_snippets):
    """The command printed for an answer past the config's positions (here: the chain up to
    `last` reaches furthest, with the weights on the GPU or in host memory), taken by 10 as
    printed; a tiny Llama of the architecture matrix trains on the CPU with its switches, packed,
    past its config's 64 positions (96 tokens, 3 tiles of 32)."""
    def reserved(length, switches):
        """Each prefix reaches 16 granules a switch word, but `last`'s past any length asked,
        and --offload's not at all where it is not `last`."""
        reach = 16 * GRANULE * len(switches)
        if "--offload" in switches:
            reach = 10**9 if last == "offload" else 0
        elif "--gradients-to-host" in switches and last == "gradients to host":
            reach = 10**9
        return 10**9 if length <= reach else 10**12
    answering(monkeypatch, reserved)
    question = asked(positions=131072)
    found = longest.walk_lengths(question, report=lambda _: None)
    folder = write_model(tmp_path / "llama", "Llama")
    text = longest.answer_text(question, found, ["--task", "causal-lm", "--model", str(folder),
                                                 "--pack"], "80GB", "A100")
    words = shlex.split(next(line for line in text.splitlines()
                             if line.strip().startswith("python 10_combined.py")))
    assert words[words.index("--max-positions") + 1] == words[words.index("--seq-len") + 1]
    args = combined.parse_args("", words[2:], flags=combined.own_flags)
    assert combined.refusal(args) is None and args.pack and args.batch_size == 1
    switches = words[words.index("--max-positions") + 2:]
    assert ("--offload" in switches) == (last == "offload")
    flags = ["--model", str(folder), "--task", "causal-lm", "--pack", "--seq-len", "96",
             "--max-positions", "128", "--batch-size", "2", *switches, *QUICK]
    record, _ = run_script("10", flags, tmp_path, unevaluated("10"))
    assert record["steps"] == 2 and all(math.isfinite(loss) for loss in record["losses"])
