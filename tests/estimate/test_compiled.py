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
    """A compiled run at budget 0.25 holds, at its peak, fewer activations than the budget-1.0
    partition saves (the budget reached each block's compiled code; the peak falls in backward,
    where each block hands back its gradients and frees what it saved), and its peak lies within
    the bound its estimate states (estimate/compiled.py).

    oneDNN off: on a CPU with AMX its bfloat16 convolution backward takes scratch buffers that
    no tensor holds (tests/scripts/test_compile.py), outside what the estimate bounds."""
    flags = ["--epochs", "1", "--max-steps", "2", "--accum-steps", "1", "--memory-budget", "0.25", *CPU]
    with torch.backends.mkldnn.flags(enabled=False):
        record, _ = run_script("05k", flags, tmp_path)
        predicted = estimate(str(script_path("05k")), [*flags, "--estimate", "--results-dir", str(tmp_path)])
    assert record["memory_counted_by"] == "allocator events (torch.profiler)"
    activations = record["breakdown_bytes"]["activations"]
    assert activations < partitions[1.0].saved_bytes
    assert predicted["compiled"] and predicted["unfused_allocated_bytes"] > predicted["allocated_bytes"]
    assert within_bound(record, predicted)


def graph_of(function, *inputs, symbolic=False):
    """`function` traced to ATen operations with inductor's decompositions, as the compiler's
    graphs are (symbolic: with sizes as symbols, as a graph recompiled for dynamic shapes)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(function, decomposition_table=select_decomp_table(),
                   tracing_mode="symbolic" if symbolic else "real")(*inputs)


def fused_names(graph):
    from estimate.compiled import fused_away
    return {node.name for node in graph.graph.nodes if fused_away(node)}


def test_the_zeros_an_embeddings_gradient_accumulates_into_are_computed_in_its_copy():
    """Inductor writes an embedding's gradient by an index_put into a copy of the zeros it
    starts from, computed in place: one buffer, as the fused run holds (tiny-text 04 compiled).
    Zeros that a matrix product reads are held."""
    def embedding_gradient(gradient, tokens):
        return torch.ops.aten.embedding_dense_backward(gradient, tokens, 100, -1, False)

    def zeros_multiplied(matrix):
        return torch.zeros(16, 16) @ matrix

    gradient, tokens = torch.randn(8, 16, dtype=torch.bfloat16), torch.randint(0, 100, (8,))
    graph = graph_of(embedding_gradient, gradient, tokens)
    assert {node.target for node in graph.graph.nodes} >= {
        torch.ops.aten.full.default, torch.ops.aten._unsafe_masked_index_put_accumulate.default}
    assert "full" in fused_names(graph)
    assert "full" not in fused_names(graph_of(zeros_multiplied, torch.randn(16, 4)))


def test_a_range_compared_in_a_kernel_is_computed_there():
    """A range (iota, which arange decomposes into) is computed from its index where it is
    read, as a fill is (a one-hot mask over the vocabulary, in a causal-lm's backward)."""
    def one_hot(tokens):
        return (torch.arange(100) == tokens[:, None]).sum(0)

    graph = graph_of(one_hot, torch.randint(0, 100, (8,)))
    assert torch.ops.prims.iota.default in {node.target for node in graph.graph.nodes}
    assert "iota" in fused_names(graph)


def test_values_of_dynamic_shapes_are_fused_with_the_shape_they_have_as_they_run():
    """A graph recompiled for dynamic shapes (05e's pieces): its pointwise chain is fused, each
    stand-in shaped as its inputs broadcast when the graph runs, at any size."""
    from estimate.compiled import broadcast_is, with_fusion

    def chain(rows, column):
        return (rows * 2 + column).sum(0)

    graph = graph_of(chain, torch.randn(5, 3), torch.randn(5, 1), symbolic=True)
    assert fused_names(graph) == {"mul", "add"}
    fused = with_fusion(graph)
    for size in [7, 2]:
        assert fused(torch.randn(size, 3), torch.randn(size, 1)).shape == (3,)
    assert broadcast_is((2, 3), [(2, 3), (3,)]) and broadcast_is((2, 3), [(1, 3), (2, 1)])
    assert not broadcast_is((2, 3), [(1, 3)]) and not broadcast_is((2, 3), [(2, 4)])
    assert not broadcast_is((2, 3), [(3,)])  # nothing gives the first size


def test_a_view_of_a_value_laid_out_by_a_stand_in_takes_its_bytes():
    """A pointwise operation that reads a stand-in (no layout) and a transposed value lays its
    output out transposed, where the graph recorded it contiguous (attention's heads merged
    back, in the causal-lm Llama): the graph's view of it then takes the same bytes."""
    from estimate.compiled import with_fusion

    def heads_merged(scores, heads, weight):
        return ((scores * 2) * heads.transpose(1, 2)).view(2, 6, 12) @ weight

    inputs = torch.randn(2, 6, 3, 4), torch.randn(2, 3, 6, 4), torch.randn(12, 5)
    graph = graph_of(heads_merged, *inputs)
    assert torch.ops.aten.view.default in {node.target for node in graph.graph.nodes}
    assert fused_names(graph) == {"mul"}  # scores * 2, read inside the next product's kernel
    assert with_fusion(graph)(*inputs).shape == (2, 6, 5)


def test_a_model_with_dropout_is_partitioned_as_inductor_partitions_it():
    """Inductor's joint-graph passes combine the seeds of random numbers (dropout: GPT-2's
    default) under the graph's fake mode, which the estimate's backend sets as inductor does."""
    from torch._dynamo.backends.debugging import boxed_nop

    from estimate.compiled import inductor_graphs
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(layer, backend=inductor_graphs(boxed_nop, boxed_nop))
        compiled(torch.randn(2, 4)).sum().backward()
    finally:
        torch._dynamo.reset()
    assert layer[0].weight.grad is not None
