"""Peak memory of training and of model creation, with a breakdown by what the memory holds.

On every device the first optimizer steps run under PyTorch's MemTracker, which counts tensor
storages exactly (identical across runs with the same seed) and sorts them into parameters,
gradients, optimizer state, activations and temporaries: the peak and its breakdown come from
the same steps. A training run reaches its peak within its first two optimizer steps that are
taken (a float16 gradient scaler may skip some: those are tracked too, up to a limit). The
tracker slows the steps it watches, so those steps are left out of the training time; it keeps
the overall peak only (OverallPeakOnly), not each module's. On CUDA the run also reports the
caching allocator's own figures over the whole run, evaluation included:
`torch.cuda.max_memory_allocated` and `max_memory_reserved` (the figure the study published);
the cache is emptied first, so they count this run alone. The same two figures read when the
tracked steps end (`cuda_steps_max_*`) cover the window that `--estimate` predicts.
"""
import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.fsdp import FSDPModule

from common.breakdown import BREAKDOWN_KEYS, fold_breakdown, model_state_bytes_per_parameter
from common.gpu_support import check_bfloat16

# host memory, where a script keeps what it offloads (05e, 05f); --estimate puts it apart from
# the GPU it emulates (estimate/contract.py)
HOST = torch.device("cpu")

TRACKED_STEPS = 2  # optimizer steps taken under the tracker
MAX_TRACKED_STEPS = 10  # steps tracked at most, while a gradient scaler skips optimizer steps


def device_snapshot(snapshot, device):
    """The part of a MemTracker snapshot that belongs to `device` (all zeros if it saw none)."""
    for dev, stats in snapshot.items():
        if dev.type == device.type:
            return stats
    return {}


class Snapshot(dict):
    """A tracker's {device: {category: bytes}}, copied; deepcopy (MemTracker copies the snapshot
    at every module call) copies it as fast as a copy of ints can be made."""

    def __init__(self, snapshot):
        super().__init__((device, dict(stats)) for device, stats in snapshot.items())

    def __deepcopy__(self, memo):
        return Snapshot(self)


class OverallPeakOnly:
    """Mixed into MemTracker and FSDPMemTracker. After every operation they update the peak of
    every module seen so far, a loop over the model's modules that takes most of a tracked
    step's time; the meter reads only the overall peak, updated here as they update it."""

    def _update_peak_stats(self, peak_state):
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)

    def get_tracker_snapshot(self, type="current"):
        if type not in ("current", "peak"):
            raise ValueError(f"Invalid type {type}")
        return Snapshot(self._curr_mem_snap if type == "current" else self._peak_mem_snap)


class ShardedMemTracker(OverallPeakOnly, FSDPMemTracker):
    """FSDPMemTracker (steps 07-09), keeping only the overall peak. `optimizer` may be a list
    (10's --optimizer-in-backward under FSDP: one per weight); FSDPMemTracker takes one."""

    def __init__(self, model, optimizer):
        self.optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        super().__init__(model, self.optimizers[0])

    def _instrument_optimizer(self):
        handles = []
        for self._optm in self.optimizers:  # each optimizer's state counted as its state
            super()._instrument_optimizer()
            handles += self._optimizer_hook_handles
        self._optimizer_hook_handles = tuple(handles)  # all removed when the tracker stops


class NoHook:
    def remove(self):
        pass


class FrozenWeightsMemTracker(OverallPeakOnly, MemTracker):
    """MemTracker, keeping only the overall peak, for models with frozen weights too (07a): torch
    2.13's puts a gradient hook on every parameter it meets, and a parameter that requires no
    gradient refuses hooks. Frozen ones are marked as hooked already, so it counts them as
    parameters and hooks only the others. A 4-bit weight's scales (07b: bitsandbytes keeps them
    beside the weight, not as parameters) are counted with the parameters."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        from common.model import quantization_tensors  # (the script has imported it)
        for parameter in module.parameters():
            if not parameter.requires_grad:
                self._param_to_grad_hook_handles.setdefault(parameter, (NoHook(), NoHook()))
            for scale in quantization_tensors(parameter):
                self._update_and_maybe_create_winfos(scale, _MemRefType.PARAM)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def memory_tracker(model, optimizer):
    """A MemTracker that knows the model and the optimizer (or list of optimizers) created
    before it starts."""
    tracker = FrozenWeightsMemTracker()
    tracker.track_external(model, *(optimizer if isinstance(optimizer, list) else [optimizer]))
    return tracker


def is_compiled(model):
    """True when torch.compile was applied to the model or to any of its modules (steps 07-09
    compile each transformer block)."""
    return any(isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
               or getattr(module, "_compiled_call_impl", None) is not None
               for module in model.modules())


def compile_seconds():
    """Seconds torch.compile has spent compiling in this process so far."""
    return torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0)


def weights_in(parameter):
    """The numbers a parameter stands for: its elements, or for a 4-bit one (07b's Params4bit,
    two weights packed in each byte) the elements of the weight it was quantized from."""
    quantized = getattr(parameter, "quant_state", None)
    return quantized.shape.numel() if quantized is not None else parameter.numel()


def is_sharded(model):
    """True when FSDP2's fully_shard has been applied to the model itself (FSDPMemTracker
    needs the root sharded; steps 07-09 shard the blocks and then the root)."""
    return isinstance(model, FSDPModule)


class MemoryMeter:
    """Wrap each optimizer step in `meter.step()`; read `meter.result()` at the end.

    `optimizer` may be a list of optimizers that each step once per training step (04a: one
    per parameter, stepped during backward); the first one's steps are counted.

    A sharded model (steps 07-09) is tracked by FSDPMemTracker, which tells a process's shards
    from the parameters gathered for a block; any other by MemTracker; a compiled one (--compile),
    which neither can watch, from the allocator's own events (common/compiled_memory.py).
    """

    def __init__(self, device, model, optimizer, snapshot=None):
        self.device, self.model, self.optimizer = device, model, optimizer
        self.snapshot = snapshot  # --memory-snapshot: on CUDA, the allocator's history of the tracked steps
        self.from_allocations = is_compiled(model)  # neither tracker can watch compiled code
        if self.from_allocations:
            from common.compiled_memory import AllocationTracker  # needed only under --compile
            self.tracker_factory = AllocationTracker
        else:
            self.tracker_factory = ShardedMemTracker if is_sharded(model) else memory_tracker
        # the model's parameters, whole (a sharded one is a DTensor, whose shape is the whole's),
        # and the share of them this process holds: 1/N of each when N processes shard them
        self.parameter_count = sum(weights_in(parameter) for parameter in model.parameters())
        self.trainable_count = sum(parameter.numel() for parameter in model.parameters()
                                   if parameter.requires_grad)  # fewer when some are frozen (07a)
        self.parameters_held = self.parameter_count / (dist.get_world_size() if is_sharded(model)
                                                       else 1)
        self.tracker = None
        self.steps_seen = self.steps_taken = 0
        self.first_optimizer = optimizer[0] if isinstance(optimizer, list) else optimizer
        self.first_optimizer.register_step_post_hook(self.count_step_taken)  # not for a skipped step
        self.tracked_seconds = 0.0
        self.steps_allocator = {}  # on CUDA, the allocator's peaks over the tracked steps
        self.snapshot_written = False
        self.peak_bytes, self.breakdown = 0, dict.fromkeys(BREAKDOWN_KEYS, 0)
        self.peak_without_scratch_bytes = 0  # compiled: what MemTracker would count
        if device.type == "cuda":
            check_bfloat16(device, model, self.from_allocations)  # V100, T4: emulated bfloat16
            torch.cuda.synchronize(device)  # creation's queued kernels are not training's
            torch.cuda.empty_cache()  # else segments cached during creation count as training's
            torch.cuda.reset_peak_memory_stats(device)

    def synchronize(self):
        """Wait for the GPU's queued work (kernels run asynchronously; the CPU's do not)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def count_step_taken(self, optimizer, args, kwargs):
        self.steps_taken += 1

    def tracking(self):
        """Whether the coming step is tracked: until TRACKED_STEPS optimizer steps were taken."""
        return self.steps_taken < TRACKED_STEPS and self.steps_seen < MAX_TRACKED_STEPS

    def forget_previous_forward(self, module, args):
        # MemTracker refuses a second forward of the root module unless told it is a new
        # iteration; with gradient accumulation one step runs several.
        if module is self.model:
            self.tracker.reset_mod_stats()
            return
        # A part of the model called again from outside it (05g: the blocks once per micro-batch,
        # the output layer once per piece of the sequence) would be refused likewise: its own
        # statistics start anew, which leaves the overall peak that the meter reads as it is.
        modules = getattr(self.tracker, "_mod_tracker", None)
        if (modules is not None and not modules.is_bw and modules.parents == {"Global"}
                and module in self.tracker.memory_tracking):
            del self.tracker.memory_tracking[module]

    @contextmanager
    def step(self):
        """Track this step while fewer than TRACKED_STEPS optimizer steps were taken; later
        steps run untouched."""
        if not self.tracking():
            yield
            return
        self.steps_seen += 1
        if self.steps_seen == 1 and self.snapshot and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
        if self.tracker is None:
            self.tracker = self.tracker_factory(self.model, self.optimizer)
        # registered before the tracker's own global hooks, so it runs first (not on compiled
        # code: a global hook that comes and goes would make torch.compile compile again)
        register = torch.nn.modules.module.register_module_forward_pre_hook
        hook = None if self.from_allocations else register(self.forget_previous_forward)
        self.synchronize()  # the time left out is this step's, also on a GPU
        start, compiling = time.perf_counter(), compile_seconds()
        try:
            with self.tracker, removing_input_hooks():  # a new peak on entering: keep the highest
                yield
        finally:
            if hook is not None:
                hook.remove()
            self.synchronize()
            # compilation (the first step's, under --compile) stays in the training time
            self.tracked_seconds += time.perf_counter() - start - (compile_seconds() - compiling)
        stats = device_snapshot(self.tracker.get_tracker_snapshot("peak"), self.device)
        if stats.get("Total", 0) > self.peak_bytes:
            self.peak_bytes, self.breakdown = stats["Total"], fold_breakdown(stats)
        if self.from_allocations:  # operations' own scratch space left out (compiled_memory.py)
            without = device_snapshot(self.tracker.peak_without_scratch, self.device) or 0
            self.peak_without_scratch_bytes = max(self.peak_without_scratch_bytes, without)
        if self.device.type == "cuda" and not self.tracking():  # the window the estimate predicts
            self.steps_allocator = {
                "cuda_steps_max_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "cuda_steps_max_reserved_bytes": torch.cuda.max_memory_reserved(self.device)}
            self.write_snapshot()

    def write_snapshot(self):
        """--memory-snapshot: the allocator's history since the first tracked step, once."""
        if self.snapshot and self.device.type == "cuda" and self.steps_seen and not self.snapshot_written:
            torch.cuda.memory._dump_snapshot(snapshot_file(self.snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_written = True

    def result(self):
        """Peak bytes and its breakdown (tracked steps), the model's parameters and its state per
        parameter at the peak, and on CUDA the allocator's own peaks over the whole run."""
        result = {"peak_memory_bytes": self.peak_bytes, "breakdown_bytes": self.breakdown,
                  "parameter_count": self.parameter_count,
                  "trainable_parameter_count": self.trainable_count,
                  "model_state_bytes_per_parameter": model_state_bytes_per_parameter(
                      self.breakdown, self.parameters_held),
                  "tracked_steps": self.steps_seen,
                  # how the peak was counted: a compiled model's steps escape MemTracker
                  "memory_counted_by": ("allocator events (torch.profiler)"
                                        if self.from_allocations else "MemTracker")}
        if self.from_allocations:
            result["peak_without_scratch_bytes"] = self.peak_without_scratch_bytes
        self.write_snapshot()  # a run of one step: its history all the same
        if self.device.type == "cuda":
            result["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            result["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            result.update(self.steps_allocator)  # absent if training stopped before its 2nd step
        if dist.is_available() and dist.is_initialized():
            result = highest_over_processes(result)
        return result


def snapshot_file(path):
    """`path`, or with several processes each its own: s.pickle -> s.rank1.pickle."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return path
    path = Path(path)
    return str(path.with_name(f"{path.stem}.rank{dist.get_rank()}{path.suffix}"))


@contextmanager
def removing_input_hooks():
    """Remove, when the block ends, the gradient hooks the tracker puts on module inputs.

    MemTracker's module tracker (torch 2.13) hooks each module's inputs with
    `register_multi_grad_hook`, whose hook keeps the inputs' grad_fn in its closure: a cycle
    through the autograd graph's C++ nodes that the garbage collector cannot see, so those
    nodes outlive the step. On a sharded model (07-09) they also hold FSDP's own hooks, and with
    them the model and its process group: the group then outlives `destroy_process_group`, and
    its gloo threads can abort the interpreter at exit ("terminate called without an active
    exception"). The block's backward has run when it ends, so the hooks have done their work.
    """
    handles = []
    register = mod_tracker.register_multi_grad_hook

    def register_and_keep(*args, **kwargs):
        handle = register(*args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = register_and_keep
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()


def every_process(result):
    """`result` as each process of the group has it (a collective: every process calls it), or
    [result] when there is no group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [result]
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


ALLOCATOR_FIGURES = ("cuda_max_allocated_bytes", "cuda_max_reserved_bytes",
                     "cuda_steps_max_allocated_bytes", "cuda_steps_max_reserved_bytes")


def highest_over_processes(result):
    """The result of the process with the highest tracked peak (its breakdown with it), with
    every process's peak beside it; on CUDA each allocator figure is its own highest over the
    processes (one process may reserve most while another allocates most), also per process."""
    results = every_process(result)
    highest = max(results, key=lambda each: each["peak_memory_bytes"])
    combined = {**highest, "rank_peak_memory_bytes": [each["peak_memory_bytes"] for each in results]}
    for name in ALLOCATOR_FIGURES:
        if name in highest:
            combined[name] = max(each[name] for each in results)
            combined[f"rank_{name}"] = [each[name] for each in results]
    if "peak_without_scratch_bytes" in highest:  # compiled
        combined["peak_without_scratch_bytes"] = max(each["peak_without_scratch_bytes"] for each in results)
    return combined


@dataclass
class Creation:
    """Model creation's peaks: on the training device and, when that is a GPU, in host memory."""
    peak_bytes: int = 0
    host_peak_bytes: int = 0

    def result(self):
        """As a record's fields; with several processes, the highest and every process's."""
        result = {"init_peak_memory_bytes": self.peak_bytes,
                  "init_host_peak_memory_bytes": self.host_peak_bytes}
        if dist.is_available() and dist.is_initialized():
            results = every_process(result)
            result = {name: max(each[name] for each in results) for name in result}
            result["rank_init_peak_memory_bytes"] = [each["init_peak_memory_bytes"]
                                                     for each in results]
        return result


@contextmanager
def measure_creation(device):
    """Peak memory while the block runs (model creation); read `.peak_bytes` after it.

    MemTracker counts the tensors of every device: on the CPU it gives both figures; on CUDA the
    device figure is the allocator's (max_memory_allocated during the block, less what was
    allocated before) and MemTracker gives the host's, where steps 01-05 build the float32 model.
    """
    creation = Creation()
    gc.collect()  # a previous model still in a reference cycle must not be freed in the block
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    tracker = MemTracker()
    with tracker:
        yield creation
    peak = tracker.get_tracker_snapshot("peak")
    creation.host_peak_bytes = device_snapshot(peak, torch.device("cpu")).get("Total", 0)
    if device.type == "cuda":
        creation.peak_bytes = torch.cuda.max_memory_allocated(device) - base
    else:
        creation.peak_bytes = device_snapshot(peak, device).get("Total", 0)
