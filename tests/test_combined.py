"""10_combined.py: each block is its script's code under its script's tag; each script's switch set
(steps.py) trains as the script does; every pair of switches trains, or stops with one line."""
import ast
import dataclasses
import gc
import io
import itertools
import math
import os
import sys
import tokenize

import pytest
import torch
from torch.distributed.tensor import DTensor

import common.data
import common.memory
import common.presets
from common.memory import is_compiled
from common.model import offloads_to_host, transformer_blocks
from conftest import QUICK, TEXT, assert_follows, load_script, run_script, script_path, unevaluated
from steps import STEPS
from support.tags import TAGS, has_tag

STEP_OF_TAG = {tag: step for step, tag in TAGS.items()}
COMBINED = "10"
CAUSAL_LM = ["--task", "causal-lm"]

# Code under a tag that is not its script's line for line, and why
ADAPTED_BLOCKS = {
    "CheckpointedBlock": "05c's wrapper with 05d's policy and 05e's hooks, each used when its "
                         "switch is on (the hooks a nullcontext otherwise)",
    "LoRALinear": "the adapters take the weight's dtype, which --precision chooses, where 07a "
                  "has its DTYPE",
    "add_adapters": "its messages say to leave --lora-rank out, not to run 07a's parent script, "
                    "and suggest a rank (10 has no default one)",
    "in_four_bits": "the products in the weight's dtype, which --precision chooses, where 07b has "
                    "its DTYPE",
}
ADAPTED_LINES = {
    "inputs, labels = to_device(inputs, device, dtype), labels.to(device, non_blocking=True)":
        "03's line with the dtype --precision chooses (03: DTYPE)",
    "micro_inputs = to_device(micro_inputs, device, dtype)": "the same (04)",
    "score = evaluate(model, data.val, device, dtype,": "04's line with the dtype --precision "
        "chooses (04: DTYPE)",
    "test_score = evaluate(model, data.test, device, dtype,": "the same",
    "pieces=args.accum_steps, loss=evaluation_loss)": "05g's line with the loss --loss chooses "
        "(05g: chunked_loss)",
    "evaluation_loss = {\"chunked\": chunked_loss, \"fused\": fused_loss}.get(args.loss)": "05g "
        "and 05h evaluate with their own loss; 10 with the loss --loss chooses",
    "def step_on_host(optimizer, weights):": "05f's lines of train_step as a function, also "
                                             "called for one weight in backward",
    "sharded = dist.is_initialized()": "07 always shards; 10 under torchrun or with --offload",
    "for param in trained:": "only the trained weights (LoRA's frozen ones get no gradient)",
    "return torch.optim.SGD(weights, lr=lr)": "make_optimizer: the optimizer over `weights`",
    "return torch.optim.Adafactor(weights, lr=lr)": "make_optimizer",
    "return AdamW8bit(weights, lr=lr, weight_decay=0.0)": "make_optimizer",
    "return AdamW4bit(weights, lr=lr)": "make_optimizer",
    "return AdamStochasticRounding(weights, lr=lr)": "make_optimizer",
    "return preset.sgd_lr": "learning_rate: each script's default rate",
    "return 0.01": "learning_rate",
    "return preset.qlora_lr": "learning_rate",
    "return preset.lora_lr if args.lora_rank else preset.lr": "learning_rate",
    "schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(each, T_max=total_steps)":
        "one schedule per optimizer (several with --optimizer-in-backward)",
    "scaler = torch.amp.GradScaler(device.type) if args.precision == \"mixed\" else None":
        "02's scaler, made only for --precision mixed",
    "with torch.autocast(device_type=device.type, dtype=torch.float16,": "02's autocast, "
        "enabled only for --precision mixed",
    "scale(loss).backward()": "02's scaler.scale(loss).backward(), or a plain backward",
    "scale = (lambda loss: loss) if scaler is None else scaler.scale": "the same",
    "step_on_host(optimizer, trained)": "05f's step, as a function for --optimizer-in-backward too",
    "step_on_host(optimizers[param], [param])": "the same, one weight at a time",
    "for weight, host_weight in zip(weights, host_weights):": "05f's loop over the weights given",
    "if weights[0].is_cuda:": "05f's wait, on the weights' device (05f: its `device`)",
    "fused = args.optimizer_on_host and args.device.type == \"cuda\"": "make_optimizer: "
        "05f's fused Adam on a GPU's host, whatever --optimizer-on-host's parent step",
    "if args.compile and args.checkpointing == \"offloaded\":": "05e's compile of each block, "
        "only when its hooks are on",
    "if args.compile and args.checkpointing != \"offloaded\":": "07's compile of each block "
        "before sharding, unless 05e compiled it already",
    "blocks[index] = CheckpointedBlock(block, offload, selective)": "the wrapper of every kind",
    "def __init__(self, block, offload, selective):": "CheckpointedBlock (above)",
    "self.selective = selective": "CheckpointedBlock (above)",
    "if self.selective:": "CheckpointedBlock (above)",
    "selective = args.checkpointing == \"selective\"": "05d's checkpointing, when chosen",
    "dtype = base.weight.dtype": "LoRALinear (above)",
    "if args.lora_rank and preset.model is None:": "07a's note, when adapters are on",
    "elif optimizer is not None:": "the same",
    "model = create_model(preset, dtype=dtype)": "06's creation in the dtype --precision names",
    "return chunked_loss(model, inputs, labels)": "05g's loss of one micro-batch",
    "check_plain_output_layer(model.config, \"Train it with --loss model\")":
        "05g's refusal, naming --loss model instead of 04",
    "return fused_loss(model, inputs, labels)": "05h's loss of one micro-batch",
    "if args.checkpointing.startswith(\"budget:\"):": "05k's budget, when --checkpointing names one",
    "args.compile = True": "05k always compiles; 10 when --checkpointing budget:F is chosen",
    "budget = args.checkpointing.startswith(\"budget:\")": "refusal: the budget refused where "
        "--compile is, as only compiled code heeds it",
    "check_output_layer_without_bias(model, \"Train it with --loss chunked\")":
        "05h's refusal, naming --loss chunked instead of 05g",
}


def tagged_lines(source):
    """[(line number, code without its comment, comment)] for every line with a comment."""
    lines = source.splitlines()
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            found.append((row, lines[row - 1][:column].strip(), token.string.lstrip("#").strip()))
    return found


def code_of(path):
    """Every line of a script without its comment, stripped."""
    return {line.split("  #")[0].strip() for line in path.read_text().splitlines()}


def definitions(path):
    return {node.name: node for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_every_technique_tag_is_in_the_combined_script():
    comments = [comment for _, _, comment in tagged_lines(script_path(COMBINED).read_text())]
    missing = [tag for tag in TAGS.values() if not any(has_tag(comment, tag) for comment in comments)]
    assert missing == []


def foreign_code(combined, adapted_lines=ADAPTED_LINES, adapted_blocks=ADAPTED_BLOCKS):
    """[(line, tag, code)] under a tag in `combined` that is not the code of the tag's script:
    a tagged line must be a line of that script, a tagged function or class that script's (or
    `adapted_lines` and `adapted_blocks` say why not)."""
    ours = definitions(combined)
    foreign = []
    for number, code, comment in tagged_lines(combined.read_text()):
        for tag in [tag for tag in STEP_OF_TAG if has_tag(comment, tag)] if code else []:
            source = script_path(STEP_OF_TAG[tag])
            name = code.split()[1].split("(")[0].rstrip(":") if code.startswith(("def ", "class ")) else None
            if name in ours and name in definitions(source):
                if ast.dump(ours[name]) != ast.dump(definitions(source)[name]) and name not in adapted_blocks:
                    foreign.append((number, tag, f"{name} differs from {source.name}'s"))
            elif code not in code_of(source) and code not in adapted_lines:
                foreign.append((number, tag, code))
    return foreign


def test_code_under_a_tag_is_its_scripts_code():
    assert foreign_code(script_path(COMBINED)) == []


def test_the_tag_check_finds_a_changed_line_and_a_changed_function(tmp_path):
    changed = tmp_path / "10_changed.py"
    changed.write_text(script_path(COMBINED).read_text()
                       .replace("torch.optim.SGD(weights, lr=lr)  # plain SGD",
                                "torch.optim.SGD(weights, lr=lr, momentum=0.9)  # plain SGD")
                       .replace("(bits + noise) & -(1 << 16)", "(bits + noise) & -(1 << 15)"))
    found = {(tag, code) for _, tag, code in foreign_code(changed)}
    assert found == {("plain SGD", "return torch.optim.SGD(weights, lr=lr, momentum=0.9)"),
                     ("stochastic rounding",
                      "stochastic_round differs from 04b_bf16_stochastic_rounding.py's")}


# ---- equal to the scripts ------------------------------------------------------------------

def read_once(read):
    """`read` (a data set reader of common.data), reading each data set once in this module."""
    kept = {}

    def reader(*args):
        key = (repr(args), common.data.SNIPPET_SPLITS)
        if key not in kept:
            kept[key] = read(*args)
        return kept[key]
    return reader


def smallest(config):
    """A preset's model config with one block: every technique here acts on each block (wraps,
    shards, adapts it) or around the blocks, so one block reaches each, at a fraction of the time."""
    return {**config, "num_hidden_layers": 1}


@pytest.fixture(scope="module", autouse=True)
def smallest_shapes_one_thread_and_each_data_set_read_once():
    """The runs here compare two runs of one shape, or ask what runs: tiny and tiny-text with one
    block, tiny-text's texts cut at 16 tokens (its output layer over 30,522 words is most of a
    step); a few operators on small tensors each, on one thread (two threads of one process only
    wait for each other on a busy machine); each data set read once; the objects alive before
    (modules, earlier tests') left out of the garbage collections each run's creation starts
    with (common/memory.py: measure_creation), which otherwise take most of a small run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    presets, decoders = common.presets.PRESETS, common.presets.CAUSAL_LM
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(presets, "tiny", dataclasses.replace(
            presets["tiny"], config=smallest(presets["tiny"].config)))
        patch.setitem(presets, "tiny-text", dataclasses.replace(
            presets["tiny-text"], config=smallest(presets["tiny-text"].config), max_length=16))
        patch.setitem(decoders, "tiny-text", {
            **decoders["tiny-text"], "config": smallest(decoders["tiny-text"]["config"])})
        for name in ("digits_datasets", "movie_snippet_datasets"):
            patch.setattr(common.data, name, read_once(getattr(common.data, name)))
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
    torch.set_num_threads(threads)


def created_as_06(script):
    """The script with 06's creation, as the combined script always creates: a decoder created in
    bfloat16 keeps its rotary frequencies (float32 buffers) in float32, which the script's
    `create_model(preset).to(device, DTYPE)` converts to bfloat16 (32 bytes, and the fifth digit
    of the loss, on tiny-text)."""
    create = script.create_model

    def created(preset):
        model = create(preset, dtype=script.DTYPE)  # on the CPU, where the test trains
        model.to = lambda *args, **kwargs: model  # already where, and in what, it trains
        return model
    script.create_model = created


@pytest.fixture(scope="module")
def combined_runs():
    """The combined script's records by command line (05 and 06 have the same switches)."""
    return {}


@pytest.mark.parametrize("name", [step for step in STEPS if not STEPS[step].combined])
def test_each_scripts_switches_train_as_the_script(name, tmp_path, small_snippets, monkeypatch,
                                                   combined_runs):
    step = STEPS[name]
    flags = [*QUICK, "--batch-size", "8", *(CAUSAL_LM if step.task else [])]  # micro-batches of 2
    script = unevaluated(name)
    if step.task:
        created_as_06(script)
    expected, _ = run_script(name, flags, tmp_path / "script", script)
    if step.sharded:  # as under torchrun, in a group of one
        monkeypatch.setenv("WORLD_SIZE", "1")
    command = (*flags, *step.switches, "sharded" if step.sharded else "")
    if command not in combined_runs:
        combined_runs[command], _ = run_script(COMBINED, [*flags, *step.switches],
                                               tmp_path / "combined", unevaluated(COMBINED))
    actual = combined_runs[command]
    assert actual["peak_memory_bytes"] == expected["peak_memory_bytes"]
    assert actual["breakdown_bytes"] == expected["breakdown_bytes"]
    assert actual["world_size"] == expected["world_size"]
    assert actual["reshard_after_forward"] == expected["reshard_after_forward"]  # null unsharded
    assert_follows(actual["losses"], expected["losses"], "tiny-text" if step.task else "tiny")


# ---- every pair trains or is refused -------------------------------------------------------

# each switch (a name and its flags) in groups: two switches of one group are one switch's values
GROUPS = [
    {"fp32": ["--precision", "fp32"], "mixed": ["--precision", "mixed"]},
    {"stochastic-rounding": ["--stochastic-rounding"]},
    {"accum": ["--accum-steps", "2"]},
    {"adamw-8bit": ["--optimizer", "adamw-8bit"], "adamw-4bit": ["--optimizer", "adamw-4bit"],
     "adafactor": ["--optimizer", "adafactor"], "sgd": ["--optimizer", "sgd"]},
    {"on-host": ["--optimizer-on-host"],
     "to-host": ["--optimizer-on-host", "--gradients-to-host"]},
    {"in-backward": ["--optimizer-in-backward"]},
    {"full": ["--checkpointing", "full"], "selective": ["--checkpointing", "selective"],
     "offloaded": ["--checkpointing", "offloaded"]},
    {"chunked": ["--loss", "chunked"], "fused": ["--loss", "fused"]},
    {"lora": ["--lora-rank", "4"], "qlora": ["--lora-rank", "4", "--qlora"]},
    {"offload": ["--offload"]},
    {"reshard": ["--reshard-after-forward", "false"]},
]
SWITCHES = {name: flags for group in GROUPS for name, flags in group.items()}
PAIRS = [(first, second) for one, other in itertools.combinations(GROUPS, 2)
         for first in one for second in other]
TEXT_SWITCHES = {"chunked", "fused", "lora", "qlora"}  # on a decoder, tiny-text under --task causal-lm
# what each refused pair says: the words after "error: " name both switches
REFUSED = {
    frozenset({"in-backward", "accum"}): "--optimizer-in-backward with --accum-steps",
    frozenset({"in-backward", "mixed"}): "--optimizer-in-backward with --precision mixed",
    frozenset({"stochastic-rounding", "fp32"}): "--stochastic-rounding with --precision fp32",
    frozenset({"stochastic-rounding", "mixed"}): "--stochastic-rounding with --precision mixed",
    frozenset({"stochastic-rounding", "adamw-8bit"}):
        "--stochastic-rounding with --optimizer adamw-8bit",
    frozenset({"stochastic-rounding", "adamw-4bit"}):
        "--stochastic-rounding with --optimizer adamw-4bit",
    frozenset({"stochastic-rounding", "adafactor"}): "--stochastic-rounding with --optimizer adafactor",
    frozenset({"stochastic-rounding", "sgd"}): "--stochastic-rounding with --optimizer sgd",
    frozenset({"on-host", "offload"}): "--optimizer-on-host with --offload",
    frozenset({"to-host", "offload"}): "--optimizer-on-host with --offload",
    frozenset({"to-host", "in-backward"}): "--gradients-to-host with --optimizer-in-backward",
    frozenset({"to-host", "mixed"}): "--optimizer-on-host with --precision mixed",
    frozenset({"adafactor", "offload"}): "--optimizer adafactor with --offload",
    frozenset({"on-host", "mixed"}): "--optimizer-on-host with --precision mixed",
    frozenset({"fused", "mixed"}): "--loss fused with --precision mixed",
    frozenset({"lora", "offload"}): "--lora-rank with --offload",
    frozenset({"qlora", "offload"}): "--lora-rank with --offload",
    frozenset({"mixed", "offload"}): "--precision mixed with --offload",
    frozenset({"qlora", "mixed"}): "--qlora with --precision mixed",
}
# --reshard-after-forward says how FSDP shards: with anything but --offload, sharding is off
REFUSED.update({frozenset({"reshard", name}): "--reshard-after-forward without sharding"
                for name in SWITCHES if name not in ("reshard", "offload")})
LR = ["--lr", "0.05"]  # updates large enough to show in every bfloat16 weight after two steps


class Took:
    """What a run built and called, for the check that no switch was dropped."""

    def __init__(self, module, monkeypatch):
        self.module, self.meter, self.initial, self.calls = module, None, None, {}
        self.scalers, self.reshard, self.stepped, self.below_rounding = 0, [], {}, {}
        took = self

        class Meter(module.MemoryMeter):
            def __init__(self, device, model, optimizer):
                super().__init__(device, model, optimizer)
                took.meter = self
                took.initial = [local(param).clone() for param in model.parameters()
                                if param.requires_grad]
                for each in optimizer if isinstance(optimizer, list) else [optimizer]:
                    took.stepped[each] = [False] * len(weights_of(each))
                    took.below_rounding[each] = [isinstance(each, torch.optim.SGD)] * len(weights_of(each))
                    each.register_step_pre_hook(took.note_gradients)

        module.MemoryMeter = Meter
        module.evaluate = lambda *args, **kwargs: float("nan")
        for name in ("chunked_loss", "fused_loss", "split_batch", "step_on_host", "GradientsToHost"):
            monkeypatch.setattr(module, name, self.counting(name, getattr(module, name)))
        shard = module.fully_shard
        monkeypatch.setattr(module, "fully_shard", lambda *args, **kwargs: (
            self.reshard.append(kwargs.get("reshard_after_forward", True)), shard(*args, **kwargs))[1])
        scaler = torch.amp.GradScaler

        class Scaler(scaler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                took.scalers += 1

        monkeypatch.setattr(torch.amp, "GradScaler", Scaler)

    def note_gradients(self, optimizer, args, kwargs):
        """Which of the optimizer's weights it steps with a gradient that is not zero; and, for
        plain SGD on bfloat16 weights, which it steps by less than half the gap between a
        weight's bfloat16 neighbours in every element, every step (steps rounded away)."""
        lr = optimizer.param_groups[0]["lr"]
        for index, weight in enumerate(weights_of(optimizer)):
            gradient = None if weight.grad is None else local(weight.grad).float()
            if gradient is not None and gradient.count_nonzero() > 0:
                self.stepped[optimizer][index] = True
            if gradient is not None and weight.dtype == torch.bfloat16:  # 8 significant bits
                half_gap = local(weight).float().abs().log2().floor().sub(8).exp2()
                if (lr * gradient.abs() > half_gap).any():
                    self.below_rounding[optimizer][index] = False
            else:
                self.below_rounding[optimizer][index] = False

    def stepped_with_a_gradient(self):
        """For each trained weight, in the model's order: stepped with a gradient not zero."""
        return [flag for flags in self.stepped.values() for flag in flags]

    def steps_rounded_away(self):
        """For each trained weight, in the model's order: every plain SGD step rounded away."""
        return [flag for flags in self.below_rounding.values() for flag in flags]

    def counting(self, name, function):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args, **kwargs)
        return counted


def weights_of(optimizer):
    return [weight for group in optimizer.param_groups for weight in group["params"]]


def local(tensor):
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def took_effect(name, module, took, record):
    """Whether switch `name` did what it says in this run."""
    model, optimizer = took.meter.model, took.meter.optimizer
    first = optimizer[0] if isinstance(optimizer, list) else optimizer
    weights = [param for param in model.parameters() if param.requires_grad]
    dtype = weights[0].dtype
    blocks = transformer_blocks(model)
    return {
        "fp32": lambda: dtype == torch.float32 and took.scalers == 0,
        "mixed": lambda: dtype == torch.float32 and took.scalers == 1,
        "stochastic-rounding": lambda: isinstance(first, module.AdamStochasticRounding),
        "accum": lambda: record["accum_steps"] == 2 and took.calls.get("split_batch", 0) >= 2,
        "adamw-8bit": lambda: type(first).__name__ == "AdamW8bit",
        "adamw-4bit": lambda: isinstance(first, module.AdamW4bit),
        "adafactor": lambda: isinstance(first, torch.optim.Adafactor),
        "sgd": lambda: isinstance(first, torch.optim.SGD),
        "on-host": lambda: took.calls.get("step_on_host", 0) >= 2 and not any(
            param is weight for param in first.param_groups[0]["params"] for weight in weights),
        "to-host": lambda: took.calls.get("GradientsToHost", 0) == 1 and took.calls.get(
            "step_on_host", 0) >= 2 and all(weight.grad is None for weight in weights),
        "in-backward": lambda: isinstance(optimizer, list) and len(optimizer) == len(weights),
        "full": lambda: all(isinstance(block, module.CheckpointedBlock) for block in blocks),
        "selective": lambda: all(block.selective for block in blocks),
        "offloaded": lambda: all(isinstance(block.offload, module.OffloadedInputs) for block in blocks),
        "chunked": lambda: took.calls.get("chunked_loss", 0) >= 2,
        "fused": lambda: took.calls.get("fused_loss", 0) >= 2,
        "lora": lambda: any(isinstance(layer, module.LoRALinear) for layer in model.modules()),
        "qlora": lambda: any(type(layer.base).__name__ == "Linear4bit" for layer in model.modules()
                     if isinstance(layer, module.LoRALinear)),
        "offload": lambda: offloads_to_host(model),
        "reshard": lambda: took.reshard and not any(took.reshard[:-1]),  # the blocks': the root's is kept
        "compile": lambda: is_compiled(model),
        "budget": lambda: all(block._compiled_call_impl is not None for block in blocks),
    }[name]()


def run_switches(names, tmp_path, monkeypatch, extra=()):
    """Run 10 with the switches `names` for two untracked steps; returns (record, Took), or the
    message it stopped with."""
    monkeypatch.setattr(common.memory, "TRACKED_STEPS", 0)  # the matrix asks what runs, not memory
    module = load_script(COMBINED)
    monkeypatch.setitem(sys.modules, module.__name__, module)  # (the compiler imports its classes)
    took = Took(module, monkeypatch)
    text = any(name in TEXT_SWITCHES for name in names)
    flags = [*QUICK, *LR, "--batch-size", "4", *(TEXT if text else []), *(CAUSAL_LM if text else []),
             *extra, *(flag for name in names for flag in SWITCHES[name])]
    try:
        record, _ = run_script(COMBINED, flags, tmp_path, module)
    except SystemExit as stop:
        return str(stop.code)
    return record, took


def assert_trains(names, result):
    """Two steps with a finite loss; every trained weight stepped with a gradient, and changed.
    In bfloat16 a step smaller than half the gap between neighbouring numbers is lost (04b's
    reason): plain SGD's may leave a weight as it was where each of its steps was that small
    (checked), and so may Adafactor's on a LoRA A matrix (its gradient is zero until B, zero at
    first, has moved); Adam's normalised step does not."""
    assert not isinstance(result, str), f"{names}: refused: {result}"
    record, took = result
    assert all(math.isfinite(loss) for loss in record["losses"]) and record["steps"] == 2, names
    assert all(took.stepped_with_a_gradient()), f"{names}: weights without a gradient"
    trained = [local(param) for param in took.meter.model.parameters() if param.requires_grad]
    assert len(took.stepped_with_a_gradient()) == len(trained), names
    unchanged = [index for index, (before, after) in enumerate(zip(took.initial, trained, strict=True))
                 if torch.equal(before, after)]
    if "sgd" in names:
        unchanged = [index for index in unchanged if not took.steps_rounded_away()[index]]
    adapters = {"lora", "qlora"} & set(names)
    if trained[0].dtype == torch.bfloat16 and "adafactor" in names and adapters:
        named = [name for name, param in took.meter.model.named_parameters() if param.requires_grad]
        unchanged = [index for index in unchanged if not named[index].endswith("down.weight")]
    assert unchanged == [], f"{names}: weights left as they were: {unchanged}"
    for name in names:
        assert took_effect(name, took.module, took, record), f"{names}: {name} had no effect"


@pytest.mark.parametrize("first, second", PAIRS)
def test_every_pair_of_switches_trains_or_is_refused_in_one_line(first, second, tmp_path,
                                                                  monkeypatch, small_snippets):
    result = run_switches([first, second], tmp_path, monkeypatch)
    refused = REFUSED.get(frozenset({first, second}))
    if refused:
        assert isinstance(result, str) and "\n" not in result, (first, second, result)
        assert result.startswith(f"error: {refused}:"), result
    else:
        assert_trains((first, second), result)


SWITCHES["compile"] = ["--compile"]  # in a few runs only: compiling takes seconds each
STACKS = [
    ("compile", "offloaded"), ("compile", "offload"),
    ("budget", "offload"),  # each block compiled before it is sharded, under the budget
    ("accum", "adamw-8bit", "selective"),
    ("chunked", "in-backward", "full"),
    ("sgd", "offload", "full", "reshard"),  # 09 at ZeRO-2's memory
    ("qlora", "chunked", "offloaded", "accum", "on-host"),
    ("lora", "fused", "to-host", "accum", "selective"),  # a frozen output layer: no gradient made
    ("adamw-4bit", "to-host", "accum", "offloaded"),  # 4-bit states in host memory
    # the whole stack in one process: each weight's 8-bit AdamW step on the host during
    # backward, activations recomputed from inputs in host memory, the loss fused
    ("fused", "offloaded", "adamw-8bit", "in-backward", "on-host"),
]


SWITCHES["budget"] = ["--checkpointing", "budget:0.5"]  # compiled: in a few runs only


@pytest.mark.parametrize("text", ["budget:1.5", "budget:half", "partial"])
def test_a_checkpointing_kind_it_does_not_know_is_a_usage_error(text, capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script(COMBINED).main(["--checkpointing", text])
    assert stopped.value.code == 2
    assert "argument --checkpointing:" in capsys.readouterr().err


@pytest.mark.parametrize("names", STACKS, ids="+".join)
def test_stacked_switches_train(names, tmp_path, monkeypatch, small_snippets):
    assert_trains(names, run_switches(names, tmp_path, monkeypatch))


# what the estimate is checked on beside the default (which tests/test_causal_lm.py estimates, as
# for every script): the activation techniques stacked in one process; and QLoRA, whose 4-bit
# weights the estimate stands in for (estimate/fake/four_bit.py) as for 07b
ESTIMATED = {"fused+offloaded+adamw-8bit+in-backward+on-host": [
                 *TEXT, *CAUSAL_LM, "--loss", "fused", "--checkpointing", "offloaded",
                 "--optimizer", "adamw-8bit", "--optimizer-in-backward", "--optimizer-on-host"],
             "qlora": ["--lora-rank", "8", "--qlora"]}


@pytest.mark.parametrize("flags", ESTIMATED.values(), ids=ESTIMATED)
def test_the_estimate_on_the_cpu_is_the_runs_peak(flags, tmp_path, small_snippets):
    from estimate.predict import predict
    flags = [*flags, "--batch-size", "8"]
    real, _ = run_script(COMBINED, [*QUICK, *flags], tmp_path, unevaluated(COMBINED))
    predicted = predict(script_path(COMBINED), [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]
    assert predicted["parameter_count"] == real["parameter_count"]


def test_every_listed_adaptation_is_needed():
    """Each line and block listed is code under a tag that differs from its script's."""
    foreign = {code for _, _, code in foreign_code(script_path(COMBINED), {}, {})}
    assert set(ADAPTED_LINES) <= foreign
    assert {f"{name} differs" for name in ADAPTED_BLOCKS} <= {code.split(" from ")[0] for code in foreign}


def test_a_stray_world_size_is_refused_and_the_estimate_shards_over_world_size(monkeypatch, tmp_path):
    """WORLD_SIZE=2 left in the environment without a launcher (no RANK) would train one process
    as a group of one: refused with what to do; WORLD_SIZE=1 alone still asks for a group of one.
    --world-size N is the processes the estimate assumes, as 07-09 take it."""
    combined = load_script(COMBINED)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="WORLD_SIZE=2 is set, but no launcher started this process"):
        combined.main([*QUICK, "--results-dir", str(tmp_path)])
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert combined.launched_sharded(combined.parse_args("", QUICK, flags=combined.switches))
    monkeypatch.delenv("WORLD_SIZE")
    from estimate.predict import predict
    record = predict(script_path(COMBINED), ["--accum-steps", "2", "--optimizer", "sgd"], world_size=2)
    assert record["world_size"] == 2 and record["reshard_after_forward"] is True
    assert "WORLD_SIZE" not in os.environ  # as it was
