"""Helpers shared by the tests: load a numbered script as a module and run its main()."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.estimate.script_import import import_script  # noqa: E402 (needs the path above)

# Tests that check what a CPU run counts pin the CPU, also on a machine with CUDA; the tests
# that only a GPU can answer are marked `requires_cuda` and skipped, with the reason, elsewhere.
CPU = ["--device", "cpu"]
QUICK = ["--epochs", "1", "--max-steps", "2", *CPU]  # the memory peak is reached within two steps
TEXT = ["--preset", "tiny-text"]
# tiny-text's train/validation/test sizes in tests: two batches to train on, quick evaluations
SMALL_SNIPPET_SPLITS = (64, 32, 32)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU; this machine has none")
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                       reason="needs 2 CUDA GPUs; this machine has fewer")


def script_path(name):
    matches = sorted(ROOT.glob(f"{name}*.py"))
    if not matches:
        raise FileNotFoundError(f"no script {name}*.py in {ROOT}")
    return matches[0]


def load_script(name):
    """Import e.g. '04' (04_grad_accum.py) as a fresh module object."""
    return import_script(script_path(name))


def model_state_bytes(breakdown):
    """A breakdown's parameters, gradients and optimizer state: what the per-parameter figure
    counts, named here apart from the code that computes it."""
    return breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]


class Captured:
    """What a run built: its MemoryMeter sees the model and the optimizer."""
    meter = None


def run_script(name, args, results_dir, module=None):
    """Run a script's main() in this process; returns (record, captured model and optimizer)."""
    module = module or load_script(name)
    captured = Captured()
    meter_class = module.MemoryMeter

    class CapturingMeter(meter_class):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            captured.meter = self

    module.MemoryMeter = CapturingMeter
    device = [] if "--device" in args else CPU  # a CPU run unless the test asks otherwise
    record = module.main([*args, *device, "--results-dir", str(results_dir)])
    return record, captured.meter


@pytest.fixture
def small_snippets(monkeypatch):
    """tiny-text trains and evaluates on SMALL_SNIPPET_SPLITS in this test."""
    import common.data
    monkeypatch.setattr(common.data, "SNIPPET_SPLITS", SMALL_SNIPPET_SPLITS)


@pytest.fixture(scope="session")
def quick_runs(tmp_path_factory):
    """One quick run of each single-device step: (its record, its meter), shared by the tests
    that only read them."""
    results = tmp_path_factory.mktemp("quick")
    return {name: run_script(name, QUICK, results) for name in ["01", "02", "03", "04", "05", "06"]}


@pytest.fixture(scope="session")
def quick_records(quick_runs):
    return {name: record for name, (record, _) in quick_runs.items()}
