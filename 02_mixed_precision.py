"""02 mixed precision: 01 plus float16 autocast and a gradient scaler.

Inside `torch.autocast` matrix multiplications run in float16, so the activations kept for the
backward pass take half the memory. Weights, gradients and Adam's state stay float32 (the
"master weights"). float16 gradients can underflow to zero, so the loss is multiplied by a
large factor before backward and the gradients divided by it before the step; a step whose
gradients overflowed to inf is skipped and the factor halved.

  python 02_mixed_precision.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 02_mixed_precision.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 02_mixed_precision.py --preset tiny-text  # text: a pretrained MiniLM on movie reviews
  python 02_mixed_precision.py --estimate        # predict peak GPU memory without a GPU
"""
import torch
import torch.nn.functional as F

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: common/estimate/contract.py.
from common.cli import parse_args
from common.data import load_data, to_device
from common.evaluate import evaluate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model
from common.presets import get_preset
from common.progress import Progress
from common.summary import report


def train_step(model, optimizer, scaler, inputs, labels, device):  # mixed precision: + scaler
    """One optimizer step on one batch; returns the loss."""
    inputs, labels = to_device(inputs, device), labels.to(device)
    with torch.autocast(device_type=device.type, dtype=torch.float16):  # mixed precision
        logits = model(**inputs).logits
        loss = F.cross_entropy(logits, labels)
    scaler.scale(loss).backward()  # mixed precision: scaled up, float16 gradients would underflow
    scaler.unscale_(optimizer)  # mixed precision: true gradients from here on (clip here)
    scaler.step(optimizer)  # mixed precision: skipped if a gradient is inf or NaN
    scaler.update()  # mixed precision: lower the scale after a skip, raise it after many good steps
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train(args, device):
    preset = get_preset(args.preset)
    torch.manual_seed(args.seed)

    data = load_data(preset, args.batch_size, device, seed=args.seed)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        model = create_model(preset).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or preset.lr)
    scaler = torch.amp.GradScaler(device.type)  # mixed precision: loss scaling

    meter = MemoryMeter(device, model, optimizer)  # the peak of the first steps, by what it holds
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, scaler, inputs, labels, device)  # mixed precision
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device))
        if progress.steps == total_steps:
            break
    test_accuracy = evaluate(model, data.test, device)
    return report(args, __file__, creation, meter, progress, test_accuracy)


def main(argv=None):
    args = parse_args(__doc__, argv)
    if args.estimate:  # predict instead: this script's main() on fake tensors (common/estimate/)
        from common.estimate import estimate
        return estimate(__file__, argv)
    return train(args, args.device)


if __name__ == "__main__":
    main()
