"""04b bf16 stochastic rounding: 03 with Adam's step rounded into bfloat16 at random.

In 03 an update smaller than half the gap between neighbouring bfloat16 numbers is lost every
time. Here the step is computed in float32, a chunk at a time, and rounded up or down at random,
up with probability (x - lower) / (upper - lower): on average nothing is lost, so small updates
add up as in float32, and nothing more is kept than 03's bfloat16 weights and states.

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import torch

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args
from common.data import load_data, to_device
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


def stochastic_round(values):  # stochastic rounding: float32 to bfloat16, up or down at random
    """`values` (float32) rounded to one of their two bfloat16 neighbours, the nearer more often,
    still as float32 (so that copying them into a bfloat16 tensor is exact): adding random low 16
    bits, then cutting them off, carries into the kept bits with probability
    (x - lower) / (upper - lower)."""
    bits = values.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    rounded = ((bits + noise) & -(1 << 16)).view(torch.float32)
    return torch.where(values.isnan(), values, rounded)  # a NaN's carry could make it 0 or inf


class AdamStochasticRounding(torch.optim.Optimizer):  # stochastic rounding
    """torch.optim.Adam's update (no weight decay) for bfloat16 weights and states, computed in
    float32 a chunk at a time and written back with stochastic_round."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, chunk=2**20):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, chunk=chunk))
        for param in (param for group in self.param_groups for param in group["params"]):
            if param.dtype != torch.bfloat16:  # float32 work on a float32 weight would alias it
                raise TypeError(f"AdamStochasticRounding updates bfloat16 weights, not {param.dtype}")

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
            for param in (param for param in group["params"] if param.grad is not None):
                state = self.state[param]
                if not state:  # bfloat16 states, as 03's Adam keeps them
                    state.update(step=0, exp_avg=torch.zeros_like(param),
                                 exp_avg_sq=torch.zeros_like(param))
                state["step"] += 1
                bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                chunks = (tensor.view(-1).split(group["chunk"]) for tensor in
                          (param, param.grad, state["exp_avg"], state["exp_avg_sq"]))
                for weight, grad, exp_avg, exp_avg_sq in zip(*chunks):  # float32 work, one chunk
                    grad = grad.float()
                    mean = exp_avg.float().lerp_(grad, 1 - beta1)
                    square = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    exp_avg.copy_(stochastic_round(mean))
                    exp_avg_sq.copy_(stochastic_round(square))
                    denominator = square.div_(bias2).sqrt_().add_(eps)
                    updated = weight.float().addcdiv_(mean, denominator, value=-lr / bias1)
                    weight.copy_(stochastic_round(updated))


def train_step(model, optimizer, inputs, labels, device):
    """One optimizer step on one batch; returns the loss."""
    inputs, labels = to_device(inputs, device, DTYPE), labels.to(device, non_blocking=True)  # bf16-true
    loss = model(**inputs, labels=labels).loss  # its own loss: over classes, or next tokens
    loss.backward()
    batch_loss = loss.detach().float()  # the record's loss, in float32 (03's is bfloat16)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return batch_loss


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
    optimizer = AdamStochasticRounding(model.parameters(), lr=args.lr or preset.lr)  # stochastic rounding

    # the peak of the first steps, by what it holds (--memory-snapshot: on CUDA, their history)
    meter = MemoryMeter(device, model, optimizer, snapshot=args.memory_snapshot)
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, optimizer, inputs, labels, device)
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device, DTYPE))  # bf16-true
        if progress.steps == total_steps:
            break
    test_score = evaluate(model, data.test, device, DTYPE)  # bf16-true: bfloat16 inputs
    return report(args, __file__, creation, meter, progress, test_score)


def main(argv=None):
    args = parse_args(__doc__, argv)
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
