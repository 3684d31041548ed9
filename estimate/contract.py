"""The names a numbered script must import by name for `--estimate` to run it.

`--estimate` runs the script's own main() on fake tensors (estimate/fake/run.py). Everything that decides
memory (precision, batch, accumulation, optimizer, sharding, offload, checkpointing) is the
script's own code; only the names below are replaced on the loaded script, because on fake
tensors they would need data, a download, other processes or a screen. A script that renames,
inlines or redefines one of them would be estimated wrongly without a word, so the estimate
first checks that each is there and is the helper from `common`, and stops with a message
naming the one that is not.
"""
import importlib

from steps import STEPS, step_id


class EstimateError(Exception):
    """A run that cannot be estimated: the message says what was wrong and what to do."""


# name -> (module it comes from, what --estimate runs instead, and why); the stand-ins
# (estimate/fake/stand_ins.py) are exactly these, and only these are replaced
REQUIRED = {
    "load_data": ("common.data", "batches of the preset's shapes, made when asked for: "
                  "no data set is read or downloaded"),
    "create_model": ("common.model", "the preset's architecture with fake parameters: "
                     "no weights are downloaded"),
    "evaluate": ("common.evaluate", "skipped: accuracy on fake tensors means nothing"),
    "Progress": ("common.progress", "counts steps silently: a fake loss has no value to print"),
    "MemoryMeter": ("common.memory", "the script's own meter, whose tracker the estimate reads"),
    "measure_creation": ("common.memory", "not measured"),
    "report": ("common.summary", "keeps the run's settings; prints and writes nothing"),
}
# required of scripts that use torch.distributed (07 on)
REQUIRED_WHEN_DISTRIBUTED = {
    "init_distributed": ("common.distributed", "a fake process group of --world-size ranks: "
                         "no other process is started"),
    "init_device_mesh": ("torch.distributed.device_mesh", "made outside the fake tensors: a mesh "
                         "computes coordinates from values"),
    "fill_shards": ("common.model", "allocates each process's shards (and on a GPU stages each "
                    "whole parameter, as the broadcast does); no values are copied"),
}

# required of scripts that keep something in host memory (05e, 05f)
REQUIRED_WHEN_OFFLOADING = {
    "HOST": ("common.memory", "the emulated GPU's host, apart from the GPU (the CPU when no GPU "
             "is emulated)"),
}

# required of scripts that keep weights in 4 bits (07b): a fake tensor cannot become a Params4bit
REQUIRED_WHEN_4BIT = {
    "Params4bit": ("bitsandbytes.nn", "a plain frozen parameter with Params4bit's attributes"),
    "Linear4bit": ("bitsandbytes.nn", "bitsandbytes' own layer around that parameter, quantized "
                   "by bitsandbytes' quantize_4bit on fake tensors (estimate/fake/four_bit.py)"),
}


def required_names(module):
    """The contract for this loaded script: {name: (home module, stand-in)}."""
    required = dict(REQUIRED)
    if getattr(module, "dist", None) is not None or hasattr(module, "init_distributed"):
        required.update(REQUIRED_WHEN_DISTRIBUTED)
    if hasattr(module, "HOST"):
        required.update(REQUIRED_WHEN_OFFLOADING)
    if any(hasattr(module, name) for name in REQUIRED_WHEN_4BIT):
        required.update(REQUIRED_WHEN_4BIT)
    return required


def check_contract(module, script_name):
    """Raise EstimateError naming the first required name the script lacks or replaces, or, for
    a step the estimate cannot run (steps.py's `by_hand`), why and the rule to use instead."""
    step = STEPS.get(step_id(script_name))
    if step is not None and step.by_hand:
        raise EstimateError(f"{script_name}: {step.by_hand}")
    for name, (home, stand_in) in required_names(module).items():
        expected = getattr(importlib.import_module(home), name)
        found = getattr(module, name, None)
        if found is expected:
            continue
        problem = ("does not import" if found is None
                   else "defines or imports its own")
        raise EstimateError(
            f"{script_name} {problem} `{name}`, which --estimate replaces ({stand_in}). "
            f"Import it with `from {home} import {name}` and call it by that name, as the "
            "numbered scripts do (the contract: estimate/contract.py)")
