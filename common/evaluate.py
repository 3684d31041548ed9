"""The score of a model over a loader, counted over all processes when there are several:
classification accuracy, or under --task causal-lm the next-token loss (and its perplexity).

Accuracy is torchmetrics' MulticlassAccuracy, micro-averaged: the correct predictions (the
highest logit) over the samples; under a process group torchmetrics sums every process's counts,
so processes that saw different numbers of samples are weighed by their samples. The next-token
loss is summed over every predicted token and divided by their count, over all processes likewise.
"""
import itertools
import math

import torch
import torch.distributed as dist

from common.data import IGNORED, RankSlice, split_batch, to_device


class Accuracy(float):
    """A fraction of correct predictions that knows how many samples it counted (`.samples`),
    so that a report can say how precise it is."""

    name = "accuracy"

    def __new__(cls, fraction, samples):
        accuracy = super().__new__(cls, fraction)
        accuracy.samples = samples
        return accuracy

    def __str__(self):
        return f"accuracy {self:.2%}"


class TokenLoss(float):
    """The mean next-token loss (cross-entropy in nats) over `.tokens` predicted tokens; its
    perplexity, exp(loss), is the number of equally likely tokens that would leave the model as
    unsure."""

    name = "loss"

    def __new__(cls, loss, tokens):
        value = super().__new__(cls, loss)
        value.tokens = tokens
        return value

    @property
    def perplexity(self):
        return math.exp(self) if math.isfinite(self) else float("nan")

    def __str__(self):
        return f"loss {self:.4f} (perplexity {self.perplexity:,.1f})"


@torch.no_grad()
def evaluate(model, loader, device, dtype=None, loss=None, pieces=1):
    """The model's score on the loader: an Accuracy, or a TokenLoss when the labels are tokens
    (--task causal-lm). `dtype` casts the floating inputs (images) to the model's dtype. `loss`
    (model, inputs, labels) -> the mean next-token loss replaces the model's own (05g's chunked
    loss, which never holds a whole text's logits). `pieces`: each batch is evaluated in that
    many parts, as training splits it into micro-batches (--accum-steps), so that no forward
    holds more samples than a training micro-batch."""
    was_training = model.training
    model.eval()
    try:
        if is_causal_lm(model):
            return token_loss(model, loader, device, dtype, loss or models_own_loss, pieces)
        return accuracy(model, loader, device, dtype, pieces)
    finally:
        model.train(was_training)


def is_causal_lm(model):
    """True for a transformers causal language model (LlamaForCausalLM, GPT2LMHeadModel, ...,
    FSDP's subclasses of them too)."""
    from transformers import GenerationMixin
    return isinstance(model, GenerationMixin)


def largest_shares(loader):
    """For each batch of `loader`, the samples of the largest process's share of it: the
    global batch's size divided by the processes, rounded up (None for a loader of another
    kind: its own share's size)."""
    sampler = getattr(loader, "sampler", None)  # none for a plain list of batches
    if not isinstance(sampler, RankSlice):
        return itertools.repeat(None)
    return (math.ceil(len(batch) / sampler.world_size) for batch in sampler.batch_sampler)


def in_pieces(loader, pieces):
    """(inputs, labels, counted) for each piece of each batch: a batch's share split into
    `pieces` parts of equal size (the last may be smaller). Processes that shard the model
    (07-09) each run as many forwards, as many as the largest share of the batch makes (each
    forward gathers the weights with the others): a process whose share makes fewer runs its
    last piece again, not `counted`."""
    for (inputs, labels), largest in zip(loader, largest_shares(loader)):
        samples = largest or len(labels)
        size = max(1, math.ceil(samples / max(1, pieces)))
        parts = split_batch(inputs, labels, size)
        for index in range(math.ceil(samples / size)):
            part_inputs, part_labels = parts[min(index, len(parts) - 1)]
            yield part_inputs, part_labels, index < len(parts)


def accuracy(model, loader, device, dtype, pieces=1):
    # torchmetrics' package imports every metric it has, matplotlib, scipy and transformers'
    # AutoModel with them (1.7 s and 1,350 modules on 2 cores here): imported when a run first
    # counts an accuracy, not with the script (nor by --estimate, which counts none)
    from torchmetrics.classification import MulticlassAccuracy
    # micro: the correct predictions over the samples (macro would average each class's
    # accuracy); its counts on the training device, as NCCL requires of CUDA; no per-batch
    # checks of the labels, which would wait for a GPU each batch
    metric = MulticlassAccuracy(model.config.num_labels, average="micro", sync_on_compute=False,
                                validate_args=False).to(device)
    for inputs, labels, counted in in_pieces(loader, pieces):
        logits = model(**to_device(inputs, device, dtype)).logits
        if not counted:
            continue  # the forward every process runs; this one has no sample left
        metric.update(logits, labels.to(device, non_blocking=True))  # the highest logit's class
    metric.sync()  # every process's counts, summed (alone: nothing to do)
    # micro: tp counts the correct predictions, fn the wrong ones; compute() would divide them
    # in float32, and the record keeps the exact fraction, so that accuracy x samples is a count
    correct, samples = int(metric.tp), int(metric.tp + metric.fn)
    return Accuracy(correct / samples if samples else float("nan"), samples)


def models_own_loss(model, inputs, labels):
    return model(**inputs, labels=labels).loss


def token_loss(model, loader, device, dtype, loss_of, pieces=1):
    """The mean next-token loss, a piece of each batch at a time (a training micro-batch's
    texts: `pieces`): a piece's logits and their float32 copies (10 bytes x tokens x vocabulary)
    are evaluation's largest tensors, no larger than a training micro-batch's. Each piece's mean
    loss times its predicted tokens is its summed loss; the sums and the tokens add up over the
    pieces and the processes. Batches are pinned on a GPU: copied without a wait, so the loop
    never waits for the GPU."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, predicted tokens
    for inputs, labels, counted in in_pieces(loader, pieces):
        labels = labels.to(device, non_blocking=True)
        tokens = (labels[:, 1:] != IGNORED).sum()  # each position predicts the next
        loss = loss_of(model, to_device(inputs, device, dtype), labels)  # the piece's mean
        if not counted:
            continue  # the forward every process runs; this one has no text left
        # a piece too short to predict anything has a NaN mean: it adds nothing (no sync)
        total += torch.stack([torch.where(tokens > 0, loss.double() * tokens, 0.0),
                              tokens.double()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)  # every process's sums
    summed, tokens = total.tolist()
    return TokenLoss(summed / tokens if tokens else float("nan"), int(tokens))
