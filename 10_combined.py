"""10 combined: every technique of the steps and branches behind a switch, each off by default.

The script to copy for a model that does not fit. With no switch it is the plain bfloat16 run
(03: bfloat16 weights, Adam, whole batches) with the model created on its device (06). Each
switch adds one script's technique, copied from it, and any of them may be stacked; a pair that
cannot work together stops before training, saying why. Under torchrun, or with --offload, the
model is sharded as in 07-09. It reads as a recipe (the model built in a fixed order of steps,
one loop of micro-batches), the table of switches and what each refuses, then each technique's
code under its script's name. steps.py lists the switches that equal each script.

  python %(prog)s                                   # 03's run, created on the device (06)
  python %(prog)s --accum-steps 4 --optimizer adamw-8bit --checkpointing selective  # 04+05a+05d
  python %(prog)s --task causal-lm --loss chunked --optimizer-in-backward --optimizer-on-host
  python %(prog)s --preset tiny-text --lora-rank 8 --qlora --accum-steps 4     # 07b
  torchrun --nproc_per_node=2 %(prog)s --accum-steps 4 --checkpointing full   # 07 with 09's
  python %(prog)s --offload --checkpointing full --estimate   # 09 as a group of one, predicted
  torchrun --nproc_per_node=2 %(prog)s --task causal-lm --sequence-parallel   # each text in 2 slices
"""
import argparse
import math  # GaLore: the bias corrections
import os
import sys
from concurrent.futures import ThreadPoolExecutor  # gradients to host: a GPU's sums on a thread
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch._functorch.config  # memory budget: the partitioner's settings
import torch.distributed as dist
import torch.nn.functional as F  # chunked loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint  # checkpointing on one device
# selective checkpointing: what to do with each operator's output, and the contexts that do it
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import AttentionInterface  # sequence parallel: attention functions by name
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # sequence parallel
from transformers.pytorch_utils import Conv1D  # LoRA: GPT-2's linear layers, weights transposed

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import (SHARED_FLAGS, check_batch_split, compiler_problem, fraction, parse_args,
                        positive_float, positive_int, true_or_false)
from common.data import IGNORED, load_data, split_batch, to_device  # chunked loss: IGNORED
from common.distributed import end_distributed, init_distributed
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import HOST, MemoryMeter, measure_creation
from common.model import (classification_head, create_model, fill_shards, transformer_blocks,
                          untied_token_embeddings)
from common.model import model_config  # sequence parallel
from common.presets import preset_for
from common.progress import Progress
from common.quirks import (BlockWrapper, check_block_mlp, check_output_layer_without_bias,
                           check_plain_output_layer, keep_training_layout)
from common.summary import report

try:  # 8-bit AdamW, QLoRA, GaLore's 8-bit form: from bitsandbytes (requirements.txt pins it)
    from bitsandbytes import functional as bnb
    from bitsandbytes.nn import Linear4bit, Params4bit
    from bitsandbytes.optim import AdamW8bit
    NO_BITSANDBYTES = None
except ImportError as error:  # said when --optimizer adamw-8bit|galore-8bit or --qlora needs it
    NO_BITSANDBYTES = f"bitsandbytes ({error}). Install it with pip install bitsandbytes==0.50.2 " \
                      "(as requirements.txt pins)"


def main(argv=None):
    args = parse_args(__doc__, argv, flags=own_flags)  # every switch of SWITCHES, below
    settings = resolved(args)  # the switches checked beside each other, and resolved, once
    return train_or_estimate(launch, settings, __file__, argv)  # --estimate: predicted instead


def launch(settings, device):
    """Train here, or as one process of a group where the switches shard the model (07-09)."""
    if not settings.sharded:
        return train(settings, device, created_on=device)
    _, world_size, device = init_distributed(device)  # FSDP: one process per device
    try:  # FSDP: release the group's connections (NCCL communicators) also on error
        settings.check_split(settings, world_size)  # equal micro-batches (08a: and slices) on every process
        # FSDP, on-device init: created as shapes only (meta), so that no device holds it all
        return train(settings, device, torch.device("meta"), dist.get_rank(), world_size)
    finally:
        end_distributed()  # FSDP: leave the group and free it, before Python exits


def train(settings, device, created_on, rank=0, world_size=1):
    preset = preset_for(settings)  # the preset, with --model's classifier if one is named
    torch.manual_seed(settings.seed)
    data = load_data(preset, settings.batch_size, device, seed=settings.seed, rank=rank,
                     world_size=world_size,  # FSDP: each process takes its slice of a batch
                     same_train_batches=settings.sequence_parallel)  # 08a: of each text
    # optimizer steps (the last partial batch is dropped), or --max-steps
    total_steps = min(settings.epochs * len(data.train), settings.max_steps or math.inf)

    with measure_creation(device) as creation:
        model = build_model(settings, preset, device, created_on, world_size)
    optimizer = Optimizer(settings, model, device, total_steps)  # the one the switches choose
    # mixed precision: a loss scaler, which does nothing where it is off (any other precision)
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "mixed")
    # the peak of the first steps, by what it holds
    meter = MemoryMeter(device, model, optimizer.stepped, snapshot=settings.memory_snapshot)
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(settings.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, scaler, inputs, labels, device, settings)
            optimizer.schedule()  # plain SGD: the cosine moves once per optimizer step
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        score = evaluate(model, data.val, device, settings.dtype,  # a micro-batch a forward
                         pieces=settings.accum_steps, loss=settings.evaluation_loss)
        progress.epoch(epoch, settings.epochs, score)
        if progress.steps == total_steps:
            break
    test_score = evaluate(model, data.test, device, settings.dtype,
                          pieces=settings.accum_steps, loss=settings.evaluation_loss)
    return report(settings, __file__, creation, meter, progress, test_score)


def build_model(settings, preset, device, created_on, world_size):
    """The model, created where it trains in its dtype (06; as shapes only when it is to be
    sharded), then each technique the switches ask for applied in a fixed order, each behind one
    check (torchtitan's parallelize_llama): adapters, 4-bit weights, the MLP's tiles (its check
    its own: --mlp-tiles or none), checkpointing, compile, sharding."""
    with torch.device(created_on):  # on-device init: tensors made in here go to the device
        model = create_model(preset, dtype=settings.dtype)  # on-device init: in its dtype from the start
        if settings.lora_rank:
            apply_adapters(model, settings, preset)  # 07a: made where the model is
    check_loss(model, settings.loss)  # 05g, 05h: the model's loss is what they compute
    if settings.qlora:
        apply_four_bits(model)  # 07b
    apply_mlp_tiles(model, settings.mlp_tiles)  # 05l, in each block before it is wrapped (or none)
    if settings.checkpointing in WRAPPED:
        apply_checkpointing(model, settings, device)  # 05c-05e (05e compiles each block first)
    if settings.compile and settings.checkpointing != "offloaded":
        apply_compile(model, settings.memory_budget)  # each block; 05k's budget, or none (1.0)
    if settings.sharded:
        apply_sharding(model, settings, preset, device, world_size)  # 07-09
    return model


class Optimizer:
    """The optimizer the switches choose, at its script's rate (OPTIMIZERS), over the trained
    weights or what stands in for them (each process's plain shards, host copies: resolved()),
    one for all or one per weight, stepped in backward (04a); how it steps after backward."""

    def __init__(self, settings, model, device, total_steps):
        self.settings = settings
        self.trained = [param for param in model.parameters() if param.requires_grad]  # LoRA
        self.weights = settings.stepped_weights(self.trained)  # the trained ones, or stand-ins
        make = partial(settings.make_optimizer, lr=settings.lr, model=model,  # GaLore: its blocks'
                       # Adam on the host: fused on a GPU's
                       fused=settings.optimizer_on_host and device.type == "cuda" or None)
        if settings.optimizer_in_backward:  # 04a: one per weight, stepped as its gradient is made
            self.stepped = [make([weight]) for weight in self.weights]
            step_in_backward(self.trained, self.stepped, settings.optimizer_on_host)
        else:
            self.stepped = [make(self.weights)]
        # gradients to host: each copied out as backward makes it (else: 05f's copies after it)
        self.to_host = settings.gradients_kept(self.trained, self.weights, device)
        self.schedules = [settings.schedule(each, total_steps) for each in self.stepped
                          if settings.schedule]  # plain SGD: a cosine

    def micro_batch_done(self):
        self.to_host.add_up()  # gradients to host: added up on the host while the next one runs

    def step(self, scaler):
        """The step once backward is done: none where each weight was stepped in it (04a)."""
        optimizer, settings = self.stepped[0], self.settings
        if settings.optimizer_in_backward:
            return
        if settings.optimizer_on_host:
            self.to_host.add_all()  # gradients to host: every copy in .grad before the step
            step_on_host(optimizer, self.trained)  # Adam on the host
            return
        move_gradients(self.trained, self.weights)  # sharded switches: onto each plain shard
        scaler.unscale_(optimizer)  # mixed precision: true gradients from here on (clip here)
        scaler.step(optimizer)  # mixed precision: skipped if a gradient is inf or NaN
        scaler.update()  # mixed precision: lower the scale after a skip, raise it after many good steps
        optimizer.zero_grad(set_to_none=True)

    def schedule(self):
        for each in self.schedules:
            each.step()  # plain SGD: the cosine moves once per optimizer step


def train_step(model, optimizer, scaler, inputs, labels, device, settings):
    """One optimizer step on one batch, as --accum-steps equal micro-batches (04; one: the whole
    batch at once, as 03) whose gradients add up in .grad; returns the batch's mean loss."""
    # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
    micro_batches = split_batch(inputs, labels, len(labels) // settings.accum_steps)
    batch_loss = None  # the record's loss, summed in float32
    for micro_inputs, micro_labels in micro_batches:
        micro_inputs = to_device(micro_inputs, device, settings.dtype)  # bf16-true: bfloat16 images
        micro_labels = micro_labels.to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.float16,  # mixed precision
                            enabled=settings.precision == "mixed"):
            loss = settings.loss_of(model, micro_inputs, micro_labels) / len(micro_batches)
        scaler.scale(loss).backward()  # mixed precision: scaled up, else as it is
        optimizer.micro_batch_done()
        # (one micro-batch: its loss in float32, as 01-03 record it; then 04's sum)
        batch_loss = loss.detach().float() if batch_loss is None else batch_loss + loss.detach().float()
    optimizer.step(scaler)
    if settings.sharded:
        dist.all_reduce(batch_loss)  # FSDP: the mean loss over all processes, for the record
        batch_loss /= dist.get_world_size()
    return batch_loss


# ==== the switches: one record each, and what cannot train together =============================

PRECISIONS = {"fp32": torch.float32, "mixed": torch.float32, "bf16": torch.bfloat16}  # 01, 02, 03
ANY = "N"  # a switch's value, where it takes a number (or names) rather than a choice

# the groups of the stack's chain (estimate/stack.py walks them in this order): what a switch's
# value costs, for the values the chain may set
EXACT, INEXACT, NO_ACCUMULATION, OVER_PCIE, WEIGHTS_ON_HOST = (
    "exact: the same arithmetic, more time", "inexact: the optimizer's arithmetic changes",
    "no accumulation: the micro-batch is the batch", "bytes over PCIe every step",
    "the weights in host memory too")


def checkpointing_kind(text):
    """--checkpointing: none, full, selective, offloaded, or budget:F with F from 0 to 1 (05k)."""
    if text in ("none", "full", "selective", "offloaded"):
        return text
    kind, _, value = text.partition(":")
    if kind != "budget":
        raise argparse.ArgumentTypeError(f"expected none, full, selective, offloaded or budget:F "
                                         f"(F from 0 to 1), got {text!r}")
    return f"budget:{fraction(value)}"


def tile_count(text):  # tiled MLP: --mlp-tiles
    """auto (the length over the hidden size, rounded up: ALST's) or a whole number of tiles."""
    return text if text == "auto" else positive_int(text)


@dataclass(frozen=True)
class Switch:
    """One switch: its flag and argparse's options for it, the step each value comes from (a
    value: its step, or steps; ANY where it takes a number), and the stack's group of each value
    the stack's chain may set. `tried`: a value the tests try it with where it takes any."""
    flag: str
    options: dict
    steps: dict
    groups: dict = None
    tried: tuple = ()


SWITCHES = (
    Switch("--precision", dict(choices=PRECISIONS, default="bf16", help=(
        "fp32 (01), mixed: float16 autocast and a loss scaler (02), bf16: the whole model in "
        "bfloat16 (03, default)")), {"fp32": "01", "mixed": "02", "bf16": "03"}),
    Switch("--stochastic-rounding", dict(action="store_true", help=(
        "Adam's step rounded into bfloat16 at random (04b)")), {True: "04b"}),
    Switch("--accum-steps", dict(type=positive_int, default=1, help=(
        "micro-batches per optimizer step (default: 1; 04)")), {ANY: "04"}, tried=("2",)),
    Switch("--optimizer", dict(choices=["adam", "adamw-8bit", "adamw-4bit", "adafactor", "sgd", "galore",
                                        "galore-8bit"], default="adam", help=(
        "adam (default), adamw-8bit (05a), adamw-4bit (05j), adafactor (05b), sgd: plain SGD "
        "with cosine decay (05), galore: Adam on a low-rank projection of each block's 2-D "
        "gradients (04c), galore-8bit: its moments in 8 bits (04c --galore-8bit)")),
        {"adamw-8bit": "05a", "adamw-4bit": "05j", "adafactor": "05b", "sgd": "05", "galore": "04c",
         "galore-8bit": "04c"},
        {"adamw-8bit": INEXACT, "adamw-4bit": INEXACT, "galore": INEXACT, "galore-8bit": INEXACT}),
    Switch("--galore-rank", dict(type=positive_int, help=(
        "with --optimizer galore: singular vectors kept (default: a quarter of each weight's "
        "narrower side)")), {ANY: "04c"}),
    Switch("--galore-gap", dict(type=positive_int, default=200, help=(
        "with --optimizer galore: optimizer steps from one projection to the next (default: 200)")),
        {ANY: "04c"}),
    Switch("--galore-scale", dict(type=positive_float, default=0.25, help=(
        "with --optimizer galore: the factor on the step projected back (default: 0.25)")),
        {ANY: "04c"}),
    Switch("--optimizer-on-host", dict(action="store_true", help=(
        "the optimizer's state and step in host memory (05f)")), {True: "05f"}, {True: OVER_PCIE}),
    Switch("--gradients-to-host", dict(action="store_true", help=(
        "with --optimizer-on-host: each gradient sent to host memory as soon as backward makes "
        "it (05i)")), {True: "05i"}, {True: OVER_PCIE}),
    Switch("--optimizer-in-backward", dict(action="store_true", help=(
        "each weight stepped as soon as its gradient is complete (04a)")), {True: "04a"},
        {True: NO_ACCUMULATION}),
    Switch("--checkpointing", dict(type=checkpointing_kind, default="none", help=(
        "recompute each block in backward: full (05c; 09 when sharded), selective (05d), "
        "offloaded: inputs in host memory (05e); budget:F: compiled, backward keeping at most F "
        "(0 to 1) of what it would (05k)")),
        {"full": ("05c", "09"), "selective": "05d", "offloaded": "05e", "budget:F": "05k"},
        {"full": EXACT, "selective": EXACT, "offloaded": OVER_PCIE}),
    Switch("--loss", dict(choices=["model", "chunked", "fused"], default="model", help=(
        "model: the model's own (default); chunked: the output layer and loss a piece of the "
        "sequence at a time (05g, --task causal-lm); fused: the same, its gradients made in "
        "forward (05h)")), {"chunked": "05g", "fused": "05h"}, {"fused": EXACT}),
    Switch("--mlp-tiles", dict(type=tile_count, help=(
        "each block's MLP run on N pieces of the sequence in turn, each recomputed in backward; "
        "auto: the length over the hidden size, rounded up, as ALST (05l, --task causal-lm)")),
        {ANY: "05l"}, {"auto": EXACT}, tried=("2",)),
    Switch("--lora-rank", dict(type=positive_int, help=(
        "train low-rank adapters of this rank on frozen weights (07a)")), {ANY: "07a"},
        tried=("4",)),
    Switch("--lora-alpha", dict(type=positive_float, help=(
        "with --lora-rank: the adapters' scale is alpha / r (default: 16)")), {ANY: "07a"}),
    Switch("--lora-targets", dict(nargs="+", metavar="NAME", help=(
        "with --lora-rank: adapt only the linear layers of these names")), {ANY: "07a"}),
    Switch("--qlora", dict(action="store_true", help=(
        "with --lora-rank: the adapted layers' frozen weights in 4 bits (07b)")), {True: "07b"}),
    Switch("--offload", dict(action="store_true", help=(
        "FSDP with parameters, gradients and optimizer state in host memory (08); alone, a group "
        "of one process")), {True: "08"}, {True: WEIGHTS_ON_HOST}),
    Switch("--world-size", dict(SHARED_FLAGS["--world-size"], default=None, help=(  # as 07-09's
        SHARED_FLAGS["--world-size"]["help"] + " (default: WORLD_SIZE, or 1)")), {ANY: "07"}),
    Switch("--reshard-after-forward", dict(type=true_or_false, metavar="{true,false}", help=(
        "when sharded: true (default, ZeRO-3) frees each block's gathered weights after forward; "
        "false (ZeRO-2's memory) keeps them (07)")), {ANY: "07"}, tried=("false",)),
    Switch("--sequence-parallel", dict(action="store_true", help=(
        "--task causal-lm, sharded: each text split across the processes, attention by "
        "all-to-alls (Ulysses, 08a); alone, a group of one process")), {True: "08a"}),
)


def own_flags(parser):
    """Each switch of SWITCHES on the command line, off by default (the run is then 03's,
    created as 06 creates it)."""
    for switch in SWITCHES:
        parser.add_argument(switch.flag, **switch.options)


def launched_sharded(args):
    """Whether the run shards the model (07-09): under torchrun (which sets RANK and WORLD_SIZE;
    the estimate runs as its process 0), alone with WORLD_SIZE=1 (a group of one, as 07-09 run
    alone), or with --offload or --sequence-parallel, which run alone as a group of one."""
    world = os.environ.get("WORLD_SIZE")
    return args.offload or args.sequence_parallel or world is not None and (
        "RANK" in os.environ or world == "1")


@dataclass(frozen=True)
class When:
    """A condition that REFUSALS names: its words (or a function of the settings that gives
    them), their form in docs/combined.md, and whether it holds for the settings."""
    words: object
    holds: object
    doc: str = None

    def said(self, settings):
        return self.words(settings) if callable(self.words) else self.words

    def __and__(self, other):  # both, said together
        return When(lambda settings: f"{self.said(settings)} and {other.said(settings)}",
                    lambda settings: self.holds(settings) and other.holds(settings),
                    f"{self.doc} and {other.doc}")


def given(flag, *values):
    """--flag given: set to one of `values` where named, else to anything but its default."""
    name = flag[2:].replace("-", "_")
    if values:
        return When(lambda settings: f"{flag} {getattr(settings, name)}",
                    lambda settings: getattr(settings, name) in values, f"{flag} {'|'.join(values)}")
    switch = next(switch for switch in SWITCHES if switch.flag == flag)
    default = switch.options.get("default", False if switch.options.get("action") else None)
    return When(flag, lambda settings: getattr(settings, name) != default, flag)


def missing(flag):
    """--flag not given; said "without --flag"."""
    return When(f"without {flag}", lambda settings: not given(flag).holds(settings), f"without {flag}")


def sharding_words(settings):
    """What shards this run, in words: --offload, torchrun, or a WORLD_SIZE=1 left set."""
    if settings.offload:
        return "--offload"
    if settings.sequence_parallel and "RANK" not in os.environ:
        return "--sequence-parallel"
    return "sharding (torchrun)" if "RANK" in os.environ else \
        "WORLD_SIZE=1 (set, it runs sharded as a group of one: unset it for a run without FSDP)"


SHARDED = When(sharding_words, launched_sharded,
               "sharding (torchrun, --offload or --sequence-parallel)")
UNDER_TORCHRUN = When(sharding_words, lambda settings: launched_sharded(settings) and not settings.offload,
                      "sharding (torchrun)")
UNSHARDED = When("without sharding", lambda settings: not launched_sharded(settings), "without sharding")
UNPACKED = When("without --pack", lambda settings: not settings.pack, "without --pack")
BUDGET = When("--checkpointing budget:F", lambda settings: settings.checkpointing.startswith("budget:"),
              "--checkpointing budget:F")
CHECK_ESTIMATE = When("--check-estimate", lambda settings: settings.check_estimate, "--check-estimate")
NO_COMPILER = When("no compiler torch.compile can use here", lambda settings: not settings.estimate
                   and compiler_problem(settings.device) is not None,
                   "no compiler torch.compile can use here")
GALORE = ("galore", "galore-8bit")  # GaLore: --optimizer's values that project
NOT_GALORE = When("without --optimizer galore|galore-8bit",
                  lambda settings: settings.optimizer not in GALORE, "without --optimizer galore|galore-8bit")
NO_BITSANDBYTES_HERE = When("without bitsandbytes", lambda settings: NO_BITSANDBYTES is not None,
                            "without bitsandbytes")
STRAY_WORLD_SIZE = When(
    lambda settings: f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set, but no launcher started this "
                     "process (torchrun sets RANK too)",
    lambda settings: os.environ.get("WORLD_SIZE") not in (None, "1") and "RANK" not in os.environ
    and not settings.estimate, "WORLD_SIZE set (other than 1) without a launcher")

def the_compilers_words(settings):
    """torch.compile's own words: what to install"""
    return compiler_problem(settings.device)


def where_to_get_bitsandbytes(settings):
    """bitsandbytes' error, and the pinned version to install"""
    return f"it needs {NO_BITSANDBYTES}; or leave it out"


def unset_or_launch(settings):
    """unset WORLD_SIZE to train in one process, or start the script with torchrun"""
    world = os.environ["WORLD_SIZE"]
    if not world.isdigit() or int(world) < 1:
        return "it is no count of processes: unset WORLD_SIZE to train in one process"
    return f"unset WORLD_SIZE to train in one process, or start it with torchrun --nproc_per_node={world}"


# the switches that cannot train together: (when each of these holds, why, and what to do); the
# first that holds stops the run before anything is built, in one line naming them
REFUSALS = (
    (given("--optimizer-in-backward"), given("--accum-steps"),
     "each weight is stepped during backward, so gradients cannot add up over micro-batches; "
     "use one of them"),
    (given("--optimizer-in-backward"), given("--precision", "mixed"),
     "the loss scaler checks every gradient for inf before one step; use --precision bf16 or fp32"),
    (given("--stochastic-rounding"), given("--precision", "fp32", "mixed"),
     "it rounds the step into bfloat16 weights; use --precision bf16"),
    (given("--stochastic-rounding"), given("--optimizer", "adamw-8bit", "adamw-4bit", "adafactor", "sgd",
                                           *GALORE),
     "it is Adam's update, rounded at random; use --optimizer adam"),
    (given("--optimizer", "adafactor"), SHARDED,
     "its second moment is factored into the sums of each weight's rows and columns, and a "
     "process holds some rows only; use --optimizer adam, sgd, adamw-8bit or adamw-4bit"),
    (given("--optimizer", *GALORE), SHARDED,
     "each process holds a slice of each weight's rows, and a projection is made from the "
     "singular vectors of the whole gradient; use --optimizer adamw-8bit or adamw-4bit"),
    (given("--optimizer", *GALORE), given("--lora-rank"),
     "GaLore trains every weight in a low-rank projection of its gradient, LoRA low-rank "
     "adapters on frozen weights; use one of them"),
    (given("--optimizer", *GALORE), given("--optimizer-on-host"),
     "GaLore keeps its moments small on the GPU, and on the host each projection's SVD would run "
     "on the CPU; use --optimizer adamw-8bit or adamw-4bit with --optimizer-on-host"),
    (given("--galore-rank"), NOT_GALORE, "it shapes GaLore's projections; add --optimizer galore"),
    (given("--galore-gap"), NOT_GALORE, "it times GaLore's projections; add --optimizer galore"),
    (given("--galore-scale"), NOT_GALORE, "it scales GaLore's steps; add --optimizer galore"),
    (given("--optimizer", "adamw-8bit"), given("--optimizer-in-backward") & UNDER_TORCHRUN,
     "FSDP calls each weight's step on its reduce-scatter stream, and bitsandbytes launches its "
     "kernels on the default stream, so a step could read a gradient shard before the "
     "reduce-scatter has written it; use --optimizer adamw-4bit, or one of them"),
    (given("--optimizer", "adamw-8bit", "adamw-4bit"), given("--precision", "mixed") & SHARDED,
     "it steps each process's gradient shards as plain tensors, so each loss scaler would look "
     "for inf in its own shards only, and the processes could disagree on skipping a step; use "
     "--precision bf16"),
    (BUDGET, NO_COMPILER, the_compilers_words),
    (given("--gradients-to-host"), missing("--optimizer-on-host"),
     "it sends each gradient to the host's optimizer; add --optimizer-on-host"),
    (given("--gradients-to-host"), given("--optimizer-in-backward"),
     "each weight's step on the host takes its gradient out as backward makes it already; use "
     "one of them"),
    (given("--optimizer-on-host"), given("--offload"),
     "both keep the optimizer's state and step in host memory; --offload also keeps the weights "
     "there: use one of them"),
    (given("--optimizer-on-host"), UNDER_TORCHRUN,
     "use --offload, which keeps each process's shards, their state and the step in host memory"),
    (given("--precision", "mixed"), given("--offload"),
     "the loss scaler's check for inf all-reduces a flag made beside the gradient shards in host "
     "memory, which a GPU group (NCCL) cannot carry; use --precision bf16 or fp32"),
    (given("--qlora"), given("--precision", "mixed"),
     "the 4-bit layers compute in their float32 weights' dtype and autocast copies each "
     "dequantized weight again in float16; use --precision bf16"),
    (given("--optimizer-on-host"), given("--precision", "mixed"),
     "the loss scaler unscales the gradients on the device, before the step; use --precision "
     "bf16 or fp32"),
    (given("--loss", "chunked", "fused"), given("--task", "classification"),
     "a classifier's logits are a few numbers per sample, with nothing to chunk; add --task "
     "causal-lm"),
    (given("--mlp-tiles"), given("--task", "classification"),
     "it cuts the long sequences of a language model's texts, and 05l trains that task only; add "
     "--task causal-lm"),
    (given("--loss", "fused"), given("--precision", "mixed"),
     "it makes its gradients in forward, before the loss scaler's factor reaches them, so small "
     "float16 gradients would underflow; use --precision bf16 or fp32"),
    (given("--lora-alpha"), missing("--lora-rank"), "it shapes the adapters; add --lora-rank R"),
    (given("--lora-targets"), missing("--lora-rank"), "it shapes the adapters; add --lora-rank R"),
    (given("--qlora"), missing("--lora-rank"), "it shapes the adapters; add --lora-rank R"),
    (given("--lora-rank"), SHARDED,
     "the sharded model is filled from the preset's model parameter by parameter, and the "
     "adapters are not in it"),
    (given("--optimizer", "adamw-8bit", "galore-8bit"), NO_BITSANDBYTES_HERE, where_to_get_bitsandbytes),
    (given("--qlora"), NO_BITSANDBYTES_HERE, where_to_get_bitsandbytes),
    (STRAY_WORLD_SIZE, unset_or_launch),
    (CHECK_ESTIMATE, BUDGET,
     "the budget compiles the blocks, whose estimate is a range (estimate/compiled.py), so "
     "nothing would be checked; leave one of them out"),
    (given("--reshard-after-forward"), UNSHARDED,
     "it says what FSDP does after a block's forward; run under torchrun or with --offload"),
    (given("--sequence-parallel"), given("--task", "classification"),
     "it splits each text for its next tokens, under causal attention; add --task causal-lm"),
    (given("--sequence-parallel"), given("--loss", "chunked"),
     "its loss is over each process's slice of the texts; use --loss fused or model"),
    (given("--sequence-parallel") & given("--loss", "fused"), UNPACKED,
     "a slice of padding alone would have no predicted token to average over; add --pack"),
)


def refusal(settings):
    """Why the switches given (the parsed command line) cannot train together, in one line naming
    them, or None."""
    for *conditions, why in REFUSALS:
        if all(condition.holds(settings) for condition in conditions):
            words = [condition.said(settings) for condition in conditions]
            named = words[0] + "".join(f" {word}" if word.startswith("without ") else f" with {word}"
                                       for word in words[1:])
            return f"{named}: {why(settings) if callable(why) else why}"
    return None


class Settings(argparse.Namespace):
    """The command line with what the switches imply resolved once (resolved()): the recipe
    reads it and never changes it."""

    def __setattr__(self, name, value):
        if name in vars(self):
            raise AttributeError(f"the settings are resolved once: {name} does not change")
        super().__setattr__(name, value)


def resolved(args):
    """This run's settings: every switch checked beside the others (the first of REFUSALS that
    holds stops here, in one line), then what they imply, worked out once."""
    problem = refusal(args)
    if problem:
        raise SystemExit(f"error: {problem}")
    settings = Settings(**vars(args), sharded=launched_sharded(args))
    budget = args.checkpointing.partition("budget:")[2]  # memory budget: compiled, under it
    chosen = OPTIMIZERS["stochastic rounding" if args.stochastic_rounding else args.optimizer]
    loss = {"model": model_loss, "chunked": chunked_loss, "fused": fused_loss}[args.loss]  # 05g, 05h
    stepped_weights = list  # the optimizer steps the trained weights, or stands in for them:
    if settings.sharded and chosen in SHARDS_STEPPED:  # sharded switches: each process's shards
        stepped_weights = partial(local_shards, in_backward=args.optimizer_in_backward)
    if args.optimizer_on_host:  # Adam on the host: host copies of the weights
        stepped_weights = host_copies
    reshard = args.reshard_after_forward  # FSDP's default, as 07-09's (null in an unsharded record)
    if reshard is None and settings.sharded:
        reshard = True
    if settings.sharded and args.loss != "model":  # sharded switches: a loss of the blocks and
        loss = root_loss  # the output layer apart is the root's forward (apply_sharding)
    if args.sequence_parallel:  # 08a: each process's slice of each text
        loss = sequence_fused_loss if args.loss == "fused" else sequence_loss
    return Settings(**{**vars(settings), **dict(
        dtype=PRECISIONS[args.precision], compile=args.compile or bool(budget),
        memory_budget=float(budget or 1.0), lora_alpha=args.lora_alpha or 16.0,  # LoRA's default
        reshard_after_forward=reshard, make_optimizer=partial(chosen.make, **chosen.flags(args)),
        schedule=chosen.schedule,
        gradients_kept=GradientsToHost if args.gradients_to_host else GradientsOnTheDevice,
        lr=args.lr or chosen.rate(preset_for(args), args), stepped_weights=stepped_weights,
        loss_of=loss, evaluation_loss=None if args.loss == "model" else loss,  # evaluation: a model's own
        check_split=check_split if args.sequence_parallel else check_batch_split)})


def model_loss(model, inputs, labels):  # its own loss: over classes, or next tokens
    return model(**inputs, labels=labels).loss


def adam_rate(preset, args):  # 03's rate; 07a's and 07b's with adapters
    return preset.qlora_lr if args.qlora else preset.lora_lr if args.lora_rank else preset.lr


@dataclass(frozen=True)
class Choice:
    """An --optimizer: how it is made over some weights of the model at a rate, its default rate
    (its script's: adam_rate unless named), the rate's schedule, where it has one, and its own
    flags' values for `make` (GaLore's)."""
    make: object  # (weights, lr, fused, model, **flags) -> the optimizer
    rate: object = adam_rate  # (preset, args) -> the rate
    schedule: object = None  # (optimizer, steps) -> its schedule
    flags: object = lambda args: {}  # (args) -> {name: value} for make


def galore_adam(weights, lr, fused, model, rank, gap, scale, eight_bit):  # GaLore
    """04c's GaLoreAdam over `weights`, each in a group of its own with its rank (none: Adam)."""
    ranks = galore_ranks(model, rank)
    return GaLoreAdam([dict(params=[weight], rank=ranks.get(weight)) for weight in weights], lr=lr,
                      gap=gap, scale=scale, eight_bit=eight_bit)


def galore_flags(args):  # GaLore: 04c's flags, --galore-8bit as --optimizer galore-8bit
    return dict(rank=args.galore_rank, gap=args.galore_gap, scale=args.galore_scale,
                eight_bit=args.optimizer == "galore-8bit")


OPTIMIZERS = {  # --optimizer, and --stochastic-rounding's Adam: each its script's optimizer
    "adam": Choice(lambda weights, lr, fused, model: torch.optim.Adam(weights, lr=lr, fused=fused)),  # 03
    "stochastic rounding": Choice(lambda weights, lr, fused, model: AdamStochasticRounding(weights, lr=lr)),
    "adamw-8bit": Choice(lambda weights, lr, fused, model: AdamW8bit(weights, lr=lr, weight_decay=0.0)),
    "adamw-4bit": Choice(lambda weights, lr, fused, model: AdamW4bit(weights, lr=lr)),  # 05j
    "adafactor": Choice(lambda weights, lr, fused, model: torch.optim.Adafactor(weights, lr=lr),
                        lambda preset, args: 0.01),  # Adafactor: a rate relative to each weight's size
    "sgd": Choice(lambda weights, lr, fused, model: torch.optim.SGD(weights, lr=lr),  # 05: plain SGD
                  lambda preset, args: preset.sgd_lr,
                  lambda optimizer, steps: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                                                      T_max=steps)),
    "galore": Choice(galore_adam, flags=galore_flags),  # 04c
    "galore-8bit": Choice(galore_adam, flags=galore_flags),  # 04c --galore-8bit
}
# sharded switches: the optimizers with no rule for a sharded weight (a DTensor), which each
# process steps over its plain shards
SHARDS_STEPPED = (OPTIMIZERS["adamw-8bit"], OPTIMIZERS["adamw-4bit"], OPTIMIZERS["stochastic rounding"])
WRAPPED = ("full", "selective", "offloaded")  # the --checkpointing kinds that wrap each block


# ==== the techniques, in steps.py's order: each its script's code, under its script's name ======


# ---- 04a_optimizer_in_backward.py: optimizer in backward ----------------------------------------


def step_in_backward(trained, optimizers, on_host):  # optimizer in backward
    """A hook on each trained weight that steps its own optimizer once backward has completed
    its gradient, and frees the gradient (Adam on the host: through the host, 05f's step)."""
    for param, optimizer in zip(trained, optimizers):
        param.register_post_accumulate_grad_hook(partial(step_and_free, optimizer=optimizer,
                                                         on_host=on_host))


def step_and_free(param, optimizer, on_host):  # optimizer in backward: this weight now, its gradient freed
    if on_host:
        step_on_host(optimizer, [param])  # Adam on the host
        return
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ---- 04b_bf16_stochastic_rounding.py: stochastic rounding --------------------------------------


def stochastic_round(values):  # stochastic rounding: float32 to bfloat16, up or down at random
    """`values` (float32) rounded to one of their two bfloat16 neighbours, the nearer more often,
    still as float32 (so that copying them into a bfloat16 tensor is exact): adding random low 16
    bits, then cutting them off, carries into the kept bits with probability
    (x - lower) / (upper - lower)."""
    bits = values.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    rounded = ((bits + noise) & -(1 << 16)).view(torch.float32)
    return torch.where(values.isnan(), values, rounded)  # a NaN's carry could make it 0 or inf


class AdamStochasticRounding(torch.optim.Optimizer):  # stochastic rounding
    """torch.optim.Adam's update (no weight decay) for bfloat16 weights and states, computed in
    float32 a chunk at a time and written back with stochastic_round."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, chunk=2**20):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, chunk=chunk))
        for param in (param for group in self.param_groups for param in group["params"]):
            if param.dtype != torch.bfloat16:  # float32 work on a float32 weight would alias it
                raise TypeError(f"AdamStochasticRounding updates bfloat16 weights, not {param.dtype}")

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
            for param in (param for param in group["params"] if param.grad is not None):
                state = self.state[param]
                if not state:  # bfloat16 states, as 03's Adam keeps them
                    state.update(step=0, exp_avg=torch.zeros_like(param),
                                 exp_avg_sq=torch.zeros_like(param))
                state["step"] += 1
                bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                chunks = (tensor.view(-1).split(group["chunk"]) for tensor in
                          (param, param.grad, state["exp_avg"], state["exp_avg_sq"]))
                for weight, grad, exp_avg, exp_avg_sq in zip(*chunks):  # float32 work, one chunk
                    grad = grad.float()
                    mean = exp_avg.float().lerp_(grad, 1 - beta1)
                    square = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    exp_avg.copy_(stochastic_round(mean))
                    exp_avg_sq.copy_(stochastic_round(square))
                    denominator = square.div_(bias2).sqrt_().add_(eps)
                    updated = weight.float().addcdiv_(mean, denominator, value=-lr / bias1)
                    weight.copy_(stochastic_round(updated))


# ---- 04c_galore.py: GaLore ---------------------------------------------------------------------

def galore_ranks(model, rank):  # GaLore: the weights it projects, each with its rank
    """{weight: rank} for each 2-D weight of the model's blocks: `rank`, or a quarter of its narrower
    side (the authors' rank for their 60M, 350M and 7B models: 128 of 512 ... 1,024 of 4,096)."""
    weights = [weight for block in transformer_blocks(model) for weight in block.parameters()
               if weight.ndim == 2]
    if not weights:
        raise SystemExit("error: the model's blocks have no 2-D weight for GaLore to project (a "
                         "convolutional network's are 4-D): train it with 04a_optimizer_in_backward.py")
    narrowest = min(min(weight.shape) for weight in weights)
    if rank and rank > narrowest:
        raise SystemExit(f"error: --galore-rank {rank} is above {narrowest}, the narrower side of the "
                         "blocks' narrowest 2-D weight, which has no more singular vectors: use at "
                         f"most {narrowest}, or leave it out")
    return {weight: rank or max(1, min(weight.shape) // 4) for weight in weights}


def projection(gradient, rank, left):  # GaLore: the gradient's top singular vectors, in its dtype
    u, _, vh = torch.linalg.svd(gradient.float(), full_matrices=False)  # float32, as the authors'
    return (u[:, :rank] if left else vh[:rank]).to(gradient.dtype, copy=True)  # those r alone


class GaLoreAdam(torch.optim.Optimizer):  # GaLore
    """The authors' GaLoreAdamW, weight decay 0: a weight whose group has a rank is stepped in its
    projection, made every `gap` steps, the step projected back times `scale`; any other as Adam.
    `eight_bit`: moments of 4,096 numbers or more in 8 bits (their GaLoreAdamW8bit). The states
    are made here, so that the first step, which makes the projections, holds what later ones do."""

    def __init__(self, params, lr, gap=200, scale=0.25, eight_bit=False, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, dict(lr=lr, rank=None, gap=gap, scale=scale, eight_bit=eight_bit,
                                      betas=betas, eps=eps))
        for group in self.param_groups:
            for weight in group["params"]:
                self.state[weight] = self.zeros(weight, group["rank"], group["eight_bit"])

    @staticmethod
    def zeros(weight, rank, eight_bit):  # the states as Adam's first step would make them
        state, shape = dict(step=0), weight.shape  # the moments': the weight's, or R's
        if rank:
            rows, columns = weight.shape
            state["left"] = rows < columns  # the narrower side projected, as galore-torch does
            shape = (rank, columns) if state["left"] else (rows, rank)
            state["projector"] = weight.new_zeros((rows, rank) if state["left"] else (rank, columns))
        if not (eight_bit and math.prod(shape) >= 4096):  # in the weights' dtype
            return dict(state, exp_avg=weight.new_zeros(shape), exp_avg_sq=weight.new_zeros(shape))
        for moment, signed in ((1, True), (2, False)):  # 8-bit codes, a float32 scale per 256 (05a's)
            state[f"state{moment}"] = torch.zeros(shape, dtype=torch.uint8, device=weight.device)
            state[f"absmax{moment}"] = torch.zeros(-(-math.prod(shape) // 256), device=weight.device)
            state[f"qmap{moment}"] = bnb.create_dynamic_map(signed=signed).to(weight.device)
        return state

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is not None:
                    self.step_weight(weight, weight.grad, self.state[weight], group)

    def step_weight(self, weight, gradient, state, group):
        (beta1, beta2), lr, rank = group["betas"], group["lr"], group["rank"]
        stepped = weight  # what Adam's step is added to: the weight, or (projected) a zero R
        if rank:
            if state["step"] % group["gap"] == 0:  # a new subspace; the moments are kept
                state["projector"] = projection(gradient, rank, state["left"])
            projector = state["projector"]
            gradient = projector.T @ gradient if state["left"] else gradient @ projector.T  # R
            stepped = torch.zeros_like(gradient)
        state["step"] += 1
        if "state1" in state:  # 8 bits: bitsandbytes' Adam decodes, updates and encodes them
            bnb.optimizer_update_8bit_blockwise(  # (its CUDA kernel reads them in memory's order)
                "adam", gradient.contiguous(), stepped, state["state1"], state["state2"], beta1,
                beta2, 0.0, 0.0, group["eps"], state["step"], lr, state["qmap1"], state["qmap2"],
                state["absmax1"], state["absmax2"])
        else:  # the authors' Adam: eps added to the second moment's root before its correction
            state["exp_avg"].mul_(beta1).add_(gradient, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
            step_size = lr * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
            stepped.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]),
                             value=-step_size)
        if rank:  # back to the weight's shape, scaled, added by one product (no temporary its size)
            weight.addmm_(*((projector, stepped) if state["left"] else (stepped, projector)),
                          alpha=group["scale"])


# ---- 05c_activation_checkpointing.py: checkpointing on one device ------------------------------


def apply_checkpointing(model, settings, device):  # checkpointing on one device: wrap each block in place
    """Each block wrapped to be recomputed in backward (FSDP then shards the wrappers, 09): from
    its input alone (05c), keeping the matrix products' outputs (05d), or with its input in host
    memory (05e, which compiles each block before wrapping it, as the hooks' `with` stops the
    compiler)."""
    blocks = transformer_blocks(model)
    offloaded = settings.checkpointing == "offloaded"
    offload = OffloadedInputs(device) if offloaded else nullcontext()  # activation offloading
    selective = settings.checkpointing == "selective"  # selective checkpointing
    for index, block in enumerate(blocks):
        if settings.compile and offloaded:  # activation offloading: each block on its own
            block.compile()
        blocks[index] = CheckpointedBlock(block, offload, selective)


class CheckpointedBlock(BlockWrapper):  # checkpointing on one device
    """Runs `block` keeping only its input for backward, where the block runs forward again."""

    def __init__(self, block, offload, selective):  # activation offloading, selective checkpointing
        super().__init__()
        self.block = block
        self.offload = offload  # activation offloading: the hooks that move the saved input
        self.selective = selective  # selective checkpointing: keep what keep_or_recompute says

    def forward(self, hidden_states, *args, **kwargs):
        # non-reentrant: the variant PyTorch recommends; it passes keyword arguments through.
        # checkpointing: FSDP shards this wrapper, so its backward hook gathers the weights first
        with self.offload:  # activation offloading: checkpoint saves the input under its hooks
            if self.selective:  # selective checkpointing: keep the outputs keep_or_recompute names
                return checkpoint(self.block, hidden_states, *args, use_reentrant=False,
                                  context_fn=selective_contexts, **kwargs)
            return checkpoint(self.block, hidden_states, *args, use_reentrant=False, **kwargs)


# ---- 05d_selective_checkpointing.py: selective checkpointing -----------------------------------

ATEN = torch.ops.aten  # selective checkpointing: the operators whose outputs forward keeps

# the weights' products and the attention kernels; not bmm or baddbmm, which make the score
# matrices (batch x heads x tokens x tokens) of a model's own attention code (BLOOM's), 05c's saving
SAVED = [ATEN.mm.default, ATEN.addmm.default,
         ATEN.convolution.default, ATEN._scaled_dot_product_flash_attention_for_cpu.default,
         ATEN._scaled_dot_product_flash_attention.default,
         ATEN._scaled_dot_product_efficient_attention.default,
         ATEN._scaled_dot_product_cudnn_attention.default]


def keep_or_recompute(context, op, *args, **kwargs):  # selective checkpointing: per operator
    """Keep the output of a SAVED operator, unless it draws random numbers (a GPU's attention
    with dropout): backward replays the random draws of what it recomputes, in order, and a
    draw skipped there would give the dropout after it another mask than forward's."""
    arguments = dict(zip((argument.name for argument in op._schema.arguments), args)) | kwargs
    if op in SAVED and not arguments.get("dropout_p"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():  # selective checkpointing: a fresh pair for each checkpointed call
    return create_selective_checkpoint_contexts(keep_or_recompute)


# ---- 05e_activation_offloading.py: activation offloading ---------------------------------------


class OffloadedInputs(torch.autograd.graph.saved_tensors_hooks):  # activation offloading
    """While inside, a tensor saved for backward that requires a gradient (the input a
    checkpointed block keeps) is copied to host memory, and its device copy left to be freed;
    backward copies it back. Masks and position tables (no gradient) stay where they are."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # copies out
        super().__init__(self.to_host, self.to_device)

    def to_host(self, tensor):
        if not tensor.requires_grad:
            return tensor
        if self.stream is None:  # a CPU: copied all the same, so the estimate sees it move
            return tensor.device, tensor.to(HOST, copy=True)
        if not tensor.is_cuda:  # a placeholder that checkpointing saves on the CPU (torch 2.11)
            return tensor
        self.stream.wait_stream(torch.cuda.current_stream())  # once the tensor is computed
        with torch.cuda.stream(self.stream):  # overlaps the compute stream's next kernels
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is reused only after the copy is done
        return tensor.device, host

    def to_device(self, packed):
        if torch.is_tensor(packed):
            return packed
        device, host = packed
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)  # the copy out is complete
        return host.to(device, non_blocking=True)



# ---- 05f_adam_on_host.py: Adam on the host -----------------------------------------------------


def host_copies(weights):  # Adam on the host: a host copy of each weight, which Adam updates
    # its state beside it (pinned on a GPU: copies to and fro are queued, not waited for)
    return [weight.detach().to(HOST, copy=True, non_blocking=True) for weight in weights]


def step_on_host(optimizer, weights):  # Adam on the host: gradients out, the step, weights back
    host_weights = optimizer.param_groups[0]["params"]
    for weight, host_weight in zip(weights, host_weights):
        if weight.grad is not None:  # the gradient goes out (none: no step), queued: no wait
            host_weight.grad = weight.grad.to(HOST, non_blocking=True)  # into pinned memory
        weight.grad = None  # and is freed on the device
    if weights[0].is_cuda:  # one wait, for the copies out: an event after them
        torch.cuda.current_stream(weights[0].device).record_event().synchronize()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for weight, host_weight in zip(weights, host_weights):
        weight.detach().copy_(host_weight, non_blocking=True)  # the updated weight comes back


# ---- 05g_chunked_loss.py: chunked loss ---------------------------------------------------------

LOSS_CHUNKS = 8  # chunked loss: pieces of the sequence whose logits exist one at a time


def piece_loss(head, hidden, targets):  # chunked loss
    """The summed next-token loss of one piece: its logits, upcast as the model's loss does."""
    logits = head(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED,
                           reduction="sum")


def chunked_loss(model, inputs, labels):  # chunked loss
    """model(**inputs, labels=labels).loss, with the output layer and the loss run piece by
    piece, each piece recomputed in backward (checkpoint) rather than kept."""
    hidden = model.base_model(**inputs).last_hidden_state  # the blocks' output, before the head
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORED)  # position t predicts token t + 1
    loss = 0.0
    for piece, piece_targets in zip(hidden.tensor_split(LOSS_CHUNKS, dim=1),
                                    targets.tensor_split(LOSS_CHUNKS, dim=1)):
        loss = loss + checkpoint(piece_loss, model.get_output_embeddings(), piece, piece_targets,
                                 use_reentrant=False)
    return loss / (targets != IGNORED).sum()  # the mean over every predicted token


def check_loss(model, loss):  # chunked loss, fused loss: the model's loss is what they compute
    if loss in ("chunked", "fused"):
        check_plain_output_layer(model.config, "Train it with --loss model")  # chunked loss
    if loss == "fused":
        check_output_layer_without_bias(model, "Train it with --loss chunked")  # fused loss


# ---- 05h_fused_loss.py: fused loss -------------------------------------------------------------


class FusedLinearCrossEntropy(torch.autograd.Function):  # fused loss
    """The mean next-token loss over head(hidden)'s logits; forward computes its gradients too."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, with_gradients):
        tokens, targets = hidden.flatten(0, 1), targets.flatten()  # every token of the batch
        kept = (targets != IGNORED).unsqueeze(-1)  # the predicted positions
        count = kept.sum()
        loss = torch.zeros((), device=hidden.device)
        grad_tokens = torch.empty_like(tokens) if with_gradients else None
        trains_weight = with_gradients and ctx.needs_input_grad[1]  # not a frozen output layer's
        grad_weight = torch.zeros_like(weight) if trains_weight else None  # held until backward
        size = -(-len(tokens) // LOSS_CHUNKS)  # tokens in a piece (the last may have fewer)
        for start in range(0, len(tokens), size):
            piece, piece_kept = tokens[start:start + size], kept[start:start + size]
            piece_targets = targets[start:start + size].clamp(min=0).unsqueeze(-1)  # IGNORED: any
            logits = (piece @ weight.T).float()  # this piece's logits, upcast as the model's loss
            normalizer = logits.logsumexp(-1, keepdim=True)
            loss += ((normalizer - logits.gather(-1, piece_targets)) * piece_kept).sum()
            if with_gradients:  # (evaluation: the loss alone)
                grad = logits.sub_(normalizer).exp_()  # softmax, in the logits' place
                grad.scatter_add_(-1, piece_targets, -piece_kept.float())  # minus the one-hot
                grad = grad.mul_(piece_kept / count).to(weight.dtype)  # of the mean; 0 if IGNORED
                torch.mm(grad, weight, out=grad_tokens[start:start + size])
                if trains_weight:  # vocabulary x hidden, summed over the pieces
                    grad_weight.addmm_(grad.T, piece)
                del grad
            del logits  # freed before the next piece's are made
        ctx.save_for_backward(grad_tokens, grad_weight)
        ctx.shape = hidden.shape
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_tokens, grad_weight = ctx.saved_tensors  # the loss's gradients, made in forward
        grad_hidden = grad_tokens.mul_(grad_loss).view(ctx.shape)  # scaled in place: no copy
        return grad_hidden, None if grad_weight is None else grad_weight.mul_(grad_loss), None, None


def fused_loss(model, inputs, labels):  # fused loss
    """model(**inputs, labels=labels).loss, with the output layer and the loss fused: no logits
    outlive their piece, and the output layer runs once."""
    hidden = model.base_model(**inputs).last_hidden_state  # the blocks' output, before the head
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORED)  # position t predicts token t + 1
    return FusedLinearCrossEntropy.apply(  # fused loss
        hidden, model.get_output_embeddings().weight, targets, torch.is_grad_enabled())


# ---- 05i_gradients_to_host.py: gradients to host -----------------------------------------------


class GradientsToHost:  # gradients to host
    """A hook on each weight that copies its gradient to host memory as soon as backward has
    finished it, and frees it on the device. A micro-batch's copies are added into the host
    weights' .grad, where Adam reads them, while the next micro-batch runs (on a GPU by a thread,
    once copied): each by its weight's next copy, which waits for it, and all by add_all()."""

    def __init__(self, weights, host_weights, device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # copies out
        # a GPU's thread that adds the copies in turn, set to this GPU (else its CUDA calls
        # would go to GPU 0, and open a context there)
        self.adder = None if self.stream is None else ThreadPoolExecutor(
            1, initializer=torch.cuda.set_device, initargs=(self.stream.device,))
        self.arrived = []  # (host copy of a gradient, its host weight), this micro-batch's
        self.copies, self.adding = {}, {}  # host weight -> its copy to add; the thread's sum of it
        for weight, host_weight in zip(weights, host_weights):
            weight.register_post_accumulate_grad_hook(
                lambda weight, host_weight=host_weight: self.to_host(weight, host_weight))

    def to_host(self, weight, host_weight):
        self.copy_added(host_weight)  # the micro-batch before's copy in .grad: its memory free
        if self.stream is None:  # a CPU: copied all the same, so the estimate sees it move
            self.arrived.append((weight.grad.to(HOST, copy=True), host_weight))
        else:
            self.stream.wait_stream(torch.cuda.current_stream())  # once the gradient is complete
            with torch.cuda.stream(self.stream):  # beside backward's next kernels
                host = torch.empty(weight.shape, dtype=weight.dtype, device=HOST, pin_memory=True)
                host.copy_(weight.grad, non_blocking=True)
            weight.grad.record_stream(self.stream)  # its memory is reused only after the copy
            self.arrived.append((host, host_weight))
        weight.grad = None  # freed on the device while backward goes on

    def add_up(self):
        """After a micro-batch's backward: its copies wait to be added, by a GPU's thread once the
        copies queued so far are done, while the next micro-batch runs (no wait here)."""
        copied = None if self.stream is None else self.stream.record_event()
        for host, host_weight in self.arrived:
            self.copies[host_weight] = host
            if self.adder is not None:
                self.adding[host_weight] = self.adder.submit(self.add_copy, host_weight, copied)
        self.arrived.clear()

    def add_copy(self, host_weight, copied=None):
        if copied is not None:
            copied.synchronize()  # the copies are in host memory
        if host_weight.grad is None:
            host_weight.grad = self.copies[host_weight]
        else:
            host_weight.grad += self.copies[host_weight]  # accumulation, in host memory

    def copy_added(self, host_weight):
        """Its waiting copy added (the thread's sum waited for; a CPU's made now), then let go
        of on this thread, which the memory meter watches, not on the adder's."""
        if host_weight in self.adding:
            self.adding.pop(host_weight).result()  # (the thread's error, if any, raised here)
        elif host_weight in self.copies:
            self.add_copy(host_weight)
        self.copies.pop(host_weight, None)

    def add_all(self):  # before Adam's step: every copy in .grad
        for host_weight in list(self.copies):
            self.copy_added(host_weight)


class GradientsOnTheDevice:  # gradients to host, not asked for: 05f's copies after backward
    def __init__(self, weights, host_weights, device):
        pass

    def add_up(self):
        pass

    def add_all(self):
        pass


# ---- 05j_adamw_4bit.py: 4-bit AdamW ------------------------------------------------------------

# 4-bit AdamW: the 16 values a code stands for, times its block's scale (the block's largest
# magnitude). The first moment's are signed and dense near zero (a dynamic exponent map with
# 3 exponent bits), with both -1 and 1, so that a block's largest value, either sign, is kept
# as it is; the second moment's are 1/16 to 1, without zero, which would divide by eps.
SIGNED = torch.tensor([-1.0, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                       0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0])

UNSIGNED = torch.linspace(0, 1, 17)[1:]

BLOCK = 128  # 4-bit AdamW: weights per scale

PIECE = 1 << 20  # 4-bit AdamW: weights decoded at a time (float32 temporaries of 4 MB each)


def encode(values, bounds):  # 4-bit AdamW: float32 values to codes (two per byte) and scales
    blocks = values.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1).clamp(min=1e-12)
    codes = torch.bucketize(blocks / scales[:, None], bounds, out_int32=True).to(torch.uint8).view(-1, 2)
    return codes[:, 0] | (codes[:, 1] << 4), scales


def decode(packed, scales, table):  # 4-bit AdamW: codes and scales back to float32 values
    codes = torch.stack((packed & 15, packed >> 4), dim=1).long()  # indices: int64
    return (table[codes].view(-1, BLOCK) * scales[:, None]).view(-1)


class AdamW4bit(torch.optim.Optimizer):  # 4-bit AdamW
    """Adam (weight decay 0) whose states are 4-bit codes; tensors under 4,096 weights, or not
    whole blocks, keep float32 states (as 05a's do)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.tables = {}  # the code tables on each device the weights are on

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
            for weight in group["params"]:
                if weight.grad is not None:
                    self.step_weight(weight, self.state[weight], beta1, beta2, lr, eps)

    def step_weight(self, weight, state, beta1, beta2, lr, eps):
        size, device = weight.numel(), weight.device
        if not state:  # the first step: states of zeros, as codes and scales or as float32
            state["step"], state["quantized"] = 0, size >= 4096 and size % BLOCK == 0
            for name in ("exp_avg", "exp_avg_sq"):
                if state["quantized"]:
                    state[name] = torch.zeros(size // 2, dtype=torch.uint8, device=device)
                    state[name + "_scales"] = torch.zeros(size // BLOCK, device=device)
                else:
                    state[name] = torch.zeros(size, device=device)
        state["step"] += 1
        correction1, correction2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
        if device not in self.tables:  # copied once: each copy to a GPU would wait for it
            tables = [table.to(device, copy=True) for table in (SIGNED, UNSIGNED)]
            # each with the bounds halfway between its neighbours: the nearest value wins
            self.tables[device] = [(table, (table[1:] + table[:-1]) / 2) for table in tables]
        (signed, signed_bounds), (unsigned, unsigned_bounds) = self.tables[device]
        flat, grad = weight.view(-1), weight.grad.reshape(-1)
        for start in range(0, size, PIECE):  # a piece at a time: float32 temporaries of a piece
            end = min(start + PIECE, size)
            codes, scales = slice(start // 2, end // 2), slice(start // BLOCK, end // BLOCK)
            if state["quantized"]:
                m = decode(state["exp_avg"][codes], state["exp_avg_scales"][scales], signed)
                v = decode(state["exp_avg_sq"][codes], state["exp_avg_sq_scales"][scales], unsigned)
            else:  # views of the float32 states, updated in place
                m, v = state["exp_avg"][start:end], state["exp_avg_sq"][start:end]
            g = grad[start:end].float()
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = (m / correction1).div_(v.sqrt().div_(correction2 ** 0.5).add_(eps))
            flat[start:end] = flat[start:end].float().sub_(update, alpha=lr)
            if state["quantized"]:  # encoded back into the same bytes
                state["exp_avg"][codes], state["exp_avg_scales"][scales] = encode(m, signed_bounds)
                state["exp_avg_sq"][codes], state["exp_avg_sq_scales"][scales] = encode(v, unsigned_bounds)



# ---- 05k_memory_budget.py: memory budget -------------------------------------------------------


def apply_compile(model, memory_budget):  # memory budget: compiled, each block on its own
    """torch.compile on each block on its own (torchtitan's way; before sharding it, so that
    FSDP's gathers stay outside compiled code), so that each block's backward hands back its
    gradients as it ends; its partition keeps at most `memory_budget` of what it would (1.0: all)."""
    torch._functorch.config.activation_memory_budget = memory_budget  # the partitioner's setting
    for block in transformer_blocks(model):
        block.compile()  # at the first call: seconds to minutes, then reused by alike blocks


# ---- 05l_tiled_mlp.py: tiled MLP --------------------------------------------------------------


def apply_mlp_tiles(model, tiles):  # tiled MLP: each block's MLP in tiles
    """05l's lines as a function: each block's `mlp` run in tiles, inside the block before
    checkpointing wraps it (05l's order); no block where `tiles` is None (no --mlp-tiles)."""
    blocks = transformer_blocks(model) if tiles else []
    check_block_mlp(blocks, "Train it without --mlp-tiles")
    for block in blocks:
        block.mlp = TiledMLP(block.mlp, tiles)  # tiled MLP: inside the block, before it is wrapped


class TiledMLP(torch.nn.Module):  # tiled MLP
    """Runs a block's `mlp` on `tiles` pieces of the sequence in turn, each recomputed in
    backward. Its inputs, (batch, sequence, hidden), are cut alike (BLOOM's takes the residual)."""

    def __init__(self, mlp, tiles):
        super().__init__()
        self.mlp, self.tiles = mlp, tiles

    def forward(self, *inputs):
        length, hidden = inputs[0].shape[1:]
        tiles = min(length, -(-length // hidden) if self.tiles == "auto" else self.tiles)
        pieces = zip(*(tensor.tensor_split(tiles, dim=1) for tensor in inputs))
        # non-reentrant, as each block's: each tile keeps only its input for backward
        return torch.cat([checkpoint(self.mlp, *piece, use_reentrant=False) for piece in pieces],
                         dim=1)


# ---- 07_fsdp.py: FSDP (08: offload) --------------------------------------------------------------


def apply_sharding(model, settings, preset, device, world_size):  # FSDP
    """Shard each block (it gathers its weights in turn), the token embeddings, then the rest as
    one more unit, over every process; each process then allocates and fills its shards."""
    shard_options = dict(mesh=init_device_mesh(device.type, (world_size,)))  # all processes
    if settings.offload:
        # offload: shards live in CPU memory between uses (pinned when training on CUDA)
        shard_options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in transformer_blocks(model):
        # true: ZeRO-3, gathered weights freed after forward; false: kept until backward
        fully_shard(block, **shard_options, reshard_after_forward=settings.reshard_after_forward)
    # FSDP: the token embeddings too, or the root would keep them gathered all step
    if (embeddings := untied_token_embeddings(model)) is not None:  # (tied: in the root)
        fully_shard(embeddings, **shard_options, reshard_after_forward=settings.reshard_after_forward)
    fully_shard(model, **shard_options)  # the rest: final norm and head (not resharded after forward)
    if settings.sequence_parallel:
        use_sequence_parallel_attention(model)  # sequence parallel
    if settings.loss != "model":  # sharded switches: the loss is the root's forward, so FSDP
        # gathers the weights outside the blocks before it reads them (sequence parallel: of
        # targets shifted before the split)
        model.forward = partial(slice_fused_loss if settings.sequence_parallel else
                                {"chunked": chunked_loss, "fused": fused_loss}[settings.loss], model)
    fill_shards(model, preset, device)  # each process allocates and fills its shards




# ---- 07a_lora.py: LoRA -------------------------------------------------------------------------


def apply_adapters(model, settings, preset):  # LoRA
    """The model frozen, an adapter on each (or each named) linear layer of its blocks."""
    add_adapters(model, settings.lora_rank, settings.lora_alpha, settings.lora_targets)
    if preset.model is None:  # a model drawn at random: nothing worth freezing
        print("note: this model is trained from scratch, so LoRA's frozen weights are random: the "
              "run shows LoRA's memory, not its accuracy (use --preset tiny-text)", file=sys.stderr)


class LoRALinear(torch.nn.Module):  # LoRA
    """`base` (a linear layer, frozen) plus a trainable low-rank update: base(x) + s * B(A(x))."""

    def __init__(self, base, rank, alpha):
        super().__init__()
        inputs, outputs = base.weight.shape if isinstance(base, Conv1D) else base.weight.shape[::-1]
        self.base, self.scale = base, alpha / rank
        dtype = base.weight.dtype  # LoRA: the adapters in the weights' precision (--precision)
        # made uninitialised where creation runs (the GPU): A is drawn on the CPU, as the model's
        # own weights are, so that a run starts from the same adapters on every device
        here = dict(bias=False, dtype=dtype, device=torch.get_default_device())
        self.down = torch.nn.utils.skip_init(torch.nn.Linear, inputs, rank, **here)  # A: random
        self.up = torch.nn.utils.skip_init(torch.nn.Linear, rank, outputs, **here)  # B: zero at first
        drawn = torch.empty(rank, inputs, dtype=dtype, device="cpu")
        torch.nn.init.kaiming_uniform_(drawn, a=math.sqrt(5))
        with torch.no_grad():
            self.down.weight.copy_(drawn)
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.scale * self.up(self.down(x))


def add_adapters(model, rank, alpha, targets=None):  # LoRA
    """Freeze `model`, put an adapter on each linear layer of its blocks (those named in
    `targets`, if given) and train the adapters and a classifier's new head; returns the names."""
    model.requires_grad_(False)
    found = sorted({name.rpartition(".")[2] for block in transformer_blocks(model)  # the names
                    for name, module in block.named_modules()  # --lora-targets may take
                    if isinstance(module, (torch.nn.Linear, Conv1D))})
    adapted = []
    for block in transformer_blocks(model):
        for name, module in list(block.named_modules()):
            parent, _, attribute = name.rpartition(".")
            if isinstance(module, (torch.nn.Linear, Conv1D)) and attribute in (targets or [attribute]):
                width = min(module.weight.shape)  # B A's rank is at most the layer's narrower side
                if rank > width:
                    shape = " x ".join(map(str, module.weight.shape))
                    raise SystemExit(f"error: --lora-rank {rank} is larger than the layer {name!r} (a "
                                     f"{shape} weight): its update cannot have a rank above {width}, "
                                     "and adapters that large hold more weights than the layer. Use "
                                     f"a --lora-rank well below {width}, such as 8")
                setattr(block.get_submodule(parent), attribute, LoRALinear(module, rank, alpha))
                adapted.append(attribute)
    unknown = sorted(set(targets or ()) - set(adapted))  # (a name misspelled among right ones too)
    if unknown:  # say the names there are
        raise SystemExit(f"error: no linear layer in the model's blocks is named {' or '.join(unknown)}; "
                         f"theirs are named {' '.join(found)}: --lora-targets takes those")
    if not adapted:
        raise SystemExit("error: the model's blocks have no linear layer for LoRA to "
                         "adapt (a convolutional network's have none): train it without --lora-rank")
    classification_head(model).requires_grad_(True)  # a new head (a classifier's) trains in full
    return sorted(set(adapted))


# ---- 07b_qlora.py: QLoRA -----------------------------------------------------------------------


def apply_four_bits(model):  # QLoRA: each adapted layer's frozen weight in 4 bits, one at a time
    for adapter in [module for module in model.modules() if isinstance(module, LoRALinear)]:
        adapter.base = in_four_bits(adapter.base)


def in_four_bits(layer):  # QLoRA
    """The frozen linear `layer` (or GPT-2's Conv1D) as a Linear4bit: its weight quantized to
    NF4 as it is moved onto its device, its products computed in the weight's precision."""
    weight = layer.weight.T if isinstance(layer, Conv1D) else layer.weight  # outputs x inputs
    four_bit = Linear4bit(weight.shape[1], weight.shape[0], bias=layer.bias is not None,
                          compute_dtype=weight.dtype, quant_type="nf4", device="meta")
    four_bit.weight = Params4bit(weight.contiguous(), requires_grad=False, quant_type="nf4",
                                 blocksize=64, compress_statistics=True, module=four_bit)
    four_bit.bias = layer.bias  # frozen, in bfloat16
    keep_training_layout(four_bit)  # on CPUs with AVX512-BF16 too (common/quirks.py)
    return four_bit.to(weight.device)  # quantized here; the bfloat16 weight is freed with `layer`


# ---- 08a_sequence_parallel.py: sequence parallel -----------------------------------------------


class AllToAll(torch.autograd.Function):  # sequence parallel
    """Chunk i of dim 0 to process i, and process i's chunk in its place; the gradient goes back
    the same way (it is its own transpose)."""

    @staticmethod
    def forward(ctx, sent):
        sent = sent.contiguous()  # a gradient may come strided: both sides dense, as NCCL needs
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent)
        return received

    backward = forward


def all_to_all(states, n):  # sequence parallel: part i of dim 1 to process i, and the parts
    received = AllToAll.apply(torch.stack(states.chunk(n, dim=1)))  # received joined along
    return torch.cat(received.unbind(), dim=2)  # dim 2, process 0's first


class LocalHeads:  # sequence parallel: the attention module, with this process's head groups
    def __init__(self, module, groups):
        self.module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self.module, name)


def sequence_parallel_attention(module, query, key, value, attention_mask, inner, **kwargs):
    """The model's own attention (`inner`) over the whole sequence for 1/N of the heads, causal,
    without the model's mask; key-value heads that do not divide by N are repeated until they
    do. Evaluating (no slices: each process its own texts, whole), `inner` as it is."""
    if not module.training:
        return inner(module, query, key, value, attention_mask, **kwargs)
    n, heads = dist.get_world_size(), query.shape[1]
    copies = n // math.gcd(key.shape[1], n)  # 1 where they divide
    key, value = (states.repeat_interleave(copies, dim=1) for states in (key, value))
    # (batch, heads, slice, size) to (batch, heads / N, whole sequence, size)
    query, key, value = (all_to_all(states, n) for states in (query, key, value))
    local = LocalHeads(module, heads // key.shape[1] // n)
    # causal, and no slice's positions (flash attention would read them as packed texts)
    output, _ = inner(local, query, key, value, None, **{**kwargs, "is_causal": True,
                                                          "position_ids": None})
    return all_to_all(output, n), None  # and back: (batch, slice, heads, size)


def use_sequence_parallel_attention(model):  # sequence parallel: the model's attention, wrapped
    name = model.config._attn_implementation  # sdpa, usually
    inner = ALL_ATTENTION_FUNCTIONS.get(name)  # none for eager, or an architecture's own (BLOOM)
    if inner is None or name == "flex_attention":  # each causal only by the mask
        raise SystemExit(f"error: {type(model).__name__}'s attention ({name}) is causal only by a "
                         "mask, which sequence parallelism leaves out; train it with 07, unsplit")
    AttentionInterface.register("sequence_parallel", partial(sequence_parallel_attention, inner=inner))
    model.config._attn_implementation = "sequence_parallel"  # no mask function: no mask made


def sequence_loss(model, inputs, labels):  # sequence parallel
    """This process's slice of each sequence through the model, at its global positions: its
    labelled tokens' summed loss over the count of all processes' (each has every label), N times,
    so that FSDP's mean of the processes' gradients is their sum."""
    rank, n = dist.get_rank(), dist.get_world_size()
    labels = F.pad(labels[:, 1:], (0, 1), value=IGNORED)  # shifted before the split
    length = labels.shape[1] // n
    kept = slice(rank * length, (rank + 1) * length)
    positions = torch.arange(kept.start, kept.stop, device=labels.device).expand(len(labels), -1)
    logits = model(input_ids=inputs["input_ids"][:, kept], position_ids=positions).logits
    summed = F.cross_entropy(logits.float().flatten(0, 1), labels[:, kept].flatten(),
                             ignore_index=IGNORED, reduction="sum")
    return summed / (labels != IGNORED).sum() * n


def check_split(args, world_size):  # sequence parallel: the texts' tokens, and the heads
    config = model_config(preset_for(args))
    length, heads = preset_for(args).max_length, config.num_attention_heads
    if getattr(config, "sliding_window", None) and config.sliding_window < length:  # (its mask)
        raise SystemExit(f"error: the model attends within a sliding window of "
                         f"{config.sliding_window} tokens, which only its mask keeps and the "
                         f"gathered causal attention would not: use --seq-len {config.sliding_window} "
                         "or less, or 07_fsdp.py")
    if length % world_size or heads % world_size or args.batch_size % args.accum_steps:
        raise SystemExit(f"error: {length} tokens (--seq-len) and {heads} attention heads in "
                         f"{world_size} processes, or --batch-size {args.batch_size} in "
                         f"{args.accum_steps} micro-batches (--accum-steps), do not split evenly: "
                         "use numbers that do")


# ---- 07-09 with the other switches: what sharding needs of them (10's own) --------------------


def root_loss(model, inputs, labels):  # sharded switches
    """The chunked or fused loss of a sharded model, which apply_sharding makes its root's
    forward: FSDP gathers the root's weights (final norm, head; tied embeddings) before the loss
    reads them, and reduce-scatters their gradients after backward, as around any forward; the
    base model calls the token embeddings' own unit, which gathers and frees its table."""
    return model(inputs, labels)


def slice_fused_loss(model, inputs, targets):  # sharded switches: --sequence-parallel --loss fused
    """05h's fused_loss of targets shifted already (sequence parallel shifts them before the
    split), as the root's forward: the mean loss over the labelled tokens of `inputs`."""
    hidden = model.base_model(**inputs).last_hidden_state  # the blocks' output, before the head
    return FusedLinearCrossEntropy.apply(
        hidden, model.get_output_embeddings().weight, targets, torch.is_grad_enabled())


def sequence_fused_loss(model, inputs, labels):  # sharded switches: --sequence-parallel --loss fused
    """08a's sequence_loss with 05h's output layer: this process's slice of each sequence at its
    global positions, its fused mean loss (the root's forward) scaled to its labelled tokens' sum
    over the count of all processes', N times. Evaluating (each process its own texts, whole:
    sequence_parallel_attention), the fused loss of the whole texts."""
    labels = F.pad(labels[:, 1:], (0, 1), value=IGNORED)  # shifted before the split
    if not model.training:
        return model(inputs, labels)
    rank, n = dist.get_rank(), dist.get_world_size()
    length = labels.shape[1] // n
    kept = slice(rank * length, (rank + 1) * length)
    positions = torch.arange(kept.start, kept.stop, device=labels.device).expand(len(labels), -1)
    targets = labels[:, kept]
    mean = model({"input_ids": inputs["input_ids"][:, kept], "position_ids": positions}, targets)
    return mean * (targets != IGNORED).sum() / (labels != IGNORED).sum() * n


def local_shards(weights, in_backward):  # sharded switches: 8-bit and 4-bit AdamW, stochastic rounding
    """This process's shard of each sharded weight (a DTensor), as a plain tensor sharing its
    memory, for an optimizer with no rule for DTensor to step: each works a weight element by
    element or in blocks of its own, so stepping shards apart steps the whole. FSDP adds up each
    weight's gradient shards over micro-batches; move_gradients puts them on the plain shards
    before the step. Stepped in backward, a hook moves each as FSDP hands it over (a hook on a
    weight turns off FSDP's overlapped copy of its gradient into pinned host memory, --offload:
    so only there)."""
    shards = [weight.to_local().detach() for weight in weights]  # the same memory
    for weight, shard in zip(weights, shards) if in_backward else ():
        weight.register_post_accumulate_grad_hook(partial(move_gradient, shard=shard))
    return shards


def move_gradients(weights, shards):  # sharded switches: each gradient shard onto its plain shard
    for weight, shard in zip(weights, shards):
        if shard is not weight and weight.grad is not None:  # (a plain weight is its own)
            move_gradient(weight, shard)


def move_gradient(weight, shard):  # sharded switches: the gradient shard onto the plain one
    gradient = weight.grad.to_local()
    # a weight of fewer rows than processes leaves some an empty shard: given no gradient, it is
    # not stepped (bitsandbytes would launch a kernel over no elements, which CUDA refuses)
    if shard.numel():
        shard.grad = gradient if shard.grad is None else shard.grad.add_(gradient)
    weight.grad = None


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
