"""Classification accuracy over a loader, summed over all processes when there are several."""
import torch
import torch.distributed as dist

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
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, seen
    for inputs, labels in loader:
        inputs, labels = to_device(inputs, device, dtype), labels.to(device)
        predictions = model(**inputs).logits.argmax(dim=-1)
        counts[0] += (predictions == labels).sum()
        counts[1] += labels.numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    model.train(was_training)
    correct, seen = counts.tolist()
    return Accuracy(correct / seen if seen else float("nan"), int(seen))
