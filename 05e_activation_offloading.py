"""05e activation offloading: 05c with each checkpointed block's input kept in host memory.

What 05c still keeps from forward to backward is each block's input. Here each goes to host
memory as soon as forward has saved it and comes back when backward reaches its block
(saved-tensor hooks around the checkpointed call); on a GPU the copy out overlaps the next
block's forward. On a CPU the host is the device: it saves nothing there.

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import torch
from torch.utils.checkpoint import checkpoint  # checkpointing on one device

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.data import load_data, split_batch, to_device
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import HOST, MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.quirks import BlockWrapper
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


class OffloadedInputs(torch.autograd.graph.saved_tensors_hooks):  # activation offloading
    """While inside, a tensor saved for backward that requires a gradient (the input a
    checkpointed block keeps) is copied to host memory, and its device copy left to be freed;
    backward copies it back. Masks and position tables (no gradient) stay where they are."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # copies out
        super().__init__(self.to_host, self.to_device)

    def to_host(self, tensor):
        if not tensor.requires_grad:
            return tensor
        if self.stream is None:  # a CPU: copied all the same, so the estimate sees it move
            return tensor.device, tensor.to(HOST, copy=True)
        if not tensor.is_cuda:  # a placeholder that checkpointing saves on the CPU (torch 2.11)
            return tensor
        self.stream.wait_stream(torch.cuda.current_stream())  # once the tensor is computed
        with torch.cuda.stream(self.stream):  # overlaps the compute stream's next kernels
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is reused only after the copy is done
        return tensor.device, host

    def to_device(self, packed):
        if torch.is_tensor(packed):
            return packed
        device, host = packed
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)  # the copy out is complete
        return host.to(device, non_blocking=True)


class CheckpointedBlock(BlockWrapper):  # checkpointing on one device
    """Runs `block` keeping only its input for backward, where the block runs forward again."""

    def __init__(self, block, offload):  # activation offloading: and the hooks that move its input
        super().__init__()
        self.block = block
        self.offload = offload  # activation offloading: the hooks that move the saved input

    def forward(self, hidden_states, *args, **kwargs):
        # non-reentrant: the variant PyTorch recommends; it passes keyword arguments through.
        with self.offload:  # activation offloading: checkpoint saves the input under its hooks
            return checkpoint(self.block, hidden_states, *args, use_reentrant=False, **kwargs)


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
    offload = OffloadedInputs(device)  # activation offloading: one side stream for all blocks
    for index, block in enumerate(blocks):
        if args.compile:  # activation offloading: compiled on its own, as the hooks' `with`
            block.compile()  # stops the compiler from tracing the blocks from the model down
        blocks[index] = CheckpointedBlock(block, offload)
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
