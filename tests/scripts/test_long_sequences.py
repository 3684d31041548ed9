"""What a long run needs of the data and the model beside the tiled MLP (05l): texts packed end
to end with no padding and no attention mask (--pack), so that no tensor of length x length is
made; and positions past a config's own maximum (--max-positions), asked for by name."""
import pytest
import torch

from conftest import QUICK, load_script, run_script, unevaluated
from estimate.predict import predict
from steps import STEPS
from support.architecture_matrix import model_flags, write_model

CAUSAL_LM = ["--task", "causal-lm"]


def preset_of(flags):
    from common.cli import parse_args
    from common.presets import preset_for
    return preset_for(parse_args("", flags))


# ---- --pack: no padding, no mask ---------------------------------------------------------------

def test_packed_texts_are_the_tokenized_texts_end_to_end_in_full_sequences_without_a_mask(
        small_snippets):
    """Each sequence is --seq-len tokens of the texts as the tokenizer encodes each alone (its
    own start and end tokens), one after another, the rest dropped; no padding, no attention
    mask; the labels are the tokens (each position predicts the next, none left out)."""
    from common.data import load_data, packed, tokenizer_for
    preset = preset_of([*CAUSAL_LM, "--pack"])
    assert preset.packed and preset.max_length == 48
    tokenizer = tokenizer_for(preset)
    texts = ["a fine film", "dull", "the best of the year, by far"]
    tokens = [token for text in texts for token in tokenizer(text)["input_ids"]]
    dataset = packed(texts, tokenizer, 5)[:]
    assert dataset["input_ids"].flatten().tolist() == tokens[:len(tokens) // 5 * 5]
    assert torch.equal(dataset["label"], dataset["input_ids"])
    inputs, labels = next(iter(load_data(preset, 8, "cpu").train))
    assert set(inputs) == {"input_ids"} and inputs["input_ids"].shape == labels.shape == (8, 48)
    assert (labels != tokenizer.pad_token_id).all()


def test_packed_synthetic_text_has_no_padding_and_no_mask(tmp_path):
    from common.data import SyntheticData
    folder = write_model(tmp_path / "llama", "Llama")
    preset = preset_of(["--model", str(folder), "--seq-len", "24", "--data", "synthetic",
                        "--pack", *CAUSAL_LM])
    batch = SyntheticData(preset, 16, 0)[[0, 5]]
    assert set(batch) == {"input_ids", "label"} and torch.equal(batch["label"], batch["input_ids"])


def test_packing_a_classifiers_texts_is_refused_with_a_message(capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script("04").main(["--preset", "tiny-text", "--pack"])
    assert stopped.value.code == 2
    assert "add --task causal-lm" in capsys.readouterr().err


@pytest.mark.parametrize("step", ["04", "05l"])
def test_a_packed_run_trains_without_a_mask_and_its_estimate_is_its_runs_peak(step, tmp_path,
                                                                              small_snippets):
    """transformers, given no mask, builds none and asks attention for is_causal; a fake run
    sees fake position ids and would say they restart (packed sequences), and build the mask:
    the estimate answers as the real run does (estimate/fake/patches.py)."""
    flags = [*CAUSAL_LM, "--pack", "--batch-size", "8", "--accum-steps", "2"]
    real, _ = run_script(step, [*flags, *QUICK], tmp_path, unevaluated(step))
    predicted = predict(STEPS[step].path, [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]


# ---- --max-positions: past a config's own maximum -----------------------------------------------

def test_a_length_past_the_models_positions_is_refused_naming_the_flag_that_extends_them(
        tmp_path, capsys):
    folder = write_model(tmp_path / "llama", "Llama")  # positions for 64 tokens
    with pytest.raises(SystemExit) as stopped:
        load_script("05l").main(["--model", str(folder), "--seq-len", "96", *QUICK])
    assert stopped.value.code == 2
    assert "--max-positions 96 to stretch its rotary positions" in capsys.readouterr().err


def test_max_positions_raises_the_maximum_and_stretches_the_rotary_frequencies(tmp_path):
    """The default rotary positions become linear position interpolation by the ratio; a config
    that scales them already (Llama 3.1's llama3 scaling, factor 8 up to 131,072) has its factor
    multiplied by it."""
    from common.model import model_config
    folder = write_model(tmp_path / "llama", "Llama")
    config = model_config(preset_of(["--model", str(folder), "--seq-len", "96",
                                     "--max-positions", "128"]))
    assert config.max_position_embeddings == 128
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 2
    long = model_config(preset_of(["--model", "docs/models/llama-3.1-8b", "--seq-len", "1048576",
                                   "--max-positions", "1048576", *CAUSAL_LM]))
    assert long.max_position_embeddings == 1048576
    assert long.rope_parameters["rope_type"] == "llama3" and long.rope_parameters["factor"] == 64


@pytest.mark.parametrize("name, words", [("GPT-2", "a table of learned positions"),
                                         ("BLOOM", "not bounded (ALiBi)")])
def test_max_positions_for_positions_not_rotary_is_refused(name, words, tmp_path, capsys):
    folder = write_model(tmp_path / "model", name)
    with pytest.raises(SystemExit):
        load_script("04").main([*model_flags(folder, name), "--max-positions", "128", *CAUSAL_LM])
    assert words in capsys.readouterr().err


def test_a_run_past_the_configs_positions_trains_in_tiles_and_its_estimate_is_its_peak(
        tmp_path, small_snippets):
    """96 tokens, packed, where the config has positions for 64: 3 tiles of 32 a block."""
    folder = write_model(tmp_path / "llama", "Llama")
    flags = ["--model", str(folder), "--seq-len", "96", "--max-positions", "128", "--pack",
             "--batch-size", "4", "--accum-steps", "2", *CAUSAL_LM]
    real, meter = run_script("05l", [*flags, *QUICK], tmp_path, unevaluated("05l"))
    assert real["steps"] == 2 and meter.model.config.max_position_embeddings == 128
    predicted = predict(STEPS["05l"].path, [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]

