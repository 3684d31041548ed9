"""The GPU memory estimate: its fake run is the real run, and its answers have the right shape.

The key claim, that with no GPU emulation (--device cpu) the estimate equals the peak the real run
of the same script measures (the fake run executes the script's own code), is tested on every
architecture and step in tests/scripts/test_architectures.py.
"""
import gc
import json
import subprocess
import sys
import weakref
from types import MethodType

import pytest
import torch

from common.model import model_class, model_config
from common.presets import PRESETS
from conftest import ROOT, TEXT, load_script, model_state_bytes, script_path
from estimate.check import estimate
from estimate.collector import frozen
from estimate.command import main as estimate_table
from estimate.command import run_rows
from estimate.fake import run as fake_runs
from estimate.fake.run import EstimateError, run_on_fake_tensors
from estimate.gpu_choices import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES, GPUS
from estimate.predict import Row, predict
from estimate.replay.allocator import MEDIUM_SEGMENT, SMALL_REQUEST, SMALL_SEGMENT, CachingAllocatorModel
from estimate.replay.trace import ALLOC, replay

NO_EMULATION = ["--device", "cpu"]


def parameter_sizes(preset_name):
    """The number of elements of each of the preset's model's parameters."""
    preset = PRESETS[preset_name]
    with torch.device("meta"):
        model = model_class(preset)._from_config(model_config(preset))
    return [param.numel() for param in model.parameters()]


def parameter_count(preset_name):
    return sum(parameter_sizes(preset_name))


@pytest.mark.parametrize("name, flags, world_size", [
    ("05c", ["--device", "cuda"], 1),  # 4 micro-batches of 16 on an emulated GPU
    ("09", ["--device", "cuda"], 4),  # sharded: 4 of 4 per process
    ("10", [*TEXT, "--task", "causal-lm", "--batch-size", "8", "--accum-steps", "4", "--loss",
            "chunked", "--optimizer-on-host", "--device", "cuda"], 1),
    ("04", ["--batch-size", "1256", "--device", "cuda"], 1),  # one step in the epoch, not two
    ("05", ["--batch-size", "6", "--device", "cuda"], 1),  # 6 over 4 micro-batches: refused
    ("05c", ["--batch-size", "8", *NO_EMULATION], 1),  # the CPU holds the whole batch: all run
], ids=["05c", "09-sharded", "10-text", "04-one-step", "05-uneven", "05c-cpu"])
def test_two_micro_batches_predict_a_step_of_as_many_as_asked(name, flags, world_size):
    """On a GPU the estimate runs two micro-batches of the size asked, however many are asked
    (--exact runs them all): the record is the same, the batch and steps asked included."""
    def record(exact):
        try:
            return predict(script_path(name), flags, world_size=world_size, exact=exact)
        except EstimateError as error:
            return str(error)
    quick, exact = record(exact=False), record(exact=True)
    assert quick == exact
    if isinstance(quick, str):
        assert "--batch-size 6" in quick and "--accum-steps" in quick
    else:
        assert (quick["batch_size"], quick["accum_steps"]) == (int(dict(zip(flags, flags[1:])).get(
            "--batch-size", 64)), 4)


def test_the_recorded_order_replays_to_memtrackers_own_peak():
    run = run_on_fake_tensors(script_path("04"), NO_EMULATION)
    replayed = replay(run.training_events(), "cpu", emulate_cuda=False)
    assert replayed.allocated_bytes == run.meter_result["peak_memory_bytes"]
    assert replayed.breakdown_bytes == run.meter_result["breakdown_bytes"]


def operations_differing_in_one_fact():
    """Copies of tensors of one shape that differ in one fact each (their dtype, device, strides,
    storage offset, storage bytes, gradient, negative or conjugate bit, inference), a product
    by a scalar of either type, and products of lists of tensors, on fake tensors: each a key
    of its own in either cache key (COPIES_AND_PRODUCTS)."""
    from estimate.fake.patches import FakeModeReadingZeros
    with FakeModeReadingZeros():
        with torch.inference_mode():
            inference = torch.zeros(3, 4)
        complex_numbers = torch.zeros(3, 4, dtype=torch.complex64)
        counts = torch.zeros(3, 4, dtype=torch.long)
        thirteen = torch.zeros(13)
        for tensor in (torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float16), counts,
                       torch.zeros(3, 4, device="cuda"), torch.zeros(4, 3).t(),
                       thirteen[:12].view(3, 4), thirteen[1:].view(3, 4), torch.zeros(4, 4)[:3],
                       torch.zeros(3, 4, requires_grad=True), torch._neg_view(torch.zeros(3, 4)),
                       complex_numbers, complex_numbers.conj(), inference):
            tensor.clone()  # (an operation that takes a negative or conjugate view as it is)
        for scalar in (2, 2.0):
            torch.mul(counts, scalar)
        for other in (torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float16)):
            torch._foreach_mul([counts.float(), other], 2.0)


COPIES_AND_PRODUCTS = 17  # operations_differing_in_one_fact's: 13 copies, 2 products, 2 of lists


@pytest.mark.parametrize("name, flags, world_size", [
    ("02", ["--device", "cuda"], 1),  # float16 autocast on an emulated GPU: casts, batch norm
    ("10", [*TEXT, "--task", "causal-lm", "--loss", "chunked", "--optimizer", "adamw-8bit",
            "--checkpointing", "selective", "--device", "cuda"], 2),  # sharded, lists of shards
    (None, [], None),  # operations_differing_in_one_fact
], ids=["02", "10-text-sharded", "one-fact-apart"])
def test_the_fake_modes_cache_key_tells_apart_the_operations_the_stock_key_does(
        name, flags, world_size, monkeypatch):
    """The fake mode keys its cache of operations' outputs on each fake tensor's facts in one
    tuple (estimate/fake/patches.py): over a whole run, two operations share its key exactly
    where they share the stock key of FakeTensorMode, and an operation goes uncached where the
    stock key would leave it so, for the same reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache

    from estimate.fake.patches import FakeModeReadingZeros
    pairs = []
    keyed = FakeTensorMode._cache_key

    def key(mode, state, func, args, kwargs):
        try:
            return keyed(mode, state, func, args, kwargs)
        except _BypassDispatchCache as bypassed:
            return f"uncached: {bypassed}"

    def both_keys(mode, state, func, args, kwargs):
        ours = key(mode, state, func, args, kwargs)
        # the stock method where the key starts and where it goes into lists
        mode._prep_args_for_hash = MethodType(FakeTensorMode._prep_args_for_hash, mode)
        try:
            stock = key(mode, state, func, args, kwargs)
        finally:
            del mode._prep_args_for_hash
        pairs.append((getattr(ours, "key", ours), getattr(stock, "key", stock)))
        if isinstance(ours, str):
            raise _BypassDispatchCache(ours.removeprefix("uncached: "))
        return ours

    monkeypatch.setattr(FakeModeReadingZeros, "_cache_key", both_keys)
    if name is None:
        operations_differing_in_one_fact()
        pairs = [pair for pair in pairs if pair[1][0] in (
            torch.ops.aten.clone.default, torch.ops.aten.mul.Tensor,
            torch.ops.aten._foreach_mul.Scalar)]
        fewest = COPIES_AND_PRODUCTS  # (all cached)
    else:
        predict(script_path(name), flags, world_size=world_size)
        fewest = 100
    ours, stock = ({pair[side] for pair in pairs} for side in (0, 1))
    assert len(ours) == len(stock) == len(set(pairs)) >= fewest  # one to one
    assert all(isinstance(a, str) == isinstance(b, str) and (a == b or not isinstance(a, str))
               for a, b in pairs)
    assert any(isinstance(part, tuple) and isinstance(part[0], torch.dtype)  # its tuples made
               for each in ours if not isinstance(each, str) for part in each if part)


@pytest.mark.parametrize("script, world_size", [("05", 1), ("09", 2)])
def test_a_workers_runs_leave_nothing_frozen_of_the_run_before(script, world_size, monkeypatch):
    """A worker of the estimate's pool runs one fake run after another inside the pool's frozen
    block, and each run freezes what lives as it starts (estimate/collector.py): the run before
    must then be garbage, its script's module (whose globals hold the run's stand-ins) out of
    sys.modules, or it would be frozen, and kept, for the life of the worker."""
    loaded = []

    def import_script(*args, **kwargs):
        module = real_import_script(*args, **kwargs)
        loaded.append(weakref.ref(module.main))  # (in a cycle: through its __globals__)
        return module

    real_import_script = fake_runs.import_script
    monkeypatch.setattr(fake_runs, "import_script", import_script)
    with frozen(collect=False):  # as output.worker_pool holds it around the workers
        for _ in range(3):
            run_on_fake_tensors(script_path(script), NO_EMULATION, world_size)
        gc.collect()
        # the last run's module stays in sys.modules, where the files it loaded are read from
        assert [main() is None for main in loaded] == [True, True, False]


@pytest.mark.parametrize("name", ["01", "02", "04", "08"])
def test_reserved_is_never_below_allocated(name):
    record = predict(script_path(name), [], world_size=2)
    assert 0 < record["allocated_bytes"] <= record["reserved_bytes"]
    assert sum(record["breakdown_bytes"].values()) == record["allocated_bytes"]


def test_bfloat16_needs_less_than_float32():
    float32 = predict(script_path("01"), [])
    bfloat16 = predict(script_path("03"), [])
    assert bfloat16["allocated_bytes"] < float32["allocated_bytes"]
    assert bfloat16["breakdown_bytes"]["activations"] < float32["breakdown_bytes"]["activations"]


def test_article_parameters_take_four_bytes_each_in_float32():
    record = predict(script_path("01"), ["--preset", "article", *NO_EMULATION])
    assert record["breakdown_bytes"]["parameters"] == 4 * parameter_count("article")
    assert record["batch_size"] == 64 and record["preset"] == "article"


def sharded_parameter_bytes(world_size):
    run = run_on_fake_tensors(script_path("07"), ["--batch-size", "16", *NO_EMULATION], world_size)
    return sum(event[2] for event in run.training_events()
               if event[0] == ALLOC and event[4] == "Sharded Param")


def test_four_processes_each_hold_about_a_quarter_of_the_parameters():
    whole, quarter = sharded_parameter_bytes(1), sharded_parameter_bytes(4)
    assert whole == 2 * parameter_count("tiny")  # bfloat16
    assert quarter / whole == pytest.approx(0.25, rel=0.02)  # shards are padded to equal rows


def test_a_sharded_estimate_gives_the_model_state_per_parameter_a_process_holds():
    record = predict(script_path("07"), [], world_size=4)  # a GPU: the bytes a GPU holds
    whole = parameter_count("tiny")
    assert record["parameter_count"] == whole  # the sharded parameters, counted whole
    assert record["model_state_bytes_per_parameter"] == (
        model_state_bytes(record["breakdown_bytes"]) / (whole / 4))


def test_offload_moves_the_sharded_state_to_host_memory():
    sharded = predict(script_path("07"), [], world_size=2)
    offloaded = predict(script_path("08"), [], world_size=2)
    assert sharded["host_bytes"] == 0 and offloaded["host_bytes"] > 0
    assert offloaded["breakdown_bytes"]["parameters"] < sharded["breakdown_bytes"]["parameters"]
    assert offloaded["allocated_bytes"] < sharded["allocated_bytes"]


def edited_copy(tmp_path, name, old, new):
    source = script_path(name).read_text()
    assert old in source
    path = tmp_path / f"{script_path(name).stem}.py"
    path.write_text(source.replace(old, new))
    return path


def test_a_changed_script_changes_its_prediction(tmp_path):
    float32 = edited_copy(tmp_path, "03", "DTYPE = torch.bfloat16", "DTYPE = torch.float32")
    assert predict(float32, [])["allocated_bytes"] > predict(script_path("03"), [])["allocated_bytes"]


def test_a_failing_script_is_reported_and_the_others_still_come_out(tmp_path):
    broken = edited_copy(tmp_path, "01", "    loss.backward()\n",
                         "    raise RuntimeError('deliberately broken')\n")
    rows = [Row(broken, []), Row(script_path("03"), [])]
    (failed_record, problem, _), (record, no_problem, _) = run_rows(rows, jobs=1)
    assert failed_record is None and "deliberately broken" in problem and "01_baseline.py" in problem
    assert no_problem is None and record["script"] == "03_bf16"


def test_bad_input_gets_a_message_that_says_what_to_do(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as stop:
        estimate_table(["--preset", "no-such-preset"])
    assert stop.value.code == 2 and "invalid choice" in capsys.readouterr().err

    with pytest.raises(EstimateError, match=r"--batch-size 24 does not split into 4 processes"):
        predict(script_path("07"), ["--batch-size", "24"], world_size=4)
    with pytest.raises(EstimateError, match=r"--batch-size 30 is not divisible by --accum-steps 4"):
        predict(script_path("04"), ["--batch-size", "30"])

    silent = tmp_path / "silent.py"
    silent.write_text(script_path("01").read_text().split("def train_step")[0]  # its imports
                      + "def main(argv=None):\n    return None\n")
    with pytest.raises(EstimateError, match="without reporting a result"):
        predict(silent, [])

    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(SystemExit, match="WORLD_SIZE='four' is not a positive whole number"):
        estimate(str(script_path("07")), ["--estimate", "--results-dir", str(tmp_path)])

    with pytest.raises(SystemExit) as stop:
        estimate_table(["--steps", "01", "99", "--results-dir", str(tmp_path)])
    assert stop.value.code == 2
    assert "--steps: no script '99'; the scripts are: 01 02" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # the flag's old name
        estimate_table(["--scripts", "01", "--results-dir", str(tmp_path)])
    assert stop.value.code == 2
    assert "--scripts is now --steps (as in python -m tour): --steps 01" in capsys.readouterr().err


def test_a_script_estimate_updates_its_own_record_and_keeps_the_others(tmp_path):
    flags = ["--estimate", "--results-dir", str(tmp_path)]
    estimate(str(script_path("01")), flags)
    estimate(str(script_path("03")), [*flags, "--batch-size", "16"])
    estimate(str(script_path("01")), flags)
    records = json.loads((tmp_path / "estimate.json").read_text())
    assert sorted((record["script"], record["batch_size"]) for record in records) == [
        ("01_baseline", PRESETS["tiny"].batch_size), ("03_bf16", 16)]
    assert not list(tmp_path.glob("*.tmp"))


def test_the_estimate_flag_works_from_the_command_line(tmp_path):
    done = subprocess.run([sys.executable, str(script_path("03")), "--batch-size", "16",
                           "--estimate", "--results-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "peak memory reserved" in done.stdout
    [record] = json.loads((tmp_path / "estimate.json").read_text())
    assert record["script"] == "03_bf16" and record["batch_size"] == 16 and record["device"] == "cuda"


def test_a_scripts_estimate_takes_the_gpu_and_world_size_the_table_takes(tmp_path, capsys):
    """`python 03_bf16.py --estimate --gpu v100` predicts what `python -m estimate --steps 03
    --gpu v100` does; without --estimate the flags are refused, saying why."""
    flags = ["--estimate", "--results-dir", str(tmp_path)]
    load_script("03").main([*flags, "--gpu", "v100"])
    load_script("07").main([*flags, "--world-size", "2"])
    load_script("04").main([*flags, "--exact", "--batch-size", "64"])  # all 4 micro-batches
    records = {record["script"]: record
               for record in json.loads((tmp_path / "estimate.json").read_text())}
    assert records["03_bf16"]["gpu"] == "V100" and records["07_fsdp"]["world_size"] == 2
    assert records["04_grad_accum"]["accum_steps"] == 4
    as_the_table = predict(script_path("03"), ["--preset", "tiny", "--device", "cuda"], gpu="v100")
    assert records["03_bf16"]["allocated_bytes"] == as_the_table["allocated_bytes"]
    for name, flag, said in [("03", ["--gpu", "v100"], "--gpu names the GPU --estimate emulates"),
                             ("07", ["--world-size", "2"], "--world-size is the process count"),
                             ("04", ["--exact"], "--exact makes --estimate run every micro-batch")]:
        with pytest.raises(SystemExit) as stop:
            load_script(name).main([*flag, "--results-dir", str(tmp_path)])
        assert stop.value.code == 2
        assert f"{said}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--gpu x100: the GPUs emulated are a100, h100, t4, v100"):
        load_script("03").main([*flags, "--gpu", "x100"])


def test_the_table_covers_each_script_and_its_world_size(tmp_path, capsys):
    status = estimate_table(["--preset", "tiny", "--steps", "02", "07", "--world-size", "2",
                             "--jobs", "1", "--results-dir", str(tmp_path)])
    assert status == 0
    table = capsys.readouterr().out
    assert "| 02_mixed_precision |" in table and "2 GPUs" in table and "wall time" in table
    # 07's branches: 07b's 4-bit weights too (stood in for: estimate/fake/four_bit.py)
    assert "| 07b_qlora (branch of 07a) | batch" in table and "not estimated" not in table
    assert "| model state B/param | activations |" in table
    records = {record["script"]: record for record in
               json.loads((tmp_path / "estimate.json").read_text())}
    assert records["02_mixed_precision"]["world_size"] == 1
    assert records["07_fsdp"]["world_size"] == 2


def test_allocator_rounds_requests_and_packs_small_ones_into_shared_segments():
    allocator = CachingAllocatorModel()
    blocks = [allocator.malloc(100) for _ in range(3)]
    assert allocator.allocated == 3 * 512 and allocator.reserved == SMALL_SEGMENT
    middle = allocator.malloc(3 << 20)  # 1-10 MiB: from a shared 20 MiB segment
    assert allocator.reserved == SMALL_SEGMENT + MEDIUM_SEGMENT
    for block in blocks:
        allocator.free(block)
    assert allocator.allocated == 3 << 20
    allocator.malloc(1000)  # a freed small block is reused: nothing new reserved
    assert allocator.reserved == SMALL_SEGMENT + MEDIUM_SEGMENT
    allocator.free(middle)
    allocator.malloc(25 << 20)  # large: its own segment, rounded up to 2 MiB
    assert allocator.reserved == SMALL_SEGMENT + MEDIUM_SEGMENT + (26 << 20)
    # the 1 MiB left of its segment is too small to split off: it counts as allocated, as on CUDA
    assert allocator.peak_allocated == (26 << 20) + 1024


def test_allocator_keeps_freed_large_blocks_and_hands_out_the_smallest_that_fits():
    allocator = CachingAllocatorModel()
    big, small = allocator.malloc(40 << 20), allocator.malloc(12 << 20)
    allocator.free(big)
    allocator.free(small)
    reserved = allocator.reserved
    reused = allocator.malloc(12 << 20)
    assert allocator.reserved == reserved and reused.size == 12 << 20
    assert allocator.peak_reserved == reserved == (40 << 20) + (12 << 20)


def test_emulation_adds_the_cublas_workspaces():
    run = run_on_fake_tensors(script_path("03"), [])
    exact = replay(run.training_events(), "cpu", emulate_cuda=False).allocated_bytes
    emulated = replay(run.training_events(), "cpu", emulate_cuda=True).allocated_bytes
    assert emulated >= exact + CUBLAS_WORKSPACES * CUBLAS_WORKSPACE_BYTES


@pytest.mark.parametrize("dtype, kernel, kept_rows", [
    (torch.float32, "ScaledDotProductEfficientAttentionBackward0", 224),  # 197 padded to 32s
    (torch.bfloat16, "ScaledDotProductFlashAttentionBackward0", 197)])
def test_gpu_attention_takes_the_kernel_cuda_takes_for_the_dtype(dtype, kernel, kept_rows):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimate.gpu_choices import gpu_attention
    with FakeTensorMode():
        query = torch.empty(2, 197, 4, 32, dtype=dtype).transpose(1, 2).requires_grad_()
        output, _ = gpu_attention(None, query, query, query, None, scaling=0.125)
        assert output.shape == (2, 197, 4, 32) and output.is_contiguous()
        node = output.grad_fn.next_functions[0][0]
        assert type(node).__name__ == kernel
        saved = "_saved_log_sumexp" if hasattr(node, "_saved_log_sumexp") else "_saved_logsumexp"
        log_sum_exp = getattr(node, saved)
        assert log_sum_exp.shape == (2, 4, kept_rows) and log_sum_exp.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dropout_in_training_keeps_a_one_byte_mask_as_on_cuda(dtype):
    """CUDA's dropout is the fused native_dropout and keeps a boolean mask for backward; the
    CPU's multiplies by noise of the input's dtype and keeps that, which the estimate must not
    count. Off in evaluation, at p=0 and in place, where both devices take the same path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimate.fake.patches import dropout_as_on_cuda

    def saved(output):
        return [getattr(output.grad_fn, name) for name in dir(output.grad_fn)
                if name.startswith("_saved_") and isinstance(getattr(output.grad_fn, name), torch.Tensor)]

    with FakeTensorMode():
        hidden = torch.empty(2, 48, 64, dtype=dtype, requires_grad=True)
        on_cpu = saved(torch.nn.Dropout(0.1)(hidden))
        with dropout_as_on_cuda():
            emulated = saved(torch.nn.Dropout(0.1)(hidden))
            assert torch.nn.functional.dropout(hidden, 0.1, training=False) is hidden
            in_place = saved(torch.nn.functional.dropout(hidden * 1, 0.1, inplace=True))
            assert [tensor.dtype for tensor in in_place] == [dtype]  # the composite path: noise
            assert torch.nn.functional.dropout(hidden, 0.0).grad_fn is None
    assert [(tensor.dtype, tensor.shape) for tensor in on_cpu] == [(dtype, hidden.shape)]
    assert [(tensor.dtype, tensor.shape) for tensor in emulated] == [(torch.bool, hidden.shape)]


@pytest.mark.parametrize("keys, kept_keys", [(48, 48), (45, 48)])  # padded to 8s, as on CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_attention_with_a_padding_mask_keeps_it_as_a_bias(dtype, keys, kept_keys):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimate.gpu_choices import gpu_attention
    with FakeTensorMode():
        query = torch.empty(2, keys, 4, 32, dtype=dtype).transpose(1, 2).requires_grad_()
        padding = torch.ones(2, keys, dtype=torch.bool)  # what transformers' sdpa_mask gives
        mask = padding[:, None, None, :].expand(2, 1, keys, keys)
        output, _ = gpu_attention(None, query, query, query, mask, scaling=0.125)
        node = output.grad_fn.next_functions[0][0]
        assert type(node).__name__ == "ScaledDotProductEfficientAttentionBackward0"
        bias = node._saved_attn_bias
        assert bias.shape == (2, 4, keys, keys) and bias.dtype == dtype
        assert bias.untyped_storage().nbytes() == 2 * keys * kept_keys * dtype.itemsize


def test_the_gpu_estimate_of_text_gives_every_layer_the_padding_mask(monkeypatch):
    """A fake mask cannot show transformers that it is all ones (no padding, so no mask)."""
    from estimate import gpu_choices
    masks, original = [], gpu_choices.additive_mask
    monkeypatch.setattr(gpu_choices, "additive_mask",
                        lambda mask, *args: masks.append(mask.shape) or original(mask, *args))
    predict(script_path("01"), TEXT)
    preset = PRESETS["tiny-text"]
    layers, length = preset.config["num_hidden_layers"], preset.max_length
    assert masks == [(preset.batch_size, 1, length, length)] * layers * 2  # two steps' forwards


def test_the_imdb_estimate_keeps_blooms_float32_attention_probabilities_per_layer():
    """BLOOM's attention is its own code: on a GPU as here, each layer keeps its softmax's
    float32 probabilities for backward; the weights are bfloat16 in 04."""
    preset = PRESETS["imdb"]
    record = predict(script_path("04"), ["--preset", "imdb", "--accum-steps", "1"])
    config = model_config(preset)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(preset)._from_config(config).parameters())
    assert record["breakdown_bytes"]["parameters"] == 2 * parameters
    probabilities = (config.n_layer * preset.batch_size * config.n_head * preset.max_length ** 2
                     * torch.float32.itemsize)
    assert probabilities <= record["breakdown_bytes"]["activations"] < 3 * probabilities


@pytest.mark.parametrize("old, new, named", [
    ("from common.data import load_data, to_device\n",
     "from common.data import load_data as read_batches, to_device\n", "does not import `load_data`"),
    ("def train_step(",
     "def evaluate(model, loader, device, dtype=None):\n    return 0.0\n\n\ndef train_step(",
     "defines or imports its own `evaluate`"),
])
def test_a_broken_contract_stops_the_estimate_naming_the_name(tmp_path, old, new, named):
    broken = edited_copy(tmp_path, "03", old, new)
    with pytest.raises(EstimateError, match=named) as stop:
        predict(broken, [])
    assert "estimate/contract.py" in str(stop.value)


def test_the_estimate_stands_in_for_exactly_the_names_of_the_contract():
    from estimate.contract import REQUIRED, REQUIRED_WHEN_DISTRIBUTED, REQUIRED_WHEN_OFFLOADING
    from estimate.fake.run import FakeRun
    from estimate.fake.stand_ins import StandIns
    # one public name of StandIns for each name of the contract (bitsandbytes': fake_4bit.py)
    own = {name for name in vars(StandIns) if not name.startswith("_")} - {"by_name"}
    assert own == (REQUIRED.keys() | REQUIRED_WHEN_DISTRIBUTED.keys()
                   | REQUIRED_WHEN_OFFLOADING.keys())
    stand_ins = StandIns(FakeRun(script="07_fsdp", emulate_cuda=True), world_size=2)
    assert all(callable(stand_in) or name == "HOST"
               for name, stand_in in stand_ins.by_name(own).items())


def test_a_sharded_script_that_fills_its_shards_another_way_is_refused(tmp_path):
    renamed = edited_copy(tmp_path, "07", "fill_shards, transformer_blocks",
                          "fill_shards as copy_weights, transformer_blocks")
    renamed.write_text(renamed.read_text().replace("fill_shards(", "copy_weights("))
    with pytest.raises(EstimateError, match="does not import `fill_shards`"):
        predict(renamed, [])


def test_a_script_that_starts_its_own_process_group_is_refused(tmp_path):
    call = "    _, world_size, device = init_distributed(device)"
    own_group = edited_copy(tmp_path, "07", call, "    dist.init_process_group('gloo')\n" + call)
    with pytest.raises(EstimateError, match="calls torch.distributed.init_process_group itself"):
        predict(own_group, [])


def test_sharded_creation_holds_a_quarter_per_gpu_and_stages_each_whole_parameter():
    """07-09 on 4 GPUs: each process holds its quarter of the bfloat16 model, and the whole
    parameter being broadcast, one at a time (NCCL sends from the GPU); 08 makes its shards in
    host memory, so its GPU holds only that staging buffer."""
    sizes = parameter_sizes("article")
    largest = 2 * max(sizes)  # ViT-L's MLP matrices, 4096 x 1024 in bfloat16: 8 MiB
    quick = ["--preset", "article", "--batch-size", "4", "--accum-steps", "1"]  # creation: any batch
    sharded = predict(script_path("07"), quick, world_size=4)
    offloaded = predict(script_path("08"), quick, world_size=4)
    assert offloaded["init_allocated_bytes"] == largest
    assert sharded["init_allocated_bytes"] == pytest.approx(2 * sum(sizes) / 4 + largest, rel=0.01)


def test_a_gpu_without_flash_attention_keeps_bfloat16_attention_on_the_math_path():
    """--gpu v100 or t4 (below compute capability 8.0): no flash attention, and no bfloat16 in
    the memory-efficient kernel, so 03's bfloat16 attention keeps its whole probability matrix
    (float32, as the math path computes half types) in every layer. float32 (01) takes the
    memory-efficient kernel on every GPU; float16 (02) flash attention on an A100 and the
    memory-efficient kernel below 8.0, whose float32 log-sum-exp rows are padded to 32 where
    flash keeps one per token."""
    preset = PRESETS["tiny"]
    batch = 512
    tokens = (preset.image_size // preset.config["patch_size"]) ** 2 + 1
    heads, layers = preset.config["num_attention_heads"], preset.config["num_hidden_layers"]
    flags = ["--preset", "tiny", "--batch-size", str(batch)]
    on = {gpu: predict(script_path("03"), flags, gpu=gpu) for gpu in ("a100", "h100", "v100", "t4")}
    assert [on[gpu]["gpu"] for gpu in on] == ["A100", "H100", "V100", "T4"]
    # Hopper's cuBLAS workspaces are 32 MiB each, not 8.125 (gpu_choices.Gpu). Each 8.125 MiB
    # one shares a 20 MiB segment whose rest later blocks take, and a block taken whole (its
    # rest not split, at most 1 MiB) counts its slack: up to 1 MiB a workspace either way
    hopper = CUBLAS_WORKSPACES * (GPUS["h100"].cublas_workspace_bytes - CUBLAS_WORKSPACE_BYTES)
    assert hopper == 2 * (32 - 8.125) * 2**20
    slack = CUBLAS_WORKSPACES * SMALL_REQUEST
    assert abs(on["h100"]["allocated_bytes"] - on["a100"]["allocated_bytes"] - hopper) <= slack
    probabilities = layers * batch * heads * tokens * tokens * 4
    for gpu in ("v100", "t4"):
        assert on[gpu]["breakdown_bytes"]["activations"] >= (
            on["a100"]["breakdown_bytes"]["activations"] + probabilities)
    float32 = {gpu: predict(script_path("01"), flags, gpu=gpu)["allocated_bytes"] for gpu in on}
    assert float32["a100"] == float32["v100"] == float32["t4"]
    assert abs(float32["h100"] - float32["a100"] - hopper) <= slack
    float16 = {gpu: predict(script_path("02"), flags, gpu=gpu)["allocated_bytes"]
               for gpu in ("a100", "v100")}
    padded_rows = layers * batch * heads * (32 - tokens) * 4
    assert float16["v100"] - float16["a100"] == padded_rows


def test_the_table_takes_a_gpu_and_compares_with_the_study_only_on_its_a100(tmp_path, capsys):
    status = estimate_table(["--preset", "tiny", "--gpu", "t4", "--steps", "03", "--jobs", "1",
                             "--results-dir", str(tmp_path)])
    assert status == 0
    records = json.loads((tmp_path / "estimate.json").read_text())
    assert [record["gpu"] for record in records] == ["T4"]
    with pytest.raises(SystemExit):
        estimate_table(["--gpu", "t4", "--device", "cpu", "--results-dir", str(tmp_path)])
    assert "leave --device cpu out" in capsys.readouterr().err


def test_a_gpu_is_estimated_as_the_emulated_gpu_nearest_below_it():
    from estimate.gpu_choices import nearest_gpu
    assert [nearest_gpu(capability) for capability in [(8, 0), (9, 0), (7, 5), (7, 0)]] == [
        "a100", "h100", "t4", "v100"]  # the GPUs emulated, each itself
    assert nearest_gpu((8, 9)) == "a100" and nearest_gpu((12, 0)) == "h100"  # an L4, a B200's kin
    assert nearest_gpu((6, 1)) == "v100"  # below them all: the oldest
