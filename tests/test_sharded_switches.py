"""10_combined.py's switches beside sharding (docs/combined.md#beside-sharding): under torchrun
with 2 CPU processes (gloo) the chunked and fused losses run as the sharded root's forward,
8-bit and 4-bit AdamW and stochastic rounding step each process's shards, and Adam stepped in
backward steps as FSDP hands each gradient shard over. Each set trains, its weights move, and
its CPU estimate with --world-size 2 equals what each process measured, to the byte.
"""
import json
import sys

import pytest

from conftest import LAUNCH_TIMEOUT, WORLD_SIZE, run_to_end, script_path
from estimate import estimate

RUN = ["--preset", "tiny-text", "--task", "causal-lm", "--epochs", "1", "--max-steps", "3",
       "--device", "cpu"]
SWITCH_SETS = {
    "fused, in backward, stochastic rounding": ["--loss", "fused", "--optimizer-in-backward",
                                                "--stochastic-rounding"],
    "chunked, 4-bit AdamW, selective": ["--loss", "chunked", "--optimizer", "adamw-4bit",
                                        "--checkpointing", "selective"],
}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
@pytest.mark.parametrize("name", list(SWITCH_SETS))
def test_switches_beside_sharding_train_as_their_estimate_says(name, tmp_path):
    switches = SWITCH_SETS[name]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={WORLD_SIZE}", str(script_path("10")), *RUN, *switches,
               "--results-dir", str(tmp_path / "run")]
    code, output = run_to_end(command)
    assert code == 0, output
    record = json.loads((tmp_path / "run" / "10_combined.json").read_text())
    assert record["world_size"] == WORLD_SIZE and record["steps"] == 3
    losses = record["losses"]
    assert losses[-1] < losses[0]  # the sharded weights were stepped (tiny-text's loss falls fast)
    predicted = estimate(str(script_path("10")), [*RUN, *switches, "--world-size", str(WORLD_SIZE),
                                                  "--estimate", "--results-dir", str(tmp_path)])
    assert record["rank_peak_memory_bytes"] == [predicted["allocated_bytes"]] * WORLD_SIZE
