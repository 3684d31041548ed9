"""03 bf16: 02 with the whole model in bfloat16 ("bf16-true") instead of mixed precision.

Weights, gradients, Adam's state and activations are all bfloat16: half of float32 everywhere.
bfloat16 keeps float32's exponent range, so gradients do not underflow and no loss scaler is
needed; it has fewer mantissa bits, so very small updates to a weight can be lost.

  python 03_bf16.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 03_bf16.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 03_bf16.py --preset tiny-text  # text: a pretrained MiniLM on movie reviews
  python 03_bf16.py --estimate        # predict peak GPU memory without a GPU
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

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


def train_step(model, optimizer, inputs, labels, device):
    """One optimizer step on one batch; returns the loss."""
    inputs, labels = to_device(inputs, device, DTYPE), labels.to(device)  # bf16-true: bfloat16 images
    logits = model(**inputs).logits
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    optimizer.step()
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
        model = create_model(preset).to(device, DTYPE)  # bf16-true
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or preset.lr)

    meter = MemoryMeter(device, model, optimizer)  # the peak of the first steps, by what it holds
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, inputs, labels, device)
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device, DTYPE))  # bf16-true
        if progress.steps == total_steps:
            break
    test_accuracy = evaluate(model, data.test, device, DTYPE)  # bf16-true: bfloat16 inputs
    return report(args, __file__, creation, meter, progress, test_accuracy)


def main(argv=None):
    args = parse_args(__doc__, argv)
    if args.estimate:  # predict instead: this script's main() on fake tensors (common/estimate/)
        from common.estimate import estimate
        return estimate(__file__, argv)
    return train(args, args.device)


if __name__ == "__main__":
    main()
