"""What a CUDA GPU does differently from this CPU, written down in one place for the estimate.

The estimate (estimate/) runs a script on fake CPU tensors, because autograd on fake
CUDA tensors aborts a CPU-only build. Where a GPU would take another path, the choice is made
here, explicitly, as PyTorch 2.13 (the version pinned here) makes it on an A100:

- Host and device: on a CPU they are one memory; on a GPU, batches and a model built on the
  host take GPU memory only once `.to(device)` copies them. The fake run keeps the host side on
  the meta device (fake/stand_ins.py), so those copies happen and are counted.
- Attention kernel, by dtype and GPU (`--gpu`, A100 by default): on compute capability 8.0 and
  later (A100, H100) float16/bfloat16 run flash attention, float32 runs the memory-efficient
  kernel (the first candidates of scaled_dot_product_attention). Below 8.0 (V100, T4) there is
  no flash attention, and the memory-efficient kernel takes float16 and float32 only: bfloat16
  falls to the math path, which keeps the whole attention matrix for backward (sdp_utils.cpp:
  check_flash_attention_hardware_support, check_dtypes_mem_efficient). For backward flash and
  memory-efficient keep their inputs, their output and a float32 log-sum-exp per query row;
  the memory-efficient kernel pads the rows to a multiple of 32. The CPU's kernel keeps a
  log-sum-exp of another shape, hence the switch (`gpu_attention`).
- Attention without a mask (packed texts, --pack): transformers asks for is_causal. Flash
  attention reads grouped key and value heads as they are (Llama, Mistral, Qwen2: enable_gqa);
  the memory-efficient kernel takes no grouped heads, so where flash does not run (float32, or
  below 8.0) a grouped model falls to the math path, which repeats them and, being causal, makes a
  mask and scores of length x length: at long lengths only flash (half types on 8.0 and later)
  holds nothing of that size.
- Attention with a padding mask (text): flash attention takes no mask, so every dtype runs the
  memory-efficient kernel. scaled_dot_product_attention first turns transformers' boolean mask
  into an additive one of the query's dtype, one (batch, 1, queries, keys) tensor per layer
  (`torch.where`), padded to a multiple of 8 keys when needed; the kernel keeps it for backward.
  Architectures whose attention is their own code (BLOOM's "eager") run the same operators on
  both devices and need no switch.
- Dropout in training: on CUDA, ATen's dropout runs the fused native_dropout, which keeps a
  one-byte mask for backward; on the CPU it multiplies by a noise tensor of the input's dtype
  and keeps that, four bytes an element in float32 (Dropout.cpp, is_fused_kernel_acceptable).
  The fake run takes CUDA's path (`dropout_as_on_cuda`, fake/patches.py).
- Optimizers: with foreach=None on CUDA tensors, the torch.optim optimizers that ask
  `_default_to_fused_or_foreach` (Adam, AdamW, SGD, ...) take their foreach implementation (on
  the CPU, the for-loop one); Adafactor never asks, and runs its single-tensor path on both.
  Foreach Adam holds one temporary the size of all parameters at once (the square root of the
  second moment; the June 2023 build the study used held two); the for-loop one, one
  parameter's worth (`foreach_as_on_cuda`).
- Allocation rounding: every block is a multiple of 512 bytes (`ALLOCATION_GRANULE`, replay/allocator.py).
- The caching allocator: freed blocks stay reserved and are reused by later requests that fit,
  so `max_memory_reserved` exceeds `max_memory_allocated` by the allocator's fragmentation
  (`CachingAllocatorModel` in replay/allocator.py).
- cuBLAS workspaces: each (thread, stream) pair that runs a matrix multiplication gets one from
  the caching allocator and keeps it: forward on the main thread, backward on autograd's
  device thread (`CUBLAS_WORKSPACES`), of 8.125 MiB each, or 32 MiB from Hopper on
  (`Gpu.cublas_workspace_bytes`).
- Offload: with FSDP2's CPUOffloadPolicy the sharded parameters, their gradients and the
  optimizer state live in host memory; only what is gathered or computed is on the GPU
  (`HOST_CATEGORIES_WHEN_OFFLOADED`).

Left out, each under 1% of a step's peak at the article preset: autocast's op lists differ
between CPU and CUDA, but in a ViT the ops whose policy differs (layer_norm, cat) see float32
inputs anyway, so every dtype matches; Adam's per-parameter `step` counters live on the host on
CUDA (a few hundred 4-byte tensors, here on the device); kernel workspaces that are never
tensors (flash attention's float32 gradient accumulator in backward, cuBLASLt's 1 MiB per matmul
with bias) are not seen. Not seen either, of a size that depends on the algorithm cuDNN picks
on the GPU: the workspace of the patch-embedding convolution.

Left out for the sharded steps (07 on): FSDP's collectives run on CUDA streams of their own,
whose cached blocks the real allocator keeps apart, and an offloaded shard is copied to the GPU
before it is gathered (here the copy is a no-op); the model treats it all as one stream and no
copy, so for these steps the reserved figure leans low.
"""
import argparse
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple  # CUDA compute capability: what kernels and dtypes run in hardware
    multiprocessors: int  # SMs: bitsandbytes' 4-bit matmul picks its kernel by them (fake/four_bit.py)

    @property
    def cublas_workspace_bytes(self):
        """One cuBLAS workspace: 32 MiB on Hopper and later (capability 9 to 12), else
        CUBLAS_WORKSPACE_CONFIG's ":4096:2:16:8" (CublasHandlePool.cpp's default; an H200 showed
        the 47.75 MiB that two workspaces of the difference make)."""
        return 4096 * 8 * 1024 if 9 <= self.capability[0] <= 12 else CUBLAS_WORKSPACE_BYTES

    @property
    def flash_attention(self):
        """Compute capability 8.0 or later: flash attention for half types, and the
        memory-efficient kernel for bfloat16 too (below it, bfloat16 takes the math path)."""
        return self.capability >= (8, 0)


class ReadGpu:
    """A Gpu whose properties a run reads are noted in `read` ({name: value}): what of the GPU
    entered a fake run's trace, so that a kept trace serves every GPU alike in those
    (estimate/shortcuts/cache.py). The replay's own choices (the cuBLAS workspace) are not a run's."""

    def __init__(self, gpu):
        self._gpu, self.read = gpu, {}

    def __getattr__(self, name):
        value = getattr(self._gpu, name)
        self.read[name] = kept_value(value)
        return value


def kept_value(value):
    """A GPU property as kept in JSON (a tuple as a list)."""
    return list(value) if isinstance(value, tuple) else value


def reads_match(read, gpu):
    """Whether `gpu` (a Gpu) has every value a run read of its GPU ({name: value}, ReadGpu's)."""
    return all(kept_value(getattr(gpu, name, None)) == value for name, value in read.items())


GPUS = {"a100": Gpu("A100", (8, 0), 108), "h100": Gpu("H100", (9, 0), 132),  # H100: SXM
        "v100": Gpu("V100", (7, 0), 80), "t4": Gpu("T4", (7, 5), 40)}
DEFAULT_GPU = "a100"  # the study's GPU


def nearest_gpu(capability):
    """The key of GPUS whose compute capability is `capability`'s, else the nearest below it
    (the newest whose kernels it has), else the oldest: an H200 (9.0) is estimated as an H100."""
    below = [key for key, gpu in GPUS.items() if gpu.capability <= tuple(capability)]
    if not below:
        return min(GPUS, key=lambda key: GPUS[key].capability)
    return max(below, key=lambda key: GPUS[key].capability)


def wants_cuda_emulation(argv):
    """--device cpu asks for the CPU itself (no GPU emulation); anything else predicts a GPU."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default="auto")
    known, _ = parser.parse_known_args(argv)
    return known.device != "cpu"


def gpu_problem(name, emulated=True):
    """What is wrong with --gpu `name` (None: not given), in words that say what to do, or None."""
    if name is None:
        return None
    if not emulated:
        return f"--gpu {name} names the GPU to emulate: leave --device cpu out"
    if name not in GPUS:
        return f"--gpu {name}: the GPUs emulated are {', '.join(sorted(GPUS))}"
    return None


CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8", before Hopper
CUBLAS_WORKSPACES = 2                 # forward (main thread) and backward (autograd's thread)

GPU_ATTENTION = "gpu_kernels"  # the transformers attention implementations registered below, one per GPU

# MemTracker's and FSDPMemTracker's categories that live in host memory under CPU offload
HOST_CATEGORIES_WHEN_OFFLOADED = frozenset({"Sharded Param", "Sharded Grad", "OptState"})


MEMORY_EFFICIENT_MASK_ALIGNMENT = 8  # keys, as scaled_dot_product_attention pads the mask


def gpu_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  gpu=GPUS[DEFAULT_GPU], **kwargs):
    """transformers attention on the kernel CUDA would pick on `gpu`: flash for half types
    without a mask, else the memory-efficient kernel (with a padding mask as its additive bias),
    else the math path.

    Calls the CUDA kernels' own aten operators, after the steps scaled_dot_product_attention
    takes on CUDA first; on fake tensors they run their shape functions, so autograd keeps
    exactly what the CUDA kernels keep for backward.
    """
    half = query.dtype in (torch.float16, torch.bfloat16)
    flash = attention_mask is None and half and gpu.flash_attention
    # without a mask (packed texts, --pack) transformers asks for is_causal, and for grouped
    # heads (Llama, Mistral, Qwen2) passes enable_gqa: flash reads the key and value heads as
    # they are, the memory-efficient kernel takes no grouped heads (sdp_utils.cpp), and the
    # math path repeats them; with a mask transformers repeats them itself (use_gqa_in_sdpa)
    causal = kwargs.get("is_causal")  # as sdpa_attention_forward reads it
    causal = attention_mask is None and query.shape[2] > 1 and (
        getattr(module, "is_causal", True) if causal is None else causal)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and not flash:
        from transformers.integrations.sdpa_attention import repeat_kv
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    compute_log_sum_exp = torch.is_grad_enabled() and any(
        tensor.requires_grad for tensor in (query, key, value))
    efficient = (query.dtype in (torch.float16, torch.float32) or gpu.flash_attention) and (
        attention_mask is not None or groups == 1)
    if flash:
        output = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout, causal, False, scale=scaling)[0]
    elif efficient:
        bias = None if attention_mask is None else additive_mask(attention_mask, query, key)
        output = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, compute_log_sum_exp, dropout, causal, scale=scaling)[0]
    else:  # bfloat16 below 8.0, or grouped heads without a mask off flash: the math path (the
        # mask as sdpa converts it, unpadded; is_causal makes one of length x length itself)
        bias = None if attention_mask is None else additive_mask(attention_mask, query, key,
                                                                 padded=False)
        output = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, bias, dropout, causal, scale=scaling)[0]
    return output.transpose(1, 2).contiguous(), None  # (batch, tokens, heads, head size), as sdpa's


def additive_mask(mask, query, key, padded=True):
    """The bias scaled_dot_product_attention gives the memory-efficient kernel for a boolean mask
    (convert_boolean_attn_mask, then preprocess_mask): 0 where attended, -inf elsewhere, in the
    query's dtype; for that kernel (`padded`) padded to a multiple of 8 keys unless already
    aligned, while the math path takes it as it is; expanded over heads."""
    if mask.dtype == torch.bool:
        minus_infinity = torch.full((), float("-inf"), dtype=query.dtype, device=query.device)
        mask = torch.where(mask, 0.0, minus_infinity)
    aligned = not padded or mask.stride(-1) == 1 and all(
        stride % MEMORY_EFFICIENT_MASK_ALIGNMENT == 0 for stride in mask.stride()[:-1])
    if not aligned:
        keys = mask.shape[-1]
        padding = MEMORY_EFFICIENT_MASK_ALIGNMENT - keys % MEMORY_EFFICIENT_MASK_ALIGNMENT
        mask = torch.nn.functional.pad(mask, (0, padding))[..., :keys]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def register_gpu_attention(gpu):
    """Register `gpu_attention` on `gpu` (a Gpu, or the ReadGpu of a run), and with it sdpa's
    masks (without a registered mask function transformers would pass it none); returns the name
    a model asks for it by."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    name = f"{GPU_ATTENTION}_{'sm80' if gpu.flash_attention else 'sm70'}"  # (what it reads)
    AttentionInterface.register(name, functools.partial(gpu_attention, gpu=gpu))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def foreach_as_on_cuda(params, differentiable, use_fused=False):
    """`_default_to_fused_or_foreach` as it answers for CUDA tensors: foreach, never fused."""
    return False, not differentiable and not torch.jit.is_scripting()
