"""GPUs without bfloat16 hardware (V100: 7.0, T4: 7.5), faked on a CPU: a warning, and --compile
refused with bfloat16 weights (Inductor would skip the frame and run it eager)."""
import warnings

import pytest
import torch

from common.gpu_support import check_bfloat16

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of the capability the test sets (nothing here touches a real one)."""
    found = {"capability": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: found["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.version, "hip", None)
    return found


def model(dtype):
    return torch.nn.Linear(4, 4, dtype=dtype)


@pytest.mark.parametrize("capability", [(7, 0), (7, 5)])
def test_bfloat16_weights_on_a_gpu_below_8_warn_and_point_to_02(gpu, capability):
    gpu["capability"] = capability
    with pytest.warns(UserWarning, match=r"compute capability 7\.\d\) has no bfloat16 hardware.*02_"):
        check_bfloat16(CUDA, model(torch.bfloat16), compiled=False)


def test_compile_with_bfloat16_weights_on_a_gpu_below_8_is_refused(gpu):
    gpu["capability"] = (7, 0)
    with pytest.raises(SystemExit, match="--compile with bfloat16 weights on Tesla V100"):
        check_bfloat16(CUDA, model(torch.bfloat16), compiled=True)


@pytest.mark.parametrize("device, dtype, capability", [
    (CUDA, torch.bfloat16, (8, 0)), (CUDA, torch.bfloat16, (9, 0)),
    (CUDA, torch.float32, (7, 0)), (CUDA, torch.float16, (7, 5)),  # 01, 02 on a V100 or T4
    (torch.device("cpu"), torch.bfloat16, (7, 0))])
def test_nothing_is_said_where_bfloat16_runs_in_hardware_or_is_not_used(gpu, device, dtype,
                                                                        capability):
    gpu["capability"] = capability
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_bfloat16(device, model(dtype), compiled=True)
