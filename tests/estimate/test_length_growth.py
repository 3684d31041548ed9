"""Tensors of length x length: the estimate finds them by comparing runs at two lengths
(estimate/length_growth.py), and the attention it emulates at long lengths (packed texts, no
mask) is the kernel CUDA picks (estimate/gpu_choices.py)."""
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from estimate import length_growth
from estimate.check import estimate
from estimate.gpu_choices import GPUS, gpu_attention
from estimate.length_growth import LengthWatch, at_length, squares
from steps import STEPS
from support.architecture_matrix import model_flags, write_model

CAUSAL_LM = ["--task", "causal-lm", "--batch-size", "8"]


def flags_for(name, tmp_path, *extra):
    folder = write_model(tmp_path / re.sub(r"\W", "", name.lower()), name)
    return [*model_flags(folder, name), *CAUSAL_LM, *extra]


def found(name, tmp_path, *extra, gpu="a100"):
    """{(function, dimensions): shape} of the squares of 04's run of `name` at 64 tokens."""
    flags = at_length(flags_for(name, tmp_path, *extra), 64)
    return {(square.function, square.dims): square.shape
            for square in squares(STEPS["04"].path, flags, gpu=gpu)}


def test_a_padded_batch_makes_a_mask_of_length_x_length_and_a_packed_one_none(tmp_path):
    """Llama with padded texts: the mask its sdpa path builds, (batch, 1, 64, 64), seen at 32
    tokens too; packed (--pack), on an A100: flash attention with is_causal, nothing."""
    padded = found("Llama", tmp_path)
    assert padded[("where", (2, 3))] == (2, 1, 64, 64)  # the micro-batch's 2 texts
    assert found("Llama", tmp_path, "--pack") == {}


def test_attention_in_a_models_own_code_or_on_the_math_path_is_found_too(tmp_path):
    """BLOOM's attention is its own code (scores of batch x heads x length x length) even when
    packed; a grouped-query Llama packed on a V100 (no flash attention; the memory-efficient
    kernel takes no grouped heads) runs the math path, whose attention weights are as large."""
    assert ("baddbmm", (1, 2)) in found("BLOOM", tmp_path, "--pack")
    assert found("Llama", tmp_path, "--pack", gpu="v100") == {
        ("_scaled_dot_product_attention_math", (2, 3)): (2, 2, 64, 64)}


def test_a_tensor_only_broadcast_over_the_length_or_made_once_is_not_a_square():
    """A stride of 0 holds no memory; a view is its base's; the length must match in both runs."""
    watch = LengthWatch(8)
    with watch:
        row = torch.ones(1, 8)
        row.expand(8, 8)  # broadcast: no memory of 8 x 8
        torch.zeros(8, 8)[:, :]  # the zeros count, the view does not
        torch.zeros(8, 3)
    assert watch.found == {("zeros", (0, 1)): ((8, 8), "float32", 256)}


class Kernels(TorchFunctionMode):
    """The attention operators called, with their key's shape."""

    def __init__(self):
        super().__init__()
        self.called = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if "attention" in getattr(func, "__name__", ""):
            self.called.append((func.__name__.split(".")[0], tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("gpu, mask, dtype, kernel, key_heads", [
    ("a100", False, torch.bfloat16, "_scaled_dot_product_flash_attention", 2),  # enable_gqa
    ("a100", True, torch.bfloat16, "_scaled_dot_product_efficient_attention", 8),
    ("a100", False, torch.float32, "_scaled_dot_product_attention_math", 8),  # grouped: no efficient
    ("v100", False, torch.bfloat16, "_scaled_dot_product_attention_math", 8),
    ("v100", False, torch.float16, "_scaled_dot_product_attention_math", 8),
])
def test_the_kernel_each_gpu_runs_for_grouped_heads_with_and_without_a_mask(gpu, mask, dtype,
                                                                            kernel, key_heads):
    """8 query heads over 2 key and value heads: without a mask transformers passes enable_gqa
    and flash reads the 2 as they are; the memory-efficient kernel takes no grouped heads, so
    without flash the math path runs, the heads repeated; with a mask transformers repeats them
    first."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    with FakeTensorMode():
        query = torch.empty(1, 8, 16, 32, dtype=dtype, requires_grad=True)
        key, value = (torch.empty(1, 2, 16, 32, dtype=dtype, requires_grad=True) for _ in "kv")
        attention_mask = torch.ones(1, 1, 16, 16, dtype=torch.bool) if mask else None
        with Kernels() as kernels:
            output, _ = gpu_attention(module, query, key, value, attention_mask, gpu=GPUS[gpu])
    assert output.shape == (1, 16, 8, 32)
    assert kernels.called[-1] == (kernel, (1, key_heads, 16, 32))


def test_an_estimate_with_a_length_says_what_grows_as_its_square(tmp_path, capsys):
    flags = flags_for("Llama", tmp_path, "--seq-len", "32", "--device", "cpu")
    estimate(str(STEPS["04"].path), [*flags, "--results-dir", str(tmp_path)])
    said = capsys.readouterr().out
    assert "length x length         tensors with two dimensions of the length" in said
    assert "__and__: bool (2, 1, 32, 32)" in said  # transformers' mask, on the CPU
    estimate(str(STEPS["04"].path), [*flags, "--pack", "--results-dir", str(tmp_path)])
    assert "length x length         none" in capsys.readouterr().out


@pytest.mark.parametrize("argv, world_size, half", [
    (["--seq-len", "65536"], 1, 32769),  # odd: no width of a model
    (["--seq-len", "65536", "--sequence-parallel"], 8, 32776),  # a slice of 4,097 a process
])
def test_the_second_length_is_about_half_and_splits_over_the_processes(argv, world_size, half,
                                                                        monkeypatch):
    asked = []
    monkeypatch.setattr(length_growth, "watched",
                        lambda script, argv, length, world, gpu: asked.append(length) or {})
    assert length_growth.squares("10_combined.py", argv, world_size) == []
    assert asked == [65536, half]
