"""Every change the estimate makes inside PyTorch (2.13) while a fake run lasts, in one place.

Each piece works around one place where fake tensors behave unlike real ones, makes a CPU
answer as CUDA would (estimate/gpu_choices.py says why), keeps a script from starting real processes, or
saves MemTracker bookkeeping the estimate does not need; each says why it is harmless, and each
context manager puts back what it replaced.
"""
import functools
import sys
import weakref
from contextlib import contextmanager

import torch
import torch._functorch.config
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor, FakeTensorMode
from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker
from torch.utils._pytree import tree_map_only

from estimate.contract import EstimateError
from estimate.gpu_choices import foreach_as_on_cuda

DEVICE_QUERY = torch.ops.prim.device.default
BATCH_NORM = torch.ops.aten.native_batch_norm.default
HALF_TYPES = (torch.float16, torch.bfloat16)
# arguments that FakeTensorMode's cache key holds as they are, after their type
KEYED_AS_THEY_ARE = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device,
                               torch.layout, torch.memory_format})


class FakeModeReadingZeros(FakeTensorMode):
    """FakeTensorMode in which reading back a value it does not know (`.item()`) gives 0, and
    batch normalisation keeps its statistics in the dtype the real kernel keeps them in.

    Values it knows, it gives: scalars made from Python numbers, such as the optimizers' step
    counters, are tracked as constants through the ops on them.
    """

    def __init__(self, *args, cuda_batch_norm=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuda_batch_norm = cuda_batch_norm  # the GPU emulation: CUDA's kernel's dtypes

    # operators that take operators (a compiled graph's random numbers that a checkpointed block
    # saves): their rules, registered for FakeTensorMode itself (which this is not), send them
    # to its __torch_dispatch__, where they go here
    supports_higher_order_operators = True

    def dispatch(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._local_scalar_dense.default
                and getattr(args[0], "constant", None) is None):
            return torch.zeros((), dtype=args[0].dtype).item()
        out = super().dispatch(func, types, args, kwargs)
        if func is BATCH_NORM:
            out = self.batch_norm_statistics(args, out)
        return out

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
        """FakeTensorMode's key for its cache of operations' outputs, of the arguments `args` (a
        list or tuple): each of this mode's fake tensors as one tuple of the facts the stock key
        flattens out of it one by one (a third of a fake run's time went to that), every other
        argument as the stock key holds it. The same facts, so the same operations share a key
        (tests/estimate/test_estimate.py compares both keys over a run), less its memory format,
        which its shape and strides decide. With a shape environment (symbolic sizes, which this
        mode never has), the stock key."""
        if self.shape_env is not None or type(args) not in (list, tuple):
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        result += (type(args), len(args))
        for arg in args:
            kind = type(arg)
            if (kind is FakeTensor and arg.fake_mode is self and arg.constant is None
                    and arg.layout is torch.strided):
                result.append((arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                               arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized,
                               arg.is_conj(), arg.is_neg(), arg.is_inference()))
            elif kind in KEYED_AS_THEY_ARE:
                result += (kind, arg)  # (the type too: 1 and 1.0 are equal keys)
            else:  # (a stock key's (tuple, "length_1") first: never one of the above's)
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def batch_norm_statistics(self, args, out):
        """native_batch_norm's outputs with the saved mean and inverse standard deviation (kept
        for backward, one per channel) in float32 where the real kernel keeps them so.

        PyTorch's shape function gives them the input's dtype on a CPU. The CPU kernel does so
        only when the weights share that dtype; a float16 input with float32 weights (a
        convolution under float16 autocast, step 02) keeps them in float32. CUDA's kernel keeps
        them in float32 for every half-precision input (its accumulation type).
        """
        output, mean, invstd = out
        weight = args[1]
        mixed = weight is not None and weight.dtype != args[0].dtype
        if mean.dtype in HALF_TYPES and (self.cuda_batch_norm or mixed):
            mean, invstd = mean.to(torch.float32), invstd.to(torch.float32)
        return output, mean, invstd


@contextmanager
def swappable_fake_parameters(fake_mode):
    """Let `Module.to()` swap fake parameters, as it swaps real ones.

    `Module._apply` swaps a FakeTensor parameter for its converted copy with swap_tensors, which
    refuses tensors that have weak references; the fake mode's memo of views holds one on every
    parameter, so `model.to(dtype)` fails with "Cannot swap t1 because it has weakref". Dropping
    those memo entries first is harmless: the memo only saves re-converting the same tensor.
    """
    original = torch.utils.swap_tensors
    memo = fake_mode.fake_tensor_converter.tensor_memo

    def swap_tensors(first, second):
        # the memo's references are KeyedRefs; keep no reference to them, or they stay alive
        keys = [ref.key for tensor in (first, second) for ref in weakref.getweakrefs(tensor)
                if isinstance(ref, weakref.KeyedRef)]
        for key in keys:
            memo.pop(key, None)
        return original(first, second)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextmanager
def device_meshes_made_for_real():
    """Let fully_shard() build its default DeviceMesh from real tensors inside the fake run.

    A DeviceMesh computes each rank's coordinates with data-dependent operators, which fake
    tensors cannot run; the mesh holds no model memory, so it is made outside the fake mode.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fully_shard
    original = _fully_shard._init_default_mesh

    def init_default_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    _fully_shard._init_default_mesh = init_default_mesh
    try:
        yield
    finally:
        _fully_shard._init_default_mesh = original


@contextmanager
def sharding_propagation_apart():
    """Let DTensor work out its output shapes in a fake mode of its own, as it does outside one.

    DTensor runs each new operator once on empty tensors of the full, unsharded shape to learn
    its output's shape; it reuses the fake mode it finds active. Inside the fake run that is the
    run's own mode, and MemTracker, which skips only ops of another fake mode, would count those
    full-size tensors as GPU memory (all parameters at once in a foreach optimizer step).
    """
    from torch.distributed.tensor import _sharding_prop
    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextmanager
def cuda_optimizer_defaults():
    """While inside, optimizers with foreach=None pick their CUDA default (foreach)."""
    modules = [module for name, module in list(sys.modules.items())
               if name.startswith("torch.optim.") and hasattr(module, "_default_to_fused_or_foreach")]
    originals = [module._default_to_fused_or_foreach for module in modules]
    for module in modules:
        module._default_to_fused_or_foreach = foreach_as_on_cuda
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module._default_to_fused_or_foreach = original


@contextmanager
def dropout_as_on_cuda():
    """While inside, a dropout in training keeps a boolean mask for backward, as CUDA's does.

    ATen's dropout runs the fused native_dropout on CUDA tensors (is_fused_kernel_acceptable in
    aten/src/ATen/native/Dropout.cpp: CUDA, 0 < p < 1, not empty), which keeps a one-byte mask;
    on the CPU it multiplies by a noise tensor of the input's dtype and keeps that (four bytes an
    element in float32). In-place dropout takes the composite path on both."""
    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


INIT_PROCESS_GROUP = dist.init_process_group  # the real one, for the fake group


@contextmanager
def reduce_scatters_copying_their_input():
    """Let each reduce-scatter hold a copy of its whole input while it runs, as gloo's does.

    On the CPU (gloo) a reduce-scatter all-reduces a copy of its whole input (N times its
    output), and copies this process's chunk out of it as the work is waited on: MemTracker
    meets the copy as the chunk is taken and sees it go as the call returns and drops the work.
    The fake group copies nothing, so here each call allocates the copy and drops it before it
    returns. Under checkpointing, where activations are few, that moment can be a run's peak (a
    2-layer Llama under 09: 6.6% above the estimate without it). Synchronous calls only (FSDP's);
    not where a GPU is emulated (NCCL makes no copy). On the CPU gloo's worker thread lets go of
    the copy as the call returns, or at times a few operations later: then a run's peak may be
    higher by up to the copy (tests/support/sharded_runs.py waits for the thread). An all-to-all
    (08a) needs nothing here: gloo's of CPU tensors, as NCCL's, reads the input it is given and
    writes the output it is given, copying neither (ProcessGroupGloo's AsyncAlltoallWork), so the
    fake group's all_to_all_single counts as the real one (tested to the byte).
    """
    from torch.distributed import distributed_c10d
    original = distributed_c10d.reduce_scatter_single

    @functools.wraps(original)
    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = original(output, input, op=op, group=group, async_op=async_op)
        if not async_op:
            torch.empty_like(input, memory_format=torch.contiguous_format)  # gloo's copy, gone
        return work

    distributed_c10d.reduce_scatter_single = dist.reduce_scatter_single = reduce_scatter_single
    try:
        yield
    finally:
        distributed_c10d.reduce_scatter_single = dist.reduce_scatter_single = original


@contextmanager
def quantization_maps_computed_once():
    """bitsandbytes' 8-bit optimizers build their quantization maps (256 values each) from
    small tensors read back with `.tolist()`, once per optimizer: with Adam stepped in backward,
    once per parameter, which on fake tensors took half of a Llama estimate. Inside, the values
    are computed once, for real, and each call makes its map as the original's last lines do (one
    tensor of them, divided in place by its maximum): the same allocation, and the true values.
    Harmless: the temporaries it no longer makes are a few hundred bytes, freed at once, while
    the optimizer is created, far from any peak. Does nothing without bitsandbytes imported."""
    functional = sys.modules.get("bitsandbytes.functional")
    if functional is None:
        yield
        return
    original = functional.create_dynamic_map
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @functools.cache
    def values(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs).tolist()

    def create_dynamic_map(*args, **kwargs):
        code = torch.tensor(values(*args, **kwargs))
        code /= code.max()
        return code

    functional.create_dynamic_map = create_dynamic_map
    try:
        yield
    finally:
        functional.create_dynamic_map = original


@contextmanager
def process_group_only_through_init_distributed(script_name):
    """A script that starts a process group itself would wait for processes that never come."""
    def refuse(*args, **kwargs):
        raise EstimateError(
            f"{script_name} calls torch.distributed.init_process_group itself; --estimate can "
            "only run a script that joins its process group through `init_distributed` "
            "(from common.distributed import init_distributed), for which it makes a fake group")
    dist.init_process_group = refuse
    try:
        yield
    finally:
        dist.init_process_group = INIT_PROCESS_GROUP


@contextmanager
def sharded_classes_forgotten(script_module):
    """fully_shard() gives each class it shards a subclass, kept in a dict for the process's
    life (get_cls_to_fsdp_cls, in torch.distributed.fsdp._fully_shard). A class the script defines (09's
    CheckpointedBlock) is defined anew by each run's fresh module, and kept there it would keep
    that module, its stand-ins and its run alive in a worker that runs hundreds: its entries
    go when the run ends."""
    try:
        yield
    finally:
        from torch.distributed.fsdp._fully_shard._fully_shard import get_cls_to_fsdp_cls
        classes = get_cls_to_fsdp_cls()
        for defined in [defined for defined in classes if defined.__module__ == script_module]:
            del classes[defined]


@contextmanager
def position_ids_of_one_sequence():
    """transformers' test for packed sequences answered for fake position ids as for real ones.
    A decoder given no attention mask (--pack) asks whether its position ids restart within a
    sequence (find_packed_sequence_indices); asked of fake ids it says yes (it cannot read them)
    and builds a causal mask of length x length, where a real run builds none and asks
    attention for is_causal. The scripts pass no position ids, and those a decoder makes itself,
    0 to length - 1, hold one sequence: None, as the real test answers."""
    import transformers.masking_utils as masking
    original = masking.find_packed_sequence_indices

    def one_sequence(position_ids):
        return None if isinstance(position_ids, FakeTensor) else original(position_ids)

    masking.find_packed_sequence_indices = one_sequence
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


@contextmanager
def compiled_graphs_run_by_operations(fused):
    """Within it, torch.compile's inductor backend (the default) runs the graphs it is given an
    operation at a time instead of generating kernels for them (estimate/compiled.py's
    run_as_compiled; `fused`: with the pointwise operations inductor fuses held nowhere), so
    that the tracker sees them. Graphs compiled before (real kernels, in a test's process) are
    dropped on the way in, and these on the way out."""
    wrapper, module = torch._TorchCompileInductorWrapper, torch.nn.Module
    generating, calling = wrapper.__call__, module.__call__

    def run_by_operations(self, model, inputs, **_):
        from estimate.compiled import run_as_compiled
        return run_as_compiled(fused)(model, inputs)

    def call(self, *args, **kwargs):
        # a module compiled in place (`model.compile()`) runs as torch.compile(model) would:
        # marked as an optimized module, where the tracker's module hooks stand aside rather
        # than being traced into the graph (which they would break at every module)
        if self._compiled_call_impl is None:
            return calling(self, *args, **kwargs)
        from torch._dynamo.eval_frame import _set_in_optimized_module
        with _set_in_optimized_module():
            return self._compiled_call_impl(*args, **kwargs)

    def forget_compiled():
        if "torch._dynamo" in sys.modules:  # (imported by the first torch.compile)
            torch._dynamo.reset()

    forget_compiled()
    wrapper.__call__, module.__call__ = run_by_operations, call
    # 05k and 10 set the compiler's memory budget for the process: restored after the run
    budget = torch._functorch.config.activation_memory_budget
    try:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            yield
    finally:
        wrapper.__call__, module.__call__ = generating, calling
        forget_compiled()


def each_tensor(kind, function, tree):
    """tree_map_only(kind, function, tree) as MemTracker and FSDPMemTracker call it, on every
    operation's output and every module's inputs: for `function`'s calls alone, its result
    unused. An output is most often a tensor or a tuple of tensors, walked here without
    flattening and rebuilding the tree (a tenth of a fake run); any other tree (or kind) goes
    to tree_map_only, which calls `function` on the same tensors in the same order."""
    if kind is not torch.Tensor:
        tree_map_only(kind, function, tree)
    elif isinstance(tree, torch.Tensor):
        function(tree)
    elif type(tree) in (tuple, list) and all(isinstance(item, torch.Tensor) or item is None
                                             for item in tree):
        for item in tree:
            if item is not None:
                function(item)
    else:
        tree_map_only(kind, function, tree)


@contextmanager
def outputs_walked_directly():
    """While inside, the trackers' walk over tensors is each_tensor (their result is unused at
    every call: torch/distributed/_tools/mem_tracker.py, fsdp2_mem_tracker.py)."""
    before = {module: module.tree_map_only for module in (mem_tracker, fsdp2_mem_tracker)}
    for module in before:
        module.tree_map_only = each_tensor
    try:
        yield
    finally:
        for module, walk in before.items():
            module.tree_map_only = walk


def for_fake_tensors(tracker):
    """The tracker (common/memory.py's, which keeps only the overall peak), answering the
    queries fake tensors make without a trip through the dispatcher, and counting compiled
    graphs as they run."""
    tracker.__class__ = fake_tensor_tracker_class(type(tracker))
    return tracker


@functools.cache
def fake_tensor_tracker_class(tracker_class):
    class FakeTensorTracker(tracker_class):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is DEVICE_QUERY and isinstance(args[0], FakeTensor):
                # asked of nearly every tensor by autograd and by optimizers' grouping: answer
                # what FakeTensor would answer, without a second trip through the dispatcher
                return _DISPATCH_META_HANDLERS[func](args)
            if func.namespace == "prim":  # other queries about a tensor: no memory either
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        # a compiled graph's operators that take operators (the random numbers a checkpointed
        # block saves, 05c compiled): tracked by what they return
        supports_higher_order_operators = True

        @classmethod
        def ignore_compile_internals(cls):
            # torch.compile compiles under this tracker, which then sees the compiled graphs run
            # (estimate/compiled.py's backend runs them operation by operation)
            return True

    FakeTensorTracker.__name__ = tracker_class.__name__
    return FakeTensorTracker
