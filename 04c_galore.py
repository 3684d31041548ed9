"""04c GaLore: 04a with Adam's moments kept for a low-rank projection of the blocks' gradients.

Every weight trains in full, stepped in backward as in 04a, but each 2-D weight of the blocks is
stepped by Adam on its gradient G projected onto r singular vectors of a recent one, on its
narrower side (R = P^T G, or G P^T), the moments R's size; the step, projected back and scaled,
goes to the whole weight (Zhao et al., ICML 2024). The projection is made again every
--galore-gap steps, the moments kept. --galore-8bit: the moments in 8 bits (bitsandbytes).

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import math  # GaLore: the bias corrections

import torch

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args, refused  # optimizer in backward: refused, for a flag
from common.cli import positive_float, positive_int  # GaLore: for its flags
from common.data import load_data, to_device
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import create_model, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.summary import report

try:  # GaLore: --galore-8bit steps with bitsandbytes' 8-bit Adam (requirements.txt pins it)
    from bitsandbytes import functional as bnb
except ImportError as error:  # --galore-8bit then refused, saying why
    bnb = None
    NO_BITSANDBYTES = f"--galore-8bit needs bitsandbytes ({error}): pip install bitsandbytes==0.50.2"

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


def galore_ranks(model, rank):  # GaLore: the weights it projects, each with its rank
    """{weight: rank} for each 2-D weight of the model's blocks: `rank`, or a quarter of its narrower
    side (the authors' rank for their 60M, 350M and 7B models: 128 of 512 ... 1,024 of 4,096)."""
    weights = [weight for block in transformer_blocks(model) for weight in block.parameters()
               if weight.ndim == 2]
    if not weights:
        raise SystemExit("error: the model's blocks have no 2-D weight for GaLore to project (a "
                         "convolutional network's are 4-D): train it with 04a_optimizer_in_backward.py")
    narrowest = min(min(weight.shape) for weight in weights)
    if rank and rank > narrowest:
        raise SystemExit(f"error: --galore-rank {rank} is above {narrowest}, the narrower side of the "
                         "blocks' narrowest 2-D weight, which has no more singular vectors: use at "
                         f"most {narrowest}, or leave it out")
    return {weight: rank or max(1, min(weight.shape) // 4) for weight in weights}


def projection(gradient, rank, left):  # GaLore: the gradient's top singular vectors, in its dtype
    u, _, vh = torch.linalg.svd(gradient.float(), full_matrices=False)  # float32, as the authors'
    return (u[:, :rank] if left else vh[:rank]).to(gradient.dtype, copy=True)  # those r alone


class GaLoreAdam(torch.optim.Optimizer):  # GaLore
    """The authors' GaLoreAdamW, weight decay 0: a weight whose group has a rank is stepped in its
    projection, made every `gap` steps, the step projected back times `scale`; any other as Adam.
    `eight_bit`: moments of 4,096 numbers or more in 8 bits (their GaLoreAdamW8bit). The states
    are made here, so that the first step, which makes the projections, holds what later ones do."""

    def __init__(self, params, lr, gap=200, scale=0.25, eight_bit=False, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, dict(lr=lr, rank=None, gap=gap, scale=scale, eight_bit=eight_bit,
                                      betas=betas, eps=eps))
        for group in self.param_groups:
            for weight in group["params"]:
                self.state[weight] = self.zeros(weight, group["rank"], group["eight_bit"])

    @staticmethod
    def zeros(weight, rank, eight_bit):  # the states as Adam's first step would make them
        state, shape = dict(step=0), weight.shape  # the moments': the weight's, or R's
        if rank:
            rows, columns = weight.shape
            state["left"] = rows < columns  # the narrower side projected, as galore-torch does
            shape = (rank, columns) if state["left"] else (rows, rank)
            state["projector"] = weight.new_zeros((rows, rank) if state["left"] else (rank, columns))
        if not (eight_bit and math.prod(shape) >= 4096):  # in the weights' dtype
            return dict(state, exp_avg=weight.new_zeros(shape), exp_avg_sq=weight.new_zeros(shape))
        for moment, signed in ((1, True), (2, False)):  # 8-bit codes, a float32 scale per 256 (05a's)
            state[f"state{moment}"] = torch.zeros(shape, dtype=torch.uint8, device=weight.device)
            state[f"absmax{moment}"] = torch.zeros(-(-math.prod(shape) // 256), device=weight.device)
            state[f"qmap{moment}"] = bnb.create_dynamic_map(signed=signed).to(weight.device)
        return state

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is not None:
                    self.step_weight(weight, weight.grad, self.state[weight], group)

    def step_weight(self, weight, gradient, state, group):
        (beta1, beta2), lr, rank = group["betas"], group["lr"], group["rank"]
        stepped = weight  # what Adam's step is added to: the weight, or (projected) a zero R
        if rank:
            if state["step"] % group["gap"] == 0:  # a new subspace; the moments are kept
                state["projector"] = projection(gradient, rank, state["left"])
            projector = state["projector"]
            gradient = projector.T @ gradient if state["left"] else gradient @ projector.T  # R
            stepped = torch.zeros_like(gradient)
        state["step"] += 1
        if "state1" in state:  # 8 bits: bitsandbytes' Adam decodes, updates and encodes them
            bnb.optimizer_update_8bit_blockwise(  # (its CUDA kernel reads them in memory's order)
                "adam", gradient.contiguous(), stepped, state["state1"], state["state2"], beta1,
                beta2, 0.0, 0.0, group["eps"], state["step"], lr, state["qmap1"], state["qmap2"],
                state["absmax1"], state["absmax2"])
        else:  # the authors' Adam: eps added to the second moment's root before its correction
            state["exp_avg"].mul_(beta1).add_(gradient, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
            step_size = lr * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
            stepped.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]),
                             value=-step_size)
        if rank:  # back to the weight's shape, scaled, added by one product (no temporary its size)
            weight.addmm_(*((projector, stepped) if state["left"] else (stepped, projector)),
                          alpha=group["scale"])


def train_step(model, inputs, labels, device):  # optimizer in backward: no optimizer here
    """One optimizer step on one batch; returns the loss."""
    inputs, labels = to_device(inputs, device, DTYPE), labels.to(device, non_blocking=True)  # bf16-true
    loss = model(**inputs, labels=labels).loss  # its own loss: over classes, or next tokens
    loss.backward()  # optimizer in backward: every weight is updated, and its gradient freed, in here
    batch_loss = loss.detach().float()  # the record's loss, in float32 (03's is bfloat16)
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
    # optimizer in backward, GaLore: one per weight, stepped by a hook once its gradient is complete:
    # the blocks' 2-D weights in their projection, the others as Adam
    ranks = galore_ranks(model, args.galore_rank)
    optimizers = {param: GaLoreAdam([dict(params=[param], rank=ranks.get(param))], lr=args.lr or preset.lr,
                                    gap=args.galore_gap, scale=args.galore_scale, eight_bit=args.galore_8bit)
                  for param in model.parameters()}

    def step_and_free(param):  # optimizer in backward: update this weight now, free its gradient
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    for param in model.parameters():  # optimizer in backward
        param.register_post_accumulate_grad_hook(step_and_free)

    # the peak of the first steps, by what it holds (--memory-snapshot: on CUDA, their history)
    meter = MemoryMeter(device, model, list(optimizers.values()),  # optimizer in backward: them all
                        snapshot=args.memory_snapshot)
    progress = Progress(total_steps)  # progress lines, the losses and the training clock
    model.train()
    for epoch in range(args.epochs):
        for inputs, labels in data.train:
            with meter.step():
                loss = train_step(model, inputs, labels, device)  # optimizer in backward
            progress.step(epoch, loss)
            if progress.steps == total_steps:
                break
        progress.epoch(epoch, args.epochs, evaluate(model, data.val, device, DTYPE))  # bf16-true
        if progress.steps == total_steps:
            break
    test_score = evaluate(model, data.test, device, DTYPE)  # bf16-true: bfloat16 inputs
    return report(args, __file__, creation, meter, progress, test_score)


def own_flags(parser):  # optimizer in backward: --accum-steps refused, beside common/cli.py's flags
    parser.add_argument("--accum-steps", action=refused(
        "04c steps each weight during backward, so it cannot accumulate gradients over "  # GaLore: 04c
        "micro-batches; for --accum-steps use 10_combined.py --optimizer galore"))
    # GaLore: its flags, with the authors' defaults (their runs of LLaMA 60M to 7B)
    parser.add_argument("--galore-rank", type=positive_int,
                        help="singular vectors kept (default: a quarter of each weight's narrower side)")
    parser.add_argument("--galore-gap", type=positive_int, default=200,
                        help="optimizer steps from one projection to the next (default: 200)")
    parser.add_argument("--galore-scale", type=positive_float, default=0.25,
                        help="the factor on the step projected back (default: 0.25)")
    parser.add_argument("--galore-8bit", action=refused(NO_BITSANDBYTES) if bnb is None else "store_true",
                        help="the moments in 8 bits, stepped by bitsandbytes' 8-bit Adam")


def main(argv=None):
    args = parse_args(__doc__, argv, flags=own_flags)  # optimizer in backward, GaLore: its flags
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
