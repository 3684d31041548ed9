"""The estimate by blocks (estimate/shortcuts/blocks.py, synthesis.py): three runs of a few periods of
a model's blocks written out to all of them give the bytes of the run of the whole model, which
--exact runs."""
import re
from dataclasses import field, make_dataclass
from types import SimpleNamespace

import pytest

from conftest import script_path
from estimate.predict import Row, attempt_run, from_one_probe, predict, record_of, run_for
from estimate.question import Question
from estimate.search.fit import search
from estimate.search.grid import next_size
from estimate.shortcuts import blocks, cache, sizes, synthesis
from steps import STEPS
from support.architecture_matrix import ARCHITECTURES, model_flags, write_model

COMPARED = ("allocated_bytes", "reserved_bytes", "breakdown_bytes", "host_bytes",
            "init_allocated_bytes", "init_reserved_bytes", "parameter_count",
            "model_state_bytes_per_parameter", "batch_size", "accum_steps")
BLOCKS = 6  # per model: probes of 2, 3 and 4 blocks (5 periods of 3 for ModernBERT)
LAYER_COUNTS = ("num_hidden_layers", "n_layers", "n_layer")  # as the configs name it


def deeper(folder, name, blocks_count):
    """The matrix's model `name`, `blocks_count` blocks deep, written to `folder`."""
    model_type, arguments = ARCHITECTURES[name]
    counted = next(key for key in LAYER_COUNTS if key in arguments)
    ARCHITECTURES[name] = (model_type, {**arguments, counted: blocks_count})
    try:
        return write_model(folder, name)
    finally:
        ARCHITECTURES[name] = (model_type, arguments)


@pytest.fixture
def probes_from_three_periods(monkeypatch):
    """Models of 5 periods and more are estimated by blocks (the default waits for 12)."""
    monkeypatch.setattr(blocks, "FEWEST_PERIODS", 3)


def assert_by_blocks_is_whole(script, flags, world_size, blocks_count, period=1):
    by_blocks = predict(script_path(script), flags, world_size=world_size)
    whole = predict(script_path(script), flags, world_size=world_size, exact=True)
    assert {key: by_blocks[key] for key in COMPARED} == {key: whole[key] for key in COMPARED}
    assert whole["blocks"] is None and by_blocks["blocks"] is not None  # not run whole
    assert by_blocks["blocks"][0] == blocks_count and by_blocks["blocks"][1] in [
        [count * period for count in probes] for probes in blocks.PROBES]


@pytest.mark.parametrize("name", [name for name in ARCHITECTURES if name != "ResNet"])
def test_every_architecture_is_estimated_by_blocks_to_the_byte(name, tmp_path,
                                                                probes_from_three_periods):
    period = 3 if name == "ModernBERT" else 1  # its global attention every third block
    count = 5 * period if period > 1 else BLOCKS
    folder = deeper(tmp_path / re.sub(r"\W", "", name.lower()), name, count)
    flags = [*model_flags(folder, name), "--device", "cuda", "--batch-size", "8"]
    assert_by_blocks_is_whole("04", flags, 1, count, period)


# a script of each kind of trace: every micro-batch at once, float16 autocast (its cache of cast
# weights freed in no order of the blocks'), the step in backward, recomputation, offload, the
# host's optimizer (its gradients sent after backward, or as made), the chunked loss, the fused
# loss (its gradients made in forward), 4 bits, FSDP (plain and checkpointed), and the runs that
# stay whole; the others (03, 04b, 05, 05a, 06, 07a, 08) change dtypes or an optimizer's state
# within these traces' shapes, and were checked on Llama-3.2-1B (the note)
@pytest.mark.parametrize("script, switches", [
    *((step, []) for step in ("01", "02", "04a", "05b", "05c", "05d", "05e", "05f", "05g", "05h",
                              "05i", "07", "07b", "09")),
    ("10", ["--accum-steps", "4", "--optimizer", "adamw-8bit", "--checkpointing", "selective",
            "--loss", "chunked"]),
    ("10", ["--optimizer-on-host", "--lora-rank", "4", "--qlora"]),
], ids=lambda value: value if isinstance(value, str) else "-".join(
    flag.removeprefix("--") for flag in value[:8:2]))
def test_every_script_is_estimated_by_blocks_to_the_byte(script, switches, tmp_path,
                                                         probes_from_three_periods):
    folder = deeper(tmp_path / "llama", "Llama", BLOCKS)
    flags = [*model_flags(folder, "Llama"), "--task", "causal-lm", "--device", "cuda",
             "--batch-size", "8", *switches]
    world_size = 2 if STEPS[script].sharded else 1
    assert_by_blocks_is_whole(script, flags, world_size, BLOCKS)


def test_a_sharded_combined_run_of_whole_batches_is_estimated_by_blocks_to_the_byte(
        tmp_path, probes_from_three_periods):
    """10 on 2 processes with one micro-batch a step, as the stack's sharded links are first
    estimated: each block's gradient shard is freed a few events after the head's optimizer
    state is made, two places closer than insertions() used to take (so Llama-3.1-70B's sharded
    links ran whole: 75-120 s each, where their probes take 11-15 s)."""
    folder = deeper(tmp_path / "llama", "Llama", BLOCKS)
    flags = [*model_flags(folder, "Llama"), "--task", "causal-lm", "--device", "cuda",
             "--batch-size", "8", "--accum-steps", "1"]
    assert_by_blocks_is_whole("10", flags, 2, BLOCKS)


def test_a_model_that_does_not_repeat_runs_whole(tmp_path, probes_from_three_periods):
    folder = write_model(tmp_path / "resnet", "ResNet")  # stages of different widths
    record = predict(script_path("04"), ["--model", str(folder), "--device", "cuda"])
    assert record["blocks"] is None and record["allocated_bytes"] > 0


def test_a_model_too_short_to_gain_runs_whole(tmp_path):
    folder = deeper(tmp_path / "llama", "Llama", BLOCKS)  # 6 periods, fewer than 12
    record = predict(script_path("04"), [*model_flags(folder, "Llama"), "--device", "cuda"])
    assert record["blocks"] is None


@pytest.mark.parametrize("one_probe", [True, False], ids=["middle", "two-smaller"])
@pytest.mark.parametrize("script, switches", [
    ("04", []), ("07", []),
    ("10", ["--optimizer", "adamw-8bit", "--checkpointing", "selective", "--loss", "chunked"]),
], ids=["04", "07", "10-8bit-selective-chunked"])
def test_another_size_is_written_from_fewer_probes_to_the_byte(
        script, switches, one_probe, tmp_path, probes_from_three_periods, monkeypatch):
    """A search's later sizes: the middle probe runs at that size (a search's line checks it),
    or the two smaller probes (the smallest the check), and the rules the three probes gave at
    the first size write it out; the same bytes as the whole run. Where the rules do not hold
    at that size, the other probes run too."""
    folder = deeper(tmp_path / "llama", "Llama", BLOCKS)
    world_size = 2 if STEPS[script].sharded else 1

    def row(micro):  # two micro-batches of `micro` samples a process
        flags = [*model_flags(folder, "Llama"), "--task", "causal-lm", "--device", "cuda",
                 "--batch-size", str(2 * micro * world_size), "--accum-steps", "2", *switches]
        return Row(script_path(script), flags, world_size, any_batch_size=True)

    learned = run_for(row(2)).learned
    ran = []
    probe = blocks.run_on_fake_tensors
    monkeypatch.setattr(blocks, "run_on_fake_tensors",
                        lambda *args, **kwargs: ran.append(kwargs["cut"]) or probe(*args, **kwargs))
    written = run_for(row(6), learned, one_probe)
    fewer = learned["periods"][1:2] if one_probe else learned["periods"][:2]
    assert len(ran) == len(fewer) and written.blocks == [BLOCKS, fewer]
    whole = predict(row(6).script, row(6).argv, world_size=world_size, exact=True)
    assert {key: record_of(written)[key] for key in COMPARED} == {key: whole[key] for key in COMPARED}
    if script == "04":  # the middle probe's trace at the first size, an event short
        learned["traces"][1] = learned["traces"][1][:-1]
        again = run_for(row(6), learned, one_probe)
        assert len(ran) == 2 * len(fewer) + 3 - len(fewer) and again.blocks[1] == [2, 3, 4]  # (not again)
        assert {key: record_of(again)[key] for key in COMPARED} == {
            key: whole[key] for key in COMPARED}


def test_a_search_by_blocks_runs_one_probe_at_each_size_after_its_first(tmp_path, monkeypatch,
                                                                         probes_from_three_periods):
    """The search's second size and its check, by blocks: the middle probe alone each, and the
    size written next to the answer is the whole run's to the byte."""
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))
    folder = deeper(tmp_path / "llama", "Llama", BLOCKS)
    flags = [*model_flags(folder, "Llama"), "--task", "causal-lm", "--device", "cuda"]
    question = Question(script_path("04"), flags)
    known = {size: question.estimate(size) for size in (2, 64)}
    capacity = (known[2][1] + known[64][1]) // 2  # the answer between the runs
    question = Question(script_path("04"), flags)
    found = search(question, capacity, known)
    assert found.problem is None and found.not_by_sizes is None and found.estimated == 1
    assert [question.runs[size].blocks[1] for size in (2, 64, found.largest)] == [[2, 3, 4], [3], [3]]
    beyond = next_size(found.largest)
    written = record_of(question.line.written(beyond))
    assert found.tried[found.largest][1] <= capacity < written["reserved_bytes"]
    row = question.row(beyond)
    exact = predict(row.script, row.argv, any_batch_size=True, exact=True)
    assert {key: written[key] for key in COMPARED[:-2]} == {key: exact[key] for key in COMPARED[:-2]}
    # the run of all three probes gone from the folder, the sizes run from one are not found:
    # no line would go through a run to check them
    (cache.folder() / f"{cache.key(question.row(2), False)}.kept").unlink()
    later = Question(script_path("04"), flags)
    assert later.found({}, 4096) == {} and later.runs == {} and later.one_probe


def test_a_line_of_two_sizes_through_a_run_of_one_probe_is_checked_where_the_answer_was_run(
        tmp_path, monkeypatch, probes_from_three_periods):
    """As the stack's walk searches up to its batch: the far size is the cap, run from the middle
    probe alone, and fits; the answer and the sizes about it were run, but a line of two sizes
    checks nothing, so a size halfway is run as the check."""
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))
    folder = deeper(tmp_path / "llama", "Llama", BLOCKS)
    flags = [*model_flags(folder, "Llama"), "--task", "causal-lm", "--device", "cuda"]
    question = Question(script_path("04"), flags)
    known = {2: question.estimate(2)}
    question = Question(script_path("04"), flags)
    found = search(question, 10**12, known, cap=16, per_sample=1)
    assert found.problem is None and found.not_by_sizes is None and found.largest == 16
    assert {size: question.runs[size].blocks[1] for size in question.runs} == {
        2: [2, 3, 4], 16: [3], 9: [3]}
    row = question.row(16)
    exact = predict(row.script, row.argv, any_batch_size=True, exact=True)
    assert found.tried[16] == (exact["allocated_bytes"], exact["reserved_bytes"])


def test_bytes_of_the_blocks_and_the_size_together_run_every_probe_again(tmp_path, monkeypatch,
                                                                         probes_from_three_periods):
    """A storage of 16 bytes a block and a sample, 512 at least (a count the code rounds up): at 2
    samples the three probes and the 6 blocks hold 512 (the rules hold), at 64 the middle probe
    3,072 bytes and the 6 blocks 6,144, which one probe cannot show. The sizes run make no line,
    so the sizes run from one probe are forgotten and those the search then tries run from two
    (whose check fails: then from three, whose check fails too: the model runs whole), and every
    figure the search answers with is the whole run's."""
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))
    folder = deeper(tmp_path / "llama", "Llama", BLOCKS)
    source = script_path("04").read_text()
    line = "        loss.backward()\n"
    planted = tmp_path / "04_planted.py"
    held = ("        held = torch.empty(max(128, len(micro_labels) * model.config.num_hidden_layers * 4), "
            "device=micro_labels.device)\n")
    planted.write_text(source.replace(line, line + held, 1))
    assert planted.read_text() != source
    flags = [*model_flags(folder, "Llama"), "--task", "causal-lm", "--device", "cuda"]
    question = Question(planted, flags)
    known = {size: question.estimate(size) for size in (2, 64)}
    assert [question.runs[size].blocks for size in (2, 64)] == [[BLOCKS, [2, 3, 4]], [BLOCKS, [3]]]
    capacity = (known[2][1] + known[64][1]) // 2
    question = Question(planted, flags)
    found = search(question, capacity, known)
    assert found.problem is None and found.not_by_sizes and 2 < found.largest < 64
    assert not question.one_probe and set(found.tried) > {2}
    for size, figures in found.tried.items():
        row = question.row(size)
        kept, _, _ = attempt_run(row, run=False)
        assert kept is not None and not from_one_probe(kept)
        exact = predict(row.script, row.argv, any_batch_size=True, exact=True)
        assert (size, figures) == (size, (exact["allocated_bytes"], exact["reserved_bytes"]))


def sized_trace(count, size, tally=0):
    """Creation, a forward of `count` blocks (an activation of 64 bytes a sample each), their
    backward in reverse; with `tally`, a storage of `tally` bytes a block and a sample, in
    units of 64 bytes at least (a tally of the blocks' outputs, rounded as MemTracker does)."""
    events, number = [("alloc", 0, 8, "cpu", "Parameter")], 1
    if tally:
        events.append(("alloc", number, max(64, tally * count * size), "cpu", "Temporary"))
        number += 1
    for _ in range(count):
        events.append(("alloc", number, 64 * size, "cpu", "Activation"))
        number += 1
    return events + [("free", storage) for storage in range(number - 1, 0, -1)]


def test_another_size_is_written_from_its_middle_probe_by_the_first_sizes_rules():
    smaller = [sized_trace(2, 1), sized_trace(3, 1)]
    for checked_by in (None, sized_trace(2, 5)):  # the line of sizes, or the smaller probe
        written = synthesis.extend_at_another_size(smaller, [2, 3, 4], 9, sized_trace(3, 5), checked_by)
        assert synthesis.renumbered(written) == synthesis.renumbered(sized_trace(9, 5))
    other = sized_trace(3, 5)[:-1]  # an event fewer at this size: refused
    with pytest.raises(synthesis.NotByBlocks, match="other events"):
        synthesis.extend_at_another_size(smaller, [2, 3, 4], 9, other, None)
    unlike = sized_trace(3, 5)
    unlike[2] = ("alloc", 2, 65 * 5, "cpu", "Activation")  # one copy's bytes off the others'
    with pytest.raises(synthesis.NotByBlocks, match="copies differ"):
        synthesis.extend_at_another_size(smaller, [2, 3, 4], 9, unlike, None)


def test_bytes_that_grow_with_the_blocks_only_past_the_first_size_are_caught_by_the_smaller_probe():
    """A storage of 7 bytes a block and a sample, 64 at least: at one sample the probes of 2, 3
    and 4 blocks hold 64 bytes each (the rules hold, checked), at 5 samples 70 and 105. The
    middle probe alone would write 105 bytes for 9 blocks (315); the smaller probe is the check."""
    three = [sized_trace(count, 1, tally=7) for count in (2, 3, 4)]
    assert synthesis.renumbered(synthesis.extend(three, [2, 3, 4], 9)) == synthesis.renumbered(
        sized_trace(9, 1, tally=7))
    with pytest.raises(synthesis.NotByBlocks, match="smallest probe"):
        synthesis.extend_at_another_size(three[:2], [2, 3, 4], 9, sized_trace(3, 5, tally=7),
                                         sized_trace(2, 5, tally=7))


def test_bytes_that_grow_with_the_blocks_only_past_the_first_size_break_the_line_of_sizes():
    """A storage of 3 bytes a block and a sample, 64 at least: at 2 samples the probes of 2, 3
    and 4 blocks hold 64 bytes each (the rules hold, checked, and 9 blocks hold 64 too), at 8
    and 12 samples the middle probe holds 72 and 108, which it writes for 9 blocks (216 and 324).
    No probe at those sizes shows it; the three sizes are no line of traces, so the search runs
    its sizes from all three probes instead (as the test before shows on a script)."""
    three = [sized_trace(count, 2, tally=3) for count in (2, 3, 4)]
    first = synthesis.extend(three, [2, 3, 4], 9)
    assert synthesis.renumbered(first) == synthesis.renumbered(sized_trace(9, 2, tally=3))
    later = {size: synthesis.extend_at_another_size(three[:2], [2, 3, 4], 9,
                                                    sized_trace(3, size, tally=3), None)
             for size in (8, 12)}
    assert later[8] != synthesis.renumbered(sized_trace(9, 8, tally=3))  # (not seen by one size)

    fields = ["events", *[(name, object, None) for name in (*sizes.SAME, "unfused_events", "batch_bytes")],
              ("size_choices", tuple, ()), ("blocks", tuple, (9, (3,))),
              ("record", dict, field(default_factory=dict))]
    kept = make_dataclass("Kept", fields)  # a KeptRun's fields that a Family reads

    assert sizes.Family({2: kept(first), 8: kept(later[8])})  # two sizes: a line, unchecked
    with pytest.raises(sizes.NotBySizes):
        sizes.Family({2: kept(first), 8: kept(later[8]), 12: kept(later[12])})


def test_frees_in_the_order_of_a_hash_table_are_written_in_the_order_of_their_storages():
    """float16 autocast, in small: each block's forward casts its two weights (kept in a cache),
    and leaving autocast frees the cache in the order of a hash table of their addresses, which
    no count of blocks repeats. As run, no rule names the storages alike; each run of frees in
    the order of its storages (the same replay), the probes write the whole model."""
    def trace(count):
        events, number = [("alloc", 0, 8, "cpu", "Parameter")], 1
        for _ in range(count):
            events += [("alloc", number, 16, "cpu", "Autocast"), ("alloc", number + 1, 32, "cpu", "Autocast")]
            number += 2
        cast = sorted(range(1, number), key=lambda storage: storage * 2654435761 % 2**32)
        return events + [("free", storage) for storage in cast] + [("alloc", number, 4, "cpu", "Loss")]

    def probe(count):
        return SimpleNamespace(trace=SimpleNamespace(events=trace(count)), creation_events=slice(0, 1))

    with pytest.raises(synthesis.NotByBlocks):
        synthesis.extend([trace(count) for count in (2, 3, 4)], [2, 3, 4], 9)
    written = synthesis.extend([blocks.marked(probe(count)) for count in (2, 3, 4)], [2, 3, 4], 9)
    assert synthesis.renumbered(written) == synthesis.renumbered(blocks.marked(probe(9)))


def test_a_trace_the_rules_do_not_write_is_refused():
    """The check: the largest probe, which the rules are not learned from, must be what they
    write, event for event; here its last block frees one storage too few."""
    def trace(count):  # creation, a forward of `count` blocks, their backward in reverse
        events, number = [("alloc", 0, 8, "cpu", "Parameter")], 1
        for _ in range(count):
            events.append(("alloc", number, 64, "cpu", "Activation"))
            number += 1
        events += [("free", storage) for storage in range(number - 1, 0, -1)]
        return events

    written = synthesis.extend([trace(2), trace(3), trace(4)], [2, 3, 4], 9)
    assert synthesis.renumbered(written) == synthesis.renumbered(trace(9))
    broken = trace(4)[:-1]
    with pytest.raises(synthesis.NotByBlocks):
        synthesis.extend([trace(2), trace(3), broken], [2, 3, 4], 9)


def test_a_region_found_a_few_events_late_starts_where_its_copies_mean_the_same(monkeypatch):
    """Adafactor's step, in small: each block's step replaces what two variables hold (freeing
    the block before's), and the final norm's, after the last block, begins as a block's does
    but replaces the other. Found by sizes, each copy would end with the next block's first
    events, and the last copy with the final norm's, which free another storage: the region
    then starts earlier, and the whole trace is written (refused without moving it)."""
    def trace(count):
        events = [("alloc", 0, 8, "cpu", "Parameter"), ("alloc", 1, 4, "cpu", "Optstate"),
                  ("alloc", 2, 4, "cpu", "Optstate")]
        first, second, number = 1, 2, 3
        for _ in range(count):
            events += [("alloc", number, 4, "cpu", "Optstate"), ("free", first),
                       ("alloc", number + 1, 4, "cpu", "Optstate"), ("free", second)]
            first, second, number = number, number + 1, number + 2
        return events + [("alloc", number, 4, "cpu", "Optstate"), ("free", second),
                         ("free", first), ("free", number)]

    written = synthesis.extend([trace(2), trace(3), trace(4)], [2, 3, 4], 9)
    assert synthesis.renumbered(written) == synthesis.renumbered(trace(9))
    monkeypatch.setattr(synthesis, "movable", lambda *args: False)
    with pytest.raises(synthesis.NotByBlocks, match="named differently"):
        synthesis.extend([trace(2), trace(3), trace(4)], [2, 3, 4], 9)


def test_a_region_found_late_moves_where_another_region_frees_its_storages(monkeypatch):
    """Found late in forward, seen from backward: each block's backward frees a storage its own
    forward made and one the next block's made (after the last block, the head's). The rule
    that fails is backward's, the region to move forward's, which made the storages: both are
    named, and the first that can move does (refused if only backward's were named)."""
    def trace(count):
        events, made, number = [("alloc", 0, 8, "cpu", "Parameter")], [], 1
        for _ in range(count):  # forward: a block makes a storage of 4 bytes and one of 2
            events += [("alloc", number, 4, "cpu", "Activation"),
                       ("alloc", number + 1, 2, "cpu", "Activation")]
            made.append((number, number + 1))
            number += 2
        head, loss = number, number + 1  # the head starts as a block does, with 4 bytes
        events += [("alloc", head, 4, "cpu", "Activation"), ("alloc", loss, 4, "cpu", "Activation")]
        events += [("alloc", number + 2 + size, 64 + size, "cpu", "Temp") for size in range(20)]
        events += [("free", number + 2 + size) for size in range(20)]  # (the head's own work)
        for index in reversed(range(count)):
            events += [("free", made[index][1]),
                       ("free", loss if index == count - 1 else made[index + 1][0])]
        return events + [("free", head), ("free", made[0][0])]

    written = synthesis.extend([trace(2), trace(3), trace(4)], [2, 3, 4], 9)
    assert synthesis.renumbered(written) == synthesis.renumbered(trace(9))
    learn = synthesis.learn

    def naming_the_failing_events_region_only(probes):
        try:
            return learn(probes)
        except synthesis.NoRule as problem:
            problem.regions = problem.regions[:1]
            raise
    monkeypatch.setattr(synthesis, "learn", naming_the_failing_events_region_only)
    with pytest.raises(synthesis.NotByBlocks, match="named differently"):
        synthesis.extend([trace(2), trace(3), trace(4)], [2, 3, 4], 9)


def test_a_unit_followed_within_a_few_events_by_another_is_found(monkeypatch):
    """Llama-3.1-70B's step under FSDP and 8-bit AdamW, in small: each block's temporary is made,
    its optimizer state in turn, then the head's, and two events later each block's temporary is
    freed: three places where a block adds events, each closer to the next than the 16 events
    insertions() asked to agree after one (refused so before, and the model then ran whole);
    with too few tries allowed, refused in words."""
    def trace(count):
        events = [("alloc", 0, 8, "cpu", "Parameter")]
        temporaries = list(range(1, count + 1))
        events += [("alloc", number, 32, "cpu", "Temp") for number in temporaries]
        number = count + 1
        for _ in range(count):  # each block's state: two storages of different sizes
            events += [("alloc", number, 64, "cpu", "OptState"),
                       ("alloc", number + 1, 4, "cpu", "OptState")]
            number += 2
        events += [("alloc", number, 1000, "cpu", "OptState"), ("alloc", number + 1, 2, "cpu", "OptState")]
        events += [("free", storage) for storage in temporaries]
        return events + [("alloc", number + 2 + size, 128 + size, "cpu", "Temp") for size in range(20)]

    shapes = [synthesis.signatures(trace(count)) for count in (3, 4)]
    assert [length for _, length in synthesis.insertions(*shapes)] == [1, 2, 1]
    written = synthesis.extend([trace(2), trace(3), trace(4)], [2, 3, 4], 9)
    assert synthesis.renumbered(written) == synthesis.renumbered(trace(9))
    monkeypatch.setattr(synthesis, "MOST_TRIES", 2)
    with pytest.raises(synthesis.NotByBlocks, match="too many ways"):
        synthesis.insertions(*shapes)
