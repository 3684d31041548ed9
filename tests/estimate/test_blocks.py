"""The estimate by blocks (estimate/shortcuts/blocks.py, synthesis.py): three runs of a few periods of
a model's blocks written out to all of them give the bytes of the run of the whole model, which
--exact runs."""
import re

import pytest

from conftest import script_path
from estimate.predict import predict
from estimate.shortcuts import blocks, synthesis
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


# a script of each kind of trace: every micro-batch at once, the step in backward, recomputation,
# offload, the host's optimizer (its gradients sent after backward, or as made), the chunked
# loss, the fused loss (its gradients made in forward), 4 bits, FSDP (plain and checkpointed),
# and the runs that stay whole; the others (02, 03, 04b, 05, 05a, 06, 07a, 08) change dtypes or an
# optimizer's state within these traces' shapes, and were checked on Llama-3.2-1B (the note)
@pytest.mark.parametrize("script, switches", [
    *((step, []) for step in ("01", "04a", "05b", "05c", "05d", "05e", "05f", "05g", "05h", "05i",
                              "07", "07b", "09")),
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
