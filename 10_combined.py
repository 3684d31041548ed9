"""10 combined: every technique of the steps and branches behind a switch, each off by default.

The script to copy for a model that does not fit. With no switch it is the plain bfloat16 run
(03: bfloat16 weights, Adam, whole batches) with the model created on its device (06). Each
switch adds one script's technique, copied from it under its tag, and any of them may be stacked;
a pair that cannot work together stops before training, saying why. Under torchrun, or with
--offload, the model is sharded as in 07-09. steps.py lists the switches that equal each script.

  python %(prog)s                                   # 03's run, created on the device (06)
  python %(prog)s --accum-steps 4 --optimizer adamw-8bit --checkpointing selective  # 04+05a+05d
  python %(prog)s --task causal-lm --loss chunked --optimizer-in-backward --optimizer-on-host
  python %(prog)s --preset tiny-text --lora-rank 8 --qlora --accum-steps 4     # 07b
  torchrun --nproc_per_node=2 %(prog)s --accum-steps 4 --checkpointing full   # 07 with 09's
  python %(prog)s --offload --checkpointing full --estimate   # 09 as a group of one, predicted
"""
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor  # gradients to host: a GPU's sums on a thread
from contextlib import nullcontext
from functools import partial  # sharded switches

import torch
import torch._functorch.config  # memory budget: the partitioner's settings
import torch.distributed as dist
import torch.nn.functional as F  # chunked loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor  # sharded switches: a sharded weight
from torch.utils.checkpoint import checkpoint  # checkpointing on one device
# selective checkpointing: what to do with each operator's output, and the contexts that do it
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers.pytorch_utils import Conv1D  # LoRA: GPT-2's linear layers, weights transposed

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import (add_shared_flags, check_batch_split, checkpointing_kind, compiler_problem,
                        parse_args, positive_float, positive_int, true_or_false)
from common.data import IGNORED, load_data, split_batch, to_device  # chunked loss: IGNORED
from common.distributed import end_distributed, init_distributed
from common.evaluate import evaluate
from common.memory import HOST, MemoryMeter, measure_creation
from common.model import classification_head, create_model, fill_shards, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.quirks import (BlockWrapper, check_output_layer_without_bias,
                           check_plain_output_layer, keep_training_layout)
from common.summary import report

try:  # 8-bit AdamW, QLoRA: from bitsandbytes (requirements.txt pins it)
    from bitsandbytes.nn import Linear4bit, Params4bit
    from bitsandbytes.optim import AdamW8bit
    NO_BITSANDBYTES = None
except ImportError as error:  # said when --optimizer adamw-8bit or --qlora needs it (main)
    NO_BITSANDBYTES = f"bitsandbytes ({error}). Install it with pip install bitsandbytes==0.50.2 " \
                      "(as requirements.txt pins)"

PRECISIONS = {"fp32": torch.float32, "mixed": torch.float32, "bf16": torch.bfloat16}  # 01, 02, 03


def main(argv=None):
    args = parse_args(__doc__, argv, flags=switches)  # the switches, --accum-steps 1 by default
    problem = refusal(args)
    if problem:
        raise SystemExit(f"error: {problem}")
    needs = "--qlora" if args.qlora else "--optimizer adamw-8bit" if args.optimizer == "adamw-8bit" else None
    if needs and NO_BITSANDBYTES:
        raise SystemExit(f"error: {needs} needs {NO_BITSANDBYTES}; or leave {needs} out")
    args.lora_alpha = args.lora_alpha or 16.0
    if args.reshard_after_forward is None and launched_sharded(args):
        args.reshard_after_forward = True  # FSDP's default, as 07-09's (null in an unsharded record)
    if args.estimate:  # predict instead: this script's main() on fake tensors (estimate/)
        from estimate import estimate
        return estimate(__file__, argv)
    if args.check_estimate:  # and predict it beside the run, on a GPU (estimate/check.py)
        from estimate.check import check_estimate
        args.estimate_check = check_estimate(__file__, argv, args.device)
    if not launched_sharded(args):
        return train(args, args.device)
    _, world_size, device = init_distributed(args.device)  # FSDP: one process per device
    try:  # FSDP: release the group's connections (NCCL communicators) also on error
        check_batch_split(args, world_size)  # equal micro-batches on every process
        return train(args, device)
    finally:
        end_distributed()  # FSDP: leave the group and free it, before Python exits


def train(args, device):
    preset = preset_for(args)  # the preset, with --model's classifier if one is named
    torch.manual_seed(args.seed)
    dtype = PRECISIONS[args.precision]

    sharded = dist.is_initialized()  # FSDP: under torchrun, or with --offload
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    data = load_data(preset, args.batch_size, device, seed=args.seed,
                     rank=rank, world_size=world_size)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    if args.checkpointing.startswith("budget:"):  # memory budget: only compiled code heeds it
        torch._functorch.config.activation_memory_budget = float(args.checkpointing.split(":")[1])
        args.compile = True  # memory budget: compiled below (sharded: as it is built)
    with measure_creation(device) as creation:
        model = build_model(args, preset, device, sharded, world_size)
    if args.lora_rank and preset.model is None:  # LoRA: a model drawn at random: nothing worth freezing
        print("note: this model is trained from scratch, so LoRA's frozen weights are random: the "
              "run shows LoRA's memory, not its accuracy (use --preset tiny-text)", file=sys.stderr)
    if args.compile and not sharded and args.checkpointing != "offloaded":  # (offloaded: above)
        for block in transformer_blocks(model):  # each block on its own (torchtitan's way), so
            block.compile()  # each block's backward hands back its gradients as it ends

    trained, optimizer, stepped, to_host, schedulers = build_optimizers(args, preset, model, device,
                                                                        total_steps)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "mixed" else None  # mixed precision

    # the peak of the first steps, by what it holds (optimizer in backward: all the optimizers)
    meter = MemoryMeter(device, model, stepped if args.optimizer_in_backward else optimizer)
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    evaluation_loss = {"chunked": chunked_loss, "fused": fused_loss}.get(args.loss)  # chunked loss
    if sharded and args.loss != "model":  # sharded switches: the loss is the root's forward
        evaluation_loss = root_loss
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, scaler, inputs, labels, device, args, trained,
                                  to_host)
            for scheduler in schedulers:
                scheduler.step()  # plain SGD: the cosine moves once per optimizer step
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        score = evaluate(model, data.val, device, dtype,  # bf16-true, gradient accumulation
                         pieces=args.accum_steps, loss=evaluation_loss)  # chunked loss
        progress.epoch(epoch, args.epochs, score)
        if progress.steps == total_steps:
            break
    test_score = evaluate(model, data.test, device, dtype,  # bf16-true, gradient accumulation
                          pieces=args.accum_steps, loss=evaluation_loss)  # chunked loss
    return report(args, __file__, creation, meter, progress, test_score)


def build_model(args, preset, device, sharded, world_size):
    """The model the switches ask for, created on its device (06; on meta, then sharded, as 07-09
    shard it): adapted (07a, 07b), its blocks wrapped (05c-05e) and sharded (07-09)."""
    dtype = PRECISIONS[args.precision]
    # on-device init: tensors made in here go to the device (FSDP: shapes only, on meta)
    with torch.device("meta" if sharded else device):
        model = create_model(preset, dtype=dtype)  # on-device init: in its dtype from the start
        if args.lora_rank:
            add_adapters(model, args.lora_rank, args.lora_alpha, args.lora_targets)  # LoRA
    if args.loss in ("chunked", "fused"):
        check_plain_output_layer(model.config, "Train it with --loss model")  # chunked loss
    if args.loss == "fused":
        check_output_layer_without_bias(model, "Train it with --loss chunked")  # fused loss
    if args.qlora:
        for adapter in [module for module in model.modules() if isinstance(module, LoRALinear)]:  # QLoRA
            adapter.base = in_four_bits(adapter.base)  # QLoRA: one layer at a time
    if args.checkpointing in ("full", "selective", "offloaded"):
        # checkpointing on one device, checkpointing: wrap each block (sharded: then the wrappers)
        blocks = transformer_blocks(model)  # checkpointing on one device: wrap each block in place
        offload = OffloadedInputs(device) if args.checkpointing == "offloaded" else nullcontext()
        selective = args.checkpointing == "selective"  # selective checkpointing
        for index, block in enumerate(blocks):
            if args.compile and args.checkpointing == "offloaded":  # activation offloading:
                block.compile()  # on its own, as the hooks' `with` stops the compiler
            blocks[index] = CheckpointedBlock(block, offload, selective)  # activation offloading
    if sharded:
        # FSDP: shard each block (it gathers its weights in turn), then the rest as one more unit
        shard_options = dict(mesh=init_device_mesh(device.type, (world_size,)))  # all processes
        if args.offload:
            # offload: shards live in CPU memory between uses (pinned when training on CUDA)
            shard_options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for block in transformer_blocks(model):
            if args.compile and args.checkpointing != "offloaded":  # FSDP: compile each block
                block.compile()  # before sharding it (torchtitan's order): gathers stay outside
            # true: ZeRO-3, gathered weights freed after forward; false: kept until backward
            fully_shard(block, **shard_options, reshard_after_forward=args.reshard_after_forward)
        fully_shard(model, **shard_options)  # embeddings, final norm and head
        if args.loss != "model":  # sharded switches: the loss is the root's forward, so FSDP
            model.forward = partial(chunked_loss if args.loss == "chunked" else fused_loss, model)
        fill_shards(model, preset, device)  # FSDP: each process allocates and fills its shards
    return model


def build_optimizers(args, preset, model, device, total_steps):
    """(the trained weights, the optimizer or None, every optimizer stepped, the gradients' hooks
    to the host or None, the schedules) the switches ask for (03's Adam by default)."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]  # LoRA
    weights = trained
    no_dtensor_rule = args.optimizer in ("adamw-8bit", "adamw-4bit") or args.stochastic_rounding
    if isinstance(trained[0], DTensor) and no_dtensor_rule:  # sharded switches: each process
        weights = local_shards(trained)  # steps its shards (plain tensors), as weights
    if args.optimizer_on_host:
        # Adam on the host: a host copy of each weight, which Adam updates, its state beside it
        # (pinned on a GPU: copies to and fro are queued, not waited for)
        weights = [weight.detach().to(HOST, copy=True, non_blocking=True) for weight in trained]
    if args.optimizer_in_backward:
        # optimizer in backward: one Adam per weight, stepped by a hook once its gradient is complete
        optimizers = {param: make_optimizer([weight], args, preset)
                      for param, weight in zip(trained, weights)}

        def step_and_free(param):  # optimizer in backward: update this weight now, free its gradient
            if args.optimizer_on_host:
                step_on_host(optimizers[param], [param])  # Adam on the host
                return
            optimizers[param].step()
            optimizers[param].zero_grad(set_to_none=True)

        for param in trained:  # optimizer in backward
            param.register_post_accumulate_grad_hook(step_and_free)
        optimizer, stepped = None, list(optimizers.values())
    else:
        optimizer = make_optimizer(weights, args, preset)
        stepped = [optimizer]
    # gradients to host: each gradient copied out as backward makes it (None: 05f's copies after)
    to_host = GradientsToHost(trained, weights, device) if args.gradients_to_host else None
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(each, T_max=total_steps)  # plain SGD
                  for each in stepped] if args.optimizer == "sgd" else []
    return trained, optimizer, stepped, to_host, schedulers


def forward(model, inputs, labels, args, device):
    """The loss of one (micro-)batch: the model's own, the chunked one or the fused one."""
    with torch.autocast(device_type=device.type, dtype=torch.float16,  # mixed precision
                        enabled=args.precision == "mixed"):
        if args.loss != "model" and dist.is_initialized():  # sharded switches: the loss is
            return root_loss(model, inputs, labels)  # the root's forward (build_model)
        if args.loss == "chunked":
            return chunked_loss(model, inputs, labels)  # chunked loss
        if args.loss == "fused":
            return fused_loss(model, inputs, labels)  # fused loss
        return model(**inputs, labels=labels).loss  # its own loss: over classes, or next tokens


def train_step(model, optimizer, scaler, inputs, labels, device, args, trained, to_host):
    """One optimizer step on one batch; returns the loss. `optimizer` is None when each weight
    is stepped during backward; `scaler` is None unless --precision mixed; `to_host` is None
    unless --gradients-to-host."""
    dtype = PRECISIONS[args.precision]
    scale = (lambda loss: loss) if scaler is None else scaler.scale  # mixed precision
    if args.accum_steps == 1:  # the whole batch at once
        inputs, labels = to_device(inputs, device, dtype), labels.to(device, non_blocking=True)  # bf16-true
        loss = forward(model, inputs, labels, args, device)
        scale(loss).backward()  # mixed precision: scaled up, float16 gradients would underflow
        if to_host is not None:
            to_host.add_up()  # gradients to host: added up on the host while the next micro-batch runs
        batch_loss = loss.detach()
    else:
        # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
        micro_size = len(labels) // args.accum_steps
        micro_batches = split_batch(inputs, labels, micro_size)
        batch_loss = 0.0
        for micro_inputs, micro_labels in micro_batches:
            micro_inputs = to_device(micro_inputs, device, dtype)  # bf16-true: bfloat16 images
            micro_labels = micro_labels.to(device, non_blocking=True)
            loss = forward(model, micro_inputs, micro_labels, args, device) / len(micro_batches)
            scale(loss).backward()  # mixed precision
            if to_host is not None:
                to_host.add_up()  # gradients to host: added up on the host while the next micro-batch runs
            batch_loss += loss.detach().float()  # the record's loss, summed in float32
    if scaler is not None:
        scaler.unscale_(optimizer)  # mixed precision: true gradients from here on (clip here)
        scaler.step(optimizer)  # mixed precision: skipped if a gradient is inf or NaN
        scaler.update()  # mixed precision: lower the scale after a skip, raise it after many good steps
        optimizer.zero_grad(set_to_none=True)
    elif args.optimizer_on_host and optimizer is not None:
        if to_host is not None:
            to_host.add_all()  # gradients to host: every copy in .grad before the step
        step_on_host(optimizer, trained)  # Adam on the host
    elif optimizer is not None:  # optimizer in backward: None, every weight stepped already
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if dist.is_initialized():
        dist.all_reduce(batch_loss)  # FSDP: the mean loss over all processes, for the record
        batch_loss /= dist.get_world_size()
    return batch_loss


# ---- the switches, and the pairs that cannot train together ------------------------------------


def switches(parser):
    """The switches of 10, each off by default (the run is then 03's, created as 06 creates it)."""
    parser.add_argument("--accum-steps", type=positive_int, default=1,
                        help="micro-batches per optimizer step (default: 1; 04)")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="fp32 (01), mixed: float16 autocast and a loss scaler (02), "
                             "bf16: the whole model in bfloat16 (03, default)")
    parser.add_argument("--stochastic-rounding", action="store_true",
                        help="Adam's step rounded into bfloat16 at random (04b)")
    parser.add_argument("--optimizer", choices=["adam", "adamw-8bit", "adamw-4bit", "adafactor", "sgd"],
                        default="adam", help="adam (default), adamw-8bit (05a), adamw-4bit (05j), "
                                             "adafactor (05b), sgd: plain SGD with cosine decay (05)")
    parser.add_argument("--optimizer-on-host", action="store_true",
                        help="the optimizer's state and step in host memory (05f)")
    parser.add_argument("--gradients-to-host", action="store_true",
                        help="with --optimizer-on-host: each gradient sent to host memory as "
                             "soon as backward makes it (05i)")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="each weight stepped as soon as its gradient is complete (04a)")
    parser.add_argument("--checkpointing", type=checkpointing_kind, default="none",
                        help="recompute each block in backward: full (05c; 09 when sharded), "
                             "selective (05d), offloaded: inputs in host memory (05e); budget:F: "
                             "compiled, backward keeping at most F (0 to 1) of what it would (05k)")
    parser.add_argument("--loss", choices=["model", "chunked", "fused"], default="model",
                        help="model: the model's own (default); chunked: the output layer and "
                             "loss a piece of the sequence at a time (05g, --task causal-lm); "
                             "fused: the same, its gradients made in forward (05h)")
    parser.add_argument("--lora-rank", type=positive_int,
                        help="train low-rank adapters of this rank on frozen weights (07a)")
    parser.add_argument("--lora-alpha", type=positive_float,
                        help="with --lora-rank: the adapters' scale is alpha / r (default: 16)")
    parser.add_argument("--lora-targets", nargs="+", metavar="NAME",
                        help="with --lora-rank: adapt only the linear layers of these names")
    parser.add_argument("--qlora", action="store_true",
                        help="with --lora-rank: the adapted layers' frozen weights in 4 bits (07b)")
    parser.add_argument("--offload", action="store_true",
                        help="FSDP with parameters, gradients and optimizer state in host "
                             "memory (08); alone, a group of one process")
    add_shared_flags(parser, ["--world-size"],  # the processes --estimate assumes (as 07-09's)
                     {"--world-size": (None, "WORLD_SIZE, or 1")})
    parser.add_argument("--reshard-after-forward", type=true_or_false, metavar="{true,false}",
                        help="when sharded: true (default, ZeRO-3) frees each block's gathered "
                             "weights after forward; false (ZeRO-2's memory) keeps them (07)")


def launched_sharded(args):
    """Whether the run shards the model (07-09): under torchrun (which sets RANK and WORLD_SIZE;
    the estimate runs as its process 0), alone with WORLD_SIZE=1 (a group of one, as 07-09 run
    alone), or with --offload, which runs alone as a group of one."""
    world = os.environ.get("WORLD_SIZE")
    return args.offload or world is not None and ("RANK" in os.environ or world == "1")


def refusal(args):
    """Why the switches given cannot train together (naming both, and why), or None."""
    sharded = "--offload" if args.offload else "sharding (torchrun)"
    if args.optimizer_in_backward and args.accum_steps > 1:
        return ("--optimizer-in-backward with --accum-steps: each weight is stepped during "
                "backward, so gradients cannot add up over micro-batches; use one of them")
    if args.optimizer_in_backward and args.precision == "mixed":
        return ("--optimizer-in-backward with --precision mixed: the loss scaler checks every "
                "gradient for inf before one step; use --precision bf16 or fp32")
    if args.stochastic_rounding and args.precision != "bf16":
        return (f"--stochastic-rounding with --precision {args.precision}: it rounds the step "
                "into bfloat16 weights; use --precision bf16")
    if args.stochastic_rounding and args.optimizer != "adam":
        return (f"--stochastic-rounding with --optimizer {args.optimizer}: it is Adam's update, "
                "rounded at random; use --optimizer adam")
    if args.optimizer == "adafactor" and launched_sharded(args):
        return (f"--optimizer adafactor with {sharded}: its second moment is factored into the "
                "sums of each weight's rows and columns, and a process holds some rows only; use "
                "--optimizer adam, sgd, adamw-8bit or adamw-4bit")
    if args.optimizer == "adamw-8bit" and args.optimizer_in_backward and launched_sharded(args) \
            and not args.offload:
        return ("--optimizer adamw-8bit with --optimizer-in-backward under torchrun: FSDP calls "
                "each weight's step on its reduce-scatter stream, and bitsandbytes launches its "
                "kernels on the default stream, so a step could read a gradient shard before the "
                "reduce-scatter has written it; use --optimizer adamw-4bit, or one of them")
    if args.optimizer in ("adamw-8bit", "adamw-4bit") and args.precision == "mixed" \
            and launched_sharded(args):
        return (f"--optimizer {args.optimizer} with --precision mixed and {sharded}: it steps each "
                "process's gradient shards as plain tensors, so each loss scaler would look for "
                "inf in its own shards only, and the processes could disagree on skipping a "
                "step; use --precision bf16")
    budget = args.checkpointing.startswith("budget:")  # memory budget: compiled, so as --compile
    if budget and not args.estimate and compiler_problem(args.device):
        return f"--checkpointing budget compiles the blocks: {compiler_problem(args.device)}"
    if args.gradients_to_host and not args.optimizer_on_host:
        return ("--gradients-to-host without --optimizer-on-host: it sends each gradient to the "
                "host's optimizer; add --optimizer-on-host")
    if args.gradients_to_host and args.optimizer_in_backward:
        return ("--gradients-to-host with --optimizer-in-backward: each weight's step on the host "
                "takes its gradient out as backward makes it already; use one of them")
    if args.optimizer_on_host and args.offload:
        return ("--optimizer-on-host with --offload: both keep the optimizer's state and step "
                "in host memory; --offload also keeps the weights there: use one of them")
    if args.optimizer_on_host and launched_sharded(args):
        return ("--optimizer-on-host with sharding (torchrun): use --offload, which keeps each "
                "process's shards, their state and the step in host memory")
    if args.precision == "mixed" and args.offload:
        return ("--precision mixed with --offload: the loss scaler's check for inf all-reduces a "
                "flag made beside the gradient shards in host memory, which a GPU group (NCCL) "
                "cannot carry; use --precision bf16 or fp32")
    if args.qlora and args.precision == "mixed":
        return ("--qlora with --precision mixed: the 4-bit layers compute in their float32 "
                "weights' dtype and autocast copies each dequantized weight again in float16; use "
                "--precision bf16")
    if args.optimizer_on_host and args.precision == "mixed":
        return ("--optimizer-on-host with --precision mixed: the loss scaler unscales the "
                "gradients on the device, before the step; use --precision bf16 or fp32")
    if args.loss != "model" and args.task != "causal-lm":
        return (f"--loss {args.loss} with --task {args.task}: a classifier's logits are a few "
                "numbers per sample, with nothing to chunk; add --task causal-lm")
    if args.loss == "fused" and args.precision == "mixed":
        return ("--loss fused with --precision mixed: it makes its gradients in forward, before "
                "the loss scaler's factor reaches them, so small float16 gradients would "
                "underflow; use --precision bf16 or fp32")
    for name in ("lora_alpha", "lora_targets", "qlora"):
        if getattr(args, name) and not args.lora_rank:
            return (f"--{name.replace('_', '-')} without --lora-rank: it shapes the adapters; "
                    "add --lora-rank R")
    if args.lora_rank and launched_sharded(args):
        return (f"--lora-rank with {sharded}: the sharded model is filled from the preset's "
                "model parameter by parameter, and the adapters are not in it")
    world = os.environ.get("WORLD_SIZE")
    if world not in (None, "1") and "RANK" not in os.environ and not args.estimate:
        return (f"WORLD_SIZE={world} is set, but no launcher started this process (torchrun sets "
                f"RANK too): unset WORLD_SIZE to train in one process, or start it with torchrun "
                f"--nproc_per_node={world}")
    if args.check_estimate and args.checkpointing.startswith("budget:"):
        return ("--check-estimate with --checkpointing budget:F: the budget compiles the blocks, "
                "whose estimate is a range (estimate/compiled.py), so nothing would be checked; "
                "leave one of them out")
    if args.reshard_after_forward is not None and not launched_sharded(args):
        return ("--reshard-after-forward without sharding: it says what FSDP does after a "
                "block's forward; run under torchrun or with --offload")
    return None


# ==== the techniques, in steps.py's order: each its script's code, under its tag ================


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


# ---- 05, 05a, 05b, 05j, 04b: the optimizer --optimizer names, at its script's rate -------------


def learning_rate(args, preset):
    """--lr, or the rate of the script whose optimizer (and adapters) the switches choose."""
    if args.lr:
        return args.lr
    if args.optimizer == "sgd":
        return preset.sgd_lr  # plain SGD
    if args.optimizer == "adafactor":
        return 0.01  # Adafactor: relative
    if args.qlora:
        return preset.qlora_lr  # QLoRA, LoRA: a lower rate
    return preset.lora_lr if args.lora_rank else preset.lr  # LoRA: Adam, adapters only


def make_optimizer(weights, args, preset):
    """The optimizer --optimizer (and --stochastic-rounding) names, over `weights`."""
    lr = learning_rate(args, preset)
    if args.optimizer == "sgd":
        return torch.optim.SGD(weights, lr=lr)  # plain SGD
    if args.optimizer == "adafactor":
        return torch.optim.Adafactor(weights, lr=lr)  # Adafactor: relative
    if args.optimizer == "adamw-8bit":
        return AdamW8bit(weights, lr=lr, weight_decay=0.0)  # 8-bit AdamW
    if args.optimizer == "adamw-4bit":
        return AdamW4bit(weights, lr=lr)  # 4-bit AdamW
    if args.stochastic_rounding:
        return AdamStochasticRounding(weights, lr=lr)  # stochastic rounding
    fused = args.optimizer_on_host and args.device.type == "cuda"  # Adam on the host: fused there
    return torch.optim.Adam(weights, lr=lr, fused=fused or None)


# ---- 05c_activation_checkpointing.py: checkpointing on one device ------------------------------


class CheckpointedBlock(BlockWrapper):  # checkpointing on one device
    """Runs `block` keeping only its input for backward, where the block runs forward again."""

    def __init__(self, block, offload, selective):  # activation offloading, selective checkpointing
        super().__init__()
        self.block = block
        self.offload = offload  # activation offloading: the hooks that move the saved input
        self.selective = selective  # selective checkpointing: keep what keep_or_recompute says

    def forward(self, hidden_states, *args, **kwargs):
        # non-reentrant: the variant PyTorch recommends; it passes keyword arguments through.
        # FSDP shards this wrapper, so its backward hook gathers the weights before the rerun.
        with self.offload:  # activation offloading: checkpoint saves the input under its hooks
            if self.selective:  # selective checkpointing: keep the outputs keep_or_recompute names
                return checkpoint(self.block, hidden_states, *args, use_reentrant=False,
                                  context_fn=selective_contexts, **kwargs)  # selective checkpointing
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


def step_on_host(optimizer, weights):  # Adam on the host: gradients out, the step, weights back
    host_weights = optimizer.param_groups[0]["params"]  # Adam on the host
    for weight, host_weight in zip(weights, host_weights):  # Adam on the host
        if weight.grad is not None:  # Adam on the host: the gradient goes out (none: no step), queued
            host_weight.grad = weight.grad.to(HOST, non_blocking=True)  # Adam on the host: into pinned memory
        weight.grad = None  # Adam on the host: and is freed on the device
    if weights[0].is_cuda:  # Adam on the host: one wait, for the copies out: an event after them
        torch.cuda.current_stream(weights[0].device).record_event().synchronize()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for weight, host_weight in zip(weights, host_weights):  # Adam on the host
        weight.detach().copy_(host_weight, non_blocking=True)  # Adam on the host: the updated weight


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


# ---- 07a_lora.py: LoRA -------------------------------------------------------------------------


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
    if not adapted and targets:  # say the names there are
        found = sorted({name.rpartition(".")[2] for block in transformer_blocks(model)
                        for name, module in block.named_modules()
                        if isinstance(module, (torch.nn.Linear, Conv1D))})
        raise SystemExit(f"error: no linear layer in the model's blocks is named {' or '.join(targets)}; "
                         f"theirs are named {' '.join(found)}: --lora-targets takes those")
    if not adapted:
        raise SystemExit("error: the model's blocks have no linear layer for LoRA to "
                         "adapt (a convolutional network's have none): train it without --lora-rank")
    classification_head(model).requires_grad_(True)  # a new head (a classifier's) trains in full
    return sorted(set(adapted))


# ---- 07b_qlora.py: QLoRA -----------------------------------------------------------------------


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


# ---- 07-09 with the other switches: what sharding needs of them (10's own) --------------------


def root_loss(model, inputs, labels):  # sharded switches
    """The chunked or fused loss of a sharded model, which build_model makes its root's forward:
    FSDP gathers the weights outside the blocks (embeddings, final norm, head) before the loss
    reads them, and reduce-scatters their gradients after backward, as around any forward."""
    return model(inputs, labels)


def local_shards(weights):  # sharded switches: 8-bit and 4-bit AdamW, stochastic rounding
    """This process's shard of each sharded weight (a DTensor), as a plain tensor sharing its
    memory, for an optimizer with no rule for DTensor to step: each works a weight element by
    element or in blocks of its own, so stepping shards apart steps the whole. A hook moves
    each gradient shard FSDP hands a weight onto its shard, added up over micro-batches."""
    shards = [weight.to_local().detach() for weight in weights]  # the same memory
    for weight, shard in zip(weights, shards):
        weight.register_post_accumulate_grad_hook(partial(move_gradient, shard=shard))
    return shards


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
