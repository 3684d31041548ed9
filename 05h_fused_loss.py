"""05h fused loss: 05g with the output layer, the loss and their gradients in one pass of forward.

An autograd.Function takes the batch's tokens LOSS_CHUNKS pieces at a time: each piece's logits,
its loss and at once its gradients with respect to the hidden states and the output layer's weight.
It keeps only those gradients; backward scales them. The output layer runs once (05g runs it
twice) and no logits outlive their piece. For --task causal-lm only (its default).

  python %(prog)s                                  # tiny-text, causal-lm: offline, a small decoder
  python %(prog)s --preset imdb                    # BLOOM-560m as a language model (GPU and network)
  python %(prog)s --model DIR --seq-len 2048 --estimate  # a decoder's config: predicted GPU memory
"""
import torch
import torch.nn.functional as F  # chunked loss

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.data import IGNORED, load_data, split_batch, to_device  # chunked loss: IGNORED
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.quirks import check_output_layer_without_bias, check_plain_output_layer  # fused loss
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations
LOSS_CHUNKS = 8  # chunked loss: pieces of the sequence whose logits exist one at a time


class FusedLinearCrossEntropy(torch.autograd.Function):  # fused loss
    """The mean next-token loss over head(hidden)'s logits; forward computes its gradients too."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, with_gradients):
        tokens, targets = hidden.flatten(0, 1), targets.flatten()  # every token of the batch
        kept = (targets != IGNORED).unsqueeze(-1)  # the predicted positions
        count = kept.sum()
        loss = torch.zeros((), device=hidden.device)
        grad_tokens = torch.empty_like(tokens) if with_gradients else None
        trains_weight = with_gradients and ctx.needs_input_grad[1]  # not a frozen output layer's
        grad_weight = torch.zeros_like(weight) if trains_weight else None  # held until backward
        size = -(-len(tokens) // LOSS_CHUNKS)  # tokens in a piece (the last may have fewer)
        for start in range(0, len(tokens), size):
            piece, piece_kept = tokens[start:start + size], kept[start:start + size]
            piece_targets = targets[start:start + size].clamp(min=0).unsqueeze(-1)  # IGNORED: any
            logits = (piece @ weight.T).float()  # this piece's logits, upcast as the model's loss
            normalizer = logits.logsumexp(-1, keepdim=True)
            loss += ((normalizer - logits.gather(-1, piece_targets)) * piece_kept).sum()
            if with_gradients:  # (evaluation: the loss alone)
                grad = logits.sub_(normalizer).exp_()  # softmax, in the logits' place
                grad.scatter_add_(-1, piece_targets, -piece_kept.float())  # minus the one-hot
                grad = grad.mul_(piece_kept / count).to(weight.dtype)  # of the mean; 0 if IGNORED
                torch.mm(grad, weight, out=grad_tokens[start:start + size])
                if trains_weight:  # vocabulary x hidden, summed over the pieces
                    grad_weight.addmm_(grad.T, piece)
                del grad
            del logits  # freed before the next piece's are made
        ctx.save_for_backward(grad_tokens, grad_weight)
        ctx.shape = hidden.shape
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_tokens, grad_weight = ctx.saved_tensors  # the loss's gradients, made in forward
        grad_hidden = grad_tokens.mul_(grad_loss).view(ctx.shape)  # scaled in place: no copy
        return grad_hidden, None if grad_weight is None else grad_weight.mul_(grad_loss), None, None


def fused_loss(model, inputs, labels):  # fused loss
    """model(**inputs, labels=labels).loss, with the output layer and the loss fused: no logits
    outlive their piece, and the output layer runs once."""
    hidden = model.base_model(**inputs).last_hidden_state  # the blocks' output, before the head
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORED)  # position t predicts token t + 1
    return FusedLinearCrossEntropy.apply(  # fused loss
        hidden, model.get_output_embeddings().weight, targets, torch.is_grad_enabled())


def train_step(model, optimizer, inputs, labels, device, accum_steps):  # gradient accumulation
    """One optimizer step on one batch; returns the loss."""
    # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
    micro_size = len(labels) // accum_steps
    micro_batches = split_batch(inputs, labels, micro_size)
    batch_loss = 0.0
    for micro_inputs, micro_labels in micro_batches:
        micro_inputs = to_device(micro_inputs, device, DTYPE)  # bf16-true: bfloat16 images
        micro_labels = micro_labels.to(device, non_blocking=True)
        loss = fused_loss(model, micro_inputs, micro_labels) / len(micro_batches)  # fused loss
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
    check_plain_output_layer(model.config, "Train it with 04_grad_accum.py")  # chunked loss
    check_output_layer_without_bias(model, "Train it with 05g_chunked_loss.py")  # fused loss
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
                         pieces=args.accum_steps, loss=fused_loss)  # fused loss
        progress.epoch(epoch, args.epochs, score)
        if progress.steps == total_steps:
            break
    test_score = evaluate(model, data.test, device, DTYPE,  # bf16-true, gradient accumulation
                          pieces=args.accum_steps, loss=fused_loss)  # fused loss
    return report(args, __file__, creation, meter, progress, test_score)


def own_flags(parser):  # gradient accumulation: this script's flag, beside common/cli.py's
    parser.add_argument("--accum-steps", type=positive_int, default=4,
                        help="micro-batches per optimizer step (default: 4)")


def main(argv=None):
    args = parse_args(__doc__, argv, task="causal-lm",  # chunked loss: its only task
                      flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
