"""05a 8-bit AdamW: 04 with Adam's two running averages stored in 8 bits instead of 16.

A branch of 04 (`diff 04_grad_accum.py 05a_adamw_8bit.py`), beside step 05's plain SGD:
bitsandbytes' AdamW8bit keeps each state as one byte per weight plus a float32 scale per block
of 256 weights, so the optimizer state takes about 2 bytes per parameter where 04's bfloat16
Adam takes 4 (and float32 Adam 8). Each step dequantizes a tensor's states, updates them in
float32 and quantizes them back, block by block. Tensors under 4,096 elements (biases, norms)
keep float32 states. Weight decay 0: the same update as 04's Adam; only its memory differs.

  python 05a_adamw_8bit.py                   # tiny preset: offline, about 30 s on a laptop CPU
  python 05a_adamw_8bit.py --preset article  # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python 05a_adamw_8bit.py --preset tiny-text  # text: a pretrained MiniLM on movie reviews
  python 05a_adamw_8bit.py --estimate        # predict peak GPU memory without a GPU
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

try:  # 8-bit AdamW: from bitsandbytes (requirements.txt pins it)
    from bitsandbytes.optim import AdamW8bit
except ImportError as error:
    raise SystemExit(f"error: 05a needs bitsandbytes' AdamW8bit ({error}). Install it with "
                     "pip install bitsandbytes==0.50.2 (as requirements.txt pins), or use 04 or 05.")

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
    optimizer = AdamW8bit(model.parameters(), lr=args.lr or preset.lr, weight_decay=0.0)  # 8-bit AdamW

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
