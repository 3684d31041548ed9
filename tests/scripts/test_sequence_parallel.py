"""08a, sequence parallelism (Ulysses), with two processes on the CPU (gloo): each text split in
two slices gives the loss and gradients of one process training on the whole texts, and the
estimate of a run is process 0's peak, to the byte.

The runs start under torchrun: the training runs in float32 through
tests/support/first_step_probe.py, which keeps each process's gradient shards of the first
optimizer step; the estimated runs as the script trains (bfloat16), in one launch through
tests/support/sharded_runs.py. Each architecture is the architecture matrix's
(tests/support/architecture_matrix.py): Llama and Qwen2 with one key-value head for two query
heads (the key-value heads do not divide by the processes, so each process gets a copy), GPT-2
with learned positions, and tiny-text's own decoder (a Llama with 2 key-value heads for 4).
"""
import json
import math
import sys

import pytest
import torch
from transformers import AutoConfig

from common.model import model_config
from common.presets import PRESETS, for_task
from conftest import LAUNCH_TIMEOUT, WORLD_SIZE, launched_runs, run_to_end, script_path
from estimate.contract import EstimateError
from estimate.predict import predict
from estimate.stack import LONG_SHARDED_CHAIN, argv_of
from support.architecture_matrix import SEQ_LEN, model_flags, write_model
from support.rounding import additions, assert_same_sum

pytestmark = pytest.mark.xdist_group(__name__)  # the runs the tests share, made once

FAMILIES = ["tiny-text", "Llama", "Qwen2", "GPT-2"]  # tiny-text: the preset's own decoder
BATCH = 8  # texts a step, in 2 micro-batches
FIRST_STEP = ["--epochs", "1", "--max-steps", "1", "--device", "cpu", "--accum-steps", "2",
              "--batch-size", str(BATCH)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (the flags that train it, its config, tokens a text)}."""
    root, found = tmp_path_factory.mktemp("models"), {}
    for family in FAMILIES:
        if family == "tiny-text":
            preset = for_task(PRESETS["tiny-text"], "causal-lm")
            found[family] = ([], model_config(preset), preset.max_length)
        else:
            folder = write_model(root / family, family)
            config = json.loads((folder / "config.json").read_text())
            # GPT-2's dropout (0.1 by default) draws its masks a process's slice at a time: one
            # process and two would drop different activations
            config.update({name: 0.0 for name in ("attn_pdrop", "embd_pdrop", "resid_pdrop")
                           if family == "GPT-2"})
            (folder / "config.json").write_text(json.dumps(config))
            found[family] = (model_flags(folder, family), AutoConfig.from_pretrained(folder),
                             SEQ_LEN)
    return found


FUSED = ["--loss", "fused", "--pack", "--precision", "fp32", "--data", "synthetic"]  # 10, the fused loss
FUSED_FAMILIES = ["Llama", "Qwen2"]
# (name, script, processes, flags, families): each split in 2 slices, and its whole in one process
LAUNCHES = [("08a", "08a", WORLD_SIZE, [], FAMILIES), ("07", "07", 1, [], FAMILIES),
            ("10-split-fused", "10", WORLD_SIZE, ["--sequence-parallel", *FUSED], FUSED_FAMILIES),
            ("10-fused", "10", 1, FUSED, FUSED_FAMILIES)]
PAIRS = {"model": ("08a", "07"), "fused": ("10-split-fused", "10-fused")}


@pytest.fixture(scope="module")
def first_steps(models, tmp_path_factory):
    """{(family, loss): (in 2 processes, the same whole in one)}: 08a and its parent 07 (the
    model's loss), 10 with --sequence-parallel --loss fused --pack and without the first; each
    (its record, each process's notes, each process's gradient shards by name) of the first
    optimizer step, in float32; the runs of each count of processes in one launch
    (tests/support/first_step_probe.py)."""
    root = tmp_path_factory.mktemp("first-steps")
    for processes in (WORLD_SIZE, 1):  # one launch for each count of processes
        runs = [[str(root / name / family), step,
                 [*FIRST_STEP, "--task", "causal-lm", *models[family][0], *flags,
                  "--results-dir", str(root / name / family / "results")]]
                for name, step, launched, flags, families in LAUNCHES if launched == processes
                for family in families]
        (root / f"{processes}.json").write_text(json.dumps(runs))
        code, output = run_to_end([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={processes}", "tests/support/first_step_probe.py",
                                   "--runs", str(root / f"{processes}.json")], timeout=3 * LAUNCH_TIMEOUT)
        assert code == 0, output

    def probed(out_dir, processes):
        record = json.loads(next((out_dir / "results").glob("*.json")).read_text())
        notes = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]
        gradients = [torch.load(out_dir / f"grads_rank{rank}.pt") for rank in range(processes)]
        return record, notes, gradients
    return {(family, loss): (probed(root / split / family, WORLD_SIZE), probed(root / whole / family, 1))
            for loss, (split, whole) in PAIRS.items()
            for family in next(families for name, *_, families in LAUNCHES if name == split)}


@pytest.mark.numerical
@pytest.mark.timeout(8 * LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("family, loss", [*((family, "model") for family in FAMILIES),
                                          *((family, "fused") for family in FUSED_FAMILIES)])
def test_two_slices_give_the_loss_and_gradients_of_one_process_on_the_whole_texts(
        family, loss, models, first_steps):
    """The texts of a batch (padded at their ends) split in two slices of their tokens, one a
    process, attention over the whole texts by head groups: the first step's loss and every
    gradient are those of 07 in one process on the whole texts with the model's own padding
    mask (10 with the fused loss, packed: those of 10 in one process), within what rounding of
    the step's sums can produce (tests/support/rounding.py)."""
    (split, _, split_gradients), (whole, _, (whole_gradients,)) = first_steps[family, loss]
    _, config, tokens = models[family]
    assert split["world_size"] == WORLD_SIZE and whole["world_size"] == 1
    n = additions(config, BATCH * tokens)
    loss = torch.tensor(whole["losses"][0])
    assert_same_sum(torch.tensor(split["losses"][0]), loss, loss.abs(), n, what="loss")
    assert whole_gradients.keys() == split_gradients[0].keys()
    for name, expected in whole_gradients.items():
        # FSDP's shards of a weight, row blocks in process order, make the whole gradient
        gradient = torch.cat([shards[name] for shards in split_gradients])
        assert gradient.shape == expected.shape, name
        assert_same_sum(gradient, expected, expected.abs().max(), n, what=name)
    assert any(gradient.abs().sum() > 0 for gradient in whole_gradients.values())


@pytest.mark.timeout(8 * LAUNCH_TIMEOUT + 60)
def test_every_process_reads_the_whole_batch(first_steps):
    """Every process reads the same texts (07's processes read half a batch each), and keeps a
    slice of each."""
    (_, notes, _), _ = first_steps["tiny-text", "model"]
    first, second = (rank["batches"] for rank in notes)
    assert first == second and [batch["size"] for batch in first] == [BATCH]


# ---- the estimate, process by process ------------------------------------------------------------

ESTIMATED_RUN = ["--data", "synthetic", "--task", "causal-lm", "--epochs", "1", "--max-steps",
                 "2", "--device", "cpu", "--batch-size", "4", "--accum-steps", "2"]
# (name, script, flags beside ESTIMATED_RUN and the family's): 08a on each family, and 10's
# switch beside others (checkpointing and offload, as 09 shards)
ESTIMATED = [*((family, "08a", family, []) for family in FAMILIES),
             ("10-Llama", "10", "Llama", ["--sequence-parallel", "--optimizer", "sgd"]),
             ("10-Qwen2-offload-checkpointing", "10", "Qwen2",
              ["--sequence-parallel", "--offload", "--checkpointing", "full"]),
             # the last link of --longest-sequence's chain on several GPUs, 2 tiles a slice
             ("10-Llama-longest-sharded", "10", "Llama",
              ["--pack", *(word.replace("auto", "2") for word in argv_of(LONG_SHARDED_CHAIN[-1].sets))])]
ESTIMATED_LAUNCH_TIMEOUT = 60 * len(ESTIMATED)


@pytest.fixture(scope="module")
def estimated_runs(models, tmp_path_factory):
    """Each case of ESTIMATED trained for 2 steps in one torchrun launch of 2 processes
    (tests/support/sharded_runs.py) and estimated while it runs: {name: (record, estimate)}."""
    runs = [[name, step, [*ESTIMATED_RUN, *models[family][0], *flags]]
            for name, step, family, flags in ESTIMATED]
    outcomes = launched_runs(tmp_path_factory.mktemp("estimated"), runs, ESTIMATED_LAUNCH_TIMEOUT,
                             lambda step, argv: predict(script_path(step), argv, world_size=WORLD_SIZE))
    for name, (record, _, _) in outcomes.items():
        assert not isinstance(record, str), f"{name}: {record}"
    return {name: (record, predicted) for name, (record, predicted, _) in outcomes.items()}


@pytest.mark.timeout(ESTIMATED_LAUNCH_TIMEOUT + 180)
@pytest.mark.parametrize("name", [name for name, _, _, _ in ESTIMATED])
def test_the_cpu_estimate_of_two_processes_is_the_peak_of_process_0(name, estimated_runs):
    """--estimate --world-size 2 --device cpu: process 0's tracked peak and its breakdown, to the
    byte (the all-to-alls' buffers are the script's own; gloo copies nothing of them on the CPU);
    both processes hold alike."""
    record, predicted = estimated_runs[name]
    assert record["world_size"] == WORLD_SIZE and record["steps"] == 2
    assert all(math.isfinite(loss) for loss in record["losses"])
    peaks = record["rank_peak_memory_bytes"]
    assert peaks[0] == predicted["allocated_bytes"], (peaks, predicted["allocated_bytes"])
    assert record["breakdown_bytes"] == predicted["breakdown_bytes"]
    assert peaks[1] <= peaks[0]


# ---- what it refuses -----------------------------------------------------------------------------

def test_a_length_that_does_not_split_stops_with_what_to_do():
    with pytest.raises(EstimateError, match=r"48 tokens \(--seq-len\) and 4 attention heads in 5 "):
        predict(script_path("08a"), ["--device", "cpu"], world_size=5)


def test_an_attention_causal_only_by_its_mask_is_refused(tmp_path):
    """BLOOM's attention is its own code (ALiBi), not transformers' registry: its causality is
    the mask's, which sequence parallelism does without."""
    folder = write_model(tmp_path / "BLOOM", "BLOOM")
    with pytest.raises(EstimateError, match="causal only by a mask"):
        predict(script_path("08a"), [*model_flags(folder, "BLOOM"), "--device", "cpu"],
                world_size=WORLD_SIZE)


def test_a_sliding_window_shorter_than_the_texts_is_refused(tmp_path):
    """A sliding window lives in the model's mask, which sequence parallelism does without: the
    gathered causal attention would attend past it."""
    folder = write_model(tmp_path / "Qwen2", "Qwen2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {**config, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}))
    with pytest.raises(EstimateError, match="sliding window of 4 tokens"):
        predict(script_path("08a"), [*model_flags(folder, "Qwen2"), "--device", "cpu"],
                world_size=WORLD_SIZE)
