"""05l, the tiled MLP: each block's MLP runs over tiles of the sequence, each recomputed in
backward; the same loss and gradients as its parent (05e) within rounding, on decoders of three
families; its estimate is its run's peak to the byte; and where the MLP's intermediate fills the
peak, it holds one tile's instead of the whole sequence's.

Llama and Qwen2 come from the architecture matrix (an MLP of gate_proj, up_proj and down_proj;
Qwen2 adds biases to its attention's projections); BLOOM is the third family: its MLP takes the
residual too (both are cut into tiles), and its attention is its own code (ALiBi, no bound on
the positions). Every shape here gives at least 2 tiles: 64 tokens over a hidden size of 32.
"""
import json
import re

import pytest
import torch

from conftest import QUICK, load_script, run_script, unevaluated
from estimate.predict import predict
from steps import STEPS
from support.architecture_matrix import model_flags, write_model
from support.rounding import additions, assert_same_sum

CAUSAL_LM = ["--task", "causal-lm"]
FAMILIES = ["Llama", "Qwen2", "BLOOM"]
LONG = ["--seq-len", "64", "--accum-steps", "2", "--batch-size", "8"]  # 2 tiles: 64 / hidden 32


def matrix_model(name, tmp_path):
    return write_model(tmp_path / re.sub(r"\W", "", name.lower()), name)


def tiles_counted(module):
    """The script's `checkpoint` wrapped to count the calls that recompute an MLP's tile (not a
    whole block): {"tiles": count}."""
    counted, checkpoint = {"tiles": 0}, module.checkpoint

    def counting(function, *args, **kwargs):
        counted["tiles"] += type(function).__name__.endswith("MLP")
        return checkpoint(function, *args, **kwargs)

    module.checkpoint = counting
    return counted


def first_gradients(step, flags, tmp_path, monkeypatch):
    """The losses of a float32 run of `step` and the gradients of its first optimizer step."""
    module = unevaluated(step)
    module.DTYPE = torch.float32
    gradients = []

    class Recording(torch.optim.Adam):
        def step(self, closure=None):
            if not gradients:
                gradients.extend(param.grad.clone() for group in self.param_groups
                                 for param in group["params"])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "Adam", Recording)
    record, meter = run_script(step, [*flags, *QUICK], tmp_path / step, module)
    return record, gradients, meter.model.config


@pytest.mark.numerical
@pytest.mark.parametrize("name, tiles", [(name, "auto") for name in FAMILIES] + [("Llama", "5")])
def test_the_tiled_mlp_gives_05es_losses_and_gradients_within_rounding(
        name, tiles, tmp_path, small_snippets, monkeypatch):
    """Float32, 2 steps of 2 micro-batches of 4 padded texts of 64 tokens: the losses, and every
    gradient of the first step, within the rounding of their sums (a weight's gradient is summed
    over the tiles here, over the whole sequence at once in 05e); 2 tiles (auto: 64 / 32) or 5 of
    13 and 12 tokens."""
    flags = [*model_flags(matrix_model(name, tmp_path), name), *LONG, *CAUSAL_LM]
    parent, parent_gradients, config = first_gradients("05e", flags, tmp_path, monkeypatch)
    tiled, gradients, _ = first_gradients("05l", [*flags, "--mlp-tiles", tiles], tmp_path,
                                          monkeypatch)
    n = additions(config, parent["batch_size"] * 64)
    expected = torch.tensor(parent["losses"])
    assert_same_sum(torch.tensor(tiled["losses"]), expected, expected.abs(), n, what="losses")
    assert len(gradients) == len(parent_gradients) > 0
    for mine, theirs in zip(gradients, parent_gradients, strict=True):
        assert_same_sum(mine, theirs, theirs.abs().max(), n, what="gradients")


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tiled_mlp_trains_in_tiles_and_its_estimate_is_its_runs_peak(name, tmp_path,
                                                                         small_snippets):
    """2 tiles a block (ALST's count: 64 tokens over a hidden size of 32), each micro-batch's
    forward and its recomputation in backward; the CPU estimate equals the run to the byte."""
    flags = [*model_flags(matrix_model(name, tmp_path), name), *LONG, *CAUSAL_LM]
    module = unevaluated("05l")
    counted = tiles_counted(module)
    real, _ = run_script("05l", [*flags, *QUICK], tmp_path, module)
    assert real["steps"] == 2 and all(map(torch.isfinite, torch.tensor(real["losses"])))
    micro_batches, blocks = 2 * 2, 2
    # forward, and again in backward when the checkpointed block runs its forward once more
    assert counted["tiles"] == 2 * micro_batches * blocks * 2
    predicted = predict(STEPS["05l"].path, [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]


def wide_mlp(tmp_path):
    """A Llama whose MLP is 32 times its hidden size and whose vocabulary is small, so that the
    MLP's intermediate, not the logits, fills the peak (a config only: --data synthetic)."""
    folder = tmp_path / "wide"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=32, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=64, max_position_embeddings=512,
        pad_token_id=0)))
    return folder


def test_where_the_mlps_intermediate_is_the_peak_the_tiles_hold_one_tiles(tmp_path):
    """512 packed tokens, 16 tiles of 32: in a block's recomputation 05e holds the intermediates
    of a micro-batch's whole sequence (the gate's and the up-projection's outputs, the gate's
    activation, their product, then their gradients), 05l one tile's at a time: its peak is
    lower by more than four of them (less a tile's)."""
    flags = ["--model", str(wide_mlp(tmp_path)), "--seq-len", "512", "--data", "synthetic",
             "--pack", "--batch-size", "4", "--accum-steps", "2", *CAUSAL_LM, *QUICK]
    parent, _ = run_script("05e", flags, tmp_path, unevaluated("05e"))
    tiled, _ = run_script("05l", flags, tmp_path, unevaluated("05l"))
    intermediate = 2 * 512 * 1024 * 2  # a micro-batch of 2 sequences, bfloat16
    saved = parent["peak_memory_bytes"] - tiled["peak_memory_bytes"]
    assert saved > 4 * intermediate * (1 - 1 / 16), (saved, intermediate)
    for kept in ("parameters", "gradients", "optimizer_state"):  # the model state is 05e's
        assert tiled["breakdown_bytes"][kept] == parent["breakdown_bytes"][kept]


def test_a_model_whose_blocks_have_no_mlp_module_is_refused_with_a_message(tmp_path):
    """OPT's blocks compute fc1 and fc2 themselves: nothing to run in tiles."""
    folder = tmp_path / "opt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="opt", hidden_size=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=2, vocab_size=64, max_position_embeddings=64, word_embed_proj_dim=32)))
    with pytest.raises(SystemExit, match="no `mlp` module .* Train it with 05e_activation_offloading"):
        load_script("05l").main(["--model", str(folder), "--seq-len", "16", "--data", "synthetic",
                                 *QUICK, "--results-dir", str(tmp_path)])


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_tile_count_that_is_not_auto_or_a_whole_number_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script("05l").main(["--mlp-tiles", value])
    assert stopped.value.code == 2
    assert "argument --mlp-tiles:" in capsys.readouterr().err
