"""05i gradients to host: 05f with each gradient sent to host memory as soon as backward makes it.

05f copies the gradients out after backward, so the device still holds every one at its end.
Here a hook on each weight copies its gradient out the moment backward has finished it, and
frees it on the device; on a GPU the copies run on a side stream, beside backward. With
accumulation the micro-batches' gradients add up in host memory, on a GPU on a thread of their
own while the next micro-batch runs. On a CPU the host is the device.

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
from concurrent.futures import ThreadPoolExecutor  # gradients to host: a GPU's sums on a thread

import torch

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
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


class GradientsToHost:  # gradients to host
    """A hook on each weight that copies its gradient to host memory as soon as backward has
    finished it, and frees it on the device. A micro-batch's copies are added into the host
    weights' .grad, where Adam reads them, while the next micro-batch runs (on a GPU by a thread,
    once copied): each by its weight's next copy, which waits for it, and all by add_all()."""

    def __init__(self, weights, host_weights, device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # copies out
        # a GPU's thread that adds the copies in turn, set to this GPU (else its CUDA calls
        # would go to GPU 0, and open a context there)
        self.adder = None if self.stream is None else ThreadPoolExecutor(
            1, initializer=torch.cuda.set_device, initargs=(self.stream.device,))
        self.arrived = []  # (host copy of a gradient, its host weight), this micro-batch's
        self.copies, self.adding = {}, {}  # host weight -> its copy to add; the thread's sum of it
        for weight, host_weight in zip(weights, host_weights):
            weight.register_post_accumulate_grad_hook(
                lambda weight, host_weight=host_weight: self.to_host(weight, host_weight))

    def to_host(self, weight, host_weight):
        self.copy_added(host_weight)  # the micro-batch before's copy in .grad: its memory free
        if self.stream is None:  # a CPU: copied all the same, so the estimate sees it move
            self.arrived.append((weight.grad.to(HOST, copy=True), host_weight))
        else:
            self.stream.wait_stream(torch.cuda.current_stream())  # once the gradient is complete
            with torch.cuda.stream(self.stream):  # beside backward's next kernels
                host = torch.empty(weight.shape, dtype=weight.dtype, device=HOST, pin_memory=True)
                host.copy_(weight.grad, non_blocking=True)
            weight.grad.record_stream(self.stream)  # its memory is reused only after the copy
            self.arrived.append((host, host_weight))
        weight.grad = None  # freed on the device while backward goes on

    def add_up(self):
        """After a micro-batch's backward: its copies wait to be added, by a GPU's thread once the
        copies queued so far are done, while the next micro-batch runs (no wait here)."""
        copied = None if self.stream is None else self.stream.record_event()
        for host, host_weight in self.arrived:
            self.copies[host_weight] = host
            if self.adder is not None:
                self.adding[host_weight] = self.adder.submit(self.add_copy, host_weight, copied)
        self.arrived.clear()

    def add_copy(self, host_weight, copied=None):
        if copied is not None:
            copied.synchronize()  # the copies are in host memory
        if host_weight.grad is None:
            host_weight.grad = self.copies[host_weight]
        else:
            host_weight.grad += self.copies[host_weight]  # accumulation, in host memory

    def copy_added(self, host_weight):
        """Its waiting copy added (the thread's sum waited for; a CPU's made now), then let go
        of on this thread, which the memory meter watches, not on the adder's."""
        if host_weight in self.adding:
            self.adding.pop(host_weight).result()  # (the thread's error, if any, raised here)
        elif host_weight in self.copies:
            self.add_copy(host_weight)
        self.copies.pop(host_weight, None)

    def add_all(self):  # before Adam's step: every copy in .grad
        for host_weight in list(self.copies):
            self.copy_added(host_weight)


def train_step(model, optimizer, to_host, inputs, labels, device,  # gradients to host: to_host
               accum_steps):  # gradient accumulation
    """One optimizer step on one batch; returns the loss."""
    # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
    micro_size = len(labels) // accum_steps
    micro_batches = split_batch(inputs, labels, micro_size)
    batch_loss = 0.0
    for micro_inputs, micro_labels in micro_batches:
        micro_inputs = to_device(micro_inputs, device, DTYPE)  # bf16-true: bfloat16 images
        micro_labels = micro_labels.to(device, non_blocking=True)
        loss = model(**micro_inputs, labels=micro_labels).loss / len(micro_batches)  # mean over the batch
        loss.backward()  # gradients to host: each gradient leaves as backward finishes it
        to_host.add_up()  # gradients to host: added up on the host while the next micro-batch runs
        batch_loss += loss.detach().float()  # the record's loss, summed in float32
    host_weights = optimizer.param_groups[0]["params"]  # Adam on the host
    to_host.add_all()  # gradients to host: every copy in .grad before the step
    optimizer.step()
    for weight, host_weight in zip(model.parameters(), host_weights):  # Adam on the host
        weight.detach().copy_(host_weight, non_blocking=True)  # the updated weight comes back
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
    if args.compile:  # fused kernels, generated by the first call (seconds to minutes), then reused
        for block in transformer_blocks(model):  # each block on its own (torchtitan's way), so
            block.compile()  # each block's backward hands back its gradients as it ends
    # Adam on the host: a host copy of each weight, which Adam updates, its state beside it
    # (pinned on a GPU: copies to and fro are queued, not waited for)
    host_weights = [weight.detach().to(HOST, copy=True, non_blocking=True) for weight in model.parameters()]
    # Adam on the host: a GPU's host steps with its fused kernel; a CPU (the host) with 04's
    optimizer = torch.optim.Adam(host_weights, lr=args.lr or preset.lr, fused=device.type == "cuda" or None)

    to_host = GradientsToHost(model.parameters(), host_weights, device)  # gradients to host
    # the peak of the first steps, by what it holds (--memory-snapshot: on CUDA, their history)
    meter = MemoryMeter(device, model, optimizer, snapshot=args.memory_snapshot)
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, to_host, inputs, labels,  # gradients to host
                                  device, args.accum_steps)  # gradient accumulation
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


def main(argv=None):
    args = parse_args(__doc__, argv, flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
