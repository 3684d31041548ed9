"""07b QLoRA: 07a with the frozen weights of the adapted layers stored in 4 bits (NF4).

Each adapted layer's frozen weight is kept in bitsandbytes' 4-bit NormalFloat (a scale per block
of 64 weights): about 0.52 bytes per weight instead of bfloat16's 2, turned back into bfloat16
for each product, a layer at a time. The adapters, the head and every other weight train as in
07a. It needs bitsandbytes (requirements.txt pins it).

  python %(prog)s                                  # tiny preset: offline, about 30 s on a laptop CPU
  python %(prog)s --preset article                 # the study: ViT-L/16 on CIFAR-10 (GPU and network)
  python %(prog)s --preset tiny-text               # text: a pretrained MiniLM on movie reviews
  python %(prog)s --estimate                       # predict peak GPU memory without a GPU
"""
import math
import sys  # LoRA: its note goes to standard error

import torch
from transformers.pytorch_utils import Conv1D  # LoRA: GPT-2's linear layers, weights transposed

# --estimate runs main() on fake tensors with stand-ins for these names (no data, no download):
# keep importing them by name. The list and the reasons: estimate/contract.py.
from common.cli import parse_args, positive_int  # gradient accumulation: for its flag
from common.cli import positive_float  # LoRA: for its flag
from common.data import load_data, split_batch, to_device
from common.evaluate import evaluate
from common.launch import train_or_estimate
from common.memory import MemoryMeter, measure_creation
from common.model import classification_head, create_model, transformer_blocks
from common.presets import preset_for
from common.progress import Progress
from common.quirks import keep_training_layout
from common.summary import report

try:  # QLoRA: 4-bit layers from bitsandbytes (requirements.txt pins it)
    from bitsandbytes.nn import Linear4bit, Params4bit
except ImportError as error:
    raise SystemExit(f"error: 07b needs bitsandbytes' Linear4bit ({error}). Install it with "
                     "pip install bitsandbytes==0.50.2 (as requirements.txt pins), or use 07a.")

DTYPE = torch.bfloat16  # bf16-true: weights, gradients, optimizer state and activations


class LoRALinear(torch.nn.Module):  # LoRA
    """`base` (a linear layer, frozen) plus a trainable low-rank update: base(x) + s * B(A(x))."""

    def __init__(self, base, rank, alpha):
        super().__init__()
        inputs, outputs = base.weight.shape if isinstance(base, Conv1D) else base.weight.shape[::-1]
        self.base, self.scale = base, alpha / rank
        # made uninitialised where creation runs (the GPU): A is drawn on the CPU, as the model's
        # own weights are, so that a run starts from the same adapters on every device
        here = dict(bias=False, dtype=DTYPE, device=torch.get_default_device())
        self.down = torch.nn.utils.skip_init(torch.nn.Linear, inputs, rank, **here)  # A: random
        self.up = torch.nn.utils.skip_init(torch.nn.Linear, rank, outputs, **here)  # B: zero at first
        drawn = torch.empty(rank, inputs, dtype=DTYPE, device="cpu")
        torch.nn.init.kaiming_uniform_(drawn, a=math.sqrt(5))
        with torch.no_grad():
            self.down.weight.copy_(drawn)
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.scale * self.up(self.down(x))


def in_four_bits(layer):  # QLoRA
    """The frozen linear `layer` (or GPT-2's Conv1D) as a Linear4bit: its weight quantized to
    NF4 as it is moved onto its device, its products computed in bfloat16."""
    weight = layer.weight.T if isinstance(layer, Conv1D) else layer.weight  # outputs x inputs
    four_bit = Linear4bit(weight.shape[1], weight.shape[0], bias=layer.bias is not None,
                          compute_dtype=DTYPE, quant_type="nf4", device="meta")
    four_bit.weight = Params4bit(weight.contiguous(), requires_grad=False, quant_type="nf4",
                                 blocksize=64, compress_statistics=True, module=four_bit)
    four_bit.bias = layer.bias  # frozen, in bfloat16
    keep_training_layout(four_bit)  # on CPUs with AVX512-BF16 too (common/quirks.py)
    return four_bit.to(weight.device)  # quantized here; the bfloat16 weight is freed with `layer`


def add_adapters(model, rank, alpha, targets=None):  # LoRA
    """Freeze `model`, put an adapter on each linear layer of its blocks (those named in
    `targets`, if given) and train the adapters and a classifier's new head; returns the names."""
    model.requires_grad_(False)
    found = sorted({name.rpartition(".")[2] for block in transformer_blocks(model)  # the names
                    for name, module in block.named_modules()  # --lora-targets may take
                    if isinstance(module, (torch.nn.Linear, Conv1D))})
    adapted = []
    for block in transformer_blocks(model):
        for name, module in list(block.named_modules()):
            parent, _, attribute = name.rpartition(".")
            if isinstance(module, (torch.nn.Linear, Conv1D)) and attribute in (targets or [attribute]):
                width = min(module.weight.shape)  # B A's rank is at most the layer's narrower side
                if rank > width:
                    shape = " x ".join(map(str, module.weight.shape))
                    raise SystemExit(f"error: --lora-rank {rank} is larger than the layer {name!r} (a "
                                     f"{shape} weight): its update cannot have a rank above {width}, "
                                     "and adapters that large hold more weights than the layer. Use "
                                     f"a --lora-rank well below {width} (8 by default)")
                setattr(block.get_submodule(parent), attribute, LoRALinear(module, rank, alpha))
                adapted.append(attribute)
    unknown = sorted(set(targets or ()) - set(adapted))  # (a name misspelled among right ones too)
    if unknown:  # say the names there are
        raise SystemExit(f"error: no linear layer in the model's blocks is named {' or '.join(unknown)}; "
                         f"theirs are named {' '.join(found)}: --lora-targets takes those")
    if not adapted:
        raise SystemExit("error: the model's blocks have no linear layer for LoRA to "
                         "adapt (a convolutional network's have none): train it with 06_on_device_init.py")
    classification_head(model).requires_grad_(True)  # a new head (a classifier's) trains in full
    return sorted(set(adapted))


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
        with torch.device(device):  # on-device init: tensors made in here go to the device
            model = create_model(preset, dtype=DTYPE)  # on-device init, bf16-true: never float32
            add_adapters(model, args.lora_rank, args.lora_alpha, args.lora_targets)  # LoRA
    for adapter in [module for module in model.modules() if isinstance(module, LoRALinear)]:  # QLoRA
        adapter.base = in_four_bits(adapter.base)  # one layer at a time
    if preset.model is None:  # a model drawn at random has nothing worth keeping frozen
        print("note: this model is trained from scratch, so LoRA's frozen weights are random: the "
              "run shows LoRA's memory, not its accuracy (use --preset tiny-text)", file=sys.stderr)
    if args.compile:  # fused kernels, generated by the first call (seconds to minutes), then reused
        for block in transformer_blocks(model):  # each block on its own (torchtitan's way), so
            block.compile()  # each block's backward hands back its gradients as it ends
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]  # LoRA
    optimizer = torch.optim.Adam(trained, lr=args.lr or preset.qlora_lr)  # QLoRA: a lower rate

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
    parser.add_argument("--lora-rank", type=positive_int, default=8,  # LoRA: its flags
                        help="the adapters' rank r (default: 8)")
    parser.add_argument("--lora-alpha", type=positive_float, default=16.0,
                        help="the adapters' scale is alpha / r (default: 16)")
    parser.add_argument("--lora-targets", nargs="+", metavar="NAME",
                        help="adapt only the linear layers of these names (query value; "
                             "q_proj v_proj); default: every linear layer of the blocks")


def main(argv=None):
    args = parse_args(__doc__, argv, flags=own_flags)  # gradient accumulation: its flag
    return train_or_estimate(train, args, __file__, argv)  # --estimate: predicted instead (estimate/)


if __name__ == "__main__":
    from common.cli import run_main  # Ctrl-C: one line instead of a traceback
    run_main(main)
