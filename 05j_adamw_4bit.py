"""05j 4-bit AdamW: 04 with Adam's two running averages stored in 4 bits instead of 16.

Each state is kept as 4-bit codes, two to a byte, with a float32 scale per block of 128 weights:
about 1.06 bytes per parameter for both states, where 04's bfloat16 Adam takes 4 and 05a's 8-bit
AdamW about 2 (Li et al. 2023, "Memory Efficient Optimizers with 4-bit States"). Each step
decodes a piece of a tensor's states, updates them in float32 and encodes them back. Weight
decay 0: the same update as 04's Adam; only its memory differs.

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import torch

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.data import load_data, split_batch, to_device
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.summary import report

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations
# 4-bit AdamW: the 16 values a code stands for, times its block's scale (the block's largest
# magnitude). The first moment's are signed and dense near zero (a dynamic exponent map with
# 3 exponent bits), with both -1 and 1, so that a block's largest value, either sign, is kept
# as it is; the second moment's are 1/16 to 1, without zero, which would divide by eps.
SIGNED = torch.tensor([-1.0, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                       0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0])
UNSIGNED = torch.linspace(0, 1, 17)[1:]
BLOCK = 128  # 4-bit AdamW: weights per scale
PIECE = 1 << 20  # 4-bit AdamW: weights decoded at a time (float32 temporaries of 4 MB each)


def encode(values, bounds):  # 4-bit AdamW: float32 values to codes (two per byte) and scales
    blocks = values.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1).clamp(min=1e-12)
    codes = torch.bucketize(blocks / scales[:, None], bounds, out_int32=True).to(torch.uint8).view(-1, 2)
    return codes[:, 0] | (codes[:, 1] << 4), scales


def decode(packed, scales, table):  # 4-bit AdamW: codes and scales back to float32 values
    codes = torch.stack((packed & 15, packed >> 4), dim=1).long()  # indices: int64
    return (table[codes].view(-1, BLOCK) * scales[:, None]).view(-1)


class AdamW4bit(torch.optim.Optimizer):  # 4-bit AdamW
    """Adam (weight decay 0) whose states are 4-bit codes; tensors under 4,096 weights, or not
    whole blocks, keep float32 states (as 05a's do)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.tables = {}  # the code tables on each device the weights are on

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
            for weight in group["params"]:
                if weight.grad is not None:
                    self.step_weight(weight, self.state[weight], beta1, beta2, lr, eps)

    def step_weight(self, weight, state, beta1, beta2, lr, eps):
        size, device = weight.numel(), weight.device
        if not state:  # the first step: states of zeros, as codes and scales or as float32
            state["step"], state["quantized"] = 0, size >= 4096 and size % BLOCK == 0
            for name in ("exp_avg", "exp_avg_sq"):
                if state["quantized"]:
                    state[name] = torch.zeros(size // 2, dtype=torch.uint8, device=device)
                    state[name + "_scales"] = torch.zeros(size // BLOCK, device=device)
                else:
                    state[name] = torch.zeros(size, device=device)
        state["step"] += 1
        correction1, correction2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
        if device not in self.tables:  # copied once: each copy to a GPU would wait for it
            tables = [table.to(device, copy=True) for table in (SIGNED, UNSIGNED)]
            # each with the bounds halfway between its neighbours: the nearest value wins
            self.tables[device] = [(table, (table[1:] + table[:-1]) / 2) for table in tables]
        (signed, signed_bounds), (unsigned, unsigned_bounds) = self.tables[device]
        flat, grad = weight.view(-1), weight.grad.reshape(-1)
        for start in range(0, size, PIECE):  # a piece at a time: float32 temporaries of a piece
            end = min(start + PIECE, size)
            codes, scales = slice(start // 2, end // 2), slice(start // BLOCK, end // BLOCK)
            if state["quantized"]:
                m = decode(state["exp_avg"][codes], state["exp_avg_scales"][scales], signed)
                v = decode(state["exp_avg_sq"][codes], state["exp_avg_sq_scales"][scales], unsigned)
            else:  # views of the float32 states, updated in place
                m, v = state["exp_avg"][start:end], state["exp_avg_sq"][start:end]
            g = grad[start:end].float()
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = (m / correction1).div_(v.sqrt().div_(correction2 ** 0.5).add_(eps))
            flat[start:end] = flat[start:end].float().sub_(update, alpha=lr)
            if state["quantized"]:  # encoded back into the same bytes
                state["exp_avg"][codes], state["exp_avg_scales"][scales] = encode(m, signed_bounds)
                state["exp_avg_sq"][codes], state["exp_avg_sq_scales"][scales] = encode(v, unsigned_bounds)


def train_step(model, optimizer, inputs, labels, device, accum_steps):  # gradient accumulation
    """One optimizer step on one batch; returns the loss."""
    # gradient accumulation: equal micro-batches, one at a time; their gradients add up in .grad
    micro_size = len(labels) // accum_steps
    micro_batches = split_batch(inputs, labels, micro_size)
    batch_loss = 0.0
    for micro_inputs, micro_labels in micro_batches:
        micro_inputs = to_device(micro_inputs, device, DTYPE)  # bf16-true: bfloat16 images
        micro_labels = micro_labels.to(device, non_blocking=True)
        loss = model(**micro_inputs, labels=micro_labels).loss / len(micro_batches)  # mean over the batch
        loss.backward()
        batch_loss += loss.detach().float()  # the record's loss, summed in float32
    optimizer.step()
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
    optimizer = AdamW4bit(model.parameters(), lr=args.lr or preset.lr)  # 4-bit AdamW

    # the peak of the first steps, by what it holds (--memory-snapshot: on CUDA, their history)
    meter = MemoryMeter(device, model, optimizer, snapshot=args.memory_snapshot)
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
