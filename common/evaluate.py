"""Classification accuracy over a loader, counted over all processes when there are several.

torchmetrics' MulticlassAccuracy counts the correct predictions and the wrong ones of each
batch; with average="micro" its accuracy is correct / samples, the plain accuracy (its default,
"macro", would average the accuracy of each class instead). Under a process group it gathers
every process's counts and sums them (so processes that saw different numbers of samples are
weighed by their samples); its counts live on the training device, as NCCL requires of CUDA.
"""
import torch
from torchmetrics.classification import MulticlassAccuracy

from common.data import to_device


class Accuracy(float):
    """A fraction of correct predictions that knows how many samples it counted (`.samples`),
    so that a report can say how precise it is."""

    def __new__(cls, fraction, samples):
        accuracy = super().__new__(cls, fraction)
        accuracy.samples = samples
        return accuracy


@torch.no_grad()
def evaluate(model, loader, device, dtype=None):
    """Fraction of correct predictions (an Accuracy); `dtype` casts the floating inputs (images)
    to the model's dtype."""
    was_training = model.training
    model.eval()
    metric = MulticlassAccuracy(model.config.num_labels, average="micro",
                                sync_on_compute=False).to(device)  # synced once, below
    for inputs, labels in loader:
        logits = model(**to_device(inputs, device, dtype)).logits
        metric.update(logits, labels.to(device))  # the prediction is the highest logit
    model.train(was_training)
    metric.sync()  # every process's counts, summed; nothing to do without a process group
    # micro: tp counts the correct predictions, fn the wrong ones. compute() would divide them
    # in float32; the record keeps the exact fraction, so that accuracy x samples is a count.
    correct, samples = int(metric.tp), int(metric.tp + metric.fn)
    return Accuracy(correct / samples if samples else float("nan"), samples)
