"""Benchmark: the compute that activation checkpointing adds, counted, not timed.

  python benchmarks/recompute_flops.py [--presets tiny tiny-text article imdb] [--budgets 1 0.5 0.25 0]

For each preset it runs one forward and backward of one micro-batch (04's: the preset's batch
over 04's --accum-steps) on fake tensors (shapes without values, as the estimate runs a script,
so no weights, data or GPU are needed), under PyTorch's FlopCounterMode, once with the model as
04 trains it and once each with its transformer blocks wrapped as 05c (and 09) and as 05d wrap
them. It prints the floating-point operations of forward, of 04's backward and of 05c's and
05d's, and what each adds as a share of the forward: the recomputation. 05c's share is below 1
where PyTorch's non-reentrant checkpoint stops recomputing a block once it has recreated the last
tensor backward needs (the work after it, such as a block's last matrix product, is not redone).
05d keeps the outputs of the matrix products and attention, the operators FlopCounterMode counts,
so what it recomputes (element-wise and normalisation operators) counts as none: its cost is in
memory traffic, seen in its time, not in FLOPs.

Then, for 05k (the compiler's memory budget), the same micro-batch compiled at each --budgets
value through AOTAutograd's partition on fake tensors (estimate/compiled.py): the activations its
forward saves for backward, and what its backward recomputes as a share of the forward.
"""
import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.model import model_class, model_config, transformer_blocks  # noqa: E402
from common.presets import PRESETS, is_text  # noqa: E402
from estimate.fake.patches import FakeModeReadingZeros  # noqa: E402
from steps import STEPS, import_script  # noqa: E402


def micro_batch(preset, size):
    """Inputs and labels of `size` samples of `preset`, as fake tensors (shapes only)."""
    labels = torch.zeros(size, dtype=torch.long)
    if is_text(preset):
        shape = (size, preset.max_length)
        return dict(input_ids=torch.zeros(shape, dtype=torch.long),
                    attention_mask=torch.ones(shape, dtype=torch.long)), labels
    images = torch.empty(size, 3, preset.image_size, preset.image_size,
                         dtype=torch.bfloat16)
    return dict(pixel_values=images), labels


def counted(function):
    with FlopCounterMode(display=False) as counter:
        result = function()
    return counter.get_total_flops(), result


def forward_backward_flops(preset, size, wrapped_as=None):
    """(forward FLOPs, backward FLOPs) of one micro-batch of `size`: 04's model, or with its
    blocks wrapped as the script of step `wrapped_as` ("05c", "05d") wraps them."""
    with FakeModeReadingZeros(allow_non_fake_inputs=True):
        return fake_forward_backward_flops(preset, size, wrapped_as)


def fake_forward_backward_flops(preset, size, wrapped_as):
    model = model_class(preset)._from_config(model_config(preset), dtype=torch.bfloat16)
    if wrapped_as:
        wrapper = import_script(STEPS[wrapped_as].path).CheckpointedBlock
        blocks = transformer_blocks(model)
        for index, block in enumerate(blocks):
            blocks[index] = wrapper(block)
    model.train()
    inputs, labels = micro_batch(preset, size)
    forward, loss = counted(lambda: torch.nn.functional.cross_entropy(model(**inputs).logits, labels))
    backward, _ = counted(loss.backward)
    return forward, backward


def budget_partitions(preset, size, budgets):
    """{budget: estimate.compiled.Partition} of one micro-batch of `size`, 05k's model compiled."""
    from estimate.compiled import partition
    with FakeModeReadingZeros(allow_non_fake_inputs=True):
        model = model_class(preset)._from_config(model_config(preset), dtype=torch.bfloat16)
        model.train()
        inputs, labels = micro_batch(preset, size)
        return {budget: partition(model, inputs, labels, budget) for budget in budgets}


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS),
                        default=["tiny", "tiny-text", "article", "imdb"])
    parser.add_argument("--budgets", nargs="*", type=float, default=[1.0, 0.75, 0.5, 0.25, 0.0],
                        help="05k's memory budgets to partition at (none: skip)")
    args = parser.parse_args(argv)
    accum_steps = STEPS["04"].accum_steps
    print("| preset | micro-batch | forward GFLOP | backward, 04 | backward, 05c | recomputed / forward, "
          "05c | 05c / 04, forward and backward | recomputed / forward, 05d |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.presets:
        preset = PRESETS[name]
        size = preset.batch_size // accum_steps
        forward, plain = forward_backward_flops(preset, size)
        _, checkpointed = forward_backward_flops(preset, size, "05c")
        _, selective = forward_backward_flops(preset, size, "05d")
        print(f"| {name} | {size} | {forward / 1e9:,.2f} | {plain / 1e9:,.2f} | "
              f"{checkpointed / 1e9:,.2f} | {(checkpointed - plain) / forward:.2f} | "
              f"{(forward + checkpointed) / (forward + plain):.2f}x | "
              f"{(selective - plain) / forward:.2f} |", flush=True)
    if not args.budgets:
        return
    print("\n| preset | micro-batch | 05k budget | saved for backward MiB | recomputed / forward |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in args.presets:
        preset = PRESETS[name]
        size = preset.batch_size // accum_steps
        found = budget_partitions(preset, size, sorted(set(args.budgets) | {1.0}, reverse=True))
        unbudgeted = found[1.0].forward_flops + found[1.0].backward_flops
        for budget in args.budgets:
            each = found[budget]
            recomputed = each.forward_flops + each.backward_flops - unbudgeted
            print(f"| {name} | {size} | {budget:g} | {each.saved_bytes / 2**20:,.2f} | "
                  f"{recomputed / each.forward_flops:.2f} |", flush=True)


if __name__ == "__main__":
    main()
