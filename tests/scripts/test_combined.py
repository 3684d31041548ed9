"""10_combined.py: each definition of its appendix is its script's, or says why not; each script's
switch set (steps.py) trains as the script does; every pair of switches trains, or stops with the
one line its table of refusals gives, naming both."""
import ast
import dataclasses
import itertools
import math
import os
import re
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

import common.data
import common.memory
import common.presets
from common.memory import is_compiled
from common.model import offloads_to_host, transformer_blocks
from conftest import QUICK, TEXT, assert_follows, load_script, run_script, script_path, unevaluated
from estimate.collector import frozen
from steps import STEPS, import_script
from support.tags import TAGS, has_tag, switch_pairs

COMBINED = "10"
CAUSAL_LM = ["--task", "causal-lm"]
BANNER = re.compile(r"^# ---- (\S+\.py): ")  # an appendix section: "# ---- 05c_...py: tag ---"
APPENDIX = "# ==== the techniques"  # the appendix's first line

# Definitions of the appendix that are not their script's as it is, and why
ADAPTED = {
    "step_in_backward": "04a's hooks as a function over each trained weight and its optimizer",
    "step_and_free": "04a's closure as a function; under --optimizer-on-host it steps through "
                     "the host (05f's step_on_host)",
    "apply_checkpointing": "05c's wrapping lines as a function, with 05d's policy and 05e's hooks "
                           "(and 05e's compile of each block) when their kind is chosen",
    "CheckpointedBlock": "05c's wrapper with 05d's policy and 05e's hooks, each used when its "
                         "--checkpointing kind is chosen (the hooks a nullcontext otherwise)",
    "host_copies": "05f's host copies of the weights as a function",
    "step_on_host": "05f's lines of train_step as a function, also called for one weight in backward",
    "check_loss": "05g's and 05h's checks of the output layer, naming --loss instead of a script",
    "GradientsOnTheDevice": "not 05i's: what 10 adds up with when --gradients-to-host is off",
    "apply_mlp_tiles": "05l's wrapping lines as a function, called for every run: it wraps no "
                       "block without --mlp-tiles, so that the recipe tests no more switches",
    "apply_compile": "05k's compile lines as a function, its budget 1.0 (the compiler's own) unless "
                     "--checkpointing budget:F names one",
    "apply_sharding": "07's sharding lines as a function, with 08's offload policy and the sharded "
                      "losses' root forward",
    "apply_adapters": "07a's lines as a function, with its note on a model drawn at random",
    "LoRALinear": "the adapters take the weight's dtype, which --precision chooses, where 07a has "
                  "its DTYPE",
    "add_adapters": "its messages say to leave --lora-rank out, not to run 07a's parent script, "
                    "and suggest a rank (10 has no default one)",
    "apply_four_bits": "07b's loop over the adapted layers as a function",
    "in_four_bits": "the products in the weight's dtype, which --precision chooses, where 07b has "
                    "its DTYPE",
}


def top_level(path):
    """{name: node} of the module's functions, classes and assignments to one name."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node
    return found


def appendix(path):
    """[(name, the script its section's banner names, or None for 10's own, node)] of each
    definition after the appendix's first line, in order."""
    lines = path.read_text().splitlines()
    start = next(number for number, line in enumerate(lines, 1) if line.startswith(APPENDIX))
    banners = [(number, (match[1] if (match := BANNER.match(line)) else None))
               for number, line in enumerate(lines, 1) if line.startswith("# ---- ")]
    found = []
    for name, node in top_level(path).items():
        if node.lineno > start:
            script = [script for number, script in banners if number < node.lineno][-1]
            found.append((name, script, node))
    return found


def unlike_its_script(path, adapted=ADAPTED):
    """[(name, script, why)] of the appendix's definitions that are not their script's (another
    body, or none of that name there) and not listed in `adapted`."""
    differ = []
    for name, script, node in appendix(path):
        if script is None:
            continue  # 10's own section: what sharding needs of the other switches
        theirs = top_level(script_path(script.split("_")[0])).get(name)
        if theirs is not None and ast.dump(theirs) == ast.dump(node):
            continue
        if name not in adapted:
            differ.append((name, script, "not in it" if theirs is None else "differs"))
    return differ


def test_every_definition_of_the_appendix_is_its_scripts_or_says_why():
    assert unlike_its_script(script_path(COMBINED)) == []


def test_every_listed_adaptation_is_needed():
    assert {name for name, _, _ in unlike_its_script(script_path(COMBINED), {})} == set(ADAPTED)


def test_the_definition_check_finds_a_changed_definition(tmp_path):
    changed = tmp_path / "10_changed.py"
    changed.write_text(script_path(COMBINED).read_text()
                       .replace("(bits + noise) & -(1 << 16)", "(bits + noise) & -(1 << 15)")
                       .replace("LOSS_CHUNKS = 8", "LOSS_CHUNKS = 4"))
    assert unlike_its_script(changed) == [
        ("stochastic_round", "04b_bf16_stochastic_rounding.py", "differs"),
        ("LOSS_CHUNKS", "05g_chunked_loss.py", "differs")]


def test_the_appendix_follows_steps_order_under_each_scripts_banner():
    order = [step.name for step in STEPS.values()]
    named = [script.removesuffix(".py") for _, script, _ in appendix(script_path(COMBINED)) if script]
    assert named == sorted(named, key=order.index)
    assert all(name in order for name in named)


def test_every_technique_tag_is_in_the_combined_script():
    text = script_path(COMBINED).read_text()
    comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    missing = [tag for tag in TAGS.values() if not any(has_tag(comment, tag) for comment in comments)]
    assert missing == []


# ---- the switch table ----------------------------------------------------------------------

def combined():
    return import_script(script_path(COMBINED), prefix="table")


def test_each_switch_of_a_scripts_set_comes_from_that_script_in_the_table():
    """For each script, the switches its set (steps.py) adds to its parent's name it (or the
    script whose technique it carries, for 09's full checkpointing under sharding) in 10's table;
    and each step the table names trains with that switch."""
    table = {switch.flag: switch for switch in combined().SWITCHES}

    def pairs(step):
        return set(switch_pairs(step.switches))

    disagreements = []
    for step in STEPS.values():
        parent = STEPS.get(step.parent)
        if parent is None or step.combined:
            continue
        for flag, value in pairs(step) - pairs(parent):
            steps = table[flag].steps
            key = "budget:F" if str(value).startswith("budget:") else value
            named = steps.get(key, steps.get("N"))
            if step.id not in (named if isinstance(named, tuple) else (named,)):
                disagreements.append(f"{step.name} adds {flag} {value}, which 10's table gives to {named}")
    named_steps = {step for switch in table.values() for steps in switch.steps.values()
                   for step in (steps if isinstance(steps, tuple) else (steps,))}
    assert disagreements == [] and named_steps <= set(STEPS)


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
        with frozen():
            yield
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
    if step.task and not step.sharded:  # (a sharded step creates as 06 does: in its dtype)
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

def switch_cases():
    """Each switch of 10's table as the tests try it, in groups (the values of one switch), by
    name: each value but the default, a flag alone, a number at its `tried` value; what a switch
    needs to mean anything (refused "without" it) added, as --gradients-to-host needs
    --optimizer-on-host. --world-size (the estimate's), --lora-alpha and --lora-targets (which
    shape the adapters --lora-rank makes), --galore-rank, --galore-gap and --galore-scale (which
    shape --optimizer galore's projections: tests/scripts/test_galore.py) and budget:F (compiled: a few
    runs only) aside."""
    module = combined()
    groups = []
    for switch in module.SWITCHES:
        if switch.flag in ("--world-size", "--lora-alpha", "--lora-targets", "--galore-rank",
                           "--galore-gap", "--galore-scale"):
            continue
        name = switch.flag[2:]
        options = switch.options
        if "choices" in options:
            cases = {str(value): [switch.flag, str(value)] for value in options["choices"]
                     if value != options.get("default")}
        elif switch.flag == "--checkpointing":
            cases = {kind: [switch.flag, kind] for kind in ("full", "selective", "offloaded")}
        elif switch.tried:
            cases = {name: [switch.flag, *switch.tried]}
        else:
            cases = {name: [switch.flag]}
        groups.append(cases)
    return groups


GROUPS = switch_cases()
SWITCHES = {name: flags for group in GROUPS for name, flags in group.items()}
NEEDS = {"gradients-to-host": SWITCHES["optimizer-on-host"], "qlora": SWITCHES["lora-rank"]}
for name, needed in NEEDS.items():
    SWITCHES[name] = [*needed, *SWITCHES[name]]
PAIRS = [(first, second) for one, other in itertools.combinations(GROUPS, 2)
         for first in one for second in other]
TEXT_SWITCHES = {"chunked", "fused", "lora-rank", "qlora",  # on a decoder: tiny-text, causal-lm
                 "sequence-parallel", "mlp-tiles"}
LR = ["--lr", "0.05"]  # updates large enough to show in every bfloat16 weight after two steps


def test_what_a_switch_needs_is_what_the_table_refuses_it_without(monkeypatch):
    """NEEDS above is the table's: each switch alone is refused without it, and trains with it."""
    module = combined()
    alone = {name: SWITCHES[name][len(needed):] for name, needed in NEEDS.items()}
    for name, flags in alone.items():
        args = module.parse_args("", [*flags], flags=module.own_flags)
        assert (module.refusal(args) or "").split(":")[0] == f"{flags[0]} without {NEEDS[name][0]}"
    without = [name for name, flags in SWITCHES.items() if name not in NEEDS and (module.refusal(
        module.parse_args("", flags, flags=module.own_flags)) or "").split(":")[0].startswith(
        f"{flags[0]} without --")]
    assert without == []


class Took:
    """What a run built and called, for the check that no switch was dropped."""

    def __init__(self, module, monkeypatch):
        self.module, self.meter, self.initial, self.calls = module, None, None, {}
        self.scalers, self.reshard, self.stepped, self.below_rounding = [], [], {}, {}
        self.micro_batches = []
        took = self

        class Meter(module.MemoryMeter):
            def __init__(self, device, model, optimizer, **options):
                super().__init__(device, model, optimizer, **options)
                took.meter = self
                took.initial = [local(param).clone() for param in model.parameters()
                                if param.requires_grad]
                for each in optimizer if isinstance(optimizer, list) else [optimizer]:
                    took.stepped[each] = [False] * len(weights_of(each))
                    took.below_rounding[each] = [isinstance(each, torch.optim.SGD)] * len(weights_of(each))
                    each.register_step_pre_hook(took.note_gradients)

        module.MemoryMeter = Meter
        module.evaluate = lambda *args, **kwargs: float("nan")
        for name in ("chunked_loss", "fused_loss", "slice_fused_loss", "step_on_host", "GradientsToHost"):
            monkeypatch.setattr(module, name, self.counting(name, getattr(module, name)))
        split = module.split_batch
        monkeypatch.setattr(module, "split_batch", lambda *args: (
            lambda parts: (self.micro_batches.append(len(parts)), parts)[1])(split(*args)))
        shard = module.fully_shard
        monkeypatch.setattr(module, "fully_shard", lambda *args, **kwargs: (
            self.reshard.append(kwargs.get("reshard_after_forward", True)), shard(*args, **kwargs))[1])
        scaler = torch.amp.GradScaler

        class Scaler(scaler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                took.scalers.append(self.is_enabled())

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


def optimizer_list(optimizer):
    return optimizer if isinstance(optimizer, list) else [optimizer]


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
        "fp32": lambda: dtype == torch.float32 and not any(took.scalers),
        "mixed": lambda: dtype == torch.float32 and took.scalers == [True],
        "stochastic-rounding": lambda: isinstance(first, module.AdamStochasticRounding),
        "accum-steps": lambda: record["accum_steps"] == 2 and took.micro_batches == [2, 2],
        "adamw-8bit": lambda: type(first).__name__ == "AdamW8bit",
        "adamw-4bit": lambda: isinstance(first, module.AdamW4bit),
        "adafactor": lambda: isinstance(first, torch.optim.Adafactor),
        "galore": lambda: isinstance(first, module.GaLoreAdam) and not first.defaults["eight_bit"]
        and any(group["rank"] for each in optimizer_list(optimizer) for group in each.param_groups),
        "galore-8bit": lambda: isinstance(first, module.GaLoreAdam) and any(
            "state1" in state for each in optimizer_list(optimizer) for state in each.state.values()),
        "sgd": lambda: isinstance(first, torch.optim.SGD),
        "optimizer-on-host": lambda: took.calls.get("step_on_host", 0) >= 2 and not any(
            param is weight for param in first.param_groups[0]["params"] for weight in weights),
        "gradients-to-host": lambda: took.calls.get("GradientsToHost", 0) == 1 and took.calls.get(
            "step_on_host", 0) >= 2 and all(weight.grad is None for weight in weights),
        "optimizer-in-backward": lambda: len(optimizer) == len(weights) > 1,
        "full": lambda: all(isinstance(block, module.CheckpointedBlock) for block in blocks),
        "selective": lambda: all(block.selective for block in blocks),
        "mlp-tiles": lambda: all(isinstance(block.mlp, module.TiledMLP) for block in blocks),
        "offloaded": lambda: all(isinstance(block.offload, module.OffloadedInputs) for block in blocks),
        "chunked": lambda: took.calls.get("chunked_loss", 0) >= 2,
        "fused": lambda: took.calls.get("fused_loss", 0) + took.calls.get("slice_fused_loss", 0) >= 2,
        "lora-rank": lambda: any(isinstance(layer, module.LoRALinear) for layer in model.modules()),
        "qlora": lambda: any(type(layer.base).__name__ == "Linear4bit" for layer in model.modules()
                     if isinstance(layer, module.LoRALinear)),
        "offload": lambda: offloads_to_host(model),
        # the blocks' kept gathered; the root's is FSDP's default
        "reshard-after-forward": lambda: took.reshard and not any(took.reshard[:-1]),
        "compile": lambda: is_compiled(model),
        "budget": lambda: all(block._compiled_call_impl is not None for block in blocks),
        # attention through 08a's function, the model's mask left out
        "sequence-parallel": lambda: model.config._attn_implementation == "sequence_parallel",
    }[name]()


def command_of(names, extra=()):
    text = any(name in TEXT_SWITCHES for name in names)
    return [*QUICK, *LR, "--batch-size", "4", *(TEXT if text else []), *(CAUSAL_LM if text else []),
            *extra, *(flag for name in names for flag in SWITCHES[name])]


def table_refusal(names, monkeypatch):
    """What 10's table of refusals says of these switches, as the run would see them, or None."""
    module = combined()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return module.refusal(module.parse_args(module.__doc__, command_of(names),
                                            flags=module.own_flags))


def run_switches(names, tmp_path, monkeypatch, extra=()):
    """Run 10 with the switches `names` for two untracked steps; returns (record, Took), or the
    message it stopped with."""
    monkeypatch.setattr(common.memory, "TRACKED_STEPS", 0)  # the matrix asks what runs, not memory
    module = load_script(COMBINED)
    monkeypatch.setitem(sys.modules, module.__name__, module)  # (the compiler imports its classes)
    took = Took(module, monkeypatch)
    flags = command_of(names, extra)
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
    adapters = {"lora-rank", "qlora"} & set(names)
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
    expected = table_refusal([first, second], monkeypatch)
    if expected:  # stopped before training, in the table's one line, which names both (or the
        # one that is refused alone: --reshard-after-forward without sharding)
        assert result == f"error: {expected}", (first, second, result)
        assert "\n" not in result
        named = [name for name in (first, second) if table_refusal([name], monkeypatch) == expected]
        assert all(any(flag in result.removeprefix("error: ").split(":")[0] for flag in SWITCHES[name]
                       if flag.startswith("--"))
                   for name in named or (first, second)), result
    else:
        assert_trains((first, second), result)


SWITCHES["compile"] = ["--compile"]  # in a few runs only: compiling takes seconds each
STACKS = [
    ("compile", "offloaded"), ("compile", "offload"),
    ("budget", "offload"),  # each block compiled before it is sharded, under the budget
    ("accum-steps", "adamw-8bit", "selective"),
    ("chunked", "optimizer-in-backward", "full"),
    ("sgd", "offload", "full", "reshard-after-forward"),  # 09 at ZeRO-2's memory
    ("sequence-parallel", "offload", "full", "accum-steps"),  # 08a with 08's and 09's
    ("qlora", "chunked", "offloaded", "accum-steps", "optimizer-on-host"),
    # a frozen output layer: no gradient made
    ("lora-rank", "fused", "gradients-to-host", "accum-steps", "selective"),
    ("adamw-4bit", "gradients-to-host", "accum-steps", "offloaded"),  # 4-bit states in host memory
    # the whole stack in one process: each weight's 8-bit AdamW step on the host during
    # backward, activations recomputed from inputs in host memory, the loss fused
    ("fused", "offloaded", "adamw-8bit", "optimizer-in-backward", "optimizer-on-host"),
    # a long run's stack (ALST's three pieces on one device): the MLP in tiles, checkpoints in
    # host memory, the fused loss; Adam's state on the host, stepped in backward
    ("mlp-tiles", "fused", "offloaded", "optimizer-in-backward", "optimizer-on-host"),
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


def test_a_long_runs_stack_splits_each_text_with_the_fused_loss(tmp_path, monkeypatch, small_snippets):
    """--longest-sequence's last link on several GPUs (estimate/stack.py), here a group of one:
    each text's slices with the fused loss, packed (without --pack it is refused)."""
    names = ("sequence-parallel", "fused", "offloaded", "mlp-tiles", "offload")
    assert_trains(names, run_switches(names, tmp_path, monkeypatch, ["--pack"]))


# what the estimate is checked on beside the default (which tests/scripts/test_causal_lm.py
# estimates, as for every script): the activation techniques stacked in one process; QLoRA, whose
# 4-bit weights the estimate stands in for (estimate/fake/four_bit.py) as for 07b; and a long
# run's stack on packed texts (no attention mask)
ESTIMATED = {"fused+offloaded+adamw-8bit+in-backward+on-host": [
                 *TEXT, *CAUSAL_LM, "--loss", "fused", "--checkpointing", "offloaded",
                 "--optimizer", "adamw-8bit", "--optimizer-in-backward", "--optimizer-on-host"],
             "qlora": ["--lora-rank", "8", "--qlora"],
             "mlp-tiles+fused+offloaded+pack": [*TEXT, *CAUSAL_LM, "--mlp-tiles", "3", "--loss",
                                                "fused", "--checkpointing", "offloaded", "--pack"]}


@pytest.mark.parametrize("flags", ESTIMATED.values(), ids=ESTIMATED)
def test_the_estimate_on_the_cpu_is_the_runs_peak(flags, tmp_path, small_snippets):
    from estimate.predict import predict
    flags = [*flags, "--batch-size", "8"]
    real, _ = run_script(COMBINED, [*QUICK, *flags], tmp_path, unevaluated(COMBINED))
    predicted = predict(script_path(COMBINED), [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]
    assert predicted["parameter_count"] == real["parameter_count"]


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
    assert combined.launched_sharded(combined.parse_args("", QUICK, flags=combined.own_flags))
    monkeypatch.delenv("WORLD_SIZE")
    from estimate.predict import predict
    record = predict(script_path(COMBINED), ["--accum-steps", "2", "--optimizer", "sgd"], world_size=2)
    assert record["world_size"] == 2 and record["reshard_after_forward"] is True
    assert "WORLD_SIZE" not in os.environ  # as it was


def recipe_of(path):
    """(lines, if statements and conditional expressions (comprehension filters too)) of the
    recipe: from `def main` to the banner of the switches."""
    source = path.read_text()
    lines = source.splitlines()
    start = next(number for number, line in enumerate(lines, 1) if line.startswith("def main("))
    end = next(number for number, line in enumerate(lines, 1) if line.startswith("# ==== the switches"))
    nodes = [node for node in ast.walk(ast.parse(source))
             if start <= getattr(node, "lineno", 0) < end]
    branches = sum(isinstance(node, (ast.If, ast.IfExp)) for node in nodes)
    branches += sum(len(each.ifs) for node in nodes if isinstance(node, ast.ListComp)
                    for each in node.generators)
    return end - start, branches


def test_the_recipe_is_150_lines_with_15_branches_at_most():
    """The recipe reads top to bottom: the choices are made once (resolved(), the tables), so that
    the model's building, the optimizer and the loop test few switches."""
    lines, branches = recipe_of(script_path(COMBINED))
    assert lines <= 150 and branches <= 15, (lines, branches)


def test_the_recipes_count_sees_a_branch_added(tmp_path):
    changed = tmp_path / "10_changed.py"
    changed.write_text(script_path(COMBINED).read_text().replace(
        "    torch.manual_seed(settings.seed)\n",
        "    torch.manual_seed(settings.seed)\n    if settings.seed:\n        pass\n"))
    assert recipe_of(changed)[1] == recipe_of(script_path(COMBINED))[1] + 1
