"""Steps 01-06 on the tiny preset: each runs, and each technique does what it claims; and what
steps.py says of every script is what the script itself does."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from common import hub
from common.model import create_model
from common.presets import PRESETS
from conftest import (
    QUICK,
    ROOT,
    load_script,
    model_state_bytes,
    requires_cuda,
    run_script,
    unevaluated,
)
from steps import STEPS, import_script
from support.rounding import additions, assert_same_sum
from tour.records import RECORD_FIELDS

SINGLE_DEVICE_STEPS = ["01", "02", "03", "04", "05", "06"]
ALWAYS = {name for name, (present, _) in RECORD_FIELDS.items() if present == "always"}


@pytest.mark.parametrize("name", SINGLE_DEVICE_STEPS)
def test_every_step_runs_and_writes_its_record(name, quick_records, tmp_path):
    record = quick_records[name]
    assert record.keys() == ALWAYS  # a one-process CPU run writes exactly these
    assert record["steps"] == 2 and record["preset"] == "tiny" and record["device"] == "cpu"
    assert 0.0 <= record["test_accuracy"] <= 1.0
    assert record["test_samples"] == 360  # the digits' test split, for the accuracy's interval
    assert record["peak_memory_bytes"] > 0
    assert sum(record["breakdown_bytes"].values()) == record["peak_memory_bytes"]


def test_the_record_gives_the_model_state_at_the_peak_per_parameter(quick_records):
    model = create_model(PRESETS["tiny"])
    parameters = sum(parameter.numel() for parameter in model.parameters())
    for name, record in quick_records.items():
        model_state = model_state_bytes(record["breakdown_bytes"])
        assert record["parameter_count"] == parameters, name
        assert record["model_state_bytes_per_parameter"] == model_state / parameters, name


def bytes_per_parameter(tensors, parameters):
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors) / parameters


@pytest.mark.parametrize("name, gradients_at_the_peak", [
    ("01", False), ("03", False),  # the peak comes before the step's gradients exist
    ("04", True),  # micro-batches add their gradients up: they exist at the peak
])
def test_model_state_per_parameter_is_weights_adam_state_and_gradients(name, gradients_at_the_peak,
                                                                        quick_runs):
    """float32 Adam holds 16 bytes per parameter with its gradients (4 + 4 + 8), bfloat16 Adam
    8; the sizes come from the run's own model and optimizer."""
    record, meter = quick_runs[name]
    parameters = record["parameter_count"]
    weights = bytes_per_parameter(meter.model.parameters(), parameters)  # 4 float32, 2 bfloat16
    adam = bytes_per_parameter([value for state in meter.optimizer.state.values()  # two moments
                                for value in state.values() if torch.is_tensor(value)], parameters)
    gradients = weights  # a gradient has its parameter's shape and dtype
    expected = weights + adam + (gradients if gradients_at_the_peak else 0)
    assert record["model_state_bytes_per_parameter"] == pytest.approx(expected, rel=0.001)
    assert 2 * weights < adam < 2.01 * weights  # Adam: two moments (and a step count per tensor)


def test_written_record_matches_returned_one(tmp_path):
    record, _ = run_script("01", QUICK, tmp_path)
    written = json.loads((tmp_path / "01_baseline.json").read_text())
    assert written == json.loads(json.dumps(record))
    assert not list(tmp_path.glob("*.tmp"))  # atomic write leaves no temporary file


def test_peak_memory_falls_step_by_step(quick_records):
    peaks = [quick_records[name]["peak_memory_bytes"] for name in ["01", "02", "03", "04", "05"]]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks


def test_memory_figures_repeat_exactly_with_the_same_seed(quick_records, tmp_path):
    again, _ = run_script("04", QUICK, tmp_path)
    first = quick_records["04"]
    assert again["peak_memory_bytes"] == first["peak_memory_bytes"]
    assert again["breakdown_bytes"] == first["breakdown_bytes"]
    assert again["losses"] == first["losses"]


SNIPPETS = [  # texts of different lengths, so that a batch of them holds padding
    "A gorgeous, witty, seductive movie.",
    "The plot is nothing but boilerplate cliches from start to finish, and the script assumes "
    "that not only would subtlety be lost on the target audience, but that it's also too stupid "
    "to realize that they've already seen this exact same movie a hundred times.",
    "Dull.", "An uplifting, funny and deeply moving story about two unlikely friends.",
]


def batch(size=8, seed=0):
    """(inputs, labels) of random images, as the tiny preset's loader gives them."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 3, 32, 32, generator=generator)
    return {"pixel_values": images}, torch.randint(0, 10, (size,), generator=generator)


def test_mixed_precision_runs_float16_activations_on_float32_weights(tmp_path):
    script = load_script("02")
    model = create_model(PRESETS["tiny"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    activation_dtypes = set()
    for block_linear in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
        block_linear.register_forward_hook(lambda m, i, out: activation_dtypes.add(out.dtype))
    script.train_step(model, optimizer, scaler, *batch(), torch.device("cpu"))
    assert activation_dtypes == {torch.float16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(t.dtype == torch.float32 for s in optimizer.state.values() for t in s.values()
               if t.dim() > 0)


def test_scaler_skips_the_step_and_lowers_the_scale_on_an_inf_gradient():
    script = load_script("02")
    model = create_model(PRESETS["tiny"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    first = next(model.parameters())
    first.register_hook(lambda grad: torch.full_like(grad, math.inf))
    script.train_step(model, optimizer, scaler, *batch(), torch.device("cpu"))
    assert scaler.get_scale() == 512.0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not optimizer.state  # Adam never stepped, so it holds no state yet


def test_bf16_true_keeps_parameters_and_optimizer_state_in_bfloat16(tmp_path):
    _, meter = run_script("03", QUICK, tmp_path)
    assert {p.dtype for p in meter.model.parameters()} == {torch.bfloat16}
    states = [t for s in meter.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.bfloat16}


class GradientCapture:
    """Stands in for the optimizer: keeps a copy of the gradients instead of stepping."""

    def __init__(self, model):
        self.model, self.gradients = model, None

    def step(self):
        self.gradients = [p.grad.clone() for p in self.model.parameters()]

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def step_gradients(model, inputs, labels, accum_steps):
    """The gradients 04's train_step (in float32) leaves for the optimizer."""
    script = load_script("04")
    script.DTYPE = torch.float32  # compare in float32, where summation order is the only difference
    capture = GradientCapture(model)
    script.train_step(model, capture, inputs, labels, torch.device("cpu"), accum_steps)
    return capture.gradients


class SummedTerms:
    """While inside, the size of the terms each gradient element sums, for the linear layers and
    embeddings: a weight's gradient adds, over the batch's samples and tokens, output gradient x
    input, and a bias's adds the output gradients, so their sizes are |output gradient| x |input|
    and |output gradient| summed alike; an embedding row adds the output gradients of the
    positions holding its token (hooks keep them; the parameters' names are the keys).

    The terms, not the result: a key projection's bias has a gradient that is zero in exact
    arithmetic (attention is blind to a constant added to every key), so its computed gradient
    is rounding alone, while the terms it sums are not small."""

    def __init__(self, model):
        self.model, self.sizes, self.hooks = model, {}, []

    def __enter__(self):
        for name, module in self.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.hooks.append(module.register_forward_hook(self.keep_input(name)))
            elif isinstance(module, torch.nn.Embedding):
                self.hooks.append(module.register_forward_hook(self.keep_tokens(name)))
        return self

    def keep_tokens(self, name):
        """An embedding's gradient adds, per token id, the output gradients of its positions."""
        def hook(module, inputs, output):
            tokens = inputs[0].detach().flatten()

            def backward(gradient):
                rows = torch.zeros(module.weight.shape, dtype=torch.float64)
                self.sizes[f"{name}.weight"] = rows.index_add_(
                    0, tokens, gradient.detach().abs().double().flatten(0, -2))
            output.register_hook(backward)
        return hook

    def keep_input(self, name):
        def hook(module, inputs, output):
            size_of_input = inputs[0].detach().abs().double().flatten(0, -2)

            def backward(gradient):
                size_of_gradient = gradient.detach().abs().double().flatten(0, -2)
                self.sizes[f"{name}.weight"] = size_of_gradient.T @ size_of_input
                self.sizes[f"{name}.bias"] = size_of_gradient.sum(dim=0)
            output.register_hook(backward)
        return hook

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def assert_accumulation_adds_up_to_the_whole_batch(model, inputs, labels, accum_steps, tokens):
    """The gradient of `accum_steps` micro-batches equals the whole batch's, within what float32
    rounding of sums over the batch's samples and `tokens` tokens each can produce, scaled by the
    size of the summed terms (tests/support/rounding.py): for linear layers and embeddings, the terms
    themselves; for the rest (normalisation, patch embedding), each sample's own contribution.
    Normwise, as error bounds of matrix products are: every element of a tensor against the
    largest size in it, since the rounding of earlier layers (a normalisation subtracting its
    mean, a softmax) reaches each element in proportion to the layer's terms, not to the
    element, which cancellation can make small."""
    size = len(labels)
    with SummedTerms(model) as terms:
        whole = step_gradients(model, inputs, labels, 1)
    accumulated = step_gradients(model, inputs, labels, accum_steps)
    per_sample = [torch.zeros_like(gradient, dtype=torch.float64) for gradient in whole]
    for sample in range(size):  # each sample's share of the batch's mean loss, in absolute value
        alone = step_gradients(model, {name: value[sample:sample + 1] for name, value in
                                       inputs.items()}, labels[sample:sample + 1], 1)
        for total, gradient in zip(per_sample, alone):
            total += gradient.abs().double() / size
    n = additions(model.config, size * tokens)
    for (name, _), ours, theirs, sample_sizes in zip(model.named_parameters(), accumulated, whole,
                                                      per_sample, strict=True):
        assert_same_sum(ours, theirs, terms.sizes.get(name, sample_sizes).max(), n, what=name)


def padded_batch(preset):
    """(inputs, labels): SNIPPETS tokenized by the text preset's tokenizer, padded to its length."""
    from common.data import tokenizer_for
    encoded = tokenizer_for(preset)(SNIPPETS, padding="max_length", truncation=True,
                                    max_length=preset.max_length, return_tensors="pt")
    inputs = {name: encoded[name] for name in ("input_ids", "attention_mask")}
    assert len(set(inputs["attention_mask"].sum(dim=1).tolist())) == len(SNIPPETS)
    return inputs, torch.tensor([1, 0, 0, 1])


@pytest.mark.numerical
@pytest.mark.parametrize("preset_name", ["tiny", "tiny-text"])
def test_accumulated_gradient_equals_the_whole_batch_gradient(preset_name):
    """4 micro-batches: of 4 images each, or of one snippet each, of different lengths."""
    torch.manual_seed(0)
    preset = PRESETS[preset_name]
    model = create_model(preset)
    if preset.max_length:  # text: padded to the preset's length
        inputs, labels = padded_batch(preset)
        tokens = preset.max_length
    else:
        inputs, labels = batch(16)
        tokens = (preset.image_size // preset.config["patch_size"]) ** 2 + 1  # patches, class token
    assert_accumulation_adds_up_to_the_whole_batch(model, inputs, labels, 4, tokens=tokens)


@pytest.mark.numerical
def test_the_gradient_check_fails_when_a_micro_batch_is_lost(monkeypatch):
    """The bound is tight enough to see a fault: accumulation that drops the last micro-batch."""
    import common.data
    split = common.data.split_batch

    def split_losing_the_last(*args):
        micro_batches = list(split(*args))
        return micro_batches[:-1] if len(micro_batches) > 1 else micro_batches

    monkeypatch.setattr(common.data, "split_batch", split_losing_the_last)
    torch.manual_seed(0)
    preset = PRESETS["tiny"]
    with pytest.raises(AssertionError, match="more than rounding can explain"):
        assert_accumulation_adds_up_to_the_whole_batch(create_model(preset), *batch(16), 4,
                                                       tokens=5)


def test_accumulation_keeps_the_optimizer_steps_of_one_epoch(tmp_path, monkeypatch):
    """A whole epoch of 217 training images (the rest held out), unevaluated: 3 batches of 64 in
    both, the last 25 images dropped, whatever the micro-batches."""
    import common.data
    monkeypatch.setattr(common.data, "DIGITS_SPLITS", (217, 180, 1400))
    steps = {name: run_script(name, ["--epochs", "1"], tmp_path, unevaluated(name))[0]["steps"]
             for name in ("03", "04")}
    assert steps["03"] == steps["04"] == 217 // PRESETS["tiny"].batch_size == 3


def test_sgd_keeps_no_state_and_cosine_ends_at_zero(tmp_path):
    record, meter = run_script("05", ["--epochs", "1", "--max-steps", "5"], tmp_path)
    assert isinstance(meter.optimizer, torch.optim.SGD)
    assert all(not state for state in meter.optimizer.state.values())
    assert record["breakdown_bytes"]["optimizer_state"] == 0
    # CosineAnnealingLR with T_max = optimizer steps: after the last step it is at eta_min = 0
    assert record["final_lr"] == pytest.approx(0.0, abs=1e-12)


def test_on_device_init_never_creates_a_float32_parameter(tmp_path, monkeypatch):
    created = {}
    original_new = torch.nn.Parameter.__new__

    def recording_new(cls, data=None, requires_grad=True):
        created.setdefault(current, set()).add(data.dtype)
        return original_new(cls, data, requires_grad)

    monkeypatch.setattr(torch.nn.Parameter, "__new__", recording_new)
    records = {}
    for current in ("05", "06"):
        records[current], _ = run_script(current, QUICK, tmp_path)
    assert torch.float32 in created["05"]  # the check can see a float32 parameter
    assert created["06"] == {torch.bfloat16}
    assert records["06"]["init_peak_memory_bytes"] < records["05"]["init_peak_memory_bytes"]


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "30", "--accum-steps", "4"], "not divisible by --accum-steps"),
    (["--device", "cuda"], "no CUDA device"),
    (["--batch-size", "0"], "must be positive"),
    (["--lr", "-1"], "must be positive"),
    (["--epochs", "two"], "expected a whole number"),
    (["--preset", "huge"], "invalid choice"),
    (["--results-dir", str(ROOT / "README.md")], "it is a file, not a directory"),
])
def test_bad_input_gets_a_message_that_says_why(argv, message, capsys):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as stop:
        load_script("04").main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_batch_larger_than_the_training_set_stops_with_a_message(tmp_path):
    with pytest.raises(SystemExit) as stop:
        load_script("01").main(["--batch-size", "2000", "--results-dir", str(tmp_path)])
    assert "larger than the 1257 training samples" in str(stop.value.code)
    assert not list(tmp_path.iterdir())  # no record of a run that trained nothing


@pytest.mark.parametrize("preset, what, instead", [("article", "uoft-cs/cifar10", "--preset tiny"),
                                                   ("imdb", "stanfordnlp/imdb", "--preset tiny-text")])
def test_a_hub_preset_offline_fails_at_once_naming_what_and_pointing_offline(monkeypatch, preset,
                                                                             what, instead):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(SystemExit) as stop:
        load_script("01").main(["--preset", preset, "--results-dir", "unused"])
    message = str(stop.value.code)
    assert what in message and instead in message


def test_hub_check_answers_quickly_when_nothing_listens(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    assert hub.hub_reachable(timeout=2.0) is False


def test_the_digits_read_from_their_file_are_scikit_learns(monkeypatch):
    """common/data.py reads the file scikit-learn ships, not through scikit-learn (whose import
    takes longer than the tiny preset's first steps); a missing package says what to install."""
    from sklearn.datasets import load_digits

    import common.data
    grey, labels = common.data.load_digits()
    digits = load_digits()
    assert np.array_equal(grey, digits.images) and grey.dtype == digits.images.dtype
    assert np.array_equal(labels, digits.target) and labels.dtype == np.int64
    monkeypatch.setattr(common.data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install -r requirements.txt"):
        common.data.load_digits()


def test_batches_are_pinned_only_for_a_cuda_device():
    """Pinning creates a CUDA context: a --device cpu run on a GPU machine must not pin."""
    from common.data import load_data
    preset = PRESETS["tiny"]
    assert not load_data(preset, 64, torch.device("cpu")).train.pin_memory
    assert load_data(preset, 64, torch.device("cuda")).train.pin_memory  # built, never iterated


@pytest.mark.parametrize("local_rank, visible, restricted, torchrun, index", [
    (0, 1, False, True, 0), (3, 1, True, False, 0), (1, 2, False, True, 1), (7, 8, False, True, 7),
    (7, 8, True, True, 7),
    (0, 1, True, True, 0)])  # torchrun's per-process GPU (LOCAL_RANK 0, that GPU alone shown)
def test_each_process_takes_its_own_gpu_or_the_one_it_is_shown(local_rank, visible, restricted,
                                                                 torchrun, index):
    from common.distributed import cuda_index
    assert cuda_index(local_rank, visible, restricted, torchrun) == index


@pytest.mark.parametrize("local_rank, visible, restricted, torchrun, said", [
    (2, 2, False, True, "torchrun shows every process"), (1, 1, False, False, "start at most"),
    # a container or job showing one GPU to torchrun's 2 processes: both would take it
    (1, 1, True, True, "(CUDA_VISIBLE_DEVICES=0), and torchrun shows every process")])
def test_more_processes_than_gpus_stop_with_a_message(local_rank, visible, restricted, torchrun,
                                                      said, monkeypatch):
    from common.distributed import cuda_index
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(SystemExit, match=f"process {local_rank} on this machine has no GPU of "
                                         f"its own: {visible} visible") as stopped:
        cuda_index(local_rank, visible, restricted, torchrun)
    assert said in str(stopped.value)


@pytest.mark.parametrize("argv, missing, how", [
    (["01_baseline.py", "--preset", "article", "--device", "cpu"],
     "uoft-cs/cifar10 is not in this machine's Hugging Face cache", ["without HF_HUB_OFFLINE=1",
                                                                      "--preset tiny"]),
    (["03_bf16.py", "--model", "someone/no-such-model", "--estimate"],
     "someone/no-such-model is not in this machine's Hugging Face cache", []),
], ids=["a-preset's-data", "a-hub-model"])
def test_offline_with_nothing_cached_says_what_is_missing_and_how_to_get_it(argv, missing, how,
                                                                             tmp_path):
    """A command line in a process of its own, offline, with an empty cache: one message, no
    traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache")}
    done = subprocess.run([sys.executable, *argv, "--results-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert missing in output and all(words in output for words in how)


def test_offline_model_not_cached_is_named(monkeypatch):
    from common import model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def not_cached(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    monkeypatch.setattr(model.model_class(PRESETS["article"]), "from_pretrained", not_cached)
    with pytest.raises(SystemExit, match="google/vit-large-patch16-224 is not in this machine's"):
        model.create_model(PRESETS["article"])


def test_the_meter_tracks_until_two_optimizer_steps_were_taken():
    """A float16 scaler that skips the first steps (an overflow at the first scale) must not
    leave the optimizer state out of the peak: tracking goes on until steps are taken."""
    from common.memory import TRACKED_STEPS, MemoryMeter
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    meter = MemoryMeter(torch.device("cpu"), model, optimizer)
    tracked = []
    for step in range(6):
        tracked.append(meter.tracking())
        with meter.step():
            model(torch.randn(8, 64)).sum().backward()
            if step >= 2:  # the first two steps are skipped, as GradScaler skips them
                optimizer.step()
            optimizer.zero_grad()
    assert tracked == [True, True, True, True, False, False]
    assert meter.steps_taken == 4 and meter.result()["tracked_steps"] == 2 + TRACKED_STEPS
    assert meter.breakdown["optimizer_state"] >= 2 * 4 * (64 * 64 + 64)  # at least Adam's 2 moments


def initial_weights(dtype, device):
    torch.manual_seed(0)
    with torch.device(device):
        return create_model(PRESETS["tiny"], dtype=dtype)


def test_05_and_06_start_from_the_same_weights():
    """05 builds float32 on the CPU and converts; 06 builds bfloat16 where it trains. The
    weights are drawn on the CPU either way, so they match to the last bit."""
    torch.manual_seed(0)
    converted = create_model(PRESETS["tiny"]).to(torch.bfloat16)  # 05
    created = initial_weights(torch.bfloat16, "cpu")  # 06
    for (name, before), after in zip(converted.named_parameters(), created.parameters()):
        assert after.dtype == torch.bfloat16 and torch.equal(before, after), name


@requires_cuda
def test_05_and_06_start_from_the_same_weights_on_a_gpu():
    torch.manual_seed(0)
    converted = create_model(PRESETS["tiny"]).to("cuda", torch.bfloat16)  # 05
    created = initial_weights(torch.bfloat16, "cuda")  # 06
    assert all(param.is_cuda for param in created.parameters())
    for before, after in zip(converted.parameters(), created.parameters()):
        assert torch.equal(before, after)


def test_initial_weights_follow_the_models_own_rules():
    model = initial_weights(torch.float32, "cpu")
    std = PRESETS["tiny"].config["initializer_range"]
    for name, param in model.named_parameters():
        if "norm" in name:
            assert torch.all(param == (1 if name.endswith("weight") else 0)), name
        elif name.endswith("bias"):
            assert torch.all(param == 0), name
        elif param.numel() > 1000:
            assert param.std().item() == pytest.approx(std, rel=0.1), name


class Parsed(Exception):
    """Raised in place of training: the flags the script's own parse_args returned."""


def parsed_flags(step, argv, results_dir):
    """The script's own parse_args(argv), called as its main() calls it, without training."""
    script = import_script(step.path)
    parse_args = script.parse_args

    def parse_only(*args, **kwargs):
        raise Parsed(parse_args(*args, **kwargs))
    script.parse_args = parse_only
    with pytest.raises(Parsed) as parsed:
        script.main([*argv, "--device", "cpu", "--results-dir", str(results_dir)])
    return parsed.value.args[0]


@pytest.mark.parametrize("step", STEPS.values(), ids=lambda step: step.id)
def test_steps_py_gives_each_script_the_accumulation_and_task_it_parses(step, tmp_path, capsys):
    """`accum_steps` is the script's --accum-steps default (1: it takes no micro-batches), and
    `task` the only --task it trains (None: it takes either)."""
    args = parsed_flags(step, [], tmp_path)
    assert args.accum_steps == step.accum_steps
    assert args.task == (step.task or "classification")
    for other in ("classification", "causal-lm"):
        if step.trains(other):
            assert parsed_flags(step, ["--task", other], tmp_path).task == other
        else:
            with pytest.raises(SystemExit):
                parsed_flags(step, ["--task", other], tmp_path)
            assert f"trains --task {step.task} only" in capsys.readouterr().err
