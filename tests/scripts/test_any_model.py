"""--model: any Hugging Face image or sequence classifier, or decoder (--task causal-lm), trained
and estimated by every step (each architecture on every step, its estimate to the byte:
tests/scripts/test_architectures.py); here, what --model reads and the messages for what it cannot take.

The models here are small ones written as config.json files (a 2-layer BERT with MiniLM's
tokenizer, a 2-layer ViT), so nothing is downloaded.
"""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from common.packaged import fetch
from common.presets import MINILM
from conftest import QUICK, ROOT, load_script, script_path
from estimate.predict import predict
from support.architecture_matrix import TOKENIZER_FILES

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)


def write_config(folder, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"text": a BERT with MiniLM's tokenizer and no weights, "images": a ViT, config only}."""
    root = tmp_path_factory.mktemp("models")
    text = write_config(root / "bert", model_type="bert", vocab_size=30522, **SMALL)
    tokenizer = fetch(MINILM, TOKENIZER_FILES)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, text / name)
    images = write_config(root / "vit", model_type="vit", image_size=32, patch_size=8, **SMALL)
    return {"text": text, "images": images}


def run_command(*args, env=None):
    """A script's command line in a process of its own: (exit status, what it printed)."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    return done.returncode, done.stdout + done.stderr


def test_the_model_sets_the_task_and_the_flags_set_the_input_shape(models):
    from common.cli import parse_args
    from common.presets import is_text, preset_for
    text = preset_for(parse_args("", ["--model", str(models["text"]), "--seq-len", "20"]))
    assert is_text(text) and text.dataset == "movie-snippets" and text.max_length == 20
    assert text.model is None and text.tokenizer == str(models["text"])  # no weights: drawn
    images = preset_for(parse_args("", ["--model", str(models["images"]), "--image-size", "64",
                                        "--num-labels", "12"]))
    assert not is_text(images) and images.dataset == "digits"
    assert images.image_size == images.config["image_size"] == 64 and images.num_classes == 12


@pytest.mark.parametrize("flags, words", [
    (["--model", "{missing}"], ["no such directory"]),
    (["--model", "{empty}"], ["has no config.json"]),
    (["--model", "{text}", "--preset", "tiny"], ["classifies text", "tiny-text"]),
    (["--model", "{text}", "--image-size", "64"], ["--image-size is for images"]),
    (["--model", "{text}", "--seq-len", "4096"], ["positions for 512 tokens"]),
    (["--model", "{audio}"], ["'whisper' model", "no sequence or image classifier"]),
    (["--model", "{unknown}"], ["transformers cannot build this architecture"]),
    (["--model", "{flash}"], ["'flash_attention_2'", "sdpa or eager"]),
    (["--model", "{no_pad}"], ["neither a padding token nor an end-of-text token"]),
    (["--seq-len", "16"], ["add --model"]),
    (["--model", "{images}", "--num-labels", "2"], ["has 10 classes"]),
])
def test_a_model_the_scripts_cannot_take_gets_a_message(flags, words, models, tmp_path, capsys):
    write_config(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").unlink()
    folders = dict(models, missing=tmp_path / "nothing-here", empty=tmp_path / "empty",
                   audio=write_config(tmp_path / "audio", model_type="whisper"),
                   unknown=write_config(tmp_path / "unknown", model_type="no-such-architecture"),
                   flash=write_config(tmp_path / "flash", model_type="bert",
                                      attn_implementation="flash_attention_2"),
                   no_pad=write_config(tmp_path / "no-pad", model_type="qwen2", num_key_value_heads=2,
                                       **SMALL))
    with pytest.raises(SystemExit) as stopped:  # argparse's exit: the message, no traceback
        load_script("03").main([*[flag.format(**folders) for flag in flags], "--device", "cpu"])
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    for word in words:
        assert word in message


def test_a_bad_model_stops_the_command_line_with_the_message_alone(tmp_path):
    status, output = run_command(str(script_path("03")), "--model", str(tmp_path / "nothing"))
    assert status == 2 and "Traceback" not in output and "no such directory" in output


def test_text_training_without_a_tokenizer_says_what_the_directory_lacks(tmp_path):
    folder = write_config(tmp_path / "bert", model_type="bert", **SMALL)
    with pytest.raises(SystemExit) as stopped:
        load_script("01").main(["--model", str(folder), *QUICK, "--results-dir", str(tmp_path)])
    assert "holds no tokenizer" in str(stopped.value.code)
    assert "--estimate needs only the config" in str(stopped.value.code)


def test_a_config_that_asks_for_eager_attention_is_estimated_with_it(tmp_path):
    """BERT's own attention code keeps each layer's attention probabilities for backward, where
    the fused kernel (sdpa, transformers' default) keeps far less: the estimate follows the ask."""
    config = dict(model_type="bert", vocab_size=30522, **SMALL)
    fused, eager = (predict(script_path("01"), ["--model", str(write_config(
        tmp_path / name, **config, **extra)), "--seq-len", "256", "--device", "cuda"])
        for name, extra in [("sdpa", {}), ("eager", {"attn_implementation": "eager"})])
    probabilities = 2 * 32 * 2 * 256 * 256 * 4  # layers x batch x heads x 256 x 256, float32
    more = eager["breakdown_bytes"]["activations"] - fused["breakdown_bytes"]["activations"]
    assert more >= probabilities


def test_grouped_query_attention_is_estimated_with_its_heads_repeated_as_on_a_gpu(tmp_path):
    """Llama-style models keep fewer key and value heads; with a padding mask transformers
    repeats them before CUDA's kernel, which the emulation does too."""
    shape = dict(model_type="llama", vocab_size=30522, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                 pad_token_id=0)
    grouped, whole = (predict(script_path("01"), ["--model", str(write_config(
        tmp_path / name, **shape, num_key_value_heads=heads)), "--device", "cuda"])
        for name, heads in [("grouped", 2), ("whole", 4)])
    assert grouped["parameter_count"] < whole["parameter_count"]  # fewer key/value weights
    assert grouped["breakdown_bytes"]["activations"] > 0


def test_the_tokenizer_pads_with_the_token_the_model_is_told_is_padding(models, tmp_path):
    """Sequence classifiers find each text's last token from config.pad_token_id; a tokenizer
    that padded with another token would have them classify from padding."""
    from common.cli import parse_args
    from common.data import tokenizer_for
    from common.presets import preset_for
    folder = tmp_path / "bert"
    shutil.copytree(models["text"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": 102}))  # [SEP]
    preset = preset_for(parse_args("", ["--model", str(folder)]))
    tokenizer = tokenizer_for(preset)
    assert tokenizer.pad_token_id == preset.config["pad_token_id"] == 102
    assert tokenizer(["a"], padding="max_length", max_length=6)["input_ids"][0][-1] == 102


def test_the_presets_classes_are_those_transformers_tables_give():
    """common/model.py names the class of each preset's architecture and task, so that a run on
    a preset does not load the tables of every architecture: --model finds the same there."""
    from common.any_model import model_class_name
    from common.model import PRESET_CLASSES
    from common.presets import CAUSAL_LM, PRESETS, for_task
    used = {(preset.architecture, preset.task) for preset in
            [for_task(preset, task) for preset in PRESETS.values()
             for task in ["classification", *(["causal-lm"] if preset.name in CAUSAL_LM else [])]]}
    assert used == set(PRESET_CLASSES)  # every preset's, and none that no preset has
    for (architecture, task), name in PRESET_CLASSES.items():
        assert name == model_class_name(architecture, task)


# ---- --data synthetic: a model at its study's shapes where its data cannot be fetched ----------

def test_synthetic_data_trains_a_config_only_model_without_reading_data_and_scores_nothing(
        tmp_path, monkeypatch):
    """Random samples of the preset's shapes, the same at every read; the record says the data
    was synthetic and holds no accuracy; the estimate of the same run counts what it measured."""
    import common.data

    def no_data(*args, **kwargs):
        raise AssertionError("a data set was read")
    for reader in ("digits_datasets", "movie_snippet_datasets", "imdb_datasets", "cifar10_datasets"):
        monkeypatch.setattr(common.data, reader, no_data)
    vit = write_config(tmp_path / "vit", model_type="vit", image_size=32, patch_size=8, **SMALL)
    flags = ["--model", str(vit), "--data", "synthetic", "--batch-size", "8", "--accum-steps", "2",
             *QUICK]
    record = load_script("04").main([*flags, "--results-dir", str(tmp_path)])
    assert record["data"] == "synthetic" and record["test_accuracy"] is None
    assert record["steps"] == 2
    predicted = predict(script_path("04"), flags)  # --device cpu: the run's own count
    assert predicted["allocated_bytes"] == record["peak_memory_bytes"]


def test_synthetic_text_is_token_ids_of_the_models_vocabulary_at_full_length(tmp_path):
    from common.cli import parse_args
    from common.data import SyntheticData
    from common.presets import preset_for
    text = write_config(tmp_path / "llama", model_type="llama", vocab_size=97, **SMALL)
    for task, labels in (("classification", (4,)), ("causal-lm", (4, 24))):
        preset = preset_for(parse_args("", ["--model", str(text), "--seq-len", "24", "--data",
                                            "synthetic", "--task", task,
                                            "--results-dir", str(tmp_path)]))
        batch = SyntheticData(preset, 16, 0)[[0, 5, 6, 7]]
        assert batch["input_ids"].shape == (4, 24) and int(batch["input_ids"].max()) < 97
        assert batch["attention_mask"][:, :-1].all() and not batch["attention_mask"][:, -1].any()
        assert batch["label"].shape == labels  # (a mask of ones would let transformers drop it)
        assert torch.equal(SyntheticData(preset, 16, 0)[[5]]["input_ids"][0], batch["input_ids"][1])


def test_the_at_scale_measurement_runs_commands_the_scripts_take_and_tables_their_records(
        tmp_path, capsys):
    """benchmarks/gpu_measured.py --at-scale: each command is one its script parses (the
    models' configs are in docs/models/, the data synthetic), and `checked` tables the records'
    own predictions, a record without the tracked steps' window by its whole run."""
    import importlib.util

    from common.cli import parse_args
    spec = importlib.util.spec_from_file_location("gpu_measured", ROOT / "benchmarks" / "gpu_measured.py")
    measured = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measured)
    for setting, step in measured.runs(at_scale=True):
        words = measured.command(setting, step, tmp_path / setting)[2:]
        script = load_script(step)  # its own flags (10: its switches)
        args = parse_args("", [*words, "--device", "cpu"],
                          flags=getattr(script, "own_flags", None))
        assert args.data == "synthetic" and args.max_steps == 2
        if step == "10":  # the stack's answer (or the long text's): switches 10 takes together
            assert script.refusal(args) is None
            assert args.accum_steps > 1 or (setting in measured.AT_SCALE_LONG and args.seq_len == 65536)
    record = {"predicted_allocated_bytes": 100 * 2**20, "predicted_reserved_bytes": 200 * 2**20,
              "cuda_max_allocated_bytes": 110 * 2**20, "cuda_max_reserved_bytes": 220 * 2**20,
              "predicted_gpu": "H100 emulated"}
    (tmp_path / "vit-large").mkdir(parents=True, exist_ok=True)
    (tmp_path / "vit-large" / "01_baseline.json").write_text(json.dumps(
        {**record, "cuda_steps_max_allocated_bytes": 105 * 2**20,
         "cuda_steps_max_reserved_bytes": 200 * 2**20}))
    (tmp_path / "vit-large" / "02_mixed_precision.json").write_text(json.dumps(record))
    measured.checked(tmp_path, at_scale=True)
    rows = capsys.readouterr().out
    assert "| vit-large | 01 | 105.0 / 200.0 | 100.0 / 200.0 | 1.050 / 1.000 | 220.0 |" in rows
    assert "| vit-large | 02 | 110.0 / 220.0 (whole run" in rows
    assert "| vit-large | 03 | no record |" in rows


@pytest.mark.parametrize("folder, parameters", [("llama-3.1-8b", 8_030_261_248),
                                                ("llama-3.1-70b", 70_553_706_496)])
def test_the_config_only_models_are_the_ones_the_docs_name(folder, parameters):
    """docs/models' configs build, on the meta device, the models whose sizes docs/combined.md and
    docs/causal-lm.md state (8.03B and 70.55B parameters: Llama-3.1's published configs)."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(ROOT / "docs" / "models" / folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(parameter.numel() for parameter in model.parameters()) == parameters
