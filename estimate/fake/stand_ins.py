"""The stand-ins: what a fake run (run.py) puts in place of each helper a script imports by
name (estimate/contract.py lists the names and why), one method of StandIns per name.

The host side of the run (batches, the model of steps 01-05 before `.to(device)`, and what a
script offloads to its `HOST`) lives on the meta device when a GPU is emulated, so that
`.to(device)` copies as it does onto a GPU; the fake CPU tensors are the GPU.
"""
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

import common.data
from common.data import Data
from common.memory import MemoryMeter, ShardedMemTracker, is_sharded, memory_tracker
from common.memory import measure_creation as real_measure_creation
from common.model import classification_head, initialise, model_class, model_config, offloads_to_host
from common.presets import is_text
from common.progress import Progress
from estimate import gpu_choices
from estimate.contract import EstimateError
from estimate.fake.patches import INIT_PROCESS_GROUP, for_fake_tensors

COMPUTE_DEVICE = torch.device("cpu")  # fake tensors stand for GPU memory here (see estimate/gpu_choices.py)
HOST_DEVICE = torch.device("meta")  # fake host memory, so that `.to(device)` copies as on a GPU


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
        # the attention mask a padded batch gets (the usual case, and the larger one); packed
        # texts (--pack) have no padding and no mask
        if is_text(preset):
            return {name: torch.ones(size, preset.max_length, dtype=torch.int64, device=self.host)
                    for name in ("input_ids", "attention_mask")[:1 if preset.packed else 2]}
        return {"pixel_values": torch.empty(size, 3, preset.image_size, preset.image_size,
                                            device=self.host)}

    def batch_bytes(self, size):
        """The bytes of a batch of `size` samples, inputs and labels, as made."""
        preset = self.preset
        if is_text(preset):
            inputs = (1 if preset.packed else 2) * size * preset.max_length * 8  # ids, mask: int64
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
            "movie-snippets": data.SNIPPET_SPLITS, "stanfordnlp/imdb": data.IMDB_SPLITS,
            data.SYNTHETIC: data.SYNTHETIC_SPLITS}.get(dataset)


class StandIns:
    """The stand-ins of one fake run (a FakeRun, which they fill in) of `world_size` processes:
    a method for each name of the contract, called as the script calls the helper."""

    HOST = COMPUTE_DEVICE  # the run's host: HOST_DEVICE where a GPU is emulated (__init__)

    def __init__(self, run, world_size):
        self.run, self.world_size = run, world_size
        self.HOST = HOST_DEVICE if run.emulate_cuda else COMPUTE_DEVICE

    def by_name(self, names):
        """{name: its stand-in} for each of `names`."""
        return {name: getattr(self, name) for name in names}

    def load_data(self, preset, batch_size, device=None, seed=0, rank=0, world_size=1,
                  same_train_batches=False):
        run = self.run
        if same_train_batches:  # every process reads each training batch whole (evaluation's
            rank, world_size = 0, 1  # are not read: evaluate stands in)
        splits = splits_of(preset.dataset)  # as common/data.py splits it
        if splits is None:
            raise EstimateError(f"no sample count known for the data set {preset.dataset!r}; "
                                "add its splits to splits_of in estimate/fake/stand_ins.py")
        samples = splits[0]
        asked = run.asked[0] if run.asked else batch_size  # the batch asked, whatever ran
        if run.any_batch_size:  # the --gpu-memory search: two batches, whatever their size
            samples = max(samples, 2 * asked)
        if asked > samples:
            raise EstimateError(f"--batch-size {asked} is larger than the {samples} training "
                                f"samples of preset {preset.name!r}: no step would run")
        loader = FakeLoader(preset, batch_size, samples, self.HOST, rank, world_size,
                            batches=samples // asked)  # as many steps as the asked batch gives
        run.batch_bytes = loader.batch_bytes(len(range(rank, asked, world_size)))  # asked
        return Data(train=loader, val=loader, test=loader)

    def create_model(self, preset, dtype=torch.float32):
        # outside a device context: the host (steps 01-05 then call .to(device)); inside one,
        # the run's own device (step 06 creates the model on it), or meta (07-09 shard it first)
        # the attention transformers picks by default: sdpa where the architecture has it (on a
        # GPU, the kernel CUDA takes: estimate/gpu_choices.py), else its own code (BLOOM's "eager")
        run = self.run
        attention = preset.config.get("attn_implementation") or (  # one its config asks for
            "sdpa" if model_class(preset)._supports_sdpa else "eager")
        if run.emulate_cuda and attention == "sdpa":
            attention = gpu_choices.register_gpu_attention(run.gpu_read)
        config = model_config(preset)
        if run.cut is not None:  # the model cut to a few periods of its blocks (shortcuts/blocks.py)
            run.periods, whole, config = run.cut(config)
            run.blocks = (whole, config.num_hidden_layers)
        with torch.device("meta"):  # initialisers read values: build on meta, then swap in fakes
            model = model_class(preset)._from_config(
                config, dtype=dtype, attn_implementation=attention)
        context = device_context()
        if context is not None and context.type == "meta":
            return model
        model = materialise_fake(model, self.HOST if context is None else COMPUTE_DEVICE)
        model.tie_weights()  # as common/model.py does: tied weights held once
        if not run.emulate_cuda:  # the CPU draws the initial weights where it trains: count them
            # all of them from scratch; a pretrained model's new head only (load_pretrained)
            initialise(model, None if preset.model is None else [classification_head(model)])
        return model

    def evaluate(self, *args, **kwargs):
        return float("nan")

    Progress = SilentProgress  # a class: the script calls it as it calls Progress

    def MemoryMeter(self, *args, **kwargs):  # noqa: N802 - the contract's name
        return FakeRunMeter(self.run, self.world_size, *args, **kwargs)

    @contextmanager
    def measure_creation(self, device):
        # the real one, on fake tensors: its MemTracker's events are replayed for the GPU figure
        run = self.run
        start = run.trace.new_tracker()
        with real_measure_creation(device) as run.creation:
            yield run.creation
        run.creation_events = slice(start, run.trace.new_tracker())

    def report(self, args, script, creation, meter, progress, test_score):
        meter.result()
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        batch_size, accum_steps = self.run.asked or (args.batch_size, args.accum_steps)
        self.run.record = {"preset": args.preset, "model": args.model, "world_size": world_size,
                           "reshard_after_forward": getattr(args, "reshard_after_forward", None),
                           "batch_size": batch_size, "accum_steps": accum_steps,
                           "steps": progress.steps}
        return self.run.record

    def init_distributed(self, device):
        from torch.testing._internal.distributed.fake_pg import FakeStore
        INIT_PROCESS_GROUP("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        return 0, self.world_size, device

    def init_device_mesh(self, *args, **kwargs):
        # a DeviceMesh computes coordinates from values fake tensors do not have; it holds no
        # model memory, so it is made outside the fake mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh as make_mesh
        with unset_fake_temporarily():
            return make_mesh(*args, **kwargs)

    def fill_shards(self, model, preset, device):
        # each process's shards, allocated as the real helper allocates them, offloaded ones in
        # host memory; no values to copy (the whole copy on process 0's host is not counted)
        with self.run.trace.counted_as_host() if offloads_to_host(model) else nullcontext():
            model.to_empty(device=COMPUTE_DEVICE)
        if self.run.emulate_cuda:
            # NCCL broadcasts from the GPU: the real helper stages each whole tensor there in
            # turn, offloaded or not (on the CPU, process 0 broadcasts its host copy as it is)
            for tensor in [*model.parameters(), *model.buffers()]:  # allocated, then freed
                torch.empty(tensor.shape, dtype=tensor.dtype, device=COMPUTE_DEVICE)


class FakeRunMeter(MemoryMeter):
    """The script's meter; its result stays on this rank (all fake ranks are alike)."""

    def __init__(self, run, world_size, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.run = run
        run.offloaded = run.offloaded or offloads_to_host(self.model)
        compiled = self.from_allocations
        if compiled:  # compiled (--compile, 05k): counted by MemTracker all the same, the
            # compiled graphs run an operation at a time (see fake_run); sharded, eagerly
            run.compiled, run.compiled_eagerly = True, world_size > 1
            self.from_allocations = False
            self.tracker_factory = ShardedMemTracker if is_sharded(self.model) else memory_tracker
        make_tracker, model = self.tracker_factory, self.model

        def tracker(*made_of):
            made = for_fake_tensors(make_tracker(*made_of))
            if compiled and not run.compiled_eagerly:
                class HookingGradients(type(made)):
                    # MemTracker hooks each parameter's gradient as a module's forward begins,
                    # which its module hooks skip inside compiled code, and unhooks them as it
                    # exits: hooked here as it enters, for each step
                    def __enter__(tracking):
                        entered = super().__enter__()
                        tracking._track_module_params_and_buffers(model, install_grad_hooks=True)
                        return entered
                HookingGradients.__name__ = type(made).__name__
                made.__class__ = HookingGradients
            return made
        self.tracker_factory = tracker

    def forget_previous_forward(self, module, args):
        # inside compiled code (traced, where it is a constant) the tracker's module hooks stand
        # aside too: nothing to forget
        if not torch._dynamo.eval_frame._is_in_optimized_module():
            super().forget_previous_forward(module, args)

    def result(self):
        self.run.meter_result = {"peak_memory_bytes": self.peak_bytes,
                                 "breakdown_bytes": dict(self.breakdown),
                                 "parameter_count": self.parameter_count,
                                 "parameters_held": self.parameters_held}
        return self.run.meter_result
