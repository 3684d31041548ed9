"""Run a numbered script's own `main()` on fake tensors, under its own memory meter.

Fake tensors (PyTorch's FakeTensorMode) carry shapes, dtypes and devices but no data: a ViT-L
step runs in seconds and allocates nothing. The script is loaded afresh under a private module
name, and on that module object only the helpers it imports by name that need data, a network,
other processes or a screen are replaced (estimate/contract.py names them; stand_ins.py holds
what replaces them). Precision, autocast, loss scaling, accumulation, optimizer, scheduler,
sharding, offload and checkpointing are the script's own code; what the run changes inside
PyTorch is in patches.py.

Values a step reads back on the host (`.item()`) that fake tensors do not know read as 0: a
gradient scaler never finds an overflow, and every step is taken.
"""
import io
import os
import sys
from contextlib import ExitStack, contextmanager, nullcontext, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from estimate import gpu_choices
from estimate.collector import frozen
from estimate.contract import REQUIRED_WHEN_4BIT, EstimateError, check_contract, required_names
from estimate.fake.patches import (
    FakeModeReadingZeros,
    compiled_graphs_run_by_operations,
    cuda_optimizer_defaults,
    device_meshes_made_for_real,
    dropout_as_on_cuda,
    outputs_walked_directly,
    position_ids_of_one_sequence,
    process_group_only_through_init_distributed,
    quantization_maps_computed_once,
    reduce_scatters_copying_their_input,
    sharded_classes_forgotten,
    sharding_propagation_apart,
    swappable_fake_parameters,
)
from estimate.fake.recording import AllocationTrace
from estimate.fake.stand_ins import StandIns
from estimate.gpu_choices import wants_cuda_emulation
from estimate.shortcuts import sizes
from steps import import_script

QUICK_RUN = ["--max-steps", "2", "--epochs", "1"]  # a run's peak falls within two optimizer steps
# micro-batches run per optimizer step on a GPU: the second adds its activations to the first's
# gradients, as every later one does, so a step of 2 peaks as a step of any more (tests/estimate
# checks it); without emulation the whole batch is in the CPU's memory too, so all of it is run
MICRO_BATCHES_RUN = 2


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
    cut: object = None  # a probe's cut of the model's config to a few periods of its blocks
    # (shortcuts/blocks.py: config -> (periods, blocks, the config cut)); None: the whole model
    periods: int = None  # a probe's: the periods of blocks of the whole model
    blocks: tuple = None  # a probe's (blocks of the whole model, its own blocks)
    learned: dict = None  # written by blocks: what another size's run needs (shortcuts/blocks.py)
    gpu_read: object = None  # the emulated GPU as the run reads it (gpu_choices.ReadGpu)
    size_choices: list = field(default_factory=list)  # chosen by the micro-batch's size (shortcuts/sizes.py)

    def training_events(self):
        return self.trace.events[self.creation_events.stop:]

    def training_phases(self):
        """Each training event's part of the step (allocation_trace.PHASES)."""
        return self.trace.phases[self.creation_events.stop:]


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


def without_estimate_flag(argv):
    return [arg for arg in argv if arg != "--estimate"]


ESTIMATED = "estimated"  # a script's module is loaded as _estimated_<its stem> (steps.import_script)


def run_on_fake_tensors(script_path, argv, world_size=1, gpu=gpu_choices.DEFAULT_GPU,
                        any_batch_size=False, every_micro_batch=False, cut=None, fused=True):
    """Run the script's main(argv) for two optimizer steps on fake tensors; returns a FakeRun.

    `argv` are the script's own flags; `world_size` is the number of processes a distributed
    script would run in (the fake process group's size); `gpu` the GPU emulated (GPUS' keys);
    `any_batch_size`: the data set is as large as two batches of the size asked need (the
    --gpu-memory search asks what fits, beyond what the preset's data set holds);
    `every_micro_batch`: run each of the --accum-steps micro-batches asked, not two (--exact).
    `cut`: run the model cut so (a probe of its blocks: shortcuts/blocks.py), not whole.
    `fused`: what torch.compile compiles runs with its pointwise operations fused, or without
    (estimate/compiled.py).
    """
    # the scripts' modules of earlier runs out of sys.modules (where the run's kept files are read
    # from: shortcuts/cache.py), so garbage now: their globals hold their runs' stand-ins, and so
    # their runs, which frozen alive as this run starts would never be freed in a worker
    for name in [name for name in sys.modules if name.startswith(f"_{ESTIMATED}_")]:
        del sys.modules[name]
    with frozen():  # (estimate/collector.py)
        return fake_run(script_path, argv, world_size, gpu, any_batch_size, every_micro_batch,
                        cut, wants_cuda_emulation(argv), fused)


def fake_run(script_path, argv, world_size, gpu, any_batch_size, every_micro_batch, cut,
             emulate_cuda, fused):
    """run_on_fake_tensors' run, its garbage collector set."""
    run = FakeRun(script=Path(script_path).stem, emulate_cuda=emulate_cuda, gpu=gpu,
                  any_batch_size=any_batch_size, cut=cut,
                  gpu_read=gpu_choices.ReadGpu(gpu_choices.GPUS[gpu]))
    module = import_script(script_path, prefix=ESTIMATED)
    check_contract(module, Path(script_path).name)
    names = required_names(module)
    replacements = StandIns(run, world_size).by_name(names.keys() - REQUIRED_WHEN_4BIT.keys())
    if REQUIRED_WHEN_4BIT.keys() <= names.keys():  # 07b: its script has imported bitsandbytes
        from estimate.fake.four_bit import stand_ins as four_bit_stand_ins
        replacements.update(four_bit_stand_ins(emulate_cuda, run.gpu_read))
    for name in names:
        setattr(module, name, replacements[name])
    if emulate_cuda and not every_micro_batch:  # (on the CPU the batch itself is on the device)
        module.parse_args = fewer_micro_batches(module.parse_args, run, world_size)
    if hasattr(module, "FusedLinearCrossEntropy"):  # 05h, 10: a choice by the size (shortcuts/sizes.py)
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
        stack.enter_context(dropout_as_on_cuda() if emulate_cuda else nullcontext())
        stack.enter_context(nullcontext() if emulate_cuda else reduce_scatters_copying_their_input())
        stack.enter_context(quantization_maps_computed_once())
        stack.enter_context(position_ids_of_one_sequence())
        stack.enter_context(run.trace.recording())
        stack.enter_context(outputs_walked_directly())
        stack.enter_context(process_group_only_through_init_distributed(Path(script_path).name))
        stack.enter_context(launched_as(world_size))
        stack.enter_context(sharded_classes_forgotten(module.__name__))
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


@contextmanager
def launched_as(world_size):
    """While inside, with more than one process, the environment of torchrun's process 0 (RANK,
    LOCAL_RANK, WORLD_SIZE), which 10_combined.py reads to shard; as it was on leaving."""
    if world_size == 1:
        yield
        return
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def world_size_from_environment():
    """The process count a launcher would give (torchrun sets WORLD_SIZE), else 1."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise EstimateError(f"WORLD_SIZE={value!r} is not a positive whole number of processes")
    return int(value)
