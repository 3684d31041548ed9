"""05g chunked loss: 04 with a causal language model's loss over its vocabulary, a piece at a time.

A language model's last layer gives every position of every sequence a score (a logit) for every
token of its vocabulary, and the loss upcasts them to float32: for Llama 3's 128,256 tokens at
2,048 positions, 1 GB per sample, then as much again for their log-probabilities, kept for
backward. Here the blocks run as before, and the output layer and the loss run on LOSS_CHUNKS
pieces of the sequence in turn, each under torch.utils.checkpoint: a piece's logits are made,
summed into the loss and freed before the next piece's, and made again, one piece at a time, in
backward. The logits held at once shrink to one piece's, for a second forward of the output layer
(2 x tokens x hidden size x vocabulary FLOPs: a third more of that layer's work); in backward
the output layer's gradient is summed over the pieces, up to three of its size at once, so the
saving needs more tokens per micro-batch than the hidden size (the estimate counts both). The
loss is the model's own: the mean over every predicted token, padding left out. A branch of 04 for --task
causal-lm (its default, and on tiny-text a small decoder drawn from scratch); a classifier's
logits are a few numbers per sample, with nothing to chunk.

  python %(prog)s                                  # tiny-text, causal-lm: offline, a small decoder
  python %(prog)s --preset imdb                    # BLOOM-560m as a language model (GPU and network)
  python %(prog)s --model DIR --seq-len 2048 --estimate  # a decoder's config: predicted GPU memory
"""
import torch
import torch.nn.functional as F  # chunked loss
from torch.utils.checkpoint import checkpoint  # chunked loss

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args
from common.data import IGNORED, load_data, split_batch, to_device  # chunked loss: IGNORED
from common.evaluate import evaluate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model
from common.presets import preset_for
from common.progress import Progress
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations
LOSS_CHUNKS = 8  # chunked loss: pieces of the sequence whose logits exist one at a time
# chunked loss: what some decoders do after their output layer (Gemma 2 caps the logits, Cohere
# and Granite scale them, mixture-of-experts models add a router loss), which chunked_loss does not
AFTER_THE_OUTPUT_LAYER = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                          "output_router_logits")


def piece_loss(head, hidden, targets):  # chunked loss
    """The summed next-token loss of one piece: its logits, upcast as the model's loss does."""
    logits = head(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED,
                           reduction="sum")


def chunked_loss(model, inputs, labels):  # chunked loss
    """model(**inputs, labels=labels).loss, with the output layer and the loss run piece by
    piece, each piece recomputed in backward (checkpoint) rather than kept."""
    hidden = model.base_model(**inputs).last_hidden_state  # the blocks' output, before the head
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORED)  # position t predicts token t + 1
    loss = 0.0
    for piece, piece_targets in zip(hidden.tensor_split(LOSS_CHUNKS, dim=1),
                                    targets.tensor_split(LOSS_CHUNKS, dim=1)):
        loss = loss + checkpoint(piece_loss, model.get_output_embeddings(), piece, piece_targets,
                                 use_reentrant=False)
    return loss / (targets != IGNORED).sum()  # the mean over every predicted token


def train_step(model, optimizer, inputs, labels, device, accum_steps):  # gradient accumulation
    """One optimizer step on one batch; returns the loss."""
    # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
    micro_size = len(labels) // accum_steps
    micro_batches = split_batch(inputs, labels, micro_size)
    batch_loss = 0.0
    for micro_inputs, micro_labels in micro_batches:
        micro_inputs = to_device(micro_inputs, device, DTYPE)  # bf16-true: bfloat16 images
        micro_labels = micro_labels.to(device)
        loss = chunked_loss(model, micro_inputs, micro_labels) / len(micro_batches)  # chunked loss
        loss.backward()
        batch_loss += loss.detach().float()  # the record's loss, summed in float32
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return batch_loss  # gradient accumulation: the whole batch's mean loss


def train(args, device):
    preset = preset_for(args)  # the preset, with --model's classifier if one is named
    torch.manual_seed(args.seed)

    data = load_data(preset, args.batch_size, device, seed=args.seed)
    total_steps = args.epochs * len(data.train)  # optimizer steps; the last partial batch is dropped
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    with measure_creation(device) as creation:
        model = create_model(preset).to(device, DTYPE)  # bf16-true
    changed = [name for name in AFTER_THE_OUTPUT_LAYER  # chunked loss: only the plain head
               if getattr(model.config, name, None) not in (None, False, 1, 1.0)]
    if changed:  # chunked loss
        raise SystemExit(f"error: this model's config sets {', '.join(changed)}: its loss is more "
                         "than cross-entropy over its output layer, which the chunked loss "
                         "computes. Train it with 04_grad_accum.py")
    if args.compile:  # fused kernels, generated by the first call (seconds to minutes), then reused
        model.base_model.compile()  # chunked loss: the blocks (the loss runs outside forward)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or preset.lr)

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
    test_score = evaluate(model, data.test, device, DTYPE)  # bf16-true: bfloat16 inputs
    return report(args, __file__, creation, meter, progress, test_score)


def main(argv=None):
    args = parse_args(__doc__, argv, task="causal-lm",  # chunked loss: its only task
                      accum_steps=4)  # gradient accumulation: --accum-steps
    if args.estimate:  # predict instead: this script's main() on fake tensors (estimate/)
        from estimate import estimate
        return estimate(__file__, argv)
    return train(args, args.device)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
