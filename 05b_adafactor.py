"""05b Adafactor: 04 with Adafactor, whose state grows with a weight's rows plus columns.

A branch of 04 (`diff 04_grad_accum.py 05b_adafactor.py`), beside step 05's plain SGD and 05a's
8-bit AdamW. Adam keeps two averages the size of every weight; `torch.optim.Adafactor` keeps
no first moment and factors the second: for a matrix of r x c weights, one average per row and
one per column (r + c numbers, not r x c), from which it rebuilds each weight's scale. Vectors
(biases, norms) keep a full average. Its learning rate is relative: a step moves a weight by
about lr times the weights' root mean square (default 0.01), so the preset's Adam rate does not
apply.

  python 05b_adafactor.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 05b_adafactor.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 05b_adafactor.py --preset tiny-text  # text: a pretrained MiniLM on movie reviews
  python 05b_adafactor.py --estimate        # predict peak GPU memory without a GPU
"""
import torch
import torch.nn.functional as F

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: common/estimate/contract.py.
from common.cli import parse_args
from common.data import load_data, split_batch, to_device
from common.evaluate import evaluate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model
from common.presets import get_preset
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
        micro_labels = micro_labels.to(device)
        logits = model(**micro_inputs).logits
        loss = F.cross_entropy(logits, micro_labels) / len(micro_batches)  # mean over the batch
        loss.backward()
        batch_loss += loss.detach().float()  # the record's loss, summed in float32
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return batch_loss  # gradient accumulation: the whole batch's mean loss


def train(args, device):
    preset = get_preset(args.preset)
    torch.manual_seed(args.seed)

    data = load_data(preset, args.batch_size, device, seed=args.seed)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        model = create_model(preset).to(device, DTYPE)  # bf16-true
    optimizer = torch.optim.Adafactor(model.parameters(), lr=args.lr or 0.01)  # Adafactor: relative

    meter = MemoryMeter(device, model, optimizer)  # the peak of the first steps, by what it holds
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, inputs, labels, device,  # gradient accumulation
                                  args.accum_steps)
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device, DTYPE))  # bf16-true
        if progress.steps == total_steps:
            break
    test_accuracy = evaluate(model, data.test, device, DTYPE)  # bf16-true: bfloat16 inputs
    return report(args, __file__, creation, meter, progress, test_accuracy)


def main(argv=None):
    args = parse_args(__doc__, argv, accum_steps=4)  # gradient accumulation: --accum-steps
    if args.estimate:  # predict instead: this script's main() on fake tensors (common/estimate/)
        from common.estimate import estimate
        return estimate(__file__, argv)
    return train(args, args.device)


if __name__ == "__main__":
    main()
