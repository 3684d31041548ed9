"""What a user can get wrong, or what can go wrong around a run, gets a message, not a traceback,
and never loses a finished run (docs/reliability.md)."""
import errno
import json
import signal
import subprocess
import sys
import time

import pytest

import common.summary
from conftest import QUICK, ROOT, load_script, run_script, script_path
from steps import STEPS


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
    """Start `command`, send it Ctrl-C's signal once it has printed `marker`; (status, output)."""
    process = subprocess.Popen(  # Ctrl-C's default action, as a terminal gives it (a test
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,  # runner
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # may ignore it)
    seen, start = "", time.monotonic()
    while marker not in seen and time.monotonic() - start < timeout:
        line = process.stdout.readline()
        if not line:
            break
        seen += line
    process.send_signal(signal.SIGINT)
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
