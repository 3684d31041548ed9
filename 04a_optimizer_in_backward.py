"""04a optimizer in backward: 03 with each weight updated as soon as its gradient is complete.

A branch of 03 beside step 04 (`diff 03_bf16.py 04a_optimizer_in_backward.py`). In 03 backward first computes
the gradients of the whole model, then Adam steps. Here every parameter has its own Adam, and a
hook (`register_post_accumulate_grad_hook`) steps it and frees its gradient the moment backward
has finished that gradient: the gradients of the whole model never exist at once, only those
backward is working on. The update is 03's (Adam treats every weight on its own).

What it cannot do: gradient accumulation (04) needs every micro-batch's gradient summed before
one step, and clipping by the global gradient norm needs every gradient at once; this script
steps during each backward, so it offers neither.

  python 04a_optimizer_in_backward.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 04a_optimizer_in_backward.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 04a_optimizer_in_backward.py --preset tiny-text  # text: a pretrained MiniLM on movie reviews
  python 04a_optimizer_in_backward.py --estimate        # predict peak GPU memory without a GPU
"""
import sys

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


def train_step(model, inputs, labels, device):  # optimizer in backward: no optimizer here
    """One optimizer step on one batch; returns the loss."""
    inputs, labels = to_device(inputs, device, DTYPE), labels.to(device)  # bf16-true: bfloat16 images
    logits = model(**inputs).logits
    loss = F.cross_entropy(logits, labels)
    loss.backward()  # optimizer in backward: every weight is updated, and its gradient freed, in here
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
    # optimizer in backward: one Adam per weight, stepped by a hook once its gradient is complete
    optimizers = {param: torch.optim.Adam([param], lr=args.lr or preset.lr)
                  for param in model.parameters()}

    def step_and_free(param):  # optimizer in backward: update this weight now, free its gradient
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    for param in model.parameters():  # optimizer in backward
        param.register_post_accumulate_grad_hook(step_and_free)

    meter = MemoryMeter(device, model, list(optimizers.values()))  # optimizer in backward: all  # the peak of the first steps, by what it holds
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, inputs, labels, device)  # optimizer in backward
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device, DTYPE))  # bf16-true
        if progress.steps == total_steps:
            break
    test_accuracy = evaluate(model, data.test, device, DTYPE)  # bf16-true: bfloat16 inputs
    return report(args, __file__, creation, meter, progress, test_accuracy)


def main(argv=None):
    if "--accum-steps" in " ".join(sys.argv[1:] if argv is None else argv):  # optimizer in backward
        raise SystemExit("error: 04a steps each weight during backward, so it cannot accumulate "
                         "gradients over micro-batches; for --accum-steps use 04_grad_accum.py")
    args = parse_args(__doc__, argv)
    if args.estimate:  # predict instead: this script's main() on fake tensors (common/estimate/)
        from common.estimate import estimate
        return estimate(__file__, argv)
    return train(args, args.device)


if __name__ == "__main__":
    main()
