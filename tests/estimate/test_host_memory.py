"""Host memory on an emulated GPU (estimate/replay/trace.py): what a GPU's run pins (copies out
of the GPU, the optimizer's weights on the host, FSDP's offloaded shards) counted as PyTorch's
caching host allocator holds it, each request rounded up to a power of two and a freed block kept
for the next request of its size; the rest of the host memory (the optimizer's state there)
exactly."""
import math

import torch

from common.model import model_class, model_config
from common.presets import PRESETS
from conftest import script_path
from estimate.gpu_choices import HOST_CATEGORIES_WHEN_OFFLOADED
from estimate.predict import predict
from estimate.replay.allocator import HostAllocatorModel, pinned_size
from estimate.replay.trace import ALLOC, FREE, LABEL, PINNED, replay


def parameter_shapes(preset_name):
    preset = PRESETS[preset_name]
    with torch.device("meta"):
        model = model_class(preset)._from_config(model_config(preset))
    return [param.shape for param in model.parameters()]


def test_a_pinned_request_takes_the_power_of_two_at_or_above_it():
    sizes = [0, 1, 3, 4, 5, 4095, 4096, 4097, 73_600_000]  # (GPT-2's embedding: 73.6 MB)
    assert [pinned_size(size) for size in sizes] == [0, 1, 4, 4, 8, 4096, 4096, 8192, 2**27]


def test_a_freed_pinned_block_is_kept_and_taken_again_only_by_its_size():
    host = HostAllocatorModel()
    first = host.malloc(3000)  # 4096
    host.free(first)
    assert host.held == 4096  # kept, not given back
    host.malloc(1500)  # 2048: a block of its own, not a piece of the free 4096
    assert host.held == 4096 + 2048
    host.malloc(2100)  # 4096: the one freed
    assert host.held == 4096 + 2048
    host.malloc(4000)  # 4096 again, none free: a new block
    assert host.held == 2 * 4096 + 2048


def test_the_replay_counts_pinned_blocks_as_held_and_the_rest_exactly():
    events = [
        (ALLOC, 0, 3000, PINNED, "Temp"),  # a copy out of the GPU: a block of 4096
        (ALLOC, 1, 1000, "meta", "Optstate"),  # the optimizer's state on the host: kept, 1000
        (ALLOC, 2, 5000, "meta", "Optstate"),  # a temporary of its step, freed: not counted
        (FREE, 2),
        (ALLOC, 3, 700, "meta", "Activation"),  # the host side's batch: not counted
        (FREE, 0),  # its block kept
        (ALLOC, 4, 2500, PINNED, "Temp"),  # takes it again
        (ALLOC, 5, 3000, "cpu", "Sharded Param"),  # offloaded shard: pinned, 4096
        (ALLOC, 6, 3000, "cpu", "Temp"),
        (LABEL, 6, "OptState"),  # offloaded optimizer state: exact
        (ALLOC, 7, 100, "cpu", "Activation"),  # on the GPU
    ]
    peak = replay(events, "cpu", emulate_cuda=True, workspaces=False,
                  host_categories=HOST_CATEGORIES_WHEN_OFFLOADED)
    assert peak.pinned_host_bytes == 2 * 4096
    assert peak.host_bytes == 2 * 4096 + 1000 + 3000
    assert peak.allocated_bytes == 3072  # storage 6, on the GPU until re-filed as offloaded


def test_05fs_host_memory_on_a_gpu_is_its_pinned_copies_and_adams_state():
    """Adam on the host: the weights' host copy and the gradients copied out are pinned, a block
    each rounded up to a power of two (the gradients' freed at each step and taken again by the
    next); Adam's two moments are made by Adam, pageable, counted exactly; all in bfloat16."""
    sizes = [2 * math.prod(shape) for shape in parameter_shapes("tiny")]
    record = predict(script_path("05f"), ["--preset", "tiny"])
    pinned = 2 * sum(pinned_size(size) for size in sizes)
    assert record["pinned_host_bytes"] == pinned > 2 * sum(sizes)
    assert record["host_bytes"] == pinned + 2 * sum(sizes)
    gradients_to_host = predict(script_path("05i"), ["--preset", "tiny"])
    # 05i: also one micro-batch's copies, each waiting for its weight's next copy at most
    assert gradients_to_host["pinned_host_bytes"] == pinned + sum(pinned_size(size) for size in sizes)


def test_offloaded_shards_are_pinned_blocks_and_their_gradients_exact():
    """08 on 2 GPUs: each weight's shard (ceil(rows / 2) rows, bfloat16) pinned, a block each;
    the gradients' shards, which the fake run holds as the reduce-scatter's outputs, exactly."""
    shards = [2 * -(-shape[0] // 2) * math.prod(shape[1:]) for shape in parameter_shapes("tiny")]
    record = predict(script_path("08"), ["--preset", "tiny"], world_size=2)
    assert record["pinned_host_bytes"] == sum(pinned_size(size) for size in shards) > sum(shards)
    assert record["host_bytes"] == record["pinned_host_bytes"] + sum(shards)


def test_checkpoints_offloaded_beside_sharding_are_pinned_host_memory_too():
    """10 with --offload (FSDP as a group of one, its tracker FSDPMemTracker) and offloaded
    checkpoints: each block's input copied out into a pinned block, as without sharding; the
    host holds at least one micro-batch's inputs of every block more than with full checkpointing."""
    flags = ["--preset", "tiny", "--offload", "--accum-steps", "4"]
    full, offloaded = (predict(script_path("10"), [*flags, "--checkpointing", kind])
                       for kind in ("full", "offloaded"))
    inputs = 4 * pinned_size(2 * 16 * 5 * 128)  # 4 blocks, a micro-batch of 16 x 5 tokens x 128
    assert offloaded["pinned_host_bytes"] - full["pinned_host_bytes"] >= inputs
