"""Progress lines while training (about twenty per run, plus one per epoch), the per-step losses
and the training clock."""
import time

import torch
import torch.distributed as dist


def is_main_process():
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class Progress:
    """Counts optimizer steps and times training: from its creation to the end of the last epoch
    (validation included, the final test not)."""

    def __init__(self, total_steps, lines=20):
        self.total_steps = total_steps
        self.steps = 0
        self.every = max(1, total_steps // lines)
        self.start = self.end = time.perf_counter()
        self.losses = []  # one detached tensor per step: no device sync until they are read

    def step(self, epoch, loss):
        """Call after each optimizer step; `loss` is a tensor, read only when printing."""
        self.steps += 1
        self.losses.append(loss.detach())
        if is_main_process() and (self.steps % self.every == 0 or self.steps == self.total_steps):
            print(f"epoch {epoch + 1} step {self.steps}/{self.total_steps} loss {loss.item():.4f} "
                  f"({time.perf_counter() - self.start:.1f} s)", flush=True)

    def epoch(self, epoch, epochs, val_score):
        """Call after each epoch's validation; `val_score` is what evaluate() gave (an accuracy,
        or a next-token loss), and says itself what it is."""
        self.end = time.perf_counter()
        if is_main_process():
            print(f"epoch {epoch + 1}/{epochs} validation {val_score}", flush=True)

    @property
    def seconds(self):
        return self.end - self.start

    def loss_values(self):
        """The per-step losses as numbers, read from the device in one transfer."""
        if not self.losses:
            return []
        return [round(value, 6) for value in torch.stack(self.losses).float().tolist()]
