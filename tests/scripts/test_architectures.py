"""Every architecture docs/estimator.md names, on every step and every branch that touches the model
(the optimizer-only branches on three: architecture_matrix.OPTIMIZER_ONLY), and a grouped-query
decoder on every script that trains --task causal-lm: it trains for two optimizer steps on the CPU,
and the estimate without GPU emulation (--device cpu) predicts that run's peak, its creation's peak
and its breakdown to the byte. This is the one test of that claim (the presets' models are these
architectures: tiny's ViT, tiny-text's BERT and, under causal-lm, its Llama). 07-09 run as one
process here (a group of one), and as two processes under torchrun for an encoder and a
grouped-query decoder (ViT, the vision model, in tests/scripts/test_distributed.py).
"""
import math
import re

import pytest

from conftest import QUICK, ROOT, launched_runs, run_script
from estimate.predict import predict
from steps import STEPS, step_id
from steps import scripts as numbered_scripts
from support.architecture_matrix import (
    ARCHITECTURES,
    REFUSED,
    TWO_PROCESSES,
    in_matrix,
    model_flags,
    write_model,
)

SCRIPTS = {step_id(script.name): script for script in numbered_scripts()}
CLASSIFYING = [step for step in SCRIPTS if STEPS[step].trains("classification")]
NO_EMULATION = ["--device", "cpu"]


def matrix_flags(step):
    """2 micro-batches where a script accumulates (not its default 4): accumulation is still
    run, and the matrix, which asks what each architecture supports, takes half the time."""
    return ["--accum-steps", "2"] if STEPS[step].accum_steps > 1 else []


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {name: write_model(root / re.sub(r"\W", "", name.lower()), name)
            for name in ARCHITECTURES}


def assert_trained(record, world_size=1):
    assert record["steps"] == 2 and record["world_size"] == world_size
    assert all(math.isfinite(loss) for loss in record["losses"])


# (architecture, step, task): the matrix classifies; a decoder also learns the next token on every
# script that trains that task (05g trains it only)
CASES = [*((name, step, "classification") for name in ARCHITECTURES for step in CLASSIFYING
           if in_matrix(name, step)),
         *(("Llama", step, "causal-lm") for step in SCRIPTS if STEPS[step].trains("causal-lm")
           and in_matrix("Llama", step))]


@pytest.mark.parametrize("name, step, task", CASES,
                         ids=[f"{name}-{step}" + ("-causal-lm" if task == "causal-lm" else "")
                              for name, step, task in CASES])
def test_every_architecture_trains_on_every_step_and_its_estimate_is_that_runs_peak(
        name, step, task, models, small_snippets, tmp_path):
    flags = [*model_flags(models[name], name), *matrix_flags(step), "--task", task]
    if (name, step) in REFUSED:  # refused with a message that says why, before any training
        with pytest.raises(SystemExit, match=REFUSED[name, step]):
            run_script(step, [*flags, *QUICK], tmp_path)
        return
    real, _ = run_script(step, [*flags, *QUICK], tmp_path)
    assert_trained(real)
    assert real["model"] == str(models[name]) and real["task"] == task
    if task == "causal-lm":  # scored by its loss on the test texts' next tokens, not accuracy
        assert real["test_accuracy"] is None and real["test_tokens"] > 0
        # below the first step's loss at the weights drawn anew (about ln 30,522 = 10.33 nats):
        # two steps learned at least which tokens are common
        assert real["test_loss"] < real["losses"][0]
        assert real["test_perplexity"] == pytest.approx(math.exp(real["test_loss"]), rel=1e-5)
    predicted = predict(SCRIPTS[step], [*flags, *NO_EMULATION], world_size=1)
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]
    if STEPS[step].sharded:  # creation on the CPU also holds process 0's copy of the model, which
        # on a GPU lies in host memory: not predicted
        assert predicted["init_allocated_bytes"] < real["init_peak_memory_bytes"]
    else:
        assert predicted["init_allocated_bytes"] == real["init_peak_memory_bytes"]
    assert predicted["parameter_count"] == real["parameter_count"]
    assert predicted["model_state_bytes_per_parameter"] == real["model_state_bytes_per_parameter"]


@pytest.fixture(scope="module")
def two_process_runs(models, tmp_path_factory):
    """Every case of TWO_PROCESSES for 2 optimizer steps, in one torchrun launch of 2 processes:
    {(name, step): its record, or the words its script stopped with}."""
    runs = [[f"{name}-{step}", step, [*model_flags(models[name], name), *QUICK]]
            for name, step in TWO_PROCESSES]
    outcomes = launched_runs(tmp_path_factory.mktemp("two-processes"), runs, TWO_PROCESSES_TIMEOUT)
    return {(name, step): outcomes[f"{name}-{step}"][0] for name, step in TWO_PROCESSES}


TWO_PROCESSES_TIMEOUT = 60 * len(TWO_PROCESSES)  # seconds; a run takes a few


@pytest.mark.timeout(TWO_PROCESSES_TIMEOUT + 60)
@pytest.mark.parametrize("name, step", TWO_PROCESSES)
def test_the_sharded_steps_train_in_two_processes(name, step, two_process_runs):
    """torchrun, gloo: each process holds half of every parameter; 2 optimizer steps."""
    real = two_process_runs[name, step]
    assert not isinstance(real, str), f"stopped: {real}"
    assert_trained(real, world_size=2)


def test_the_documents_name_exactly_the_architectures_the_matrix_runs():
    chapter = (ROOT / "docs" / "estimator.md").read_text()
    section = chapter.split("<!-- architectures -->")[1].split("<!-- /architectures -->")[0]
    named = re.findall(r"^\| ([^|]+?) \|", section, flags=re.MULTILINE)[2:]  # after the header and its rule
    assert named == list(ARCHITECTURES)


@pytest.mark.parametrize("name", ["GPT-2", "Llama", "Mistral", "Qwen2", "BLOOM"])
def test_a_decoder_created_for_training_keeps_no_key_value_cache(name, models):
    """Its config says no cache, so a training forward returns none: recomputing a block in
    backward (09) then sees the keys and values forward saw, not those appended twice."""
    import torch

    from common.cli import parse_args
    from common.model import create_model
    from common.presets import preset_for
    model = create_model(preset_for(parse_args("", model_flags(models[name], name))))
    assert model.config.use_cache is False
    model.train()
    output = model(input_ids=torch.ones(2, 8, dtype=torch.long),
                   attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert getattr(output, "past_key_values", None) is None
