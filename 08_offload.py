"""08 CPU offload: 07 with parameters, gradients and optimizer state kept in CPU memory.

Between uses every process's shards live in CPU memory (pinned on CUDA): FSDP copies a block's
shards to the device just before gathering its weights, sends its gradient shards back after
backward, and the optimizer step runs on the CPU. The price is a copy over PCIe for every block
in every pass; on a machine without a GPU the device is the CPU already, and it saves nothing.

  torchrun --nproc_per_node=2 %(prog)s             # tiny preset, 2 processes (CPU: gloo, GPU: nccl)
  torchrun --nproc_per_node=2 %(prog)s --preset tiny-text # text
  python %(prog)s                                  # the same as one process
  torchrun --nproc_per_node=4 %(prog)s --preset article # the study's model on 4 GPUs
  torchrun --nproc_per_node=2 %(prog)s --reshard-after-forward false # ZeRO-2's memory
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import add_shared_flags, check_batch_split, true_or_false  # FSDP: batch split, flags
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.data import load_data, split_batch, to_device
from common.distributed import end_distributed, init_distributed
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, fill_shards, transformer_blocks, untied_token_embeddings
from common.presets import preset_for
from common.progress import Progress
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


def train_step(model, optimizer, inputs, labels, device, accum_steps):  # gradient accumulation
    """One optimizer step on one batch; returns the loss."""
    # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
    micro_size = len(labels) // accum_steps
    micro_batches = split_batch(inputs, labels, micro_size)
    batch_loss = 0.0
    for micro_inputs, micro_labels in micro_batches:
        micro_inputs = to_device(micro_inputs, device, DTYPE)  # bf16-true: bfloat16 images
        micro_labels = micro_labels.to(device, non_blocking=True)
        loss = model(**micro_inputs, labels=micro_labels).loss / len(micro_batches)  # mean over the batch
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
    data = load_data(preset, args.batch_size, device, seed=args.seed,
                     rank=rank, world_size=world_size)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        with torch.device("meta"):  # FSDP, on-device init: shapes only, so no device holds it all
            model = create_model(preset, dtype=DTYPE)  # on-device init, bf16-true: never float32
        # FSDP: shard each block (it gathers its weights in turn), the embeddings, then the rest
        shard_options = dict(mesh=init_device_mesh(device.type, (world_size,)))  # all processes
        # offload: shards live in CPU memory between uses (pinned when training on CUDA)
        shard_options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
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


def train_in_group(args, device):  # FSDP: one process per device, in a group
    _, world_size, device = init_distributed(device)
    try:  # release the group's connections (NCCL communicators) also on error
        check_batch_split(args, world_size)  # equal micro-batches on every process
        return train(args, device)
    finally:
        end_distributed()  # leave the group and free it, before Python exits


def main(argv=None):
    args = parse_args(__doc__, argv, flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train_in_group, args, __file__, argv)  # FSDP: in a process group


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
