"""06 on-device initialisation: 05 with the model created on its device, in bfloat16.

05 builds the model in float32 on the CPU and then converts and moves it: for a moment the
float32 copy and the bfloat16 copy both exist (on a GPU machine the float32 one in host RAM).
Here every parameter is created on the target device in bfloat16 from the start (pretrained
weights are loaded straight into it), so model creation needs only the final model's memory,
and no time is spent building and converting a float32 copy. Training itself is unchanged.

  python 06_on_device_init.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 06_on_device_init.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 06_on_device_init.py --estimate        # predict peak GPU memory without a GPU
"""
import time

import torch
import torch.nn.functional as F

from common.cli import parse_args
from common.data import load_data
from common.estimate import estimate
from common.evaluate import evaluate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model
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
    return batch_loss


def main(argv=None):
    args = parse_args(__doc__, argv, accum_steps=4)  # gradient accumulation
    if args.estimate:  # run this script on fake tensors instead (common/estimate.py)
        return estimate(__file__, argv)
    preset, device = get_preset(args.preset), args.device
    torch.manual_seed(args.seed)

    data = load_data(preset, args.batch_size, seed=args.seed)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        model = create_model(preset, device=device, dtype=DTYPE)  # created on the device, in bf16
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr or preset.sgd_lr)  # no state
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)  # cosine

    meter = MemoryMeter(device, model, optimizer)
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
                  test_accuracy, step, losses=progress.loss_values(),
                  final_lr=scheduler.get_last_lr()[0])


if __name__ == "__main__":
    main()
