"""Steps 07-09 with two processes on CPU (gloo): sharding, offload and checkpointing as claimed.

Each training run starts two processes under torchrun, in float32, through tests/support/fsdp_probe.py,
which notes what every process holds; a run is shared by the tests that read it. The bad-input
tests start the two processes themselves, with the environment torchrun gives its workers, to
see each one's exit code and message. Every test that starts processes has a timeout, and a run
that outlives its own is killed with all its processes.

The estimate of a sharded run is checked against what each process measured: 07-09, and 10 with
each link of the stack's sharded chain, in one launch through tests/support/sharded_runs.py (as
the scripts train, in bfloat16), which waits for gloo's worker threads to let go of each
collective's tensors, so that the count does not hang on their timing.
"""
import gc
import json
import math
import os
import re
import socket
import subprocess
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch

from common.evaluate import evaluate
from common.model import create_model, transformer_blocks
from common.presets import PRESETS
from conftest import (
    PROBED_TEST_TIMEOUT,
    QUICK,
    ROOT,
    SHARDED_RUN,
    TEXT,
    WORLD_SIZE,
    assert_follows,
    launched_runs,
    load_script,
    model_state_bytes,
    one_process_fp32,
    script_path,
    stop,
)
from estimate.predict import predict
from estimate.question import Question
from estimate.stack import SHARDED_CHAIN, WEIGHT_BYTES, argv_of, resident_bytes
from support.architecture_matrix import model_flags, write_model
from tour.records import RECORD_FIELDS


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_two_processes_follow_the_loss_of_one_with_the_same_global_batch(probed_runs, unsharded):
    sharded, single = probed_runs("07").record, unsharded
    assert sharded["world_size"] == 2 and sharded["steps"] == single["steps"] == 3
    assert sharded["batch_size"] == single["batch_size"]
    assert_follows(sharded["losses"], single["losses"])
    assert len(set(single["losses"])) == 3  # the loss moves, so following it means something
    # each process evaluates half of the test set: the counts of both make the accuracy of one
    assert sharded["test_samples"] == single["test_samples"] == 360
    assert sharded["test_accuracy"] == single["test_accuracy"]


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_two_processes_follow_one_on_text(probed_runs, small_snippets, tmp_path):
    """tiny-text: token ids and padding masks sliced across processes, a pretrained model's
    weights filled into the shards from process 0's copy."""
    sharded = probed_runs("07", TEXT).record
    single = one_process_fp32("06", tmp_path, TEXT)
    assert sharded["preset"] == single["preset"] == "tiny-text"
    assert sharded["world_size"] == 2 and sharded["steps"] == single["steps"] == 2
    assert_follows(sharded["losses"], single["losses"], "tiny-text")


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_each_process_trains_on_its_own_half_of_every_batch(probed_runs):
    batches = [run["batches"] for run in probed_runs("07").ranks]
    assert [len(seen) for seen in batches] == [3, 3]
    for first, second in zip(*batches):
        assert first["size"] == second["size"] == PRESETS["tiny"].batch_size // WORLD_SIZE
        assert first["input_sum"] != second["input_sum"]  # different samples


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_each_process_holds_about_half_of_every_parameter(probed_runs):
    runs = probed_runs("07").ranks
    names = runs[0]["shards"].keys()
    for name in names:
        held = [run["shards"][name][0] for run in runs]
        whole, rows = runs[0]["shards"][name][1:]
        assert sum(held) == whole, name  # the shards add up to the parameter, no copy twice
        row = whole // rows
        assert all(part <= -(-rows // WORLD_SIZE) * row for part in held), (name, held)
    totals = [sum(run["shards"][name][0] for name in names) for run in runs]
    whole_model = sum(runs[0]["shards"][name][1] for name in names)
    assert all(abs(total - whole_model / 2) < 0.01 * whole_model for total in totals), totals


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
@pytest.mark.parametrize("name, tied", [("Llama", False), ("GPT-2", True)])
def test_the_token_embeddings_are_a_unit_of_their_own_unless_tied(name, tied, probed_runs,
                                                                  tmp_path_factory):
    """FSDP2 does not reshard the root unit after forward: token embeddings left in it would stay
    gathered from forward to the end of backward. 07 shards them as their own unit, freed after
    forward as a block is (torchtitan's way), unless the output layer shares their weight (a
    weight belongs to one unit: tied, they stay in the root with the head). A decoder of the
    architecture matrix with its own output layer (Llama) and one tied to its embeddings (GPT-2),
    under causal-lm, each process noting after the first forward."""
    folder = write_model(tmp_path_factory.mktemp("embeddings") / name.lower(), name)
    run = probed_runs("07", (*model_flags(folder, name), "--task", "causal-lm", "--data", "synthetic",
                             "--batch-size", "4"))
    for rank in run.ranks:
        assert rank["embeddings_after_forward"] == {
            "tied": tied, "own_unit": not tied, "in_root": tied, "gathered": tied}


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_the_record_carries_every_process_peak_and_the_highest(probed_runs):
    record = probed_runs("07").record
    peaks = record["rank_peak_memory_bytes"]
    assert len(peaks) == 2 and all(peak > 0 for peak in peaks)
    assert record["peak_memory_bytes"] == max(peaks)
    assert sum(record["breakdown_bytes"].values()) == record["peak_memory_bytes"]
    present = {name: when for name, (when, _) in RECORD_FIELDS.items()}
    assert {present.get(name) for name in record} == {"always", "several processes"}
    assert {name for name, when in present.items() if when in ("always", "several processes")
            } == record.keys()
    assert record["breakdown_bytes"]["optimizer_state"] == 0  # plain SGD keeps none


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_model_state_per_parameter_counts_a_process_share_of_the_whole_model(probed_runs,
                                                                             unsharded):
    record = probed_runs("07").record
    assert record["parameter_count"] == unsharded["parameter_count"]  # whole, not one shard
    model_state = model_state_bytes(record["breakdown_bytes"])  # the highest peak's process's
    assert record["model_state_bytes_per_parameter"] == model_state / (
        record["parameter_count"] / WORLD_SIZE)


class GivenLogits(torch.nn.Module):
    """A classifier of 3 classes whose logits come with its inputs."""
    config = SimpleNamespace(num_labels=3)

    def forward(self, logits):
        return SimpleNamespace(logits=logits)


def batches_of(predictions, labels):
    """One evaluation batch (inputs, labels): logits that predict `predictions`."""
    logits = torch.nn.functional.one_hot(torch.tensor(predictions), 3).float()
    return [({"logits": logits}, torch.tensor(labels))]


# process 0 gets 3 samples, all right; process 1 gets 5, one right: 4 of 8 (a mean of the two
# processes' accuracies would give 60%)
UNEVEN_SHARES = [batches_of([0, 1, 2], [0, 1, 2]), batches_of([0, 2, 0, 0, 0], [0, 1, 2, 1, 1])]


def evaluate_in_group(rank, init_file, out_dir):
    """Process `rank` of 2 evaluates its share of UNEVEN_SHARES; writes what it got."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2)
    try:
        accuracy = evaluate(GivenLogits(), UNEVEN_SHARES[rank], torch.device("cpu"))
    finally:
        torch.distributed.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps([accuracy, accuracy.samples]))


def test_accuracy_is_the_share_of_samples_whose_highest_logit_is_their_label():
    """torchmetrics' micro-averaged count, over batches of classes seen unevenly (a macro average,
    torchmetrics' default, would weigh each class's accuracy alike instead: 0.5 here)."""
    generator = torch.Generator().manual_seed(0)
    batches = [({"logits": torch.randn(size, 3, generator=generator)},
                torch.randint(0, 3, (size,), generator=generator)) for size in (5, 7, 4)]
    correct = sum(int((inputs["logits"].argmax(-1) == labels).sum()) for inputs, labels in batches)
    batches += batches_of([0, 0, 0, 0, 1], [0, 0, 0, 0, 0])  # class 0: 4 of 5 right
    found = evaluate(GivenLogits(), batches, torch.device("cpu"))
    assert (found, found.samples) == ((correct + 4) / 21, 21)


@pytest.mark.timeout(120)
def test_accuracy_counts_every_sample_of_processes_that_saw_different_numbers(tmp_path):
    alone = evaluate(GivenLogits(), [pair for share in UNEVEN_SHARES for pair in share],
                     torch.device("cpu"))
    assert (alone, alone.samples) == (0.5, 8)
    torch.multiprocessing.spawn(evaluate_in_group, args=(tmp_path / "init", tmp_path), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [0.5, 8]


@pytest.mark.timeout(300)
def test_plain_python_runs_as_one_process(unsharded, tmp_path):
    record = one_process_fp32("07", tmp_path)
    assert not torch.distributed.is_initialized()  # the group of one is gone again
    assert record["world_size"] == 1
    assert record["rank_peak_memory_bytes"] == [record["peak_memory_bytes"]]
    assert_follows(record["losses"], unsharded["losses"])


def watching_model_and_group(name):
    """The script, and a list that gets weak references to its model and its process group."""
    script, alive = load_script(name), []

    class WatchingMeter(script.MemoryMeter):
        def __init__(self, device, model, optimizer, **options):
            super().__init__(device, model, optimizer, **options)
            alive.extend([weakref.ref(model), weakref.ref(torch.distributed.group.WORLD)])

    script.MemoryMeter = WatchingMeter
    return script, alive


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["07", "08", "09"])
def test_neither_the_sharded_model_nor_the_group_outlives_the_run(name, tmp_path):
    """A process group that outlives the run keeps gloo's worker threads alive: one that
    releases a finished collective's tensors while Python shuts down aborts the process at exit
    (SIGABRT, about 2 in 100 two-process runs on a loaded machine). The abort is rare; the group
    outliving the run is not: held by the sharded model (a reference cycle, and kept for good by
    the memory tracker's leftover hooks) and by DTensor's caches."""
    script, alive = watching_model_and_group(name)
    gc.disable()  # what the run leaves must be gone when it returns, not at some later collection
    try:
        script.main([*SHARDED_RUN, "--results-dir", str(tmp_path)])
        model, group = alive
        assert model() is None, "the sharded model outlives the run"
        assert group() is None, "the process group outlives the run"
    finally:
        gc.enable()


@pytest.mark.timeout(300)
def test_a_run_that_fails_leaves_neither_the_model_nor_the_group_behind(tmp_path):
    script, alive = watching_model_and_group("07")

    def failing_evaluation(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    script.evaluate = failing_evaluation
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="evaluation failed") as failure:
            script.main([*SHARDED_RUN, "--accum-steps", "2", "--results-dir", str(tmp_path)])
        model, group = alive
        assert model() is None and group() is None
        assert "failing_evaluation" in str(failure.traceback[-1])  # the traceback still says where
    finally:
        gc.enable()


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_offload_keeps_parameters_gradients_and_optimizer_state_on_cpu(probed_runs):
    for run in probed_runs("08").ranks:  # a --device cpu run: nothing pinned, also where CUDA exists
        assert run["offload"] == [[True, False]]  # every parameter, as FSDP holds it
        assert all(seen == {"parameters": ["cpu"], "optimizer_state": []}  # SGD: no state
                   for seen in run["between_steps"])
        assert len(run["between_steps"]) == 3
        assert all(seen["gradients"] == ["cpu"] and seen["gradient_count"] == len(run["shards"])
                   for seen in run["in_optimizer_step"])
    for run in probed_runs("07").ranks:  # the same probe sees 07 not offloading
        assert run["offload"] == [[False, False]]


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_offload_trains_like_sharding_alone(probed_runs):
    assert_follows(probed_runs("08").record["losses"], probed_runs("07").record["losses"])


def without_wrapper(gradients):
    """Parameter names as they are without 09's CheckpointedBlock (which adds `.block`)."""
    return {name.replace(".block.", "."): gradient for name, gradient in gradients.items()}


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_checkpointing_leaves_gradients_and_losses_exactly_as_they_were(probed_runs):
    """Bit for bit in float32: the rerun computes the very same activations."""
    plain, checkpointed = probed_runs("08"), probed_runs("09")
    assert any(".block." in name for name in checkpointed.gradients[0])  # wrapped
    for before, after in zip(plain.gradients, checkpointed.gradients):
        after = without_wrapper(after)
        assert before.keys() == after.keys()
        assert any(gradient.abs().sum() > 0 for gradient in before.values())
        for name, gradient in before.items():
            assert torch.equal(after[name], gradient), name
    assert checkpointed.record["losses"] == plain.record["losses"]


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_checkpointing_lowers_the_activations_at_the_peak(probed_runs):
    plain, checkpointed = probed_runs("08").record, probed_runs("09").record
    activations = [record["breakdown_bytes"]["activations"] for record in (plain, checkpointed)]
    assert activations[1] < activations[0], activations
    assert checkpointed["peak_memory_bytes"] < plain["peak_memory_bytes"]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ranks(script, argv, world_size):
    """Start `world_size` processes of `script` with the environment torchrun gives its workers."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        processes.append(subprocess.Popen(
            [sys.executable, script_path(script), *argv], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
    return processes


@pytest.mark.timeout(150)
@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "1", "--accum-steps", "1"], "2 processes share batches of 1 (--batch-size)"),
    (["--batch-size", "8", "--accum-steps", "8"], "gets 4 samples, not divisible by 8"),
])
def test_bad_split_stops_every_process_with_a_message(argv, message, tmp_path):
    processes = start_ranks("07", [*argv, "--device", "cpu", "--results-dir", str(tmp_path)],
                            WORLD_SIZE)
    try:
        outputs = [process.communicate(timeout=60) for process in processes]  # fails in ~10 s
    except subprocess.TimeoutExpired:
        pytest.fail("a process still waits: the bad split hangs instead of stopping")
    finally:
        for process in processes:
            stop(process)
    for rank, (process, (stdout, stderr)) in enumerate(zip(processes, outputs)):
        assert process.returncode == 1, (rank, stderr)
        assert message in stderr and "--batch-size" in stderr, (rank, stderr)
        assert "Traceback" not in stderr, (rank, stderr)  # a message, not a crash
    assert not list(tmp_path.iterdir())  # nothing trained, nothing recorded


def test_an_evaluation_batch_too_small_to_split_stops_with_a_message():
    from common.data import make_loader
    samples = list(range(10))  # batches of 4: the last one holds 2, too few for 4 processes
    with pytest.raises(SystemExit, match="fewer than the 4 processes"):
        make_loader(samples, batch_size=4, shuffle=False, rank=0, world_size=4)
    # where the last batch can be split, every process gets as many batches and all samples
    per_rank = [list(make_loader(samples, batch_size=4, shuffle=False, rank=rank,
                                 world_size=2).sampler) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 3 and all(map(all, zip(*per_rank)))
    assert sorted(i for batches in per_rank for batch in batches for i in batch) == samples


KEEP_GATHERED = ["--reshard-after-forward", "false"]


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_keeping_the_gathered_weights_to_backward_trains_alike_and_holds_more(probed_runs):
    """--reshard-after-forward false (ZeRO-2's memory): the same math, fewer gathers, and the
    gathered weights of the blocks held from forward to backward."""
    freed, kept = probed_runs("07"), probed_runs("07", KEEP_GATHERED)
    assert (freed.record["reshard_after_forward"], kept.record["reshard_after_forward"]) == (
        True, False)
    assert_follows(kept.record["losses"], freed.record["losses"])
    for before, after in zip(freed.gradients, kept.gradients):  # each process's, by name
        assert before.keys() == after.keys()
        for name in before:
            assert_follows(after[name], before[name], what=name)
    # float32, 4 blocks: freed holds one block's whole weights gathered (two while the next is
    # fetched); kept holds every block's at the end of forward, less its own half of each
    block_bytes = 4 * sum(param.numel() for param in
                          transformer_blocks(create_model(PRESETS["tiny"]))[0].parameters())
    more = (kept.record["breakdown_bytes"]["parameters"]
            - freed.record["breakdown_bytes"]["parameters"])
    assert more >= block_bytes, (more, block_bytes)
    assert kept.record["peak_memory_bytes"] > freed.record["peak_memory_bytes"]


def test_the_estimate_predicts_the_kept_weights_too():
    from estimate.predict import predict
    freed, kept = (predict(script_path("07"), ["--preset", "article", "--device", "cuda",
                                               "--batch-size", "4", "--accum-steps", "1",  # quicker
                                               "--reshard-after-forward", value], world_size=4)
                   for value in ("true", "false"))
    whole_blocks_bf16 = 24 * 12.6e6 * 2  # ViT-L/16: 24 blocks of 12.6M parameters, 2 bytes
    more = kept["breakdown_bytes"]["parameters"] - freed["breakdown_bytes"]["parameters"]
    assert 0.8 * whole_blocks_bf16 < more < whole_blocks_bf16  # every block's, less a share


@pytest.mark.parametrize("script, value", [("06", "false"), ("07", "maybe")])
def test_the_flag_is_07_to_09s_and_takes_true_or_false(script, value, capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script(script).main(["--reshard-after-forward", value, "--estimate"])
    assert stopped.value.code == 2
    assert "--reshard-after-forward" in capsys.readouterr().err


def test_each_allocator_figure_is_its_own_highest_over_the_processes(monkeypatch):
    """On CUDA one process may reserve the most while another allocates the most: each figure
    of the record is the highest of its kind, and every process's is kept."""
    import common.memory
    ranks = [{"peak_memory_bytes": 900, "breakdown_bytes": {"parameters": 900},
              "cuda_max_allocated_bytes": 1000, "cuda_max_reserved_bytes": 4000},
             {"peak_memory_bytes": 800, "breakdown_bytes": {"parameters": 800},
              "cuda_max_allocated_bytes": 1200, "cuda_max_reserved_bytes": 3000}]
    monkeypatch.setattr(common.memory, "every_process", lambda result: ranks)
    record = common.memory.highest_over_processes(ranks[0])
    assert record["peak_memory_bytes"] == 900 and record["breakdown_bytes"] == {"parameters": 900}
    assert record["cuda_max_allocated_bytes"] == 1200 and record["cuda_max_reserved_bytes"] == 4000
    assert record["rank_cuda_max_allocated_bytes"] == [1000, 1200]
    assert record["rank_cuda_max_reserved_bytes"] == [4000, 3000]


def test_creation_is_measured_after_earlier_garbage_is_freed():
    """An earlier model kept by a reference cycle (optimizer, hooks, meter) is freed before the
    creation window opens, not inside it, where on CUDA it would lower the creation peak."""
    from common.memory import measure_creation

    class Cycle:
        pass
    earlier = Cycle()
    earlier.self, earlier.weights = earlier, torch.zeros(1000)
    freed = weakref.ref(earlier)
    del earlier
    with measure_creation(torch.device("cpu")):
        assert freed() is None


@pytest.mark.parametrize("backend, failed, ended_by", [
    ("nccl", True, "abort"), ("nccl", False, "destroy"), ("gloo", True, "destroy")])
def test_a_failed_nccl_process_aborts_its_group_instead_of_waiting(backend, failed, ended_by,
                                                                    monkeypatch):
    """On NCCL a process that failed alone must not wait for collectives the others never join
    (destroy_process_group waits for queued work); gloo has no abort."""
    import torch.distributed as dist

    import common.distributed
    called = []
    monkeypatch.setattr(dist, "get_backend", lambda *args: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *args: called.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda *args: called.append("abort"))
    if failed:
        try:
            raise RuntimeError("a collective's input was wrong")
        except RuntimeError:
            common.distributed.end_distributed()
    else:
        common.distributed.end_distributed()
    assert called == [ended_by]


def test_the_group_waits_long_enough_for_process_0_to_load_the_weights(monkeypatch):
    """Under torchrun the others wait in the first broadcast while process 0 loads (maybe
    downloads) the model: the group's time-out is longer than NCCL's default 10 minutes."""
    from datetime import timedelta

    import torch.distributed as dist

    import common.distributed
    asked = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: asked.update(kwargs))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    common.distributed.init_distributed(torch.device("cpu"))
    assert asked["timeout"] >= timedelta(minutes=30)


# ---- the estimate of a sharded run, process by process ------------------------------------------

# A grouped-query decoder (4 query heads, 2 key/value heads) whose vocabulary (257 rows) does not
# split evenly, from its config alone, trained on synthetic token ids: one text of 8 tokens a
# micro-batch a process, so that the weights, their gathers and their reduce-scatters make the
# peak rather than the activations (under checkpointing a reduce-scatter's own copy of its input,
# on the CPU, then sets it).
GQA_LLAMA = dict(model_type="llama", vocab_size=257, hidden_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                 max_position_embeddings=64, pad_token_id=0)
GQA_RUN = ["--data", "synthetic", "--task", "causal-lm", "--seq-len", "8", "--epochs", "1",
           "--max-steps", "2", "--device", "cpu"]
MICRO_BATCH = 1  # samples a process, a micro-batch


def chain_flags(link):
    """10's flags for a link of the stack's sharded chain, as the stack's walk estimates it: two
    micro-batches a step, or, for Adam stepped in backward, none to accumulate (estimate/stack.py,
    estimate/question.py's rows)."""
    accumulates = ("--optimizer-in-backward", True) not in link.sets
    return Question(script_path("10"), argv_of(link.sets), WORLD_SIZE,
                    accumulates=accumulates).row(MICRO_BATCH).argv


# 10's other switches beside sharding (docs/combined.md#beside-sharding), not links of the chain:
# the losses as the root's forward, each process's shards stepped, Adam stepped in backward
BESIDE_SHARDING = (("--loss", "fused", "--optimizer-in-backward", "--stochastic-rounding"),
                   ("--loss", "chunked", "--optimizer", "adamw-4bit", "--checkpointing", "selective"))

# 10 stepping each process's shards on the tiny ViT, whose class token (1 x 1 x 128) and position
# table (1 x 17 x 128) have one row: the second process's shards of them are empty, and must not
# be stepped (on a GPU, bitsandbytes launches its kernel over no elements, and CUDA ends the
# process)
VIT_RUN = ["--data", "synthetic", "--epochs", "1", "--max-steps", "2", "--device", "cpu"]
EMPTY_SHARDS = {"vit-adamw-8bit": ["--batch-size", "4", "--accum-steps", "2", "--optimizer", "adamw-8bit"],
                "vit-adamw-4bit-in-backward": ["--batch-size", "2", "--optimizer", "adamw-4bit",
                                               "--optimizer-in-backward"],
                "vit-stochastic-rounding-offload": ["--batch-size", "4", "--accum-steps", "2",
                                                    "--stochastic-rounding", "--offload"]}

# (name, script, flags beside GQA_RUN and --model, or None: beside VIT_RUN): 07-09, 10 with each
# link of the chain and with other switches beside sharding, and 10 with empty shards
SHARDED_CASES = [
    *((step, step, ["--batch-size", str(2 * MICRO_BATCH * WORLD_SIZE), "--accum-steps", "2"])
      for step in ("07", "08", "09")),
    *((re.sub(r"\W+", "-", link.name), "10", chain_flags(link)) for link in SHARDED_CHAIN),
    *(("-".join(word.strip("-") for word in switches), "10",
       Question(script_path("10"), list(switches), WORLD_SIZE,
                accumulates="--optimizer-in-backward" not in switches).row(MICRO_BATCH).argv)
      for switches in BESIDE_SHARDING),
    *((name, "10", None) for name in EMPTY_SHARDS)]
SHARDED_LAUNCH_TIMEOUT = 30 * len(SHARDED_CASES)  # seconds; a run takes a few


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Every case of SHARDED_CASES run for 2 optimizer steps in one torchrun launch of 2 processes
    (tests/support/sharded_runs.py), and estimated while it runs: {name: (its record, or the
    words its script stopped with; its estimate, or what the estimate raised; each process's
    [empty tensors, empty tensors with a gradient] of each optimizer step)}."""
    root = tmp_path_factory.mktemp("sharded")
    model = root / "gqa-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(GQA_LLAMA))
    runs = [[name, step, [*VIT_RUN, *EMPTY_SHARDS[name]] if flags is None
             else [*GQA_RUN, "--model", str(model), *flags]] for name, step, flags in SHARDED_CASES]
    return launched_runs(root, runs, SHARDED_LAUNCH_TIMEOUT, estimated)


def estimated(step, argv):
    """predict()'s record, or the error it raised (raised again by the case's own test)."""
    try:
        return predict(script_path(step), argv, world_size=WORLD_SIZE)
    except Exception as error:  # noqa: BLE001
        return error


@pytest.mark.xdist_group(__name__)  # with this module's other shared runs, on one worker
@pytest.mark.timeout(SHARDED_LAUNCH_TIMEOUT + 120)
@pytest.mark.parametrize("name, step", [(name, step) for name, step, _ in SHARDED_CASES],
                         ids=[name for name, _, _ in SHARDED_CASES])
def test_a_sharded_run_trains_and_its_cpu_estimate_is_the_peak_of_process_0(name, step,
                                                                            sharded_runs):
    """07-09, and 10 with the switches of each link of the stack's sharded chain (read from
    estimate/stack.py, so that a link added there is run here): each trains in 2 processes
    (10's refusals let it), and the estimate with --world-size 2 --device cpu is process 0's
    tracked peak and breakdown, to the byte. Process 0 holds the larger half of a weight whose
    rows do not split evenly (FSDP pads its shard, not Adam's state of it, 10's default): the
    highest peak, the record's; the other process's is no higher, and equal where nothing is kept
    of the unpadded shards (07-09's plain SGD)."""
    record, predicted, _ = sharded_runs[name]
    assert isinstance(record, dict), f"{name}: the script stopped: {record}"
    assert record["world_size"] == WORLD_SIZE and record["steps"] == 2
    assert all(math.isfinite(loss) for loss in record["losses"])
    if isinstance(predicted, Exception):
        raise predicted
    peaks = record["rank_peak_memory_bytes"]
    assert peaks[0] == record["peak_memory_bytes"] == predicted["allocated_bytes"], peaks
    assert record["breakdown_bytes"] == predicted["breakdown_bytes"]  # (the first highest's)
    assert all(peak <= peaks[0] for peak in peaks), peaks
    if step != "10":  # SGD: no state; gradients and weights in padded shards
        assert len(set(peaks)) == 1, peaks


@pytest.mark.xdist_group(__name__)
@pytest.mark.timeout(SHARDED_LAUNCH_TIMEOUT + 120)
@pytest.mark.parametrize("link", SHARDED_CHAIN, ids=[link.name for link in SHARDED_CHAIN])
def test_the_floor_the_stack_skips_a_sharded_link_by_is_under_its_estimate(link, sharded_runs):
    """The walk leaves a link unestimated where its floor (estimate/stack.py's resident_bytes)
    exceeds the GPU: on 2 processes it is under the link's estimate, and ZeRO-2's holds every
    weight whole (the gathered weights kept from forward to backward)."""
    record, predicted, _ = sharded_runs[re.sub(r"\W+", "-", link.name)]
    if isinstance(predicted, Exception):
        raise predicted
    floor = resident_bytes(link.sets, record["parameter_count"], WORLD_SIZE)
    assert 0 < floor <= predicted["allocated_bytes"]
    if ("--reshard-after-forward", "false") in link.sets:  # whole weights besides ZeRO-3's
        # shards of weights and state (its gradient shards need not exist yet at the end of
        # forward), which outweigh ZeRO-3's floor at the step
        zero3 = [pair for pair in link.sets if pair[0] != "--reshard-after-forward"]
        parameters = record["parameter_count"]
        assert floor >= WEIGHT_BYTES * parameters + resident_bytes(
            [*zero3, ("--optimizer-in-backward", True)], parameters, WORLD_SIZE)
        assert floor >= resident_bytes(zero3, parameters, WORLD_SIZE)


@pytest.mark.xdist_group(__name__)
@pytest.mark.timeout(SHARDED_LAUNCH_TIMEOUT + 120)
@pytest.mark.parametrize("name", EMPTY_SHARDS)
def test_no_optimizer_is_handed_an_empty_shard_with_a_gradient(name, sharded_runs):
    """A weight of fewer rows than processes leaves the second process an empty shard, which FSDP
    still hands a gradient: 10 gives the plain tensor stepped in its place none, so no optimizer
    (8-bit or 4-bit AdamW, stochastic rounding; in backward or after it) steps zero elements."""
    record, _, steps = sharded_runs[name]
    assert isinstance(record, dict), f"{name}: the script stopped: {record}"
    assert record["world_size"] == WORLD_SIZE and record["steps"] == 2
    empty, with_gradient = (sum(counts[i] for rank in steps for counts in rank) for i in (0, 1))
    assert empty > 0, "no process held an empty shard: the case tests nothing"
    assert with_gradient == 0, steps


@pytest.mark.parametrize("in_backward", [False, True], ids=["after backward", "in backward"])
def test_a_hook_moves_gradient_shards_only_for_a_step_in_backward(in_backward, tmp_path):
    """A post-accumulate-grad hook on a sharded weight turns off FSDP's overlapped copy of its
    gradient into pinned host memory (--offload on a GPU: every gradient then copied with a
    blocking .to("cpu")). 10 stepping plain shards (8-bit AdamW here) moves them before its
    step; only a step in backward needs the hook, which is where it hands each one over."""
    script, hooked = load_script("10"), []

    class Watching(script.MemoryMeter):
        def __init__(self, device, model, optimizer, **options):
            super().__init__(device, model, optimizer, **options)
            hooked.extend(bool(param._post_accumulate_grad_hooks) for param in model.parameters())

    script.MemoryMeter = Watching
    record = script.main([*QUICK, "--offload", "--optimizer", "adamw-8bit", "--batch-size", "4",
                          *(["--optimizer-in-backward"] if in_backward else ["--accum-steps", "2"]),
                          "--results-dir", str(tmp_path)])
    assert record["steps"] == 2 and all(math.isfinite(loss) for loss in record["losses"])
    assert hooked and set(hooked) == {in_backward}
