"""Peak memory of a compiled model's steps, counted from the allocator's own events.

MemoryMeter (common/memory.py) counts with PyTorch's MemTracker, a TorchDispatchMode, which
cannot watch compiled code: torch.compile (torch 2.13) does not compile a frame first reached
under such a mode; it runs it eagerly and marks its code never to be compiled again
(torch/_dynamo/convert_frame.py: "non-infra torch dispatch mode present"), so a compiled run
tracked by MemTracker would measure, and then train, the eager model. Nor could a dispatch mode
see the buffers of the code inductor generates, which are allocated without the dispatcher.

So the steps of a compiled model are watched by the profiler instead (torch.profiler with
profile_memory): it hears of every allocation and free from the allocator itself, compiled
code's included, and leaves compilation alone. The count starts where MemTracker's does, from
the model's parameters, buffers and gradients and the optimizer's state alive when the step
begins, adds everything allocated during the step and takes off what it frees. On the first
step of 01 (float32, eager) both count the same peak to the byte but for the labels
(tests/scripts/test_compile.py).
Elsewhere the allocator sees a little more and a little less: more, the buffers an operation
allocates for itself and frees before returning, which MemTracker, seeing only what operations
return, cannot (a bfloat16 matrix product on a CPU takes one: 0.19 MiB at the peak of 03's
first step); less, tensors made before the step that MemTracker counts once an operation returns
a view of them (the labels, of which the model's loss takes a view; 04's micro-batches of the
input batch, on a CPU) or that it saw made in an earlier watched step (the loss of the step
before).

Each block alive at the peak goes into the category MemTracker would give it, by what it is and
by what the profiler saw running when it was allocated: parameters and buffers (and, sharded,
the whole weights FSDP gathers); gradients (the blocks that are the parameters' gradients when
the optimizer step begins, counted from their allocation: MemTracker counts a gradient from when
autograd hands it over, a temporary until then); the optimizer's state and whatever
optimizer.step() allocates; temporaries (made during backward: autograd's, and FSDP's buffers
for its collectives); activations (made anywhere else: forward, loss).
"""
import os

import torch
from torch._C._profiler import RecordScope, _EventType
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.profiler import ProfilerActivity, _utils, profile

from common.model import quantization_tensors

# the profiler's record_function names whose allocations go to a category (the nearest wins),
# as MemTracker's and FSDPMemTracker's names, which memory.py folds into the five it reports
MADE_IN = [("FSDP::all_gather_copy_out", "Unsharded Param"), ("FSDP::all_gather", "All Gather"),
           ("FSDP::post_backward_reduce", "Reduce Scatter"), ("Optimizer.step#", "Optstate"),
           ("autograd::engine::evaluate_function", "Temp")]
MADE_ELSEWHERE = "Activation"


def storages(tensors):
    """{(device, data pointer): bytes} of the tensors' storages (a DTensor's local shard)."""
    found = {}
    for tensor in tensors:
        for storage in get_untyped_storages(tensor):
            if storage.nbytes():
                found[storage.device, storage.data_ptr()] = storage.nbytes()
    return found


def category_of(allocation):
    """The category of what the operation around `allocation` made (see MADE_IN)."""
    node = allocation.parent
    while node is not None:
        for name, category in MADE_IN:
            if node.name.startswith(name):
                return category
        node = node.parent
    return MADE_ELSEWHERE


_SEEN_WHOLE = {}  # an operator's name: whether a dispatch mode sees it as one operation


def seen_whole(name):
    """Whether the operator `name` (as the profiler names it: no overload) is one that a
    dispatch mode (MemTracker) sees as one operation, what it returns and not what its kernel
    allocates inside: a dispatched operator none of whose overloads decomposes above the
    dispatch modes (CompositeImplicitAutograd: aten::linear runs as aten::t and aten::addmm,
    which the mode sees). Not an operator's name (a backward function's, a user's scope): no."""
    if name not in _SEEN_WHOLE:
        overloads = [operator for operator in torch._C._dispatch_get_all_op_names()
                     if operator == name or operator.startswith(name + ".")]
        _SEEN_WHOLE[name] = bool(overloads) and not any(
            torch._C._dispatch_has_kernel_for_dispatch_key(operator, "CompositeImplicitAutograd")
            for operator in overloads)
    return _SEEN_WHOLE[name]


def whole_operation_ends(events):
    """{id(event): when the outermost operation seen whole around `event` (itself included)
    returns, in ns, or None} for the profiler's `events` (depth first: parents first). An
    operator called again inside itself (autocast's kernel casts, then calls it again; so do a
    DTensor's and a custom operation's autograd wrapper) reaches a dispatch mode as the inner
    call, and what the outer one does around it as operations of their own: the outer one is
    passed over."""
    operations = [event for event in events if event.typed[0] == _EventType.TorchOp
                  and event.typed[1].scope == RecordScope.FUNCTION]
    whole = {id(event) for event in operations if seen_whole(event.name)}
    for event in operations:
        if id(event) in whole:
            node = event.parent
            while node is not None:
                if node.name == event.name:
                    whole.discard(id(node))
                node = node.parent
    ends = {}
    for event in events:
        outer = None if event.parent is None else ends[id(event.parent)]
        ends[id(event)] = event.end_time_ns if outer is None and id(event) in whole else outer
    return ends


def scratch(allocations, ends):
    """The indices of `allocations` (in time order, frees included) that are an operation's own
    scratch space: allocated inside an operation that a dispatch mode sees whole (the outermost
    one: `ends`, whole_operation_ends) and freed before it returns. MemTracker never sees them,
    nor does the estimate (bitsandbytes' 8-bit AdamW on a CPU dequantizes each tensor's states
    to float32 inside its operation; a CPU's bfloat16 matrix product takes a buffer); the
    allocator does."""
    found, pending = set(), {}  # (device, pointer): (index, when its operation returns)
    for index, event in enumerate(allocations):
        fields = event.typed[1]
        key = (fields.device, fields.ptr)
        if fields.alloc_size > 0:
            pending[key] = (index, ends[id(event)])
        elif key in pending:
            made, returns = pending.pop(key)
            if returns is not None and event.start_time_ns <= returns:
                found.add(made)
    return found


class AllocationTracker:
    """Use as MemTracker is used by MemoryMeter: `with tracker:` around a step, then
    `get_tracker_snapshot("peak")`: {device: {"Total": bytes, category: bytes}}, the highest
    peak of the steps watched so far. `peak_without_scratch` {device: bytes}: the highest
    count of the same steps without operations' own scratch space (see scratch()), which is
    what MemTracker and the estimate count."""

    def __init__(self, model, optimizer):
        self.model = model  # `optimizer`: one, or a list of them (04a: one per parameter)
        self.optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.peak = {}  # device: {"Total": bytes, category: bytes}
        self.gradients = set()  # (device, pointer) of the gradients the optimizer step found
        self.optimizer_steps = []  # (start, end) in ns of the optimizer steps of the last step
        self.peak_without_scratch = {}  # device: bytes

    def state_at_start(self):
        """{(device, pointer): (bytes, category)} of the model's and optimizer's tensors."""
        parameters = [*self.model.parameters(), *self.model.buffers()]
        parameters += [tensor for parameter in self.model.parameters()  # 07b's 4-bit scales
                       for tensor in quantization_tensors(parameter)]
        # what an optimizer steps may be other tensors than the model's: 05f's host copies of
        # the weights, which MemTracker counts as optimizer state (the step returns them)
        stepped = [parameter for optimizer in self.optimizers for group in optimizer.param_groups
                   for parameter in group["params"]]
        gradients = [parameter.grad for parameter in [*self.model.parameters(), *stepped]
                     if parameter.grad is not None]
        state = [value for optimizer in self.optimizers for per_parameter in optimizer.state.values()
                 for value in per_parameter.values() if isinstance(value, torch.Tensor)]
        held = {}  # a later category wins: the model's parameters are its own, not the optimizer's
        for tensors, category in [(stepped, "Optstate"), (parameters, "Parameter"),
                                  (gradients, "Gradient"), (state, "Optstate")]:
            held.update({key: (nbytes, category) for key, nbytes in storages(tensors).items()})
        return held

    def note_gradients(self, optimizer, args, kwargs):
        gradients = [parameter.grad for group in optimizer.param_groups
                     for parameter in group["params"] if parameter.grad is not None]
        self.gradients |= set(storages(gradients))

    def note_gradient(self, parameter):
        """A model parameter's gradient, as backward finishes it: 05f moves it off the device
        and frees it before the optimizer's step, where note_gradients would look (04a's hook,
        which steps and frees it, may have run first: nothing left to note)."""
        if parameter.grad is not None:
            self.gradients |= set(storages([parameter.grad]))

    def __enter__(self):
        self.gradients.clear()
        self.start = self.state_at_start()
        self.hooks = [optimizer.register_step_pre_hook(self.note_gradients)
                      for optimizer in self.optimizers]
        self.hooks += [parameter.register_post_accumulate_grad_hook(self.note_gradient)
                       for parameter in self.model.parameters() if parameter.requires_grad]
        # kineto's own log lines (profiler_start, profiler_stop) would interleave with the run's
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc_info):
        self.profiler.__exit__(*exc_info)
        for hook in self.hooks:
            hook.remove()
        events = list(_utils.traverse_dfs(
            self.profiler.profiler.kineto_results.experimental_event_tree()))
        del self.profiler
        steps = [event.start_time_ns for event in events
                 if event.name.startswith("Optimizer.step#")]
        # under another dispatch mode (MemTracker, beside this count) some of the optimizer
        # step's allocations come without it as a parent in the event tree: its time tells
        self.optimizer_steps = [(event.start_time_ns, event.end_time_ns) for event in events
                                if event.name.startswith("Optimizer.step#")]
        allocations = sorted((event for event in events if event.typed[0] == _EventType.Allocation),
                             key=lambda event: event.start_time_ns)
        self.count(allocations, min(steps, default=None), whole_operation_ends(events))
        return False

    def count(self, allocations, step_start, ends):
        """Replay the step's allocations and frees from the state at its start; keep each
        device's highest total and the blocks alive then. `step_start`: when the optimizer step
        began, where the gradients it found are the blocks alive. `ends`: whole_operation_ends of
        the events, which tells an operation's scratch space (scratch())."""
        live = {key: (nbytes, category, None) for key, (nbytes, category) in self.start.items()}
        totals = {}
        for (device, _), (nbytes, _, _) in live.items():
            totals[device] = totals.get(device, 0) + nbytes
        peaks = {device: (total, dict(live)) for device, total in totals.items()}
        inside, scratch_held = scratch(allocations, ends), dict.fromkeys(totals, 0)
        for device, total in totals.items():
            self.peak_without_scratch[device] = max(self.peak_without_scratch.get(device, 0), total)
        gradients = set()  # the indices of the allocations that made gradients
        for index, event in enumerate(allocations):
            if step_start is not None and event.start_time_ns > step_start:
                gradients = {live[key][2] for key in self.gradients if key in live}
                step_start = None
            fields = event.typed[1]
            device, key = fields.device, (fields.device, fields.ptr)
            if fields.alloc_size > 0:
                if key in live:  # its free went unheard (seen once in ~800 events, sharded):
                    nbytes, _, made = live.pop(key)  # the allocator reuses only freed blocks
                    totals[device] -= nbytes
                    if made in inside:
                        scratch_held[device] -= nbytes
                category = category_of(event)
                if category == MADE_ELSEWHERE and any(
                        start <= event.start_time_ns <= end for start, end in self.optimizer_steps):
                    category = "Optstate"
                live[key] = (fields.alloc_size, category, index)
                totals[device] = totals.get(device, 0) + fields.alloc_size
                if index in inside:
                    scratch_held[device] = scratch_held.get(device, 0) + fields.alloc_size
                if totals[device] > peaks.get(device, (0, None))[0]:
                    peaks[device] = (totals[device], dict(live))
                self.peak_without_scratch[device] = max(self.peak_without_scratch.get(device, 0),
                                                        totals[device] - scratch_held.get(device, 0))
            elif key in live:  # frees of blocks made before the step and not counted: no concern
                nbytes, _, made = live.pop(key)
                totals[device] -= nbytes
                if made in inside:
                    scratch_held[device] -= nbytes
        for device, (total, blocks) in peaks.items():
            if total <= self.peak.get(device, {}).get("Total", 0):
                continue
            by_category = {"Total": total}
            for nbytes, category, index in blocks.values():
                category = "Gradient" if index is not None and index in gradients else category
                by_category[category] = by_category.get(category, 0) + nbytes
            self.peak[device] = by_category

    def get_tracker_snapshot(self, kind="peak"):
        if kind != "peak":
            raise ValueError(f"AllocationTracker keeps only the peak, not {kind!r}")
        return dict(self.peak)
