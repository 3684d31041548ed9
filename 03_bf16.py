"""03 bf16: 02 with the whole model in bfloat16 ("bf16-true") instead of mixed precision.

Weights, gradients, Adam's state and activations are all bfloat16: half of float32 everywhere.
bfloat16 keeps float32's exponent range, so gradients do not underflow and no loss scaler is
needed; it has fewer mantissa bits, so very small updates to a weight can be lost.

  python 03_bf16.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 03_bf16.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 03_bf16.py --estimate        # predict peak GPU memory without a GPU
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


def train_step(model, optimizer, images, labels, device):
    """One optimizer step on one batch; returns the loss."""
    images, labels = images.to(device, DTYPE), labels.to(device)  # bf16-true: bfloat16 inputs
    logits = model(pixel_values=images).logits
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def main(argv=None):
    args = parse_args(__doc__, argv)
    if args.estimate:  # run this script on fake tensors instead (common/estimate.py)
        return estimate(__file__, argv)
    preset, device = get_preset(args.preset), args.device
    torch.manual_seed(args.seed)

    data = load_data(preset, args.batch_size, seed=args.seed)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        model = create_model(preset).to(device, DTYPE)  # bf16-true
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or preset.lr)

    meter = MemoryMeter(device, model, optimizer)
    progress = Progress(total_steps)
    step = 0
    start = time.perf_counter()
    model.train()
    for epoch in range(args.epochs):
        for images, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, images, labels, device)
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
                  test_accuracy, step, losses=progress.loss_values())


if __name__ == "__main__":
    main()
