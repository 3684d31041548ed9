"""--compile: a compiled model trains as the eager one does, and its memory is still measured.

Compiling takes tens of seconds on a CPU, so each compiled run here is made once and shared by
the tests that read it.
"""
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch._dynamo.utils import counters

from common.breakdown import fold_breakdown
from common.cli import compiler_problem, parse_args
from common.compiled_memory import AllocationTracker
from common.memory import device_snapshot
from common.model import transformer_blocks
from conftest import CPU, PROBED_TEST_TIMEOUT, QUICK, assert_follows, load_script, run_script, script_path
from estimate import estimate
from estimate.compiled import within_bound

# two epochs of tiny (19 steps each) cut short: train, validate, train again, validate, test
COMPILED = ["--compile", "--epochs", "2", "--max-steps", "21", *CPU]
COMPILED_LAUNCH_TIMEOUT = 400  # two processes compiling on two cores


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """01 compiled: (its record, its meter, the graphs torch.compile made during the run)."""
    before = counters["stats"]["unique_graphs"]
    record, meter = run_script("01", COMPILED, tmp_path_factory.mktemp("compiled"))
    return record, meter, counters["stats"]["unique_graphs"] - before


@pytest.mark.timeout(400)
def test_a_compiled_model_follows_the_eager_losses(compiled, quick_records):
    record, _, graphs = compiled
    assert graphs >= 1  # it was compiled, not run eagerly
    eager = quick_records["01"]["losses"]  # the same seed, so the same first two batches
    assert len(set(eager)) == 2  # the loss moves, so following it means something
    assert_follows(record["losses"][:2], eager)


@pytest.mark.timeout(400)
def test_switching_between_training_and_evaluation_compiles_each_once(compiled):
    """Training, evaluation (no gradients) and evaluation's smaller last batch, where the batch
    size becomes dynamic: three graphs, reused in the second epoch, never compiled again."""
    record, _, graphs = compiled
    assert record["steps"] == 21 and record["epochs"] == 2  # into the second epoch
    assert graphs <= 3


@pytest.mark.timeout(400)
def test_a_compiled_run_records_its_peak_counted_from_the_allocator(compiled, quick_runs):
    record, meter, _ = compiled
    assert isinstance(meter.tracker, AllocationTracker)
    assert record["memory_counted_by"].startswith("allocator")  # the record says how
    assert quick_runs["01"][0]["memory_counted_by"] == "MemTracker"
    breakdown, eager = record["breakdown_bytes"], quick_runs["01"][0]["breakdown_bytes"]
    assert record["peak_memory_bytes"] == sum(breakdown.values()) > 0
    # the same model and Adam: its state is the eager run's, counted by what it is
    assert breakdown["parameters"] == eager["parameters"]
    assert breakdown["optimizer_state"] == eager["optimizer_state"]
    # compiled code's buffers are seen: a tracker blind to them would find few activations
    assert breakdown["activations"] > eager["activations"] / 2


class AlsoCountingAllocations:
    """A MemoryMeter of `script` that also counts the allocator's events over the same steps."""

    def __init__(self, script):
        meter_class = script.MemoryMeter

        class Meter(meter_class):
            def __init__(self, device, model, optimizer, **options):
                super().__init__(device, model, optimizer, **options)
                self.allocations = AllocationTracker(model, optimizer)

            @contextmanager
            def step(self):
                tracking = self.tracking()
                with super().step():
                    with self.allocations if tracking else nullcontext():
                        yield

        script.MemoryMeter = Meter


@pytest.mark.timeout(120)
def test_the_allocator_counts_the_eager_first_step_as_memtracker_does(tmp_path):
    """01 in float32, one step, both counts over the same step: the same peak to the byte but
    for the labels, the same tensors by what they are. The labels were made before the step: the
    allocator's count never sees them, MemTracker counts them (as activations) once the model's
    loss returns a view of them. MemTracker counts a gradient from when autograd hands it over,
    the allocator's count from its allocation, so only their sum with temporaries agrees."""
    script = load_script("01")
    AlsoCountingAllocations(script)
    record, meter = run_script("01", [*QUICK, "--max-steps", "1"], tmp_path, module=script)
    stats = device_snapshot(meter.allocations.get_tracker_snapshot("peak"), torch.device("cpu"))
    counted = fold_breakdown(stats)
    labels = record["batch_size"] * torch.tensor([], dtype=torch.int64).element_size()
    assert stats["Total"] + labels == meter.peak_bytes > labels
    for key in ["parameters", "optimizer_state"]:
        assert counted[key] == meter.breakdown[key], key
    assert counted["activations"] + labels == meter.breakdown["activations"]
    assert (counted["gradients"] + counted["temporaries"]
            == meter.breakdown["gradients"] + meter.breakdown["temporaries"])


@pytest.mark.timeout(120)
def test_the_allocator_counts_what_the_optimizer_step_makes_as_optimizer_state(tmp_path):
    """04 (bfloat16, micro-batches), one step: Adam's state, made in the optimizer step, is
    optimizer state by both counts (to a few bytes), not activations.

    oneDNN off: on a CPU with AMX its bfloat16 convolution backward (ViT's patch embedding)
    takes 7.4 MB of scratch buffers from the allocator, which no tensor holds, so MemTracker
    does not see them and the allocator's peak moves there, before Adam's state exists."""
    script = load_script("04")
    AlsoCountingAllocations(script)
    with torch.backends.mkldnn.flags(enabled=False):
        _, meter = run_script("04", [*QUICK, "--max-steps", "1"], tmp_path, module=script)
    stats = device_snapshot(meter.allocations.get_tracker_snapshot("peak"), torch.device("cpu"))
    counted = fold_breakdown(stats)["optimizer_state"]
    assert counted == pytest.approx(meter.breakdown["optimizer_state"], abs=1024) and counted > 0


def test_the_count_without_scratch_leaves_out_what_an_operation_frees_inside_itself():
    """An operator whose kernel allocates a float64 copy of its input and frees it before it
    returns (as bitsandbytes' 8-bit AdamW does on a CPU; defined with an overload name only, as
    aten::add is, which the profiler leaves out): the allocator's count holds it, the count
    without scratch does not, as MemTracker, seeing what operations return, would not. What a
    dispatch mode sees as operations of their own is counted by both, though it runs inside
    another operation's event: a composite operation's parts (cross-entropy's log-softmax,
    freed before cross-entropy returns) and autocast's casts (made inside aten::addmm, which
    autocast then calls again)."""
    library = torch.library.Library("scratch_test", "DEF")
    try:
        library.define("column_sums.twice(Tensor x) -> Tensor")
        library.impl("column_sums.twice", lambda x: (x.double() * 2).sum(0).float(), "CPU")
        model = torch.nn.Linear(4, 4)
        inputs, labels = torch.randn(1000, 256), torch.zeros(1000, dtype=torch.int64)
        tracker = AllocationTracker(model, torch.optim.SGD(model.parameters()))
        with tracker, torch.no_grad():
            sums = torch.ops.scratch_test.column_sums.twice(inputs)
            loss = torch.nn.functional.cross_entropy(inputs, labels)
    finally:
        library._destroy()
    cpu = torch.device("cpu")
    model_bytes = 4 * (16 + 4)
    double = 2 * inputs.nelement() * 8  # the copy and its double, inside the operator
    log_softmax = inputs.nelement() * inputs.element_size()
    assert device_snapshot(tracker.get_tracker_snapshot("peak"), cpu)["Total"] >= model_bytes + double
    without = device_snapshot(tracker.peak_without_scratch, cpu)
    assert model_bytes + sums.nbytes + log_softmax <= without < model_bytes + double
    assert without <= model_bytes + sums.nbytes + log_softmax + loss.nbytes + 4096  # nll's own

    square = torch.randn(512, 512)
    tracker = AllocationTracker(model, torch.optim.SGD(model.parameters()))
    with tracker, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        product = torch.addmm(square, square, square)
    casts = 3 * square.nelement() * 2  # each operand in bfloat16, freed as addmm returns
    assert device_snapshot(tracker.peak_without_scratch, cpu) >= model_bytes + casts + product.nbytes


def test_the_allocators_count_starts_with_the_4bit_scales():
    """07b compiled: the state a step starts with holds each 4-bit weight's scales and code
    tables beside the packed weight, as MemTracker's count of an eager run does."""
    from common.compiled_memory import AllocationTracker
    from common.model import quantization_tensors
    layer = load_script("07b").in_four_bits(torch.nn.Linear(128, 64, dtype=torch.bfloat16))
    held = AllocationTracker(layer, torch.optim.SGD([layer.bias])).state_at_start()
    scales = quantization_tensors(layer.weight)
    assert len(scales) >= 2  # the absmax per block (compressed: itself quantized) and the code
    assert all((scale.device, scale.untyped_storage().data_ptr()) in held for scale in scales)
    weights = [layer.weight, layer.bias, *scales]
    assert sum(nbytes for nbytes, _ in held.values()) == sum(
        tensor.untyped_storage().nbytes() for tensor in weights)


def test_without_a_cpu_compiler_compile_stops_with_what_to_install(monkeypatch, capsys):
    from torch._inductor import cpp_builder, exc

    def no_compiler():
        raise exc.InvalidCxxCompiler()

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(SystemExit) as stopped:
        parse_args("", ["--compile", *CPU])
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    assert "--compile" in message and "g++" in message and "CXX" in message
    assert "without --compile" in message and "Traceback" not in message
    parse_args("", ["--compile", "--estimate", *CPU])  # the estimate compiles nothing


def test_without_triton_a_gpu_run_is_told_to_install_it(monkeypatch):
    import torch.utils._triton
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    assert "pip install triton" in compiler_problem(torch.device("cuda"))
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    assert compiler_problem(torch.device("cuda")) is None
    assert compiler_problem(torch.device("cpu")) is None  # this machine has g++


@pytest.mark.timeout(400)
def test_the_estimate_of_a_compiled_run_bounds_what_it_measures(compiled, tmp_path, capsys):
    """01 compiled, on the CPU: the estimate runs the graphs torch.compile makes (fused, and
    unfused for its bound above) and the run's peak lies within estimate/compiled.py's bound."""
    flags = ["--estimate", *CPU, "--results-dir", str(tmp_path)]
    eager = estimate(str(script_path("01")), flags)
    said_for_eager = capsys.readouterr().out
    before = counters["stats"]["unique_graphs"]
    predicted = estimate(str(script_path("01")), [*flags, "--compile"])
    said = capsys.readouterr().out
    assert counters["stats"]["unique_graphs"] > before  # compiled, not run eagerly
    assert predicted["compiled"] and not predicted["compiled_eagerly"] and not eager["compiled"]
    assert "with nothing fused" in said and "with nothing fused" not in said_for_eager
    assert predicted["allocated_bytes"] < predicted["unfused_allocated_bytes"]
    assert predicted["allocated_bytes"] != eager["allocated_bytes"]  # it is not the eager count
    assert within_bound(compiled[0], predicted)


@pytest.mark.timeout(400)
def test_stepping_in_backward_compiled_steps_as_each_blocks_backward_ends(tmp_path, capsys):
    """--compile compiles each block on its own, never the whole model: each block's backward
    is its own compiled graph, which hands back that block's gradients as it ends, so 10's
    --optimizer-in-backward steps them before the next block's backward starts (a compiled whole
    model hands back every gradient at once). It trains, and its estimate bounds what it holds."""
    argv = ["--preset", "tiny-text", "--task", "causal-lm", "--compile", "--optimizer-in-backward",
            "--max-steps", "2", "--epochs", "1"]
    record, meter = run_script("10", argv, tmp_path / "run")
    blocks = transformer_blocks(meter.model)
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert meter.model._compiled_call_impl is None and record["steps"] == 2
    predicted = estimate(str(script_path("10")), [*argv, "--estimate", *CPU, "--results-dir",
                                                   str(tmp_path / "estimate")])
    assert predicted["compiled"] and within_bound(record, predicted)


@pytest.mark.timeout(300)
def test_a_compiled_chunked_loss_is_estimated_fused(tmp_path, capsys):
    """05g compiles the blocks and runs the output layer a piece at a time outside them (a second
    call per micro-batch, which the tracker allows). Its decoder's graphs view values whose
    layout a stand-in changed (attention's heads merged back): they run fused, and the
    gradients are still counted as gradients."""
    record = estimate(str(script_path("05g")), ["--preset", "tiny-text", "--task", "causal-lm",
                                                "--compile", "--estimate", *CPU, "--results-dir",
                                                str(tmp_path)])
    assert record["compiled"] and record["fused"] is True
    assert record["allocated_bytes"] <= record["unfused_allocated_bytes"]
    assert record["breakdown_bytes"]["gradients"] > 0
    assert "with nothing fused they would hold" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_a_compiled_run_is_estimated_unfused_where_fusion_cannot_be_emulated(
        tmp_path, capsys, monkeypatch):
    """Where a fused graph cannot run (here a view that fails, as views of a stand-in's layout
    did before view_of_the_bytes), the estimate runs the graphs unfused, the range's upper
    side, and says so."""
    from estimate import compiled as emulation

    def cannot(tensor, shape):
        raise RuntimeError("a layout the emulation cannot take")

    monkeypatch.setattr(emulation, "view_of_the_bytes", cannot)
    record = estimate(str(script_path("01")), ["--preset", "tiny", "--compile", "--estimate",
                                               *CPU, "--results-dir", str(tmp_path)])
    assert record["compiled"] and record["fused"] is False
    assert record["unfused_allocated_bytes"] == record["allocated_bytes"]
    assert "with nothing fused (the fusion" in capsys.readouterr().out


@pytest.mark.timeout(PROBED_TEST_TIMEOUT + COMPILED_LAUNCH_TIMEOUT)
def test_two_processes_compiling_each_block_follow_the_eager_loss(probed_runs, unsharded):
    """07 with each transformer block compiled before it is sharded, in float32 on 2 processes,
    against 06 uncompiled on one."""
    run = probed_runs("07", ["--compile"], timeout=COMPILED_LAUNCH_TIMEOUT)
    assert all(rank["compiled_graphs"] >= 1 for rank in run.ranks)  # compiled, not run eagerly
    sharded = run.record
    assert sharded["world_size"] == 2 and sharded["steps"] == unsharded["steps"] == 3
    assert_follows(sharded["losses"], unsharded["losses"])
    assert len(sharded["rank_peak_memory_bytes"]) == 2 and all(
        peak > 0 for peak in sharded["rank_peak_memory_bytes"])
    assert sum(sharded["breakdown_bytes"].values()) == sharded["peak_memory_bytes"]
