"""07b's estimate: bitsandbytes' 4-bit weights stood in for on fake tensors (estimate/fake/four_bit.py).

The stand-in holds the tensors bitsandbytes stores, byte for byte (on the CPU 07b's estimate equals
its run's peak and breakdown to the byte on every architecture: tests/scripts/test_architectures.py); on a
GPU, forward also holds the bfloat16 copy of
the weight that CUDA's gemm_4bit makes where it does not run its fused kernel.
"""
from contextlib import contextmanager

import pytest
import torch
from bitsandbytes import functional
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from common.memory import FrozenWeightsMemTracker
from common.model import quantization_tensors
from conftest import load_script
from estimate.fake.four_bit import fused_on_gpu, stand_ins
from estimate.fake.patches import swappable_fake_parameters
from estimate.gpu_choices import GPUS

# outputs x inputs: whole blocks of 64; a part block and scales not in whole groups of 256
# (10,280 weights: 161 blocks); an odd number of weights (one byte holds half a pair)
SHAPES = [(128, 128), (257, 40), (3, 5)]


@contextmanager
def fake_tensors():
    """Fake tensors, whose parameters `Module.to()` may swap, as in the estimate's run."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, swappable_fake_parameters(mode):
        yield


def held(weight):
    """Each tensor a 4-bit weight holds (the packed weight, then its quantization state's):
    shape, dtype and the bytes of its storage."""
    return [(tuple(tensor.shape), tensor.dtype, tensor.untyped_storage().nbytes())
            for tensor in [weight, *quantization_tensors(weight)]]


def four_bit_layer(outputs, inputs, names=None):
    """07b's own in_four_bits on a bfloat16 linear layer: with bitsandbytes' classes, or with
    `names` (the stand-ins) in their place."""
    script = load_script("07b")
    vars(script).update(names or {})
    return script.in_four_bits(torch.nn.Linear(inputs, outputs, dtype=torch.bfloat16))


@pytest.mark.parametrize("outputs, inputs", SHAPES)
def test_the_stand_in_holds_the_tensors_bitsandbytes_stores(outputs, inputs, monkeypatch):
    real = held(four_bit_layer(outputs, inputs).weight)
    assert len(real) == 6  # packed weight; 8-bit scales, code, offset; float32 scales, their code
    monkeypatch.delitem(functional.name2qmap, "dynamic")  # as before bitsandbytes' first use
    with fake_tensors():
        fake = four_bit_layer(outputs, inputs, stand_ins(emulate_cuda=False)).weight
        assert isinstance(fake, FakeTensor) and held(fake) == real
    # the table of codes bitsandbytes keeps for later quantizations stays a real tensor
    assert not isinstance(functional.name2qmap["dynamic"], FakeTensor)


def forward_peak(on_gpu, rows, outputs=512, inputs=128):
    """The peak bytes MemTracker counts in a stand-in Linear4bit's forward of `rows` rows."""
    with fake_tensors():
        layer = four_bit_layer(outputs, inputs, stand_ins(emulate_cuda=on_gpu))
        x = torch.empty(rows, inputs, dtype=torch.bfloat16)
        with FrozenWeightsMemTracker() as tracker:  # the meter's: it takes frozen weights
            layer(x)
        return tracker.get_tracker_snapshot("peak")[x.device]["Total"]


def test_on_a_gpu_forward_holds_the_dequantized_weight_where_the_fused_kernel_does_not_run():
    outputs, inputs, rows = 512, 128, 2048  # more rows than bitsandbytes' fused kernel takes
    blocks = outputs * inputs // 64
    copy = 2 * outputs * inputs + 2 * 4 * blocks  # the bfloat16 weight; its scales in float32, twice
    assert forward_peak(True, rows) - forward_peak(False, rows) == copy
    assert forward_peak(True, rows=2) == forward_peak(False, rows=2)  # fused: no copy


def test_the_kernel_is_chosen_by_bitsandbytes_own_rule_for_each_gpu():
    bfloat16 = torch.bfloat16
    for gpu in GPUS.values():
        assert fused_on_gpu(2, 4096, 4096, 64, bfloat16, gpu)  # a few rows: always fused
        assert not fused_on_gpu(2048, 4096, 4096, 64, bfloat16, gpu)  # training's many rows
        assert not fused_on_gpu(8, 4096, 4000, 64, bfloat16, gpu)  # inputs not in whole blocks
    # a short wide weight (128 inputs, 512 outputs), 1,024 rows: fused on an A100, not an H100
    assert fused_on_gpu(1024, 512, 128, 64, bfloat16, GPUS["a100"])
    assert not fused_on_gpu(1024, 512, 128, 64, bfloat16, GPUS["h100"])
