"""estimate/compiled.py: AOTAutograd's partition under 05k's memory budget, on fake tensors, and
a compiled CPU run of 05k that keeps what it says and peaks within its estimate's bound."""
import pytest
import torch

from benchmarks.recompute_flops import budget_partitions
from common.presets import PRESETS
from conftest import CPU, run_script, script_path
from estimate import estimate
from estimate.compiled import within_bound

BATCH = 64  # tiny's batch, run whole (--accum-steps 1) so that activations fill the peak


@pytest.fixture(scope="module")
def partitions():
    return budget_partitions(PRESETS["tiny"], BATCH, [1.0, 0.25, 0.0])


def test_a_smaller_budget_saves_less_and_recomputes_more(partitions):
    whole, quarter, none = partitions[1.0], partitions[0.25], partitions[0.0]
    assert whole.graphs == quarter.graphs == none.graphs == 1  # no graph break
    assert whole.saved_bytes > quarter.saved_bytes > none.saved_bytes
    assert whole.forward_flops == quarter.forward_flops == none.forward_flops  # forward unchanged
    assert whole.backward_flops < quarter.backward_flops < none.backward_flops


def test_a_budget_of_zero_recomputes_one_forward_at_most(partitions):
    """Nothing of forward kept but its inputs: backward runs forward again, once at most."""
    recomputed = partitions[0.0].backward_flops - partitions[1.0].backward_flops
    assert 0.5 * partitions[0.0].forward_flops < recomputed <= partitions[0.0].forward_flops


@pytest.mark.timeout(600)
def test_05k_compiled_on_the_cpu_keeps_what_its_partition_saves_and_its_estimate_bounds(
        partitions, tmp_path):
    """A compiled run at budget 0.25 holds, at its peak, at least the activations its partition
    saves and less than the budget-1.0 partition would (the budget reached the compiled code),
    and its peak lies within the bound its estimate states (estimate/compiled.py).

    oneDNN off: on a CPU with AMX its bfloat16 convolution backward takes scratch buffers that
    no tensor holds (tests/test_compile.py), outside what the estimate bounds."""
    flags = ["--epochs", "1", "--max-steps", "2", "--accum-steps", "1", "--memory-budget", "0.25", *CPU]
    with torch.backends.mkldnn.flags(enabled=False):
        record, _ = run_script("05k", flags, tmp_path)
        predicted = estimate(str(script_path("05k")), [*flags, "--estimate", "--results-dir", str(tmp_path)])
    assert record["memory_counted_by"] == "allocator events (torch.profiler)"
    activations = record["breakdown_bytes"]["activations"]
    assert partitions[0.25].saved_bytes <= activations < partitions[1.0].saved_bytes
    assert predicted["compiled"] and predicted["unfused_allocated_bytes"] > predicted["allocated_bytes"]
    assert within_bound(record, predicted)
