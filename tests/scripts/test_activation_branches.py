"""The activation branches' claims: 05c recomputes each block in backward, 05d keeps the matrix
products' outputs, 05e keeps the blocks' inputs in host memory; each trains as its parent and
keeps the activations it promises."""
import pytest
import torch

from conftest import QUICK, assert_trains_as, load_script, run_script


@pytest.mark.numerical
def test_checkpointing_on_one_device_trains_as_04(runs):
    """Recomputing the blocks in backward changes when the work is done, not its result."""
    assert_trains_as("05c", "04", runs)


def test_checkpointing_on_one_device_keeps_fewer_activations(quick_records, runs):
    record, _ = runs("05c")
    plain = quick_records["04"]
    assert record["breakdown_bytes"]["activations"] < 0.7 * plain["breakdown_bytes"]["activations"]
    assert record["peak_memory_bytes"] < plain["peak_memory_bytes"]
    for kept in ("parameters", "gradients", "optimizer_state"):  # the model state is 04's
        assert record["breakdown_bytes"][kept] == plain["breakdown_bytes"][kept]


@pytest.mark.parametrize("preset", ["tiny", "tiny-text"])
def test_checkpointing_recomputes_at_most_one_forward_and_selective_no_matrix_product(preset):
    """benchmarks/recompute_flops.py counts it: 05c's backward grows by more than half a forward
    (every block runs again) and by no more than one (nothing runs twice over); 05d's not at all,
    since FlopCounterMode counts the matrix products and attention, whose outputs 05d keeps."""
    from benchmarks.recompute_flops import forward_backward_flops
    from common.presets import PRESETS
    forward, plain = forward_backward_flops(PRESETS[preset], 2)
    _, checkpointed = forward_backward_flops(PRESETS[preset], 2, "05c")
    _, selective = forward_backward_flops(PRESETS[preset], 2, "05d")
    assert 0.5 * forward < checkpointed - plain <= forward
    assert selective == plain


def test_selective_checkpointing_recomputes_attention_that_draws_random_numbers():
    """A GPU's attention kernels draw dropout's random numbers themselves: keeping their output
    would skip that draw in the recomputation and shift the dropout masks after it."""
    module = load_script("05d")
    aten, policy = torch.ops.aten, module.CheckpointPolicy
    query = torch.zeros(1, 1, 2, 4)
    for op, dropout in ((aten._scaled_dot_product_flash_attention.default, "dropout_p"),
                        (aten._scaled_dot_product_efficient_attention.default, "dropout_p")):
        arguments = (query, query, query, None, False) if "efficient" in op.name() else (query,) * 3
        assert module.keep_or_recompute(None, op, *arguments) == policy.MUST_SAVE
        assert module.keep_or_recompute(None, op, *arguments, **{dropout: 0.1}) == \
            policy.PREFER_RECOMPUTE
    flash_for_cpu = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert module.keep_or_recompute(None, flash_for_cpu, query, query, query, 0.1) == \
        policy.PREFER_RECOMPUTE  # dropout_p given by position
    assert module.keep_or_recompute(None, aten.mm.default, query, query) == policy.MUST_SAVE
    assert module.keep_or_recompute(None, aten.gelu.default, query) == policy.PREFER_RECOMPUTE


def test_selective_checkpointing_recomputes_the_score_matrices_of_attention_in_python():
    """BLOOM's attention (its own code) makes each layer's batch x heads x tokens x tokens scores
    with baddbmm: those are what 05c frees, so 05d recomputes them (and bmm's likewise)."""
    module = load_script("05d")
    scores = torch.zeros(2, 4, 4)
    for op, arguments in ((torch.ops.aten.baddbmm.default, (scores, scores, scores)),
                          (torch.ops.aten.bmm.default, (scores, scores))):
        assert module.keep_or_recompute(None, op, *arguments) == module.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.numerical
def test_selective_checkpointing_trains_as_05c(runs):
    """Reusing saved outputs instead of recomputing them changes no result."""
    assert_trains_as("05d", "05c", runs)


def test_selective_checkpointing_keeps_activations_between_04s_and_05cs(quick_records, runs):
    records = {name: runs(name)[0] for name in ("05c", "05d")}
    activations = {name: record["breakdown_bytes"]["activations"] for name, record in
                   [*records.items(), ("04", quick_records["04"])]}
    assert activations["05c"] < activations["05d"] < activations["04"]
    peaks = {name: record["peak_memory_bytes"] for name, record in
             [*records.items(), ("04", quick_records["04"])]}
    assert peaks["05c"] < peaks["05d"] < peaks["04"]


@pytest.mark.numerical
def test_activation_offloading_trains_as_05c(runs):
    """Moving the saved inputs to the host and back changes where they wait, not their values."""
    assert_trains_as("05e", "05c", runs)


def test_offloading_moves_each_blocks_input_to_the_host_and_frees_the_original(tmp_path):
    """Per micro-batch, one input per block goes out and comes back once; when forward ends,
    none of the originals is alive any more: only the host copies are kept for backward."""
    import weakref
    module = load_script("05e")
    moved, came_back, alive_after_forward = [], [], []
    to_host, to_device = module.OffloadedInputs.to_host, module.OffloadedInputs.to_device

    def counting_to_host(self, tensor):
        packed = to_host(self, tensor)
        if packed is not tensor:
            moved.append((weakref.ref(tensor), tensor.shape, packed[1].device))
        return packed

    def counting_to_device(self, packed):
        came_back.append(packed)
        return to_device(self, packed)

    module.OffloadedInputs.to_host, module.OffloadedInputs.to_device = counting_to_host, counting_to_device

    class Meter(module.MemoryMeter):
        def __init__(self, device, model, optimizer, **options):
            super().__init__(device, model, optimizer, **options)
            model.register_forward_hook(lambda *_: alive_after_forward.append(
                sum(original() is not None for original, _, _ in moved[-4:]) if model.training else 0))

    module.MemoryMeter = Meter
    record, _ = run_script("05e", QUICK, tmp_path, module)
    micro_batches = record["steps"] * record["accum_steps"]
    assert len(moved) == len(came_back) == 4 * micro_batches  # the tiny ViT's 4 blocks
    assert {(tuple(shape), device.type) for _, shape, device in moved} == {((16, 5, 128), "cpu")}
    assert alive_after_forward[:micro_batches] == [0] * micro_batches
