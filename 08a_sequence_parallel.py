"""08a sequence parallel (Ulysses): 07 with each text split across the processes.

For --task causal-lm only. Every process reads the same texts and keeps 1/N of each sequence's
tokens, so activations shrink N-fold. Around attention an all-to-all trades the slices for 1/N
of the heads over the whole sequence, and a second one trades them back. FSDP shards the weights
over the same processes.

  torchrun --nproc_per_node=2 %(prog)s             # tiny-text, each text in 2 slices
  python %(prog)s --estimate --world-size 2        # predict peak GPU memory without a GPU
"""
import math  # sequence parallel: the key-value heads repeated
from functools import partial  # sequence parallel

import torch
import torch.distributed as dist
import torch.nn.functional as F  # sequence parallel: the loss of a slice
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AttentionInterface  # sequence parallel: attention functions by name
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # sequence parallel

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import add_shared_flags, true_or_false  # FSDP: flags
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.data import IGNORED, load_data, split_batch, to_device  # sequence parallel: IGNORED
from common.distributed import end_distributed, init_distributed
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, fill_shards, transformer_blocks, untied_token_embeddings
from common.model import model_config  # sequence parallel
from common.presets import preset_for
from common.progress import Progress
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


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


def train_step(model, optimizer, inputs, labels, device, accum_steps):  # gradient accumulation
    """One optimizer step on one batch; returns the loss."""
    # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
    micro_size = len(labels) // accum_steps
    micro_batches = split_batch(inputs, labels, micro_size)
    batch_loss = 0.0
    for micro_inputs, micro_labels in micro_batches:
        micro_inputs = to_device(micro_inputs, device, DTYPE)  # bf16-true: bfloat16 images
        micro_labels = micro_labels.to(device, non_blocking=True)
        # sequence parallel: its slice's loss, whose mean over the processes is the batch's
        loss = sequence_loss(model, micro_inputs, micro_labels) / len(micro_batches)
        loss.backward()
        batch_loss += loss.detach().float()  # the record's loss, summed in float32
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(batch_loss)  # FSDP: the mean loss over all processes, for the record
    batch_loss /= dist.get_world_size()
    return batch_loss  # gradient accumulation: the whole batch's mean loss


def train(args, device):
    preset = preset_for(args)  # the preset, with --model's model in place of its own if named
    torch.manual_seed(args.seed)

    rank, world_size = dist.get_rank(), dist.get_world_size()  # FSDP: each process takes its slice
    data = load_data(preset, args.batch_size, device, seed=args.seed,  # sequence parallel: each
                     rank=rank, world_size=world_size, same_train_batches=True)  # reads them whole
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        with torch.device("meta"):  # FSDP, on-device init: shapes only, so no device holds it all
            model = create_model(preset, dtype=DTYPE)  # on-device init, bf16-true: never float32
        use_sequence_parallel_attention(model)  # sequence parallel
        # FSDP: shard each block (it gathers its weights in turn), the embeddings, then the rest
        shard_options = dict(mesh=init_device_mesh(device.type, (world_size,)))  # all processes
        for block in transformer_blocks(model):
            if args.compile:  # compile each block before sharding it (torchtitan's order):
                block.compile()  # FSDP's gathers stay outside compiled code; alike blocks share it
            # true: ZeRO-3, gathered weights freed after forward; false: kept until backward
            fully_shard(block, **shard_options, reshard_after_forward=args.reshard_after_forward)
        # FSDP: the token embeddings too, or the root would keep them gathered all step
        if (embeddings := untied_token_embeddings(model)) is not None:  # (tied: in the root)
            fully_shard(embeddings, **shard_options, reshard_after_forward=args.reshard_after_forward)
        fully_shard(model, **shard_options)  # the rest: final norm and head (not resharded after forward)
        fill_shards(model, preset, device)  # each process allocates and fills its shards
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr or preset.sgd_lr)  # plain SGD
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    # the peak of the first steps, by what it holds (--memory-snapshot: on CUDA, their history)
    meter = MemoryMeter(device, model, optimizer, snapshot=args.memory_snapshot)
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, inputs, labels, device,  # gradient accumulation
                                  args.accum_steps)
            scheduler.step()  # plain SGD: the cosine moves once per optimizer step
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        score = evaluate(model, data.val, device, DTYPE,  # bf16-true, gradient accumulation
                         pieces=args.accum_steps)  # a micro-batch a forward
        progress.epoch(epoch, args.epochs, score)
        if progress.steps == total_steps:
            break
    test_score = evaluate(model, data.test, device, DTYPE,  # bf16-true, gradient accumulation
                          pieces=args.accum_steps)  # a micro-batch a forward
    return report(args, __file__, creation, meter, progress, test_score)


def own_flags(parser):  # gradient accumulation: this script's flag, beside common/cli.py's
    parser.add_argument("--accum-steps", type=positive_int, default=4,
                        help="micro-batches per optimizer step (default: 4)")
    parser.add_argument("--reshard-after-forward", type=true_or_false, default=True,  # FSDP: ZeRO-3 or 2
                        metavar="{true,false}",
                        help="true (default, ZeRO-3): each block's gathered weights are freed "
                             "after its forward and gathered again in backward; false "
                             "(ZeRO-2's memory): kept from forward to backward, one gather")
    add_shared_flags(parser, ["--world-size"],  # FSDP: the processes --estimate assumes
                     {"--world-size": (None, "WORLD_SIZE, or 1")})


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


def train_in_group(args, device):  # FSDP: one process per device, in a group
    _, world_size, device = init_distributed(device)
    try:  # release the group's connections (NCCL communicators) also on error
        check_split(args, world_size)  # sequence parallel: equal slices and micro-batches
        return train(args, device)
    finally:
        end_distributed()  # leave the group and free it, before Python exits


def main(argv=None):
    args = parse_args(__doc__, argv, task="causal-lm",  # sequence parallel: its only task
                      flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train_in_group, args, __file__, argv)  # FSDP: in a process group


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
