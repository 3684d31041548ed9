"""Classification accuracy over a loader, summed over all processes when there are several."""
import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate(model, loader, device, dtype=None):
    """Fraction of correct predictions; `dtype` casts the images to the model's dtype."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, seen
    for images, labels in loader:
        images, labels = images.to(device, dtype), labels.to(device)
        predictions = model(pixel_values=images).logits.argmax(dim=-1)
        counts[0] += (predictions == labels).sum()
        counts[1] += labels.numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    model.train(was_training)
    return (counts[0] / counts[1]).item() if counts[1] else float("nan")
