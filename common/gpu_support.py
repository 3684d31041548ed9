"""What the GPU a run trains on supports, checked once the model is on it (MemoryMeter does,
before the first step): bfloat16 needs compute capability 8.0 (A100, RTX 30xx and later).

On a V100 (7.0) or a T4 (7.5) PyTorch still runs bfloat16 tensors, emulated in float32 arithmetic:
the memory is that of bfloat16, the time far longer, and torch.compile's Inductor leaves such code
to eager mode (with a warning that it skips bfloat16 compilation, which is easy to miss). Steps
03 on hold bfloat16 weights; 02 (float16 autocast) is the step such a GPU runs fast.
"""
import warnings

import torch

BFLOAT16_CAPABILITY = (8, 0)


def without_bfloat16_hardware(device):
    """The compute capability of `device` when it is a GPU without bfloat16 hardware, else None."""
    if device.type != "cuda" or torch.version.hip:  # every ROCm GPU has it (as torch says)
        return None
    capability = torch.cuda.get_device_capability(device)
    return capability if capability < BFLOAT16_CAPABILITY else None


def check_bfloat16(device, model, compiled):
    """Warn when a model with bfloat16 weights trains on a GPU without bfloat16 hardware; stop a
    compiled one there (it would run eager while the record says compiled)."""
    if not any(parameter.dtype == torch.bfloat16 for parameter in model.parameters()):
        return
    capability = without_bfloat16_hardware(device)
    if capability is None:
        return
    gpu = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
    if compiled:
        raise SystemExit(f"error: --compile with bfloat16 weights on {gpu}: Inductor does not "
                         "compile bfloat16 code for a GPU below 8.0 and would run it eager. Run "
                         "without --compile, or use 02_mixed_precision.py (float16), which this "
                         "GPU runs in hardware")
    warnings.warn(f"{gpu} has no bfloat16 hardware: this step's bfloat16 runs emulated, in the "
                  "memory of bfloat16 but far slower. 02_mixed_precision.py (float16 autocast) "
                  "is the step this GPU runs fast", stacklevel=3)
