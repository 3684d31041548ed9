"""What a compiled model's forward saves for backward, and what its backward recomputes, from
AOTAutograd's own partition of the joint graph, on fake tensors.

torch.compile traces forward and backward into one joint graph and splits it in two
(`min_cut_rematerialization_partition`, inductor's partitioner): the forward graph's extra
outputs are what backward reads, and under `torch._functorch.config.activation_memory_budget`
(05k) the partitioner saves less and recomputes the rest in backward. `partition()` runs that
split, with inductor's decompositions and partition function, through a backend that keeps the
two graphs instead of generating kernels from them, so it needs no GPU, no compiler toolchain and
no data: on fake tensors ViT-L/16's takes about a minute on 2 cores. It counts:

- saved_bytes: the tensors backward's graph takes from forward's, the model's own weights and
  inputs left out (they exist whatever is saved): the activations a compiled step keeps between
  its forward and its backward;
- forward_flops and backward_flops: FlopCounterMode's count of each graph as it runs, so a
  budget's recomputation is its backward's FLOPs beyond the budget-1.0 backward's.

It is not a prediction of a compiled run's peak: the kernels inductor generates keep buffers of
their own, which only a GPU (or the CPU run, for CPU kernels) shows; benchmarks/recompute_flops.py
prints these counts beside measured CPU runs of 05k (docs/branches.md).
"""
from dataclasses import dataclass

import torch
import torch._functorch.config
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.compile_fx import partition_fn as inductor_partition
from torch._inductor.decomposition import select_decomp_table
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class Partition:
    saved_bytes: int = 0     # what backward reads from forward, weights and inputs left out
    forward_flops: int = 0
    backward_flops: int = 0
    graphs: int = 0          # forward graphs compiled (more than one: a graph break)


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

    # inductor's own decompositions and partition (its joint-graph passes, then the min-cut
    # partition): the graphs inductor would be given
    backend = aot_autograd(fw_compiler=keeper("forward"), bw_compiler=keeper("backward"),
                           decompositions=select_decomp_table(), partition_fn=inductor_partition)
    torch._dynamo.reset()  # graphs compiled earlier (another budget) would be reused otherwise
    with torch._functorch.config.patch(activation_memory_budget=budget):
        compiled = torch.compile(model, backend=backend)
        compiled(**inputs, labels=labels).loss.backward()
    torch._dynamo.reset()
    return found
