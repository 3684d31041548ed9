"""08 CPU offload: 07 with parameters, gradients and optimizer state kept in CPU memory.

Between uses, every process's shards of the parameters, gradients and optimizer state live in
CPU memory (pinned, for fast copies, where CUDA exists). FSDP copies a block's shards to the
device just before gathering its weights, sends its gradient shards back after backward, and the
optimizer step runs on the CPU. The device holds little more than the activations and one or two
blocks' weights at a time; the price is a copy over PCIe for every block in every pass.

On a machine without a GPU the "device" is the CPU already: offloading moves CPU tensors to
the CPU, so the peak measured there does not fall below 07's. The saving shows on a GPU.

  torchrun --nproc_per_node=2 08_offload.py      # tiny preset, 2 processes (CPU: gloo, GPU: nccl)
  python 08_offload.py                            # the same as one process
  torchrun --nproc_per_node=4 08_offload.py --preset article  # the study's model on 4 GPUs
  python 08_offload.py --estimate                 # predict peak GPU memory without a GPU
"""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from common.cli import check_batch_split, parse_args
from common.data import load_data
from common.distributed import init_distributed
from common.estimate import estimate
from common.evaluate import evaluate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
from common.presets import get_preset
from common.progress import Progress
from common.report import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


def train_step(model, optimizer, images, labels, device, accum_steps):
    """One optimizer step on one batch; returns the loss."""
    micro_size = len(labels) // accum_steps  # gradient accumulation: split the batch
    micro_batches = list(zip(images.split(micro_size), labels.split(micro_size)))
    batch_loss = 0.0
    for micro_images, micro_labels in micro_batches:
        micro_images = micro_images.to(device, DTYPE)  # bf16-true: bfloat16 inputs
        micro_labels = micro_labels.to(device)
        logits = model(pixel_values=micro_images).logits
        loss = F.cross_entropy(logits, micro_labels) / len(micro_batches)  # mean over the batch
        loss.backward()  # gradients add up in .grad until the optimizer step
        batch_loss += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(batch_loss)  # FSDP: the mean loss over all processes, for the record
    return batch_loss / dist.get_world_size()


def train(args, rank, world_size, device):
    preset = get_preset(args.preset)
    torch.manual_seed(args.seed)  # FSDP: every process builds the same model, then keeps a shard

    data = load_data(preset, args.batch_size, seed=args.seed, rank=rank, world_size=world_size)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        model = create_model(preset, device=device, dtype=DTYPE)  # created on the device, in bf16
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # offload: pinned for CUDA
        mesh = init_device_mesh(device.type, (world_size,))  # FSDP: all processes, this device type
        for block in transformer_blocks(model):  # FSDP: each block gathers its weights in turn
            fully_shard(block, mesh=mesh, offload_policy=offload)  # offload
        fully_shard(model, mesh=mesh, offload_policy=offload)  # offload: and the rest, as one more unit
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr or preset.sgd_lr)  # no state
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)  # cosine

    meter = MemoryMeter(device, model, optimizer, tracker_factory=FSDPMemTracker)  # FSDP: shards
    progress = Progress(total_steps)
    step = 0
    start = time.perf_counter()
    model.train()
    for epoch in range(args.epochs):
        for images, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, images, labels, device, args.accum_steps)
            scheduler.step()  # cosine: once per optimizer step
            step += 1
            progress.step(step, epoch, loss)
            if step == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device, DTYPE))
        if step == total_steps:
            break
    train_seconds = time.perf_counter() - start - meter.tracked_seconds

    test_accuracy = evaluate(model, data.test, device, DTYPE)
    return report(args, __file__, meter.result(), creation.peak_bytes, train_seconds,
                  test_accuracy, step, world_size=world_size, losses=progress.loss_values(),
                  final_lr=scheduler.get_last_lr()[0])


def main(argv=None):
    args = parse_args(__doc__, argv, accum_steps=4)  # gradient accumulation
    if args.estimate:  # run this script on fake tensors instead (common/estimate.py)
        return estimate(__file__, argv)
    rank, world_size, device = init_distributed(args.device)  # FSDP: one process per device
    try:  # FSDP: release the group's connections (NCCL communicators) also on error
        check_batch_split(args, world_size)  # FSDP: equal micro-batches on every process
        return train(args, rank, world_size, device)  # FSDP
    finally:
        dist.destroy_process_group()  # FSDP


if __name__ == "__main__":
    main()
