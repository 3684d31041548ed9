"""05l tiled MLP: 05e with each block's MLP run over tiles of the sequence, each recomputed.

In a long sequence a checkpointed block's largest tensor is its MLP's intermediate, 3.5 to 4
times the hidden size a token. Here each block's `mlp` runs on --mlp-tiles pieces of the sequence
in turn, each under torch.utils.checkpoint: the intermediate exists for one piece at a time, and
each weight's gradient adds up over the pieces. By default the tiles are ALST's count: the length
over the hidden size, rounded up. --task causal-lm only, on blocks that call an `mlp` module.

  python %(prog)s                                  # tiny-text, causal-lm: offline, a small decoder
  python %(prog)s --mlp-tiles 4                    # tiny-text's 48 tokens in 4 tiles of 12
  python %(prog)s --model DIR --seq-len 32768 --pack --estimate  # a decoder's config: predicted GPU memory
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
from common.quirks import BlockWrapper, check_block_mlp  # tiled MLP: the check
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


def tile_count(text):  # tiled MLP: --mlp-tiles
    """auto (the length over the hidden size, rounded up: ALST's) or a whole number of tiles."""
    return text if text == "auto" else positive_int(text)


class TiledMLP(torch.nn.Module):  # tiled MLP
    """Runs a block's `mlp` on `tiles` pieces of the sequence in turn, each recomputed in
    backward. Its inputs, (batch, sequence, hidden), are cut alike (BLOOM's takes the residual)."""

    def __init__(self, mlp, tiles):
        super().__init__()
        self.mlp, self.tiles = mlp, tiles

    def forward(self, *inputs):
        length, hidden = inputs[0].shape[1:]
        tiles = min(length, -(-length // hidden) if self.tiles == "auto" else self.tiles)
        pieces = zip(*(tensor.tensor_split(tiles, dim=1) for tensor in inputs))
        # non-reentrant, as each block's: each tile keeps only its input for backward
        return torch.cat([checkpoint(self.mlp, *piece, use_reentrant=False) for piece in pieces],
                         dim=1)


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
    check_block_mlp(blocks, "Train it with 05e_activation_offloading.py")  # tiled MLP
    offload = OffloadedInputs(device)  # activation offloading: one side stream for all blocks
    for index, block in enumerate(blocks):
        block.mlp = TiledMLP(block.mlp, args.mlp_tiles)  # tiled MLP: inside the checkpointed block
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
    parser.add_argument("--mlp-tiles", type=tile_count, default="auto",  # tiled MLP: its flag
                        help="pieces of the sequence each block's MLP runs on in turn (default: "
                             "auto, the length over the hidden size rounded up, as ALST)")


def main(argv=None):
    args = parse_args(__doc__, argv, task="causal-lm",  # tiled MLP: a decoder's long sequences
                      flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
