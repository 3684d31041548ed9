"""05k memory budget: 04 compiled, with the compiler told how much of forward backward may keep.

torch.compile's partitioner splits each compiled graph (a block's) into forward and backward and chooses
which intermediate results forward saves. `torch._functorch.config.activation_memory_budget`
(0 to 1, `--memory-budget`, default 0.5) caps what it saves at that fraction of its own default
choice, and it recomputes the cheapest rest in backward (by FLOPs): checkpointing chosen by the
compiler per operator instead of by hand per block (05c, 05d). Only compiled code heeds it.

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import torch
import torch._functorch.config  # memory budget: the partitioner's settings

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import fraction  # memory budget: for its flag
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.data import load_data, split_batch, to_device
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
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
    return batch_loss  # gradient accumulation: the whole batch's mean loss


def train(args, device):
    preset = preset_for(args)  # the preset, with --model's model in place of its own if named
    torch.manual_seed(args.seed)

    data = load_data(preset, args.batch_size, device, seed=args.seed)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        model = create_model(preset).to(device, DTYPE)  # bf16-true
    # memory budget: what the partition may save for backward, of what it saves unasked (1.0)
    torch._functorch.config.activation_memory_budget = args.memory_budget
    for block in transformer_blocks(model):  # memory budget: always compiled, each block on its
        block.compile()  # own (its budget is a block's), at the first call: seconds to minutes
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or preset.lr)

    # the peak of the first steps, by what it holds (--memory-snapshot: on CUDA, their history)
    meter = MemoryMeter(device, model, optimizer, snapshot=args.memory_snapshot)
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
    parser.add_argument("--memory-budget", type=fraction, default=0.5,  # memory budget: its flag
                        help="0 to 1: what backward may keep, of what the compiler keeps unasked")
    parser.set_defaults(compile=True)  # memory budget: always compiled, checked as --compile is


def main(argv=None):
    args = parse_args(__doc__, argv, flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
