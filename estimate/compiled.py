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
- saved_bytes: the tensors each block's backward graph takes from its forward graph, summed
  over the blocks, the weights and the block's input left out (they exist whatever is saved):
  the activations a compiled step keeps between its forward and its backward;
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
  inputs it reads live until that kernel runs. So is a fill (zeros, a range) read so or copied by a
  scatter (an embedding's gradient: an index_put into zeros), and so are values of dynamic
  shapes, their stand-ins shaped as the graph runs. Inductor fuses about so: it keeps a few such
  values in buffers, and fuses some this does not (random numbers, which are held here), so it is
  not a bound below;
- unfused (the bound above): every operation's value held, as if nothing were fused.
A kernel's own scratch space (a CPU's bfloat16 matrix product takes some) is in neither: a
measured run's is left out before the two are compared (measured_peak).
"""
from dataclasses import dataclass

import torch
import torch._functorch.config
import torch._prims_common
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import partition_fn as inductor_partition
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from common.model import transformer_blocks


@dataclass
class Partition:
    saved_bytes: int = 0     # what backward reads from forward, weights and inputs left out
    forward_flops: int = 0
    backward_flops: int = 0
    graphs: int = 0          # forward graphs compiled (more than one: a graph break)


def inductor_graphs(forward_compiler, backward_compiler):
    """A torch.compile backend that hands the two graphs inductor would be given (its own
    decompositions, its joint-graph passes, then the min-cut partition) to the two compilers.
    Run, as inductor runs them, with the graph's fake mode set where its passes look for it
    (random numbers' seeds, made when a model has dropout, are combined under it)."""
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                           decompositions=select_decomp_table(), partition_fn=inductor_partition)

    def compile_graph(graph, example_inputs):
        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
        with V.set_fake_mode(fake_mode):
            return backend(graph, example_inputs)
    return compile_graph


def saved_positions(backward_graph):
    """Where a backward graph's inputs are the tensors it takes from its forward graph: neither
    incoming gradients (tangents_*) nor the forward's own inputs passed through (primals_*:
    the weights and the block's input)."""
    inputs = [node for node in backward_graph.graph.nodes if node.op == "placeholder"]
    return [index for index, node in enumerate(inputs)
            if isinstance(node.meta.get("val"), torch.Tensor)
            and not node.name.startswith(("tangents", "primals"))]


def partition(model, inputs, labels, budget):
    """The Partition of one training forward and backward of `model` on `inputs` and `labels`
    (the model's own loss) under activation memory budget `budget` (0 to 1), its transformer
    blocks compiled each on its own as the scripts compile them (alike blocks share a graph;
    what runs uncompiled around them, embeddings and head, is not counted)."""
    found = Partition()

    def keeper(kind):
        def compiler(graph, example_inputs):
            found.graphs += kind == "forward"
            saved = saved_positions(graph) if kind == "backward" else []

            def run(args):  # the graph itself, run as it is, its operations counted
                found.saved_bytes += sum(args[index].nbytes for index in saved)  # each block's
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
        for block in transformer_blocks(model):
            block.compile(backend=backend)
        try:
            model(**inputs, labels=labels).loss.backward()
        finally:
            for block in transformer_blocks(model):
                block._compiled_call_impl = None  # the model as it was given
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


# tensors computed from their index alone (one value everywhere, or a range: iota, arange's
# decomposition): inductor computes them wherever they are read, as pointwise operations, so
# they are held only where a consumer needs a buffer
FILLS = {aten.full.default, aten.full_like.default, aten.zeros.default, aten.zeros_like.default,
         aten.ones.default, aten.ones_like.default, aten.scalar_tensor.default,
         torch.ops.prims.iota.default}
# operations that write into a copy of their first input (inductor lowers each as a clone of it,
# then the in-place operation): a fill copied so is computed straight into that copy, the output
SCATTERS_INTO_A_COPY = {aten.index_put.default, aten._unsafe_index_put.default,
                        aten._unsafe_masked_index_put_accumulate.default, aten.scatter.src,
                        aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two}


def reads_in_kernel(user, node):
    """Whether `user` reads `node` where a fused producer can be computed: inside its kernel,
    or (a fill) as the copy a scatter writes into."""
    if in_kernel(user):
        return True
    read = [each for each in tree_leaves((user.args, user.kwargs)) if each is node]
    return node.target in FILLS and user.target in SCATTERS_INTO_A_COPY and user.args[0] is node \
        and len(read) == 1  # the copy only: not also an index or the values written


def fused_away(node):
    """Whether inductor computes `node` inside its consumers' kernels, never into a buffer:
    a pointwise operation or a fill (FILLS) whose shape a stand-in can take (shape_of)."""
    value = node.meta.get("val")
    return (is_operator(node) and not node.target._schema.is_mutable
            and (torch.Tag.pointwise in node.target.tags or node.target in FILLS)
            and isinstance(value, torch.Tensor) and shape_of(node) is not None
            and bool(node.users) and all(reads_in_kernel(user, node) for user in node.users))


def is_tensor(node):
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def shape_of(node):
    """(shape, tensors): how a stand-in for `node`'s value gets its shape when it runs: `shape`
    (ints, or the graph's own size arguments), or, where it is None, the broadcast of the
    shapes of `tensors` (nodes). None where neither gives the value's shape: a graph of dynamic
    shapes (torch.compile recompiles a graph whose shapes changed with symbolic sizes) knows its
    sizes only as they run."""
    value = node.meta["val"]
    if all(isinstance(size, int) for size in value.shape):
        return tuple(value.shape), ()
    if node.target is torch.ops.prims.iota.default:  # its length
        return (node.args[0],), ()
    if node.target in FILLS:  # a size, or the shape of a tensor `*_like`
        return (None, (node.args[0],)) if is_tensor(node.args[0]) else (node.args[0], ())
    tensors = [each for each in node.all_input_nodes if is_tensor(each)]
    if tensors and broadcast_is(value.shape, [each.meta["val"].shape for each in tensors]):
        return None, tuple(tensors)
    return None


def broadcast_is(shape, shapes):
    """Whether `shapes` broadcast to `shape`, told from their sizes' expressions (symbolic
    sizes compared as written, never guarded on)."""
    if max(len(each) for each in shapes) != len(shape):
        return False
    for position in range(-len(shape), 0):
        size, sizes = str(shape[position]), {str(each[position]) for each in shapes
                                             if len(each) >= -position}
        if not sizes <= {size, "1"} or size not in sizes | {"1"}:
            return False
    return True


def stand_in(like, shaped_as, *inputs):
    """A tensor of `like`'s (shape, dtype, device) that holds no memory (one element,
    expanded) and keeps the tensors among `inputs` alive as long as it lives: the kernel that
    computes a fused value reads that value's inputs when it runs. Where the shape is None, it
    is the broadcast of the shapes of the tensors `shaped_as` (shape_of)."""
    shape, dtype, device = like
    if shape is None:
        shape = torch.broadcast_shapes(*(tensor.shape for tensor in shaped_as))
    tensor = torch.empty((), dtype=dtype, device=device).expand(shape)
    tensor.keeps = [value for value in inputs if isinstance(value, torch.Tensor)]
    return tensor


# views that need their input's layout to be one a view can take (reshape's rule)
LAYOUT_VIEWS = {aten.view.default, aten._unsafe_view.default}


def view_of_the_bytes(tensor, shape):
    """`tensor` viewed as `shape`; where its layout forbids the view, the same bytes taken as
    laid out contiguously, then viewed. An operation that reads a stand-in (no layout: every
    stride 0) lays its output out as its other inputs are, so a value can reach a view in
    another layout than the graph recorded (a transposed one, from attention's heads); in
    inductor it had the recorded one. Only the layout differs: an alias of a dense value's
    bytes holds what the graph's view would. A value not dense (a slice of such a value) stops
    the run, and the estimate runs the graphs unfused (predict.py)."""
    try:
        return tensor.view(shape)
    except (RuntimeError, ValueError):
        if not torch._prims_common.is_non_overlapping_and_dense_or_false(tensor):
            raise
        contiguous = torch._prims_common.make_contiguous_strides_for(tensor.shape)
        return tensor.as_strided(tensor.shape, contiguous, tensor.storage_offset()).view(shape)


def with_fusion(graph):
    """`graph` (a GraphModule) with each value that inductor fuses away replaced by a stand-in,
    and each view that needs a layout taken of the value's bytes (view_of_the_bytes)."""
    for node in list(graph.graph.nodes):
        if is_operator(node) and node.target in LAYOUT_VIEWS:
            node.target = view_of_the_bytes
        elif fused_away(node):
            value, (shape, shaped_as) = node.meta["val"], shape_of(node)
            inputs = [] if node.target in FILLS else node.all_input_nodes  # (a fill reads none)
            with graph.graph.inserting_before(node):
                replacement = graph.graph.call_function(
                    stand_in, ((shape, value.dtype, value.device), shaped_as, *inputs))
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
# inductor writes a kernel's output into the buffer of an input that dies there (its
# inplace_buffers and buffer reuse), which the fused run does not emulate: it holds both for the
# kernel's time. Measured on tiny's 05k, each block compiled, at budgets 0.25 and 0.5: the run
# peaked 1.4% below the fused prediction beyond the batch (a CPU, docs/estimator.md)
NOT_EMULATED_REUSE = 0.02


def measured_peak(run):
    """A compiled CPU run's peak as the estimate counts (its record `run`): the allocator's
    count (common/compiled_memory.py) without the scratch space an operation allocates and
    frees inside itself, which neither MemTracker nor the estimate sees (bitsandbytes' 8-bit
    AdamW on a CPU: each tensor's states in float32)."""
    return run.get("peak_without_scratch_bytes", run["peak_memory_bytes"])


def within_bound(run, record):
    """Whether a compiled CPU run's peak (its record `run`, measured_peak) lies within the range
    its estimate `record` states: at most the unfused peak, and at least the fused prediction
    less what the allocator's count cannot see and MemTracker's does: tensors made before the
    step other than the model's and its optimizer's state, that is the batch (MemTracker counts
    it once the model takes a view of it, as 04's micro-batches are) and an optimizer's own
    small tensors (OPTIMIZERS_OWN), and the buffers inductor reuses (NOT_EMULATED_REUSE). The
    prediction, the range's lower side, is what the estimate answers with and what "fits" reads:
    a compiled run is expected at or a little below it, never above the unfused side."""
    predicted, unfused = record["allocated_bytes"], record["unfused_allocated_bytes"]
    below = record["batch_bytes"] + OPTIMIZERS_OWN + NOT_EMULATED_REUSE * predicted
    return predicted - below <= measured_peak(run) <= unfused
