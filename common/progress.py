"""Progress lines while training: about twenty per run, plus one per epoch."""
import time

import torch.distributed as dist


def is_main_process():
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class Progress:
    def __init__(self, total_steps, lines=20):
        self.total_steps = total_steps
        self.every = max(1, total_steps // lines)
        self.start = time.perf_counter()
        self.losses = []  # one detached tensor per step: no device sync until they are read

    def step(self, step, epoch, loss):
        """Call after optimizer step `step` (1-based); `loss` is a tensor, read only when printing."""
        self.losses.append(loss.detach())
        if is_main_process() and (step % self.every == 0 or step == self.total_steps):
            elapsed = time.perf_counter() - self.start
            print(f"epoch {epoch + 1} step {step}/{self.total_steps} loss {loss.item():.4f} "
                  f"({elapsed:.1f} s)", flush=True)

    def loss_values(self):
        return [round(loss.item(), 6) for loss in self.losses]

    def epoch(self, epoch, epochs, val_accuracy):
        if is_main_process():
            print(f"epoch {epoch + 1}/{epochs} validation accuracy {val_accuracy:.2%}", flush=True)
