"""A compiled model's memory on fake tensors: AOTAutograd's own partition of the joint graph,
what it saves and recomputes, and the compiled graphs run under the estimate's tracker.

torch.compile traces forward and backward into one joint graph and splits it in two
(`min_cut_rematerialization_partition`, inductor's partitioner): the forward graph's extra
outputs are what backward reads, and under `torch._functorch.config.activation_memory_budget`
(05k) the partitioner saves less and recomputes the rest in backward. Both uses below run that
split, with inductor's decompositions and partition function, through a backend that keeps the
two graphs instead of generating kernels from them, so they need no GPU, no compiler toolchain
and no data.

`partition()` counts (benchmarks/recompute_flops.py prints them):
- saved_bytes: the tensors backward's graph takes from forward's, the model's own weights and
  inputs left out (they exist whatever is saved): the activations a compiled step keeps between
  its forward and its backward;
- forward_flops and backward_flops: FlopCounterMode's count of each graph as it runs, so a
  budget's recomputation is its backward's FLOPs beyond the budget-1.0 backward's.

`run_as_compiled()` is how the estimate predicts a compiled run (`--compile`, 05k): in
it, torch.compile's inductor backend gives the two graphs back to be run an operation at a time
(FX frees each value after its last use, and each input once the graph has taken it), and the
estimate's tracker, which tells torch.compile to compile under it (ignore_compile_internals),
counts them as they run. What inductor's kernels hold cannot be generated without its code
generator, so it is bounded from both sides:
- fused (the prediction): each pointwise operation whose every consumer is a pointwise operation
  or a reduction (through views) is computed inside its consumer's kernel and never held; the
  inputs it reads live until that kernel runs. Inductor fuses about so: it keeps a few such
  values in buffers, and fuses some this does not (random numbers, which are held here; a graph
  of dynamic shapes is not fused here at all), so it is not a bound below;
- unfused (the bound above): every operation's value held, as if nothing were fused.
A kernel's own scratch space (a CPU's bfloat16 matrix product takes some) is in neither.
"""
from dataclasses import dataclass

import torch
import torch._functorch.config
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.compile_fx import partition_fn as inductor_partition
from torch._inductor.decomposition import select_decomp_table
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class Partition:
    saved_bytes: int = 0     # what backward reads from forward, weights and inputs left out
    forward_flops: int = 0
    backward_flops: int = 0
    graphs: int = 0          # forward graphs compiled (more than one: a graph break)


def inductor_graphs(forward_compiler, backward_compiler):
    """A torch.compile backend that hands the two graphs inductor would be given (its own
    decompositions, its joint-graph passes, then the min-cut partition) to the two compilers."""
    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                        decompositions=select_decomp_table(), partition_fn=inductor_partition)


def saved_by_forward(backward_graph):
    """Bytes of the tensors a backward graph takes from its forward graph: its inputs that are
    neither incoming gradients (tangents_*) nor the forward's own inputs passed through
    (primals_*: the weights and the batch). With a graph break, a later graph's inputs include
    the earlier one's outputs, which this leaves out: Partition.graphs says when."""
    return sum(node.meta["val"].nbytes for node in backward_graph.graph.nodes
               if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)
               and not node.name.startswith(("tangents", "primals")))


def partition(model, inputs, labels, budget):
    """The Partition of one training forward and backward of `model` on `inputs` and `labels`
    (the model's own loss) under activation memory budget `budget` (0 to 1)."""
    found = Partition()

    def keeper(kind):
        def compiler(graph, example_inputs):
            if kind == "backward":
                found.saved_bytes += saved_by_forward(graph)
            else:
                found.graphs += 1

            def run(args):  # the graph itself, run as it is, its operations counted
                with FlopCounterMode(display=False) as counter:
                    out = graph(*args)
                setattr(found, f"{kind}_flops", getattr(found, f"{kind}_flops") + counter.get_total_flops())
                return out
            run._boxed_call = True  # AOTAutograd's calling convention: one list of arguments
            return run
        return compiler

    backend = inductor_graphs(keeper("forward"), keeper("backward"))
    torch._dynamo.reset()  # graphs compiled earlier (another budget) would be reused otherwise
    with torch._functorch.config.patch(activation_memory_budget=budget):
        compiled = torch.compile(model, backend=backend)
        compiled(**inputs, labels=labels).loss.backward()
    torch._dynamo.reset()
    return found


aten = torch.ops.aten
# views a kernel reads through (index arithmetic), which a stand-in (every stride 0) can take
INLINED_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.permute.default,
                 aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
                 aten.squeeze.dims, aten.expand.default, aten.slice.Tensor, aten.select.int}


def is_operator(node):
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)


def in_kernel(node):
    """Whether `node` reads its inputs inside its own kernel, where a fused producer is computed:
    pointwise operations and reductions do, and views between them are inlined; a matrix
    product, a convolution, a mutation or the graph's output needs its input in a buffer."""
    if not is_operator(node) or node.target._schema.is_mutable:
        return False
    if torch.Tag.pointwise in node.target.tags or torch.Tag.reduction in node.target.tags:
        return True
    return node.target in INLINED_VIEWS and all(in_kernel(user) for user in node.users)


def fused_away(node):
    """Whether inductor computes `node` inside its consumers' kernels, never into a buffer."""
    value = node.meta.get("val")
    return (is_operator(node) and torch.Tag.pointwise in node.target.tags
            and not node.target._schema.is_mutable and isinstance(value, torch.Tensor)
            and all(isinstance(size, int) for size in value.shape)  # (a static shape)
            and bool(node.users) and all(in_kernel(user) for user in node.users))


def stand_in(like, *inputs):
    """A tensor of `like`'s (shape, dtype, device) that holds no memory (one element,
    expanded) and keeps the tensors among `inputs` alive as long as it lives: the kernel that
    computes a fused value reads that value's inputs when it runs."""
    shape, dtype, device = like
    tensor = torch.empty((), dtype=dtype, device=device).expand(shape)
    tensor.keeps = [value for value in inputs if isinstance(value, torch.Tensor)]
    return tensor


def with_fusion(graph):
    """`graph` (a GraphModule) with each value that inductor fuses away replaced by a stand-in."""
    for node in list(graph.graph.nodes):
        if fused_away(node):
            value = node.meta["val"]
            with graph.graph.inserting_before(node):
                replacement = graph.graph.call_function(
                    stand_in, ((tuple(value.shape), value.dtype, value.device),
                               *node.all_input_nodes))
            replacement.meta["val"] = value
            node.replace_all_uses_with(replacement)
            graph.graph.erase_node(node)
    graph.recompile()
    return graph


def run_by_operations(fused):
    """A compiler of AOTAutograd's graphs: the graph itself, with fusion (`fused`) or without,
    run an operation at a time, each input freed once the graph has taken it (boxed)."""
    def compiler(graph, example_inputs):
        return boxed_nop(with_fusion(graph) if fused else graph, example_inputs)
    return compiler


def run_as_compiled(fused):
    """The backend that stands for inductor in the estimate (see the module's docstring)."""
    return inductor_graphs(run_by_operations(fused), run_by_operations(fused))


# tensors an optimizer keeps beside its state, made in its first step (05j's code tables: 248
# bytes): the allocator's count of a later step does not see them either
OPTIMIZERS_OWN = 4096


def within_bound(measured, record):
    """Whether a compiled CPU run's measured peak (the allocator's count, common/
    compiled_memory.py) lies within the range its estimate `record` states: at most the unfused
    peak, and at least the fused prediction less what the allocator's count cannot see and
    MemTracker's does: tensors made before the step other than the model's and its optimizer's
    state, that is the batch (MemTracker counts it once the model takes a view of it, as 04's
    micro-batches are) and an optimizer's own small tensors (OPTIMIZERS_OWN)."""
    predicted, unfused = record["allocated_bytes"], record["unfused_allocated_bytes"]
    return predicted - record["batch_bytes"] - OPTIMIZERS_OWN <= measured <= unfused
