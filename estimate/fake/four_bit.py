"""bitsandbytes' 4-bit weights (07b's Linear4bit and Params4bit) on fake tensors.

Params4bit is a tensor subclass made around a real tensor, so a fake tensor cannot become one.
The estimate gives a script that imports the two names these stand-ins (run.py puts them
where the script's own names were): the weight is a plain frozen parameter that carries
Params4bit's attributes, and is quantized when its layer is moved to its device by bitsandbytes'
own `quantize_4bit`, on fake tensors. So it holds exactly the tensors bitsandbytes stores (the
packed weight, two per byte; a scale per block of 64 weights, itself quantized to one byte
against float32 scales per 256 blocks, with their offset and their code tables) and forward and
backward are bitsandbytes' own `Linear4bit.forward` and `matmul_4bit`. Its kernels are custom
operators, of which fake tensors run the shape functions bitsandbytes registers: what an
operator allocates inside itself is not seen, only what it returns.

On the CPU that is what MemTracker counts in a real run: the CPU's `gemm_4bit` dequantizes the
weight inside the operator, out of MemTracker's sight, in forward; backward dequantizes it in
Python (`dequantize_4bit`, a bfloat16 copy of the weight), in sight. On a GPU the caching
allocator sees everything: CUDA's `gemm_4bit` either runs a fused kernel that holds no copy, or
(for more rows than its kernel is worth, as in training) dequantizes the weight into a bfloat16
temporary and calls `linear`; `dequantized_on_gpu` adds that temporary, chosen by bitsandbytes'
own rule for the emulated GPU.
"""
import ast
import functools
from contextlib import contextmanager, nullcontext
from pathlib import Path

import bitsandbytes
import torch
from bitsandbytes import functional
from bitsandbytes.nn import Linear4bit as BitsandbytesLinear4bit

from estimate import gpu_choices
from estimate.shortcuts import sizes

CUDA_OPS = Path(bitsandbytes.__file__).parent / "backends" / "cuda" / "ops.py"


ATTRIBUTES = ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage",
              "bnb_quantized", "module")  # Params4bit's own, which its code and bitsandbytes' read


def Params4bit(data=None, requires_grad=False, quant_state=None, blocksize=None,  # noqa: N802
               compress_statistics=True, quant_type="fp4", quant_storage=torch.uint8, module=None,
               bnb_quantized=False, **kwargs):
    """bitsandbytes' Params4bit (same arguments) as a plain parameter with its attributes."""
    parameter = torch.nn.Parameter(torch.empty(0) if data is None else data,
                                   requires_grad=requires_grad)
    values = (blocksize or 64, compress_statistics, quant_type, quant_state, quant_storage,
              bnb_quantized, module)
    for name, value in zip(ATTRIBUTES, values):
        setattr(parameter, name, value)
    return parameter


def quantized(weight, device):
    """`weight` (a stand-in Params4bit) in 4 bits, as Params4bit._quantize makes it."""
    packed, state = functional.quantize_4bit(
        weight.data.contiguous().to(device), blocksize=weight.blocksize,
        compress_statistics=weight.compress_statistics, quant_type=weight.quant_type,
        quant_storage=weight.quant_storage)
    return Params4bit(packed, weight.requires_grad, state, weight.blocksize,
                      weight.compress_statistics, weight.quant_type, weight.quant_storage,
                      weight.module, bnb_quantized=True)


def make_code_table_for_real():
    """bitsandbytes keeps the 8-bit code table of its nested scales in a global, made on first
    use: made by a fake run it would be a fake tensor, which a later real run cannot read."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    if "dynamic" not in functional.name2qmap:
        with unset_fake_temporarily():
            functional.name2qmap["dynamic"] = functional.create_dynamic_map()


class Linear4bit(BitsandbytesLinear4bit):
    """bitsandbytes' Linear4bit (same arguments, its own forward) around a stand-in Params4bit."""

    on_gpu = False  # emulating CUDA: add what its gemm_4bit allocates beside its output
    gpu = None  # the emulated GPU (gpu_choices.GPUS' value) whose rule picks gemm_4bit's kernel

    def __init__(self, input_features, output_features, bias=True, compute_dtype=None,
                 compress_statistics=True, quant_type="fp4", quant_storage=torch.uint8,
                 device=None):
        torch.nn.Linear.__init__(self, input_features, output_features, bias, device)
        self.weight = Params4bit(self.weight.data, requires_grad=False, quant_type=quant_type,
                                 compress_statistics=compress_statistics,
                                 quant_storage=quant_storage, module=self)
        self.compute_dtype, self.compute_type_is_set = compute_dtype, compute_dtype is not None
        self.quant_state, self.quant_storage = None, quant_storage
        # CPUs with AVX512-BF16 repack the weight for inference, in evaluation: not estimated
        self.support_avx512bf16_for_cpu = False

    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type != "meta" and not self.weight.bnb_quantized:
            make_code_table_for_real()
            self.weight = quantized(self.weight, device)  # as Params4bit.to: where it goes
            self.quant_state = self.weight.quant_state
        return super().to(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        # Module._apply swaps a fake parameter for a new one, without its attributes
        attributes = {name: getattr(self.weight, name) for name in ATTRIBUTES}
        super()._apply(fn, recurse)
        for name, value in attributes.items():
            setattr(self.weight, name, value)
        return self

    def forward(self, x):
        with dequantized_on_gpu(self, x) if self.on_gpu else nullcontext():
            return super().forward(x)


def stand_ins(emulate_cuda, gpu=gpu_choices.GPUS[gpu_choices.DEFAULT_GPU]):
    """The stand-ins for the names a script imports from bitsandbytes.nn, by name; `gpu` the
    emulated GPU (a value of gpu_choices.GPUS), whose kernel rule the forward follows."""
    return {"Params4bit": Params4bit,
            "Linear4bit": type("Linear4bit", (Linear4bit,), {"on_gpu": emulate_cuda, "gpu": gpu})}


@contextmanager
def dequantized_on_gpu(layer, x):
    """While inside: what CUDA's gemm_4bit holds beside its output when it does not take its
    fused kernel (backends/cuda/ops.py, _dequant_linear_fallback): the nested scales in float32
    and with their offset added, and the weight in the compute dtype; freed as it returns."""
    state = layer.weight.quant_state
    rows, (outputs, inputs) = x.numel() // x.shape[-1], state.shape
    dtype = layer.compute_dtype or x.dtype
    sizes.note_choice("bitsandbytes' 4-bit matmul kernel, chosen by its rows")
    if fused_on_gpu(rows, outputs, inputs, state.blocksize, dtype, layer.gpu):
        yield
        return
    held = []
    if state.nested:
        held.append(torch.empty_like(state.absmax, dtype=torch.float32))
        held.append(held[-1] + state.offset)
    held.append(torch.empty(state.shape, dtype=dtype, device=x.device))
    try:
        yield
    finally:
        held.clear()


def fused_on_gpu(rows, outputs, inputs, blocksize, dtype, gpu):
    """Whether CUDA's gemm_4bit runs its fused kernel (no dequantized copy) for `rows` rows
    times an outputs x inputs weight on the emulated GPU: its kernel's rule, which leaves more
    rows than _gemm_4bit_custom_max_m or inputs not in whole blocks to dequantize-then-linear,
    and asks bitsandbytes' per-architecture rule for the rest."""
    rule = cuda_rule(gpu.multiprocessors, tuple(gpu.capability))
    if rows > rule["_gemm_4bit_custom_max_m"] or inputs % blocksize:
        return False
    return rule["_gemm_4bit_use_custom_cuda"](0, dtype, rows, outputs, inputs)


@functools.cache
def cuda_rule(multiprocessors, capability):
    """bitsandbytes' CUDA dispatch rule, read from its source (the module imports only where
    CUDA is), with the emulated GPU's multiprocessors and compute capability in place of the
    device's: {name: value} of its module-level constants and functions that the rule uses."""
    tree = ast.parse(CUDA_OPS.read_text())
    wanted = {"_GEMM_4BIT_CUSTOM_FLOOR_M", "_gemm_4bit_custom_max_m", "_gemm_4bit_use_custom_cuda"}
    nodes = []
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "torch.version.hip is None":
            node = node.body  # the CUDA side of `if torch.version.hip is None:`
        for each in node if isinstance(node, list) else [node]:
            names = ({target.id for target in each.targets if isinstance(target, ast.Name)}
                     if isinstance(each, ast.Assign) else {getattr(each, "name", None)})
            if names & wanted:
                nodes.append(each)
    rule = {"torch": torch, "functools": functools,
            "_gpu_dispatch_props": lambda index: (multiprocessors, *capability)}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(CUDA_OPS), "exec"), rule)  # noqa: S102
    missing = wanted - set(rule)
    if missing:
        raise RuntimeError(f"{CUDA_OPS} no longer defines {', '.join(sorted(missing))}: the "
                           "estimate reads bitsandbytes' CUDA rule from it (estimate/fake/four_bit.py)")
    return rule
