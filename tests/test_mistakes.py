"""A user's mistakes: each gets one true line (what was wrong, what to do), exit status 2, and
leaves nothing behind. In-process (main(argv)) where a subprocess adds nothing."""
import json

import pytest

import common.cli
from conftest import QUICK, load_script
from estimate.command import main as estimate_main
from tour.runner import parse_args as tour_args


def refused(main, argv, capsys):
    """The one line `main(argv)` stops with (argparse's, or a SystemExit's), after checking
    that it stopped as a usage error does."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    said = capsys.readouterr().err.strip().splitlines()
    if isinstance(stop.value.code, str):  # raise SystemExit("error: ...")
        return stop.value.code
    assert stop.value.code == 2, said
    return said[-1]


def nothing_in(folder):
    return not folder.exists() or not any(folder.iterdir())


@pytest.mark.parametrize("step", ["05", "05j", "10"])
@pytest.mark.parametrize("rate", ["inf", "1e400"])
def test_an_infinite_learning_rate_is_refused(step, rate, tmp_path, capsys):
    said = refused(load_script(step).main, [*QUICK, "--lr", rate, "--results-dir", str(tmp_path)], capsys)
    assert "--lr: must be a finite number" in said
    assert nothing_in(tmp_path)


def test_a_seed_beyond_torchs_range_is_refused(tmp_path, capsys):
    said = refused(load_script("03").main, [*QUICK, "--seed", "99999999999999999999",
                                           "--results-dir", str(tmp_path)], capsys)
    assert "--seed: must be from 0 to 9223372036854775807" in said
    assert nothing_in(tmp_path)


def test_an_empty_results_dir_is_refused(capsys):
    said = refused(load_script("03").main, [*QUICK, "--results-dir", ""], capsys)
    assert "--results-dir is empty" in said


def write_config(folder, text):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(text)
    return str(folder)


SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


@pytest.mark.parametrize("size, asked", [(33, 32), (7, 8)])
def test_an_image_size_that_is_not_a_multiple_of_the_patch_is_refused_before_anything_is_built(
        size, asked, tmp_path, capsys):
    vit = write_config(tmp_path / "vit", json.dumps(dict(model_type="vit", patch_size=8, **SMALL)))
    out = tmp_path / "out"
    said = refused(load_script("04").main, [*QUICK, "--model", vit, "--image-size", str(size),
                                           "--results-dir", str(out)], capsys)
    assert f"--image-size {size}:" in said and f"ask for --image-size {asked}" in said
    assert nothing_in(out)
    said = refused(estimate_main, ["--model", vit, "--image-size", str(size), "--steps", "04",
                                   "--results-dir", str(out)], capsys)
    assert f"--image-size {size}:" in said and "usage" not in said


def test_num_labels_under_causal_lm_is_refused(tmp_path, capsys):
    llama = write_config(tmp_path / "llama", json.dumps(dict(model_type="llama", vocab_size=97, **SMALL)))
    said = refused(load_script("04").main, [*QUICK, "--model", llama, "--task", "causal-lm",
                                           "--num-labels", "3", "--results-dir", str(tmp_path)], capsys)
    assert "--num-labels 3: --task causal-lm predicts each next token" in said


def test_a_config_that_is_not_json_is_named_as_such(tmp_path, capsys):
    broken = write_config(tmp_path / "broken", "{not json")
    said = refused(load_script("03").main, [*QUICK, "--model", broken, "--results-dir", str(tmp_path)],
                   capsys)
    assert "its config.json is not valid JSON" in said and "Hub" not in said


def test_lora_targets_that_name_nothing_list_the_names_there_are(tmp_path, capsys):
    llama = write_config(tmp_path / "llama", json.dumps(dict(model_type="llama", vocab_size=97,
                                                             pad_token_id=0, **SMALL)))
    said = refused(load_script("07a").main, [*QUICK, "--model", llama, "--seq-len", "8",
                                            "--data", "synthetic", "--lora-targets", "query", "value",
                                            "--results-dir", str(tmp_path / "out")], capsys)
    assert "is named query or value; theirs are named" in said
    assert "q_proj" in said and "v_proj" in said


def test_a_causal_lm_only_script_on_a_classifier_does_not_suggest_classifying(tmp_path, capsys):
    bert = write_config(tmp_path / "bert", json.dumps(dict(model_type="bert", vocab_size=97, **SMALL)))
    said = refused(load_script("05h").main, [*QUICK, "--model", bert, "--results-dir", str(tmp_path)],
                   capsys)
    assert "this script trains --task causal-lm only" in said and "classifier" not in said.split(";")[-1]


def test_a_script_that_always_compiles_does_not_suggest_leaving_compile_out(tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.setattr(common.cli, "compiler_problem", lambda device: "no C++ compiler found")
    said = refused(load_script("05k").main, [*QUICK, "--results-dir", str(tmp_path)], capsys)
    assert "this script always compiles" in said and "without --compile" not in said
    said = refused(load_script("04").main, [*QUICK, "--compile", "--results-dir", str(tmp_path)], capsys)
    assert said.endswith("or run without --compile")


def test_a_negative_gpu_memory_is_read_as_a_size_and_refused(tmp_path, capsys):
    said = refused(estimate_main, ["--gpu-memory", "-5GB", "--results-dir", str(tmp_path)], capsys)
    assert "expected one argument" not in said and "-5GB" in said


def test_the_estimates_errors_carry_no_training_scripts_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        estimate_main(["--model", str(tmp_path / "nowhere"), "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--epochs" not in err and "--memory-snapshot" not in err
    assert err.strip().splitlines()[-1].startswith("python -m estimate: error: --model")


def test_ctrl_c_during_the_estimate_names_the_file_it_keeps(tmp_path):
    from estimate import command, records
    command.parse_table_args(["--results-dir", str(tmp_path / "kept")])
    assert records.KEPT == tmp_path / "kept" / "estimate.json"


def test_a_snapshot_file_that_cannot_be_written_is_refused_before_the_estimate(tmp_path, capsys):
    """/proc takes no new files, even from root, whom a folder's permissions do not stop."""
    said = refused(load_script("03").main, ["--estimate", "--memory-snapshot", "/proc/s.pickle",
                                           "--results-dir", str(tmp_path / "out")], capsys)
    assert "--memory-snapshot" in said and "cannot write" in said
    assert nothing_in(tmp_path / "out")


def test_publishing_the_tour_to_a_file_is_refused_before_the_first_step(tmp_path, capsys):
    file = tmp_path / "docs.md"
    file.write_text("")
    said = refused(lambda argv: tour_args(argv), ["--publish", str(file)], capsys)
    assert said.startswith("python -m tour: error: --publish") or "--publish" in said
    assert "it is a file, not a directory" in said


def test_8bit_adamw_stepped_in_backward_under_torchrun_is_refused(tmp_path, capsys, monkeypatch):
    """Under torchrun FSDP steps each weight on its reduce-scatter stream, where bitsandbytes'
    kernels (launched on the default stream) could read a gradient shard too early; refused
    before the group starts, as torchrun's process 0 (with --offload, on the host, it trains)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    said = refused(load_script("10").main, [*QUICK, "--optimizer", "adamw-8bit",
                                            "--optimizer-in-backward", "--results-dir",
                                            str(tmp_path)], capsys)
    assert said.startswith("error: --optimizer adamw-8bit with --optimizer-in-backward and "
                           "sharding (torchrun):") and "\n" not in said
    assert nothing_in(tmp_path)
