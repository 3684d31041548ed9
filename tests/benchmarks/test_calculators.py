"""benchmarks/calculators.py: the calculators' rules as their sources write them, and its rows as
the published figures they compare with. No estimate runs here (the benchmark's main() runs them)."""
import importlib.util

import pytest

from common.cli import parse_args
from conftest import ROOT, load_script
from estimate.records import STUDY_RESERVED_GB
from steps import STEPS

spec = importlib.util.spec_from_file_location("calculators", ROOT / "benchmarks" / "calculators.py")
calculators = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calculators)


def tiny_config():
    from common.model import model_config
    from common.presets import PRESETS
    return model_config(PRESETS["tiny"])


def test_accelerate_trains_with_adam_in_4x_the_weights_bytes():
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModel

    with init_empty_weights():
        model = AutoModel.from_config(tiny_config(), dtype=torch.float32)
    weights = 4 * sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    size, adam = calculators.accelerate_estimate_memory(tiny_config(), "float32")
    assert (size, adam) == (weights, 4 * weights)
    size, adam = calculators.accelerate_estimate_memory(tiny_config(), "float16")
    assert (size, adam) == (weights / 2, 4 * weights / 2)
    assert calculators.accelerate_estimate_memory(tiny_config(), "bfloat16") == (size, adam)
    with pytest.raises(ValueError, match="int8"):
        calculators.accelerate_estimate_memory(tiny_config(), "int8")


def test_deepspeed_formulas_give_its_documented_examples():
    # memory.html: 2851M parameters, 8 GPUs, nothing offloaded: 15.93 GB (ZeRO-2), and 6.09 GB
    # with 32M in the largest layer (ZeRO-3); DeepSpeed prints GiB
    assert round(calculators.deepspeed_zero2_gpu_bytes(2851e6, num_gpus=8) / 2**30, 2) == 15.93
    assert round(calculators.deepspeed_zero3_gpu_bytes(2851e6, 32e6, num_gpus=8) / 2**30, 2) == 6.09
    params = 335_143_938
    # one GPU: 20 bytes per parameter, as the code writes it since #5099 (2 + 18 / GPUs)
    assert calculators.deepspeed_zero2_gpu_bytes(params) == 20 * params == 2 * params + 18 * params
    assert calculators.deepspeed_zero3_gpu_bytes(params, 1000) == 18 * params + 4000


def test_the_bytes_per_parameter_rule_has_both_ends():
    assert calculators.bytes_per_parameter_rule(10) == (160, 180)


def test_the_study_rows_are_the_published_figures():
    rows = calculators.study_rows()
    assert {(row.script, row.batch_size, row.accum_steps): row.measured_gb
            for row in rows} == STUDY_RESERVED_GB


def test_the_transformers_rows_leave_out_the_cuda_context():
    measured = [round(row.measured_gb, 2) for row in calculators.transformers_rows()]
    assert measured == [14.27, 7.69, 13.21]  # (14949, 8681, 13939 MiB) - 1343 MiB, in GB
    assert not {row.model for row in calculators.transformers_rows()} - {"bert"}


def test_every_row_runs_a_script_with_flags_it_takes(tmp_path):
    for row in calculators.rows():
        words = row.command()
        step = STEPS[words[0].split("_")[0]]
        assert step.path.name == words[0]
        args = parse_args("", [*words[1:], "--device", "cpu", "--results-dir", str(tmp_path)],
                          flags=getattr(load_script(step.id), "own_flags", None))
        assert (args.batch_size, args.estimate) == (row.batch_size, True)


def test_weight_dtypes_are_read_from_the_scripts():
    assert [calculators.weight_dtype(script) for script in
            ("01_baseline", "02_mixed_precision", "03_bf16", "04_grad_accum", "05_sgd_cosine")] == \
        ["float32", "float32", "bfloat16", "bfloat16", "bfloat16"]


def test_closest_is_the_ratio_nearest_one():
    assert calculators.closest({"a": 0.8, "b": 1.15, "c": 3.0}) == "b"
