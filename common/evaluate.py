"""The score of a model over a loader, counted over all processes when there are several:
classification accuracy, or under --task causal-lm the next-token loss (and its perplexity).

Accuracy counts the samples whose highest logit is their label, and the samples, on the training
device (as NCCL requires of CUDA); under a process group every process's counts are summed, so
processes that saw different numbers of samples are weighed by their samples. The next-token loss
is summed over every predicted token and divided by their count, over all processes likewise.
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
def evaluate(model, loader, device, dtype=None, loss=None):
    """The model's score on the loader: an Accuracy, or a TokenLoss when the labels are tokens
    (--task causal-lm). `dtype` casts the floating inputs (images) to the model's dtype. `loss`
    (model, inputs, labels) -> the mean next-token loss replaces the model's own (05g's chunked
    loss, which never holds a whole text's logits)."""
    was_training = model.training
    model.eval()
    try:
        if is_causal_lm(model):
            return token_loss(model, loader, device, dtype, loss or models_own_loss)
        return accuracy(model, loader, device, dtype)
    finally:
        model.train(was_training)


def is_causal_lm(model):
    """True for a transformers causal language model (LlamaForCausalLM, GPT2LMHeadModel, ...,
    FSDP's subclasses of them too)."""
    from transformers import GenerationMixin
    return isinstance(model, GenerationMixin)


def largest_shares(loader):
    """For each batch of `loader`, the texts of the largest process's share of it: the
    global batch's size divided by the processes, rounded up (None for a loader of another
    kind: its own share's size)."""
    sampler = getattr(loader, "sampler", None)  # none for a plain list of batches
    if not isinstance(sampler, RankSlice):
        return itertools.repeat(None)
    return (math.ceil(len(batch) / sampler.world_size) for batch in sampler.batch_sampler)


def accuracy(model, loader, device, dtype):
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # correct predictions, samples
    for inputs, labels in loader:
        logits = model(**to_device(inputs, device, dtype)).logits
        predicted = logits.argmax(dim=-1)  # the highest logit (the first of equal ones)
        counts[0] += (predicted == labels.to(device, non_blocking=True)).sum()
        counts[1] += len(labels)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)  # every process's counts
    correct, samples = counts.tolist()  # exact: accuracy x samples is a count
    return Accuracy(correct / samples if samples else float("nan"), samples)


def models_own_loss(model, inputs, labels):
    return model(**inputs, labels=labels).loss


def token_loss(model, loader, device, dtype, loss_of):
    """The mean next-token loss, one text at a time: a text's logits and their float32 copies
    (10 bytes x tokens x vocabulary) are evaluation's largest tensors, and a whole batch's could
    exceed what training, in micro-batches, ever holds. Processes that shard the model (07-09)
    each run as many forwards, one per text of the largest share of the batch (each forward
    gathers the weights with the others): a process whose share is one text short runs its
    last text again, which counts for nothing. Batches are pinned on a GPU: copied without a
    wait, so the loop never waits for the GPU."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, predicted tokens
    for (inputs, labels), largest in zip(loader, largest_shares(loader)):
        texts = split_batch(inputs, labels, 1)
        for index in range(largest or len(texts)):
            one_input, one_labels = texts[min(index, len(texts) - 1)]
            one_labels = one_labels.to(device, non_blocking=True)
            tokens = (one_labels[:, 1:] != IGNORED).sum()  # each position predicts the next
            loss = loss_of(model, to_device(one_input, device, dtype), one_labels)  # the mean
            if index >= len(texts):
                continue  # the forward every process runs; this one has no text left
            # a text too short to predict anything has a NaN mean: it adds nothing (no sync)
            total += torch.stack([torch.where(tokens > 0, loss.double() * tokens, 0.0),
                                  tokens.double()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)  # every process's sums
    summed, tokens = total.tolist()
    return TokenLoss(summed / tokens if tokens else float("nan"), int(tokens))
