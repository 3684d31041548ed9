"""02 mixed precision: 01 plus float16 autocast and a gradient scaler.

Inside `torch.autocast` matrix multiplications run in float16, so the activations kept for the
backward pass take half the memory. Weights, gradients and Adam's state stay float32 (the
"master weights"). float16 gradients can underflow to zero, so the loss is multiplied by a
large factor before backward and the gradients divided by it before the step; a step whose
gradients overflowed to inf is skipped and the factor halved.

  python 02_mixed_precision.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 02_mixed_precision.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 02_mixed_precision.py --estimate        # predict peak GPU memory without a GPU
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


def train_step(model, optimizer, scaler, images, labels, device):
    """One optimizer step on one batch; returns the loss."""
    images, labels = images.to(device), labels.to(device)
    with torch.autocast(device_type=device.type, dtype=torch.float16):  # mixed precision
        logits = model(pixel_values=images).logits
        loss = F.cross_entropy(logits, labels)
    scaler.scale(loss).backward()  # loss scaling: float16 gradients would underflow
    scaler.unscale_(optimizer)  # true gradients from here on: clip them here, if you clip
    scaler.step(optimizer)  # skipped if a gradient is inf or NaN
    scaler.update()  # lower the scale after a skipped step, raise it after many good ones
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
        model = create_model(preset).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or preset.lr)
    scaler = torch.amp.GradScaler(device.type)  # mixed precision: loss scaling

    meter = MemoryMeter(device, model, optimizer)
    progress = Progress(total_steps)
    step = 0
    start = time.perf_counter()
    model.train()
    for epoch in range(args.epochs):
        for images, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, scaler, images, labels, device)
            step += 1
            progress.step(step, epoch, loss)
            if step == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device))
        if step == total_steps:
            break
    train_seconds = time.perf_counter() - start - meter.tracked_seconds

    test_accuracy = evaluate(model, data.test, device)
    return report(args, __file__, meter.result(), creation.peak_bytes, train_seconds,
                  test_accuracy, step, losses=progress.loss_values())


if __name__ == "__main__":
    main()
