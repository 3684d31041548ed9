"""Run a numbered script's own `main()` on fake tensors, under its own memory meter.

Fake tensors (PyTorch's FakeTensorMode) carry shapes, dtypes and devices but no data: a ViT-L
step runs in seconds and allocates nothing. The script is loaded afresh under a private module
name, and on that module object only the helpers it imports by name that need data, a network,
other processes or a screen are replaced: `load_data` (batches of the preset's shapes),
`create_model` (the preset's architecture, no weights), `evaluate` (skipped), `Progress`
(silent), `MemoryMeter` (the script's own meter, its result kept on this rank),
`measure_creation` (measured on the fake tensors), `report` (kept, not printed) and
`init_distributed` (a fake process group of N ranks). Precision, autocast, loss scaling,
accumulation, optimizer, scheduler, sharding, offload and checkpointing are the script's own
code; what the run changes inside PyTorch is in fake_tensor_patches.py.

The host side of the run (batches, the model of steps 01-05 before `.to(device)`, and what a
script offloads to its `HOST`) lives on the meta device when a GPU is emulated, so that
`.to(device)` copies as it does onto a GPU; the fake CPU tensors are the GPU. Values a step
reads back on the host (`.item()`) that fake tensors do not know read as 0: a gradient scaler
never finds an overflow, and every step is taken.
"""
import argparse
import gc
import io
import os
import sys
from contextlib import ExitStack, contextmanager, nullcontext, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import common.data
from common.data import Data
from common.memory import MemoryMeter, ShardedMemTracker, is_sharded, memory_tracker
from common.memory import measure_creation as real_measure_creation
from common.model import classification_head, initialise, model_class, model_config, offloads_to_host
from common.presets import is_text
from common.progress import Progress
from estimate import gpu_choices, sizes
from estimate.allocation_trace import AllocationTrace
from estimate.blocks import cut_for_probe
from estimate.contract import EstimateError, check_contract, required_names
from estimate.fake_tensor_patches import (
    INIT_PROCESS_GROUP,
    FakeModeReadingZeros,
    compiled_graphs_run_by_operations,
    cuda_optimizer_defaults,
    device_meshes_made_for_real,
    for_fake_tensors,
    process_group_only_through_init_distributed,
    quantization_maps_computed_once,
    sharding_propagation_apart,
    swappable_fake_parameters,
)
from steps import import_script

QUICK_RUN = ["--max-steps", "2", "--epochs", "1"]  # a run's peak falls within two optimizer steps
# micro-batches run per optimizer step on a GPU: the second adds its activations to the first's
# gradients, as every later one does, so a step of 2 peaks as a step of any more (tests/estimate
# checks it); without emulation the whole batch is in the CPU's memory too, so all of it is run
MICRO_BATCHES_RUN = 2
COMPUTE_DEVICE = torch.device("cpu")  # fake tensors stand for GPU memory here (see gpu_choices.py)
HOST_DEVICE = torch.device("meta")  # fake host memory, so that `.to(device)` copies as on a GPU


@dataclass
class FakeRun:
    """What one fake run of a script saw: its settings, its meter's result, the allocation order."""
    script: str
    emulate_cuda: bool
    gpu: str = gpu_choices.DEFAULT_GPU  # the GPU emulated (a key of GPUS), when emulate_cuda
    any_batch_size: bool = False  # the data set holds two batches of any size (--gpu-memory)
    record: dict = None  # what the script passed to report()
    meter_result: dict = None
    trace: AllocationTrace = field(default_factory=AllocationTrace)
    offloaded: bool = False  # FSDP keeps the sharded state in host memory (CPUOffloadPolicy)
    compiled: bool = False  # the script compiled its model (--compile, 05k)
    compiled_eagerly: bool = False  # ... and it ran eagerly here (sharded: see fake_run)
    batch_bytes: int = 0  # one batch as the data loader gives it (this process's share)
    creation: object = None  # what measure_creation measured, on fake tensors
    creation_events: slice = field(default_factory=lambda: slice(0, 0))  # model creation's events
    asked: tuple = None  # (batch, accumulation steps) asked, where fewer micro-batches ran
    probe: int = None  # periods of blocks this run cuts the model to (blocks.py), or None: whole
    periods: int = None  # a probe's: the periods of blocks of the whole model (blocks.py)
    blocks: tuple = None  # a probe's (blocks of the whole model, its own blocks)
    gpu_read: object = None  # the emulated GPU as the run reads it (gpu_choices.ReadGpu)
    size_choices: list = field(default_factory=list)  # choices made by the micro-batch's size (sizes.py)

    def training_events(self):
        return self.trace.events[self.creation_events.stop:]

    def training_phases(self):
        """Each training event's part of the step (allocation_trace.PHASES)."""
        return self.trace.phases[self.creation_events.stop:]


class FakeLoader:
    """Batches of the preset's shapes, made when asked for, as many as a real epoch has."""

    def __init__(self, preset, batch_size, samples, host, rank=0, world_size=1, batches=None):
        self.batches = samples // batch_size if batches is None else batches
        # each process takes every world_size-th sample of a global batch (common/data.py)
        self.samples = len(range(rank, batch_size, world_size))
        self.preset, self.host = preset, host

    def __len__(self):
        return self.batches

    def inputs(self):
        """The model's inputs by name, as common/data.py's batches hold them."""
        size, preset = self.samples, self.preset
        # token ids, and a mask: fake, so transformers cannot see that it is all ones and builds
        # the attention mask a padded batch gets (the usual case, and the larger one)
        if is_text(preset):
            return {name: torch.ones(size, preset.max_length, dtype=torch.int64, device=self.host)
                    for name in ("input_ids", "attention_mask")}
        return {"pixel_values": torch.empty(size, 3, preset.image_size, preset.image_size,
                                            device=self.host)}

    def batch_bytes(self, size):
        """The bytes of a batch of `size` samples, inputs and labels, as made."""
        preset = self.preset
        if is_text(preset):
            inputs = 2 * size * preset.max_length * 8  # token ids and mask, int64
        else:
            inputs = size * 3 * preset.image_size ** 2 * 4  # float32 pixels
        return inputs + size * (preset.max_length if preset.task == "causal-lm" else 1) * 8

    def labels(self):
        """A class per sample, or under --task causal-lm a token per position."""
        shape = (self.samples, self.preset.max_length) if self.preset.task == "causal-lm" else (
            self.samples,)
        return torch.zeros(shape, dtype=torch.int64, device=self.host)

    def __iter__(self):
        for _ in range(self.batches):
            yield self.inputs(), self.labels()


class SilentProgress(Progress):
    """Progress that counts steps (the script's loop stops on its count) and prints nothing."""

    def step(self, epoch, loss):
        self.steps += 1

    def epoch(self, epoch, epochs, val_score):
        pass

    def loss_values(self):
        return []


def device_context():
    """The device of the innermost `with torch.device(...)` (step 06 creates its model in one,
    steps 07-09 on "meta"), or None outside one: torch.get_default_device() would answer "cpu"
    both outside and inside `with torch.device("cpu")`, the fake run's device."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    contexts = [mode for mode in _get_current_function_mode_stack()
                if isinstance(mode, DeviceContext)]
    return torch.device(contexts[-1].device) if contexts else None


def materialise_fake(model, device):
    """Give every parameter and buffer of a meta-device model an (empty) fake tensor on `device`."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return model


def splits_of(dataset):
    """(train, validation, test) samples of a preset's data set (`preset.dataset`), as
    common/data.py splits it, or None."""
    data = common.data  # read at each call: tests shorten SNIPPET_SPLITS
    return {"digits": data.DIGITS_SPLITS, "uoft-cs/cifar10": data.CIFAR10_SPLITS,
            "movie-snippets": data.SNIPPET_SPLITS, "stanfordnlp/imdb": data.IMDB_SPLITS}.get(dataset)


def stand_ins(run, world_size):
    """The replacements for the helpers a script imports by name, keyed by that name."""
    host = HOST_DEVICE if run.emulate_cuda else COMPUTE_DEVICE

    def load_data(preset, batch_size, device=None, seed=0, rank=0, world_size=1):
        splits = splits_of(preset.dataset)  # as common/data.py splits the data set
        if splits is None:
            raise EstimateError(f"no sample count known for the data set {preset.dataset!r}; "
                                "add its splits to splits_of in estimate/fake_run.py")
        samples = splits[0]
        asked = run.asked[0] if run.asked else batch_size  # the batch asked, whatever ran
        if run.any_batch_size:  # the --gpu-memory search: two batches, whatever their size
            samples = max(samples, 2 * asked)
        if asked > samples:
            raise EstimateError(f"--batch-size {asked} is larger than the {samples} training "
                                f"samples of preset {preset.name!r}: no step would run")
        loader = FakeLoader(preset, batch_size, samples, host, rank, world_size,
                            batches=samples // asked)  # as many steps as the asked batch gives
        run.batch_bytes = loader.batch_bytes(len(range(rank, asked, world_size)))  # asked
        return Data(train=loader, val=loader, test=loader)

    def create_model(preset, dtype=torch.float32):
        # outside a device context: the host (steps 01-05 then call .to(device)); inside one,
        # the run's own device (step 06 creates the model on it), or meta (07-09 shard it first)
        # the attention transformers picks by default: sdpa where the architecture has it (on a
        # GPU, the kernel CUDA takes: gpu_choices.py), else its own code (BLOOM's "eager")
        attention = preset.config.get("attn_implementation") or (  # one its config asks for
            "sdpa" if model_class(preset)._supports_sdpa else "eager")
        if run.emulate_cuda and attention == "sdpa":
            attention = gpu_choices.register_gpu_attention(run.gpu_read)
        config = model_config(preset)
        if run.probe is not None:  # the model cut to a few periods of its blocks (blocks.py)
            run.periods, whole, config = cut_for_probe(config, run.probe)
            run.blocks = (whole, config.num_hidden_layers)
        with torch.device("meta"):  # initialisers read values: build on meta, then swap in fakes
            model = model_class(preset)._from_config(
                config, dtype=dtype, attn_implementation=attention)
        context = device_context()
        if context is not None and context.type == "meta":
            return model
        model = materialise_fake(model, host if context is None else COMPUTE_DEVICE)
        model.tie_weights()  # as common/model.py does: tied weights held once
        if not run.emulate_cuda:  # the CPU draws the initial weights where it trains: count them
            # all of them from scratch; a pretrained model's new head only (load_pretrained)
            initialise(model, None if preset.model is None else [classification_head(model)])
        return model

    def fill_shards(model, preset, device):
        # each process's shards, allocated as the real helper allocates them, offloaded ones in
        # host memory; no values to copy (the whole copy on process 0's host is not counted)
        with run.trace.counted_as_host() if offloads_to_host(model) else nullcontext():
            model.to_empty(device=COMPUTE_DEVICE)
        if run.emulate_cuda:
            # NCCL broadcasts from the GPU: the real helper stages each whole tensor there in
            # turn, offloaded or not (on the CPU, process 0 broadcasts its host copy as it is)
            for tensor in [*model.parameters(), *model.buffers()]:  # allocated, then freed
                torch.empty(tensor.shape, dtype=tensor.dtype, device=COMPUTE_DEVICE)

    class FakeRunMeter(MemoryMeter):
        """The script's meter; its result stays on this rank (all fake ranks are alike)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            run.offloaded = run.offloaded or offloads_to_host(self.model)
            compiled = self.from_allocations
            if compiled:  # compiled (--compile, 05k): counted by MemTracker all the same, the
                # compiled graphs run an operation at a time (see fake_run); sharded, eagerly
                run.compiled, run.compiled_eagerly = True, world_size > 1
                self.from_allocations = False
                self.tracker_factory = ShardedMemTracker if is_sharded(self.model) else memory_tracker
            make_tracker = self.tracker_factory

            model = self.model

            def tracker(*made_of):
                made = for_fake_tensors(make_tracker(*made_of))
                if compiled and not run.compiled_eagerly:
                    class HookingGradients(type(made)):
                        # MemTracker hooks each parameter's gradient as a module's forward
                        # begins, which its module hooks skip inside compiled code, and unhooks
                        # them as it exits: hooked here as it enters, for each step
                        def __enter__(tracking):
                            entered = super().__enter__()
                            tracking._track_module_params_and_buffers(model, install_grad_hooks=True)
                            return entered
                    HookingGradients.__name__ = type(made).__name__
                    made.__class__ = HookingGradients
                return made
            self.tracker_factory = tracker

        def forget_previous_forward(self, module, args):
            # inside compiled code (traced, where it is a constant) the tracker's module hooks
            # stand aside too: nothing to forget
            if not torch._dynamo.eval_frame._is_in_optimized_module():
                super().forget_previous_forward(module, args)

        def result(self):
            run.meter_result = {"peak_memory_bytes": self.peak_bytes,
                                "breakdown_bytes": dict(self.breakdown),
                                "parameter_count": self.parameter_count,
                                "parameters_held": self.parameters_held}
            return run.meter_result

    @contextmanager
    def measure_creation(device):
        # the real one, on fake tensors: its MemTracker's events are replayed for the GPU figure
        start = run.trace.new_tracker()
        with real_measure_creation(device) as run.creation:
            yield run.creation
        run.creation_events = slice(start, run.trace.new_tracker())

    def report(args, script, creation, meter, progress, test_score):
        meter.result()
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        batch_size, accum_steps = run.asked or (args.batch_size, args.accum_steps)
        run.record = {"preset": args.preset, "model": args.model, "world_size": world_size,
                      "reshard_after_forward": getattr(args, "reshard_after_forward", None),
                      "batch_size": batch_size, "accum_steps": accum_steps,
                      "steps": progress.steps}
        return run.record

    def init_distributed(device):
        from torch.testing._internal.distributed.fake_pg import FakeStore
        INIT_PROCESS_GROUP("fake", store=FakeStore(), rank=0, world_size=world_size)
        return 0, world_size, device

    def init_device_mesh(*args, **kwargs):
        # a DeviceMesh computes coordinates from values fake tensors do not have; it holds no
        # model memory, so it is made outside the fake mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh as make_mesh
        with unset_fake_temporarily():
            return make_mesh(*args, **kwargs)

    return {"load_data": load_data, "create_model": create_model,
            "evaluate": lambda *args, **kwargs: float("nan"),
            "Progress": SilentProgress, "MemoryMeter": FakeRunMeter,
            "measure_creation": measure_creation, "report": report,
            "init_distributed": init_distributed, "init_device_mesh": init_device_mesh,
            "fill_shards": fill_shards, "HOST": host}


def fewer_micro_batches(parse_args, run, world_size):
    """The script's parse_args, whose arguments then ask for MICRO_BATCHES_RUN micro-batches of
    the size asked where more were asked (the asked batch and steps are kept in `run.asked`).
    A batch that does not split evenly is left as asked: the script's own check says so."""
    def parse(*args, **kwargs):
        parsed = parse_args(*args, **kwargs)
        steps = getattr(parsed, "accum_steps", None) or 1
        if steps > MICRO_BATCHES_RUN and parsed.batch_size % (steps * world_size) == 0:
            run.asked = (parsed.batch_size, steps)
            parsed.batch_size = parsed.batch_size // steps * MICRO_BATCHES_RUN
            parsed.accum_steps = MICRO_BATCHES_RUN
        return parsed
    return parse


def noting_pieces(function, chunks):
    """The fused loss's autograd.Function, which notes as it runs that its pieces are
    ceil(tokens / `chunks`) tokens of the micro-batch: byte counts off the line of sizes."""
    class Noted(function):
        @staticmethod
        def forward(*args, **kwargs):
            sizes.note_choice(f"the fused loss's pieces of ceil(tokens / {chunks})")
            return function.forward(*args, **kwargs)
    Noted.__name__ = function.__name__
    return Noted


def wants_cuda_emulation(argv):
    """--device cpu asks for the CPU itself (no GPU emulation); anything else predicts a GPU."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default="auto")
    known, _ = parser.parse_known_args(argv)
    return known.device != "cpu"


def without_estimate_flag(argv):
    return [arg for arg in argv if arg != "--estimate"]


def run_on_fake_tensors(script_path, argv, world_size=1, gpu=gpu_choices.DEFAULT_GPU,
                        any_batch_size=False, every_micro_batch=False, probe=None, fused=True):
    """Run the script's main(argv) for two optimizer steps on fake tensors; returns a FakeRun.

    `argv` are the script's own flags; `world_size` is the number of processes a distributed
    script would run in (the fake process group's size); `gpu` the GPU emulated (GPUS' keys);
    `any_batch_size`: the data set is as large as two batches of the size asked need (the
    --gpu-memory search asks what fits, beyond what the preset's data set holds);
    `every_micro_batch`: run each of the --accum-steps micro-batches asked, not two (--exact).
    `probe`: run the model cut to that many periods of its blocks (blocks.py), not whole.
    `fused`: what torch.compile compiles runs with its pointwise operations fused, or without
    (estimate/compiled.py).
    """
    with collector_frozen():
        return fake_run(script_path, argv, world_size, gpu, any_batch_size, every_micro_batch,
                        probe, wants_cuda_emulation(argv), fused)


@contextmanager
def collector_frozen():
    """What lives now frozen for the garbage collector while inside: the collection that each
    run's measure_creation starts with then scans only what the runs made (a third of a second
    less each run); thawed on leaving. Where something froze it already (the workers' pool, a
    test, the estimate by blocks around its probes), it is left as it is."""
    global inside
    if inside:  # (asked once: gc.get_freeze_count walks every frozen object, 30 ms a time)
        yield
        return
    thaw = gc.get_freeze_count() == 0
    if thaw:
        gc.collect()
        gc.freeze()
    inside = True
    try:
        yield
    finally:
        inside = False
        if thaw:
            gc.unfreeze()


inside = False  # within collector_frozen


def fake_run(script_path, argv, world_size, gpu, any_batch_size, every_micro_batch, probe,
             emulate_cuda, fused):
    """run_on_fake_tensors' run, its garbage collector set."""
    run = FakeRun(script=Path(script_path).stem, emulate_cuda=emulate_cuda, gpu=gpu,
                  any_batch_size=any_batch_size, probe=probe,
                  gpu_read=gpu_choices.ReadGpu(gpu_choices.GPUS[gpu]))
    module = import_script(script_path, prefix="estimated")
    check_contract(module, Path(script_path).name)
    replacements = stand_ins(run, world_size)
    if "Params4bit" in required_names(module):  # 07b: its script has imported bitsandbytes
        from estimate.fake_4bit import stand_ins as four_bit_stand_ins
        replacements.update(four_bit_stand_ins(emulate_cuda, run.gpu_read))
    for name in required_names(module):
        setattr(module, name, replacements[name])
    if emulate_cuda and not every_micro_batch:  # (on the CPU the batch itself is on the device)
        module.parse_args = fewer_micro_batches(module.parse_args, run, world_size)
    if hasattr(module, "FusedLinearCrossEntropy"):  # 05h, 10: a choice by the size (sizes.py)
        module.FusedLinearCrossEntropy = noting_pieces(module.FusedLinearCrossEntropy,
                                                       module.LOSS_CHUNKS)
    sizes.CHOICES.clear()
    script_argv = [*without_estimate_flag(argv), *QUICK_RUN, "--device", "cpu"]
    fake_mode = FakeModeReadingZeros(allow_non_fake_inputs=True, cuda_batch_norm=emulate_cuda)
    with ExitStack() as stack:
        # torch.compile's graphs run an operation at a time under the tracker (compiled.py); with
        # sharding it stands aside (the model runs eagerly, the prediction is the eager run's)
        stack.enter_context(compiled_graphs_run_by_operations(fused) if world_size == 1
                            else torch.compiler.set_stance("force_eager"))
        stack.enter_context(fake_mode)
        stack.enter_context(swappable_fake_parameters(fake_mode))
        stack.enter_context(device_meshes_made_for_real())
        stack.enter_context(sharding_propagation_apart())
        stack.enter_context(cuda_optimizer_defaults() if emulate_cuda else nullcontext())
        stack.enter_context(quantization_maps_computed_once())
        stack.enter_context(run.trace.recording())
        stack.enter_context(process_group_only_through_init_distributed(Path(script_path).name))
        messages = io.StringIO()
        try:
            with redirect_stderr(messages):
                module.main(script_argv)
        except SystemExit as stop:  # the script's own checks (argparse, batch split) end this way
            # the script's own message; argparse prints its usage, then the error, to stderr
            said = (stop.code if isinstance(stop.code, str)
                    else (messages.getvalue().strip().splitlines() or ["the script stopped"])[-1])
            raise EstimateError(said.removeprefix("error: ").split(": error: ")[-1]) from None
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        # the warnings of a run that went through; not a script's notes on its accuracy (07a)
        sys.stderr.writelines(line for line in messages.getvalue().splitlines(keepends=True)
                              if not line.startswith("note: "))
    run.size_choices = list(dict.fromkeys(sizes.CHOICES))
    if run.record is None or run.meter_result is None:
        raise EstimateError(f"{run.script} ran without reporting a result: it must measure its "
                            "steps with MemoryMeter and end with report(), as the numbered scripts do")
    if not run.trace.events:
        raise EstimateError(f"{run.script}'s MemoryMeter tracked nothing: its tracker_factory must "
                            "make a MemTracker (or FSDPMemTracker), whose counts the estimate reads")
    return run


def world_size_from_environment():
    """The process count a launcher would give (torchrun sets WORLD_SIZE), else 1."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise EstimateError(f"WORLD_SIZE={value!r} is not a positive whole number of processes")
    return int(value)
