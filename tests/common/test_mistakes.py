"""What a user can get wrong, or what can go wrong around a run, of a script, the estimate or the
tour: each mistake gets one true line (what was wrong, what to do), exit status 2, and leaves
nothing behind; a finished run is never lost (docs/reliability.md). In-process (main(argv)) where
a subprocess adds nothing."""
import errno
import json
import signal
import subprocess
import sys
import time

import pytest

import common.cli
import common.summary
from conftest import QUICK, ROOT, load_script, run_script, script_path
from estimate.command import main as estimate_main
from steps import STEPS
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


# ---- configs that cannot train, named before anything is built (a script, and the estimate) --

def llama_config(folder, **changes):
    return write_config(folder, json.dumps({**dict(model_type="llama", vocab_size=97, pad_token_id=0,
                                                   max_position_embeddings=64, **SMALL), **changes}))


@pytest.mark.parametrize("config, words", [
    (dict(hidden_size=30, num_attention_heads=4), "hidden size (30) is not a multiple of the number of "
                                                  "attention heads (4)"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "4 attention heads and 3 key-value heads"),
], ids=["heads", "key-value heads"])
def test_a_config_whose_heads_do_not_divide_is_named_as_such(config, words, tmp_path, capsys):
    llama = llama_config(tmp_path / "llama", **config)
    for main, argv in ((load_script("03").main, [*QUICK, "--data", "synthetic"]),
                       (load_script("10").main, [*QUICK, "--data", "synthetic"]),
                       (estimate_main, ["--steps", "03"])):
        said = refused(main, [*argv, "--model", llama, "--task", "causal-lm",
                              "--results-dir", str(tmp_path / "out")], capsys)
        assert words in said and "fake" not in said, said
    assert nothing_in(tmp_path / "out")


@pytest.mark.parametrize("step, flags", [("03", []), ("10", ["--lora-rank", "8"])])
def test_an_encoder_decoder_is_refused_with_what_the_scripts_train(step, flags, tmp_path, capsys):
    t5 = write_config(tmp_path / "t5", json.dumps(dict(model_type="t5", vocab_size=97, d_model=32,
                                                       d_kv=8, d_ff=64, num_layers=1, num_heads=4)))
    said = refused(load_script(step).main, [*QUICK, *flags, "--model", t5, "--data", "synthetic",
                                            "--results-dir", str(tmp_path / "out")], capsys)
    assert "'t5' model is an encoder-decoder" in said and "encoders and decoders" in said
    assert nothing_in(tmp_path / "out")


def test_a_clip_config_trains_at_its_image_towers_size_and_a_config_file_names_its_folder(tmp_path):
    """CLIP keeps its image size in vision_config (224 by default), which its position table
    follows; --model may name the config.json itself."""
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 patch_size=32)
    clip = write_config(tmp_path / "clip", json.dumps(dict(
        model_type="clip", vision_config=tower, text_config=dict(vocab_size=97, **SMALL))))
    record = load_script("03").main([*QUICK, "--model", f"{clip}/config.json", "--data", "synthetic",
                                     "--batch-size", "2", "--results-dir", str(tmp_path / "out")])
    assert record["steps"] == 2 and record["model"] == f"{clip}/config.json"


@pytest.mark.parametrize("length, least", [("1", 3), ("2", 3)])
def test_a_text_too_short_to_predict_a_token_is_refused(length, least, tmp_path, capsys):
    llama = llama_config(tmp_path / "llama")
    said = refused(load_script("03").main, [*QUICK, "--model", llama, "--task", "causal-lm",
                                           "--data", "synthetic", "--seq-len", length,
                                           "--results-dir", str(tmp_path / "out")], capsys)
    assert f"--seq-len {length}:" in said and f"ask for --seq-len {least} or more" in said
    assert nothing_in(tmp_path / "out")


def test_an_abbreviated_flag_is_refused_not_guessed(tmp_path, capsys):
    said = refused(load_script("07").main, ["--estimate", "--world", "2",
                                           "--results-dir", str(tmp_path)], capsys)
    assert "unrecognized arguments: --world 2" in said
    said = refused(lambda argv: tour_args(argv), ["--one-at", "--steps", "01"], capsys)
    assert "unrecognized arguments: --one-at" in said


def test_a_misspelled_lora_target_beside_right_ones_is_named(tmp_path, capsys):
    llama = llama_config(tmp_path / "llama")
    said = refused(load_script("10").main, [*QUICK, "--model", llama, "--task", "causal-lm",
                                            "--data", "synthetic", "--seq-len", "8", "--lora-rank",
                                            "4", "--lora-targets", "q_proj", "qproj_typo",
                                            "--results-dir", str(tmp_path / "out")], capsys)
    assert "is named qproj_typo; theirs are named" in said and "q_proj" in said.split("theirs")[1]


# ---- a launcher's variables, set by hand or left over ------------------------------------------

@pytest.mark.parametrize("environment, words", [
    (dict(WORLD_SIZE="abc", RANK="0"), "WORLD_SIZE=abc and RANK=0 do not name a process"),
    (dict(WORLD_SIZE="2", RANK="0"), "MASTER_ADDR and MASTER_PORT not"),
])
def test_a_group_that_cannot_form_is_named_before_it_is_joined(environment, words, tmp_path, capsys,
                                                              monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    said = refused(load_script("07").main, [*QUICK, "--results-dir", str(tmp_path)], capsys)
    assert words in said and "torchrun --nproc_per_node=N" in said
    assert nothing_in(tmp_path)


def test_a_process_started_by_hand_says_what_it_waits_for(monkeypatch, capsys):
    from common.distributed import check_launch_environment
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    check_launch_environment()
    assert "waiting at 10.0.0.7:29500 for the other 1" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")  # torchrun starts them all: nothing to say
    check_launch_environment()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("world", ["0", "abc"])
def test_a_stray_world_size_that_counts_no_processes_suggests_no_launch(world, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.delenv("RANK", raising=False)
    said = refused(load_script("10").main, [*QUICK, "--results-dir", str(tmp_path)], capsys)
    assert f"WORLD_SIZE={world}" in said and "nproc_per_node" not in said


def test_a_leftover_world_size_of_one_is_named_where_it_shards(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    said = refused(load_script("10").main, [*QUICK, "--optimizer-on-host",
                                            "--results-dir", str(tmp_path)], capsys)
    assert said.startswith("error: --optimizer-on-host with WORLD_SIZE=1") and "unset it" in said


@pytest.mark.parametrize("where", ["/proc/no-such-dir", "{file}"])
def test_an_unwritable_results_dir_stops_the_run_before_training(where, tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(SystemExit) as stopped:
        load_script("01").main([*QUICK, "--results-dir", where.format(file=file)])
    assert stopped.value.code == 2  # argparse's exit, before any data or model
    message = capsys.readouterr().err
    assert "cannot write there" in message and "Name a directory" in message


def test_the_estimate_table_checks_its_results_dir_first(tmp_path, capsys):
    from estimate.command import main
    with pytest.raises(SystemExit):
        main(["--results-dir", "/proc/no-such-dir"])
    assert "cannot write there" in capsys.readouterr().err


def test_a_record_that_cannot_be_written_is_printed_whole(tmp_path, monkeypatch, capsys):
    """A disk that fills during the run: the record goes to standard output, with a message."""
    def disk_full(path, record):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(common.summary, "write_json_atomically", disk_full)
    with pytest.raises(SystemExit) as stopped:
        run_script("01", QUICK, tmp_path)
    assert "No space left on device" in str(stopped.value.code)
    assert "printed in full above" in str(stopped.value.code)
    printed = capsys.readouterr().out
    record = json.loads(printed[printed.index("{\n"):])
    assert record["script"] == "01_baseline" and record["steps"] == 2


def interrupt_after(command, marker, timeout=120):
    """Start `command`, send it Ctrl-C's signal once it has printed `marker` (and again every 10 s
    while it runs on: Python drops an interrupt that lands in an object's finalizer, "Exception
    ignored in __del__", as a user then presses Ctrl-C again); (status, output)."""
    process = subprocess.Popen(  # Ctrl-C's default action, as a terminal gives it (a test
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,  # runner
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # may ignore it)
    seen, start = "", time.monotonic()
    while marker not in seen and time.monotonic() - start < timeout:
        line = process.stdout.readline()
        if not line:
            break
        seen += line
    for _ in range(3):
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        output, _ = process.communicate(timeout=timeout)
    return process.returncode, seen + output


def test_ctrl_c_in_a_run_says_so_in_one_line(tmp_path):
    status, output = interrupt_after(
        [sys.executable, str(script_path("01")), "--device", "cpu", "--results-dir", str(tmp_path)],
        " step ")
    assert status == -signal.SIGINT and "Traceback" not in output
    assert "interrupted (Ctrl-C)" in output and not list(tmp_path.glob("*.json"))


def test_parsing_a_scripts_command_line_leaves_pythons_hooks_alone(tmp_path):
    """A copied script's main() may run inside its user's program: Ctrl-C's one line comes from
    the script's own last lines (run_main), never from a process-wide hook."""
    from common.cli import parse_args
    before = sys.excepthook
    parse_args("", ["--results-dir", str(tmp_path)])
    assert sys.excepthook is before


def test_every_script_runs_its_main_through_the_same_last_lines():
    """So that Ctrl-C says so in one line in every script, and no diff between two shows it."""
    ends = {step.path.name: step.path.read_text().rstrip().splitlines()[-3:]
            for step in STEPS.values()}  # the combined script's too
    assert set(map(tuple, ends.values())) == {(
        'if __name__ == "__main__":',
        "    from common.cli import run_main  # Ctrl-C: one line instead of a traceback",
        "    run_main(main)")}


@pytest.mark.parametrize("flags, marker, said", [
    (["--device", "cpu"], "[1/", "estimates: no table"),
    # two scripts, searched by workers (named in full: "04 05" would pick 13, their branches too)
    (["--gpu-memory", "1GB", "--steps", "04_grad_accum", "05_sgd_cosine"], "searching the largest",
     "during the --gpu-memory search"),
])
def test_ctrl_c_in_the_estimate_stops_its_workers_and_says_so(tmp_path, flags, marker, said):
    status, output = interrupt_after(
        [sys.executable, "-m", "estimate", "--preset", "tiny", *flags,
         "--results-dir", str(tmp_path)], marker)
    assert status != 0 and "Traceback" not in output
    assert "interrupted (Ctrl-C) " in output and said in output
    assert not (tmp_path / "estimate.json").exists()


def test_ctrl_c_after_the_answer_leaves_it_on_screen(tmp_path):
    """--gpu-memory prints the stack's answer before the table's rows are estimated: Ctrl-C then
    stops the rows (one at a time, in this process) and the answer stays above its one line.
    Three rows and their searches after it: with one, a fast machine finished the work before
    the interrupt arrived."""
    status, output = interrupt_after(
        [sys.executable, "-m", "estimate", "--preset", "tiny", "--gpu-memory", "1GB", "--steps",
         "04_grad_accum", "05_sgd_cosine", "06_on_device_init", "--jobs", "1", "--results-dir",
         str(tmp_path)], "with adapters", 300)
    assert status != 0  # a traceback only where Python dropped an interrupt (interrupt_after)
    assert output.count("Traceback (most recent call last)") == output.count("Exception ignored in")
    answer = output.index("The stack: bf16 fits batch 64")
    assert answer < output.index("interrupted (Ctrl-C) after the answer, which stands: no table")
    assert "| script |" not in output and not (tmp_path / "estimate.json").exists()


def test_two_runs_writing_one_results_dir_at_once_leave_a_whole_record(tmp_path):
    command = [sys.executable, str(script_path("01")), *QUICK, "--results-dir", str(tmp_path)]
    runs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for _ in range(2)]
    for run in runs:
        output, _ = run.communicate(timeout=120)
        assert run.returncode == 0, output
    assert [path.name for path in tmp_path.iterdir()] == ["01_baseline.json"]  # no leftovers
    assert json.loads((tmp_path / "01_baseline.json").read_text())["steps"] == 2


def test_corrupted_weights_are_named_with_what_to_do(tmp_path, small_snippets, capsys):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from support.architecture_matrix import model_flags, write_model
    folder = write_model(tmp_path / "bert", "BERT")
    AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])  # a download that stopped halfway
    with pytest.raises(SystemExit) as stopped:
        run_script("04", [*model_flags(folder, "BERT"), *QUICK], tmp_path)
    message = str(stopped.value.code)
    assert str(folder) in message and "could not be read" in message
    assert "move the weight files aside" in message


def test_weights_saved_with_another_number_of_classes_get_a_new_head(tmp_path, small_snippets):
    """A model finetuned for 5 classes, trained here on 2: its body loads, its head is new."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from support.architecture_matrix import model_flags, write_model
    folder = write_model(tmp_path / "bert", "BERT")
    AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(folder, num_labels=5)).save_pretrained(folder)
    record, meter = run_script("04", [*model_flags(folder, "BERT"), *QUICK], tmp_path)
    assert record["steps"] == 2 and meter.model.config.num_labels == 2
    assert meter.model.classifier.out_features == 2


def test_a_gpu_out_of_memory_while_loading_is_not_called_corrupted_weights(tmp_path, monkeypatch):
    """Loading puts the weights on the training device: its out-of-memory error stays itself."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from support.architecture_matrix import model_flags, write_model
    folder = write_model(tmp_path / "bert", "BERT")
    AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(folder)).save_pretrained(folder)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", out_of_memory)
    monkeypatch.setattr("transformers.BertForSequenceClassification.from_pretrained", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        run_script("04", [*model_flags(folder, "BERT"), *QUICK], tmp_path)


@pytest.mark.parametrize("argv, words", [
    (["--gpu-memory", "0.5b"], "--gpu-memory '0.5b': expected a size such as 24GB"),
    (["--gpu-memory", "24GB", "--host-memory", "0"], "--host-memory '0': expected a size"),
    (["--gpu-memory", "24GB", "--host-memory", "64gigs"], "--host-memory '64gigs': expected a size"),
    (["--gpu-memory", "24GB", "--host-memory", "-1GB"], "--host-memory '-1GB': expected a size"),
    (["--gpu-memory", "24GB", "--stack-only", "--steps", "01", "03"],
     "--steps picks the table's rows, and --stack-only prints no table"),
    (["--steps", "4.5"], "no script '4.5'; the scripts are: 01 02 03"),
    (["--gpu-memory", "24GB", "--world", "2"], "unrecognized arguments: --world 2"),
    (["--gpu-memory", "24GB", "--stack-only", "--world-size", "1000000"],
     "a batch of 64 does not split over 1000000 GPUs (--world-size), each taking a whole share: "
     "give --batch-size a multiple of 1000000, or fewer GPUs"),
    (["--gpu-memory", "24GB", "--world-size", "3", "--batch-size", "7"],
     "a batch of 7 does not split over 3 GPUs"),
])
def test_the_estimates_mistakes_are_named_before_anything_runs(argv, words, tmp_path, capsys):
    said = refused(estimate_main, [*argv, "--results-dir", str(tmp_path)], capsys)
    assert words in said
    assert nothing_in(tmp_path)


def test_a_stack_whose_every_estimate_failed_says_so_not_that_nothing_fits():
    from estimate.search.answers import stack_text
    from estimate.search.walk import Answer
    from estimate.stack import CHAIN
    answer = Answer(tried=[(CHAIN[0], [], [], "an operation needs values"),
                           (CHAIN[1], [], [], "an operation needs values")],
                    estimated=2, failures=[f"{CHAIN[0].name}: an operation needs values"] * 2)
    said = stack_text(answer, [], 8, 24 * 10**9, "24GB", [])
    assert said.startswith("The stack: no answer for batch 8: every estimate of the chain failed, "
                           f"the first ({CHAIN[0].name}: an operation needs values)")
    assert "no prefix fits" not in said


def test_a_clip_configs_stack_is_answered_at_its_image_towers_size(tmp_path, capsys):
    """The stack prices CLIP by its image tower, which the scripts train (the CLIP config has no
    num_hidden_layers of its own)."""
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 patch_size=32)
    clip = write_config(tmp_path / "clip", json.dumps(dict(
        model_type="clip", vision_config=tower, text_config=dict(vocab_size=97, **SMALL))))
    assert estimate_main(["--model", str(clip), "--gpu-memory", "1GB", "--stack-only", "--quiet",
                          "--batch-size", "4", "--results-dir", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.startswith("The stack: bf16 fits batch 4 in --gpu-memory 1GB")
