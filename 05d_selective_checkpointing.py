"""05d selective activation checkpointing: 05c keeping the outputs of the matrix products and attention.

05c recomputes every operator of a block in backward, the matrix products too. Here the outputs
of the weights' matrix products, the convolutions and the attention kernels are kept from forward
(a policy by operator), and only the cheap operators between them run again: memory between 04's
and 05c's, and element-wise kernels recomputed instead of a second forward's FLOPs.

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import torch
from torch.utils.checkpoint import checkpoint  # checkpointing on one device
# selective checkpointing: what to do with each operator's output, and the contexts that do it
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.data import load_data, split_batch, to_device
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.quirks import BlockWrapper
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations
ATEN = torch.ops.aten  # selective checkpointing: the operators whose outputs forward keeps
# the weights' products and the attention kernels; not bmm or baddbmm, which make the score
# matrices (batch x heads x tokens x tokens) of a model's own attention code (BLOOM's), 05c's saving
SAVED = [ATEN.mm.default, ATEN.addmm.default,
         ATEN.convolution.default, ATEN._scaled_dot_product_flash_attention_for_cpu.default,
         ATEN._scaled_dot_product_flash_attention.default,
         ATEN._scaled_dot_product_efficient_attention.default,
         ATEN._scaled_dot_product_cudnn_attention.default]


def keep_or_recompute(context, op, *args, **kwargs):  # selective checkpointing: per operator
    """Keep the output of a SAVED operator, unless it draws random numbers (a GPU's attention
    with dropout): backward replays the random draws of what it recomputes, in order, and a
    draw skipped there would give the dropout after it another mask than forward's."""
    arguments = dict(zip((argument.name for argument in op._schema.arguments), args)) | kwargs
    if op in SAVED and not arguments.get("dropout_p"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():  # selective checkpointing: a fresh pair for each checkpointed call
    return create_selective_checkpoint_contexts(keep_or_recompute)


class CheckpointedBlock(BlockWrapper):  # checkpointing on one device
    """Runs `block` keeping only its input for backward, where the block runs forward again."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden_states, *args, **kwargs):
        # non-reentrant: the variant PyTorch recommends; it passes keyword arguments through.
        return checkpoint(self.block, hidden_states, *args, use_reentrant=False,  # selective checkpointing
                          context_fn=selective_contexts, **kwargs)


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
    blocks = transformer_blocks(model)  # checkpointing on one device: wrap each block in place
    for index, block in enumerate(blocks):
        blocks[index] = CheckpointedBlock(block)
    if args.compile:  # fused kernels, generated by the first call (seconds to minutes), then reused
        for block in transformer_blocks(model):  # each block on its own (torchtitan's way), so
            block.compile()  # each block's backward hands back its gradients as it ends
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


def main(argv=None):
    args = parse_args(__doc__, argv, flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
