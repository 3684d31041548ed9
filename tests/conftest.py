"""Helpers shared by the tests: load a numbered script as a module and run its main(), or run
a sharded step in processes of its own."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# Two test workers on two cores each run PyTorch's two OpenMP threads: threads that wait for
# their turn sleep instead of spinning on the cores the other worker's threads need (as many
# threads, so the same sums). Set before torch loads OpenMP; the scripts the tests start
# inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimate.collector import frozen  # noqa: E402 (needs the path above)
from steps import STEPS, import_script  # noqa: E402

# every estimate is computed (tests change what an estimate runs); tests/estimate/test_cache.py
# turns the kept estimates on where it tests them
os.environ["ESTIMATE_CACHE"] = "0"

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


def script_path(step):
    """The script of step `step` ("04", "05a"), as steps.py finds it."""
    return STEPS[step].path


def load_script(name):
    """Import e.g. '04' (04_grad_accum.py) as a fresh module object."""
    return import_script(script_path(name))


def unevaluated(name):
    """A script loaded with its evaluation skipped (as the estimate skips it), for the tests
    whose claim is in the training steps: on a CPU without bfloat16 arithmetic the evaluation of
    tiny-text's batches takes longer than its two steps."""
    module = load_script(name)
    module.evaluate = lambda *args, **kwargs: float("nan")
    return module


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


# fixtures that train (or estimate) once and are shared by the tests that only read what they made
SHARED_ACROSS_MODULES = {"quick_runs", "quick_records", "runs", "trained", "compiled"}
SHARED_IN_A_MODULE = {"probed_runs", "unsharded", "estimated_once", "every_prefix", "between",
                      "predicted", "two_process_runs"}


def pytest_configure(config):
    # pytest 9 ignores the group that xdist 3.8 adds to a grouped test's id: every test would be
    # sent anywhere, and each worker would make every shared run (and a module's, once per visit)
    if config.getoption("dist", "no") == "loadgroup" and int(pytest.__version__.split(".")[0]) >= 9:
        raise pytest.UsageError(f"pytest {pytest.__version__} ignores xdist's groups (--dist "
                                "loadgroup, pytest.ini): install requirements-dev.txt's pins")


# `pytest -m quick`: a test of each claim the README makes, within 3 minutes on 2 cores, for the
# edit-and-test loop (the README's test command runs them all). Each claim names tests by the
# start of their ids; tests/repository/test_layout.py checks that each names one.
QUICK_SUBSET = {
    "a step is its parent plus one technique, its lines tagged": (
        "tests/repository/test_layout.py::test_every_changed_block_opens_with_its_steps_tag[03-04]",
        "tests/repository/test_layout.py::test_the_readme_lists_every_tag",
        "tests/scripts/test_registry.py::test_a_branch_starts_from_the_parent_of_its_step"),
    "each technique does what it says": (
        "tests/scripts/test_steps.py::test_accumulated_gradient_equals_the_whole_batch_gradient[tiny]",
        "tests/scripts/test_steps.py::test_sgd_keeps_no_state_and_cosine_ends_at_zero",
        "tests/scripts/test_steps.py::test_bf16_true_keeps_parameters_and_optimizer_state_in_bfloat16"),
    "every run prints and records its peak, time and score": (
        "tests/scripts/test_steps.py::test_written_record_matches_returned_one",),
    "--estimate predicts a run's peak without a GPU": (
        "tests/estimate/test_estimate.py::test_the_recorded_order_replays_to_memtrackers_own_peak",
        "tests/estimate/test_cache.py::test_what_the_gpu_emulation_reads_is_what_it_keeps"),
    "--gpu-memory finds the largest batch that fits; asked again, from kept runs": (
        "tests/estimate/test_sizes.py::test_a_later_question_between_the_sizes_run",
        "tests/estimate/test_fit.py::test_the_search_finds_the_largest_that_fits_from_any_first_guess"),
    "the stack: the first prefix of the chain that fits": (
        "tests/estimate/test_stack.py::test_the_cost_model_orders_the_links_within_their_group",),
    "the combined script holds every technique behind a switch": (
        "tests/scripts/test_combined.py::test_every_technique_tag_is_in_the_combined_script",
        "tests/scripts/test_combined.py::test_every_definition_of_the_appendix_is_its_scripts_or_says_why"),
    "the calculators people use, beside the estimate": (
        "tests/benchmarks/test_calculators.py::test_accelerate_trains_with_adam_in_4x_the_weights_bytes",),
    "language models: evaluation and the chunked loss": (
        "tests/scripts/test_causal_lm.py::test_evaluation_runs_a_piece_of_a_batch_at_a_time",),
    "a copied script needs only common/": (
        "tests/repository/test_layout.py::test_copying_a_script_lists_what_each_script_imports",),
    "the tour's report": ("tests/tour/test_tour.py::test_report_table_rows_ratios_and_failures",),
    "the chapters' links and commands": (
        "tests/repository/test_docs.py::test_every_relative_link_resolves",
        "tests/repository/test_docs.py::test_the_readme_is_a_landing_page_that_links_every_chapter"),
    "no library warning a user cannot act on": (
        "tests/common/test_library_warnings.py::test_memtrackers_own_warnings_are_silenced_and_no_other",),
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups marked here
def pytest_collection_modifyitems(items):
    """Two worker processes (pytest.ini: --dist loadgroup) would each make a shared fixture once:
    the tests that read one are sent to one worker, so that it is made once. The tests
    QUICK_SUBSET names are marked `quick`."""
    quick = tuple(start for starts in QUICK_SUBSET.values() for start in starts)
    for item in items:
        if item.nodeid.startswith(quick):
            item.add_marker(pytest.mark.quick)
        names = set(item.fixturenames)
        if names & SHARED_ACROSS_MODULES:
            item.add_marker(pytest.mark.xdist_group("quick-runs"))
        elif names & SHARED_IN_A_MODULE:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


COLLECT_EVERY = 8  # tests; what earlier tests left in reference cycles waits at most this long
tests_started = 0


@pytest.fixture(autouse=True)
def earlier_objects_frozen():
    """A run collects garbage before it measures creation (common/memory.py), and a full
    collection scans every object Python tracks: about 0.25 s in a worker that has imported
    torch, transformers and the scripts, two or three times per run and estimate. What lives as
    a test starts is frozen, so its collections scan only what the test makes; thawed after it
    (unless a module's block holds it frozen: estimate/collector.py).
    Every COLLECT_EVERY tests a full collection first frees what earlier tests left."""
    global tests_started
    collect = tests_started % COLLECT_EVERY == 0
    tests_started += 1
    with frozen(collect):
        yield


@pytest.fixture(autouse=True)
def memory_budget_restored():
    """05k and 10's --checkpointing budget:F set the compiler's activation memory budget for the
    process; a test that runs either in-process leaves the next one the default (1.0)."""
    import torch._functorch.config
    before = torch._functorch.config.activation_memory_budget
    yield
    torch._functorch.config.activation_memory_budget = before


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


# Steps 07-09 under torchrun, through tests/support/fsdp_probe.py (more in
# tests/scripts/test_distributed.py): 2 tracked steps and one more; whole batches (no
# micro-batches), so that the activations checkpointing saves outweigh the few hundred KiB by
# which the collectives' buffers vary
SHARDED_RUN = ["--epochs", "1", "--max-steps", "3", "--device", "cpu", "--accum-steps", "1"]
WORLD_SIZE = 2
LAUNCH_TIMEOUT = 150  # seconds for one group of processes; far above a normal run
PROBED_TEST_TIMEOUT = 2 * LAUNCH_TIMEOUT + 60  # a test may start two runs (08 and 09)


def assert_follows(actual, expected, preset_name="tiny", what="losses"):
    """`actual` (losses, or gradients) computed as `expected` was, in float32, but with its sums
    in another order (two processes, compiled kernels, another resharding): equal within what
    rounding of a forward and backward of the preset's model over one batch can produce, scaled
    by the largest of the compared values (tests/support/rounding.py)."""
    from common.model import model_config
    from common.presets import PRESETS
    from support.rounding import additions, assert_same_sum
    preset = PRESETS[preset_name]
    tokens = preset.max_length or (preset.image_size // preset.config["patch_size"]) ** 2 + 1
    expected, actual = torch.as_tensor(expected), torch.as_tensor(actual)
    assert actual.shape == expected.shape, what
    if expected.numel() == 0:  # a process's empty shard of a small parameter
        return
    assert_same_sum(actual, expected, expected.abs().max(),
                    additions(model_config(preset), preset.batch_size * tokens), what=what)


def stop(process):
    """End a process we started and everything it started: torchrun ends its workers on SIGTERM."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_to_end(command, env=None, timeout=LAUNCH_TIMEOUT):
    """Run `command` from the repository's root; returns (exit code, output). Fails on a hang."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s, so killed: {' '.join(map(str, command))}")
    finally:
        stop(process)  # also when pytest-timeout interrupts the wait
    return process.returncode, output


def launched_runs(root, runs, timeout, meanwhile=None, processes=WORLD_SIZE):
    """Each of `runs` ([name, script id, argv]) in one torchrun launch of `processes` processes
    (tests/support/sharded_runs.py: starting torchrun and the Pythons is most of a small run's
    time), `meanwhile(step, argv)` called for each as it runs (an estimate): {name: (its record,
    or the words its script stopped with; what `meanwhile` gave; each process's [empty tensors,
    empty tensors with a gradient] of each optimizer step)}."""
    (root / "runs.json").write_text(json.dumps(runs))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", "tests/support/sharded_runs.py", root / "out",
               root / "runs.json"]
    with open(root / "output.txt", "w") as output:
        launch = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            beside = {name: meanwhile and meanwhile(step, argv) for name, step, argv in runs}
            launch.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s, so killed")
        finally:
            stop(launch)
    assert launch.returncode == 0, (root / "output.txt").read_text()
    outcomes = {}
    for name, _, _ in runs:
        folder = root / "out" / name
        stopped = folder / "stopped.txt"
        record = stopped.read_text() if stopped.exists() else json.loads(next(
            path for path in folder.glob("*.json") if not path.name.endswith("-steps.json")).read_text())
        outcomes[name] = (record, beside[name],
                          [json.loads((folder / f"rank{rank}-steps.json").read_text())
                           for rank in range(processes)])
    return outcomes


class ProbedRun:
    """One torchrun run of a step in float32: its JSON record and what each process noted."""

    def __init__(self, out_dir):
        self.record = json.loads(next((out_dir / "results").glob("*.json")).read_text())
        self.ranks = [json.loads((out_dir / f"rank{rank}.json").read_text())
                      for rank in range(WORLD_SIZE)]
        self.gradients = [torch.load(out_dir / f"grads_rank{rank}.pt")  # of the third step
                          for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def probed_runs(tmp_path_factory):
    """probed_runs("07") runs 07 once per test module, on first use."""
    runs = {}

    def run(name, extra=(), timeout=LAUNCH_TIMEOUT):
        key = (name, *extra)
        if key not in runs:
            out_dir = tmp_path_factory.mktemp(f"run{name}")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={WORLD_SIZE}", "tests/support/fsdp_probe.py", out_dir, name,
                       *SHARDED_RUN, *extra, "--results-dir", out_dir / "results"]
            code, output = run_to_end(command, timeout=timeout)
            assert code == 0, output
            runs[key] = ProbedRun(out_dir)
        return runs[key]
    return run


def one_process_fp32(name, results_dir, extra=()):
    """A step run as one plain process, in this one, in float32; returns its record."""
    script = load_script(name)
    script.DTYPE = torch.float32
    return run_script(name, [*SHARDED_RUN, *extra], results_dir, module=script)[0]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """06 in float32 as one process: the same step on one device, without sharding."""
    return one_process_fp32("06", tmp_path_factory.mktemp("run06"))


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """runs(name, flags, float32=False): the step's run, made once (per test worker)
    and shared by the tests that only read it: (its record, its meter). float32: the script's
    DTYPE made float32, so that runs that differ only in the order or timing of the work can be
    compared closely."""
    made = {}

    def run(name, flags=QUICK, float32=False):
        key = (name, tuple(flags), float32)
        if key not in made:
            module = load_script(name)
            if float32:
                module.DTYPE = torch.float32
            made[key] = run_script(name, flags, tmp_path_factory.mktemp(name), module)
        return made[key]
    return run


def assert_trains_as(branch, parent, runs):
    """`branch` and `parent` run in float32 (only the order or the timing of the work differs):
    the same losses and weights, within rounding."""
    (ours, our_meter), (theirs, their_meter) = (runs(name, float32=True) for name in (branch, parent))
    assert_follows(ours["losses"], theirs["losses"])
    for mine, other in zip(our_meter.model.parameters(), their_meter.model.parameters(), strict=True):
        assert_follows(mine.detach(), other.detach(), what="parameters")
