"""Runs kept on disk (estimate/shortcuts/cache.py): a row asked again is answered from the trace of its
first run, replayed for any GPU that reads as the first did; anything its bytes depend on (its
flags, the script, the model's config, a module it loaded, a library it imported, the kernels'
environment, the GPU's properties the run read) makes a new run."""
import json
import os
import shutil
import subprocess
import sys
import zlib

import pytest

from conftest import ROOT, script_path
from estimate.gpu_choices import GPUS
from estimate.predict import Row, attempt, attempt_run, predict
from estimate.shortcuts import cache


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Runs kept in a folder of the test's own; every real run counted."""
    monkeypatch.setenv("MEMORY_TECHNIQUES_CACHE", str(tmp_path))
    monkeypatch.setenv(cache.VARIABLE, "1")
    calls = []
    real = sys.modules["estimate.predict"].run_for

    def run_for(row, learned=None, one_probe=False):
        calls.append(list(row.argv))
        return real(row, learned, one_probe)
    monkeypatch.setattr(sys.modules["estimate.predict"], "run_for", run_for)
    return calls


TINY = ["--preset", "tiny", "--batch-size", "8"]


def test_a_row_asked_again_is_answered_from_its_first_run(kept):
    first = attempt(Row(script_path("04"), TINY))
    again = attempt(Row(script_path("04"), TINY))
    assert again == (first[0], None, None) and len(kept) == 1  # None: no time, it was kept


def test_a_kept_run_is_replayed_for_another_gpu_that_reads_alike(kept):
    """An A100 and an H100 both run flash attention: one run, two replays (the H100's cuBLAS
    workspaces are larger), each what a run for that GPU gives; a V100 reads otherwise: a run."""
    a100, _, _ = attempt(Row(script_path("04"), TINY, gpu="a100"))
    h100, _, seconds = attempt(Row(script_path("04"), TINY, gpu="h100"))
    assert seconds is None and len(kept) == 1
    attempt(Row(script_path("04"), TINY, gpu="v100"))
    assert len(kept) == 2
    assert attempt(Row(script_path("04"), TINY, gpu="t4"))[2] is None  # as the V100 reads
    assert h100 == predict(script_path("04"), TINY, gpu="h100")  # a run of its own (not kept)
    assert h100["reserved_bytes"] > a100["reserved_bytes"] and h100["gpu"] == "H100"


@pytest.mark.parametrize("other", [
    Row(script_path("04"), ["--preset", "tiny", "--batch-size", "16"]),
    Row(script_path("05"), TINY),
    Row(script_path("04"), TINY, world_size=2),
    Row(script_path("04"), TINY, exact=True),
    Row(script_path("04"), TINY, any_batch_size=True),
])
def test_a_row_that_differs_in_anything_is_run(kept, other):
    attempt(Row(script_path("04"), TINY))
    record, _, seconds = attempt(other)
    assert seconds is not None and record and len(kept) == 2


def test_a_changed_script_or_model_config_is_a_new_row(kept, tmp_path):
    script = tmp_path / "04_copy.py"
    shutil.copy(script_path("04"), script)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    row = Row(script, ["--model", str(model)])
    first = cache.key(row, False)
    assert first == cache.key(Row(script, ["--model", str(model)]), False)
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 128}))
    second = cache.key(row, False)
    script.write_text(script.read_text() + "\n# edited\n")
    assert len({first, second, cache.key(row, False)}) == 3


def kept_changed(row, change):
    """Rewrite the kept variants of `row` with `change(variant)` applied to each."""
    path = cache.folder() / f"{cache.key(row, False)}.kept"
    variants = cache.read(cache.key(row, False))
    for variant in variants:
        change(variant)
    path.write_bytes(zlib.compress(json.dumps({"variants": variants}).encode()))


def test_the_modules_and_libraries_a_run_loaded_are_found_from_it_and_checked(kept):
    """What the run loaded (the repository's files, the installed distributions) is kept beside
    it; a file or version changed since reads as nothing kept, and the new run takes its place."""
    row = Row(script_path("04"), TINY)
    attempt(row)
    [variant] = cache.read(cache.key(row, False))
    for found in ("04_grad_accum.py", "common/model.py", "common/memory.py", "steps.py",
                  "estimate/fake/run.py", "estimate/replay/trace.py"):
        assert found in variant["sources"]
    assert {"torch", "transformers"} <= set(variant["distributions"])
    kept_changed(row, lambda variant: variant["sources"].update({"common/model.py": "0" * 64}))
    assert attempt(row)[2] is not None and len(kept) == 2  # a module it loaded changed since
    assert attempt(row)[2] is None and len(kept) == 2  # the new run was kept in its place
    kept_changed(row, lambda variant: variant["distributions"].update({"transformers": "0.0"}))
    assert attempt(row)[2] is not None and len(kept) == 3  # a library it imported changed since
    assert len(cache.read(cache.key(row, False))) == 1  # the run that no longer held is gone


def test_what_the_gpu_emulation_reads_is_what_it_keeps():
    from estimate.gpu_choices import ReadGpu, reads_match
    gpu = ReadGpu(GPUS["h100"])
    assert gpu.flash_attention and gpu.read == {"flash_attention": True}
    assert reads_match(gpu.read, GPUS["a100"]) and not reads_match(gpu.read, GPUS["v100"])
    gpu.multiprocessors  # noqa: B018 - bitsandbytes' 4-bit rule reads it
    assert not reads_match(gpu.read, GPUS["a100"])


def test_what_is_not_kept(kept, tmp_path, monkeypatch):
    """A failure, a memory snapshot (a file the run writes) and a Hub model not on this machine
    are run each time; ESTIMATE_CACHE=0 keeps nothing."""
    assert cache.key(Row(script_path("04"), [], snapshot=str(tmp_path / "s.pickle")), False) is None
    assert cache.key(Row(script_path("04"), ["--model", "no-such-org/no-such-model"]), False) is None
    monkeypatch.setattr(sys.modules["estimate.predict"], "run_for", lambda *args: 1 / 0)
    row = Row(script_path("04"), ["--preset", "tiny"])
    assert attempt(row)[0] is None and not list(cache.folder().glob("*.kept"))
    for off in ("0", "off", "False"):
        monkeypatch.setenv(cache.VARIABLE, off)
        assert cache.key(row, False) is None
    monkeypatch.setenv(cache.VARIABLE, "1")
    (tmp_path / "unreadable").mkdir()  # a --model "folder" whose config cannot be read
    (tmp_path / "unreadable" / "config.json").mkdir()
    assert cache.key(Row(script_path("04"), ["--model", str(tmp_path / "unreadable")]), False) is None


@pytest.mark.parametrize("variable", ["ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                      "TORCHINDUCTOR_MAX_AUTOTUNE", "PYTORCH_CUDA_ALLOC_CONF"])
def test_the_kernels_and_compiler_asked_of_pytorch_are_part_of_the_key(kept, monkeypatch, variable):
    row = Row(script_path("04"), ["--preset", "tiny", "--device", "cpu"])
    monkeypatch.delenv(variable, raising=False)
    before = cache.key(row, False)
    monkeypatch.setenv(variable, "default")
    assert cache.key(row, False) != before


def test_the_folder_is_held_under_its_size_the_runs_read_longest_ago_going_first(kept, monkeypatch):
    rows = [Row(script_path("04"), ["--preset", "tiny", "--batch-size", str(size)])
            for size in (8, 16, 24)]
    for row in rows:
        attempt_run(row)
    files = {row.argv[-1]: cache.folder() / f"{cache.key(row, False)}.kept" for row in rows}
    for age, size in enumerate(("16", "24", "8")):  # 8 read last: it stays
        os.utime(files[size], (1000 + age, 1000 + age))
    one = max(path.stat().st_size for path in files.values())
    cache.evict(limit=int(2.5 * one))
    assert [size for size, path in files.items() if path.exists()] == ["8"]


def test_the_table_asked_again_answers_from_kept_runs_with_the_same_table(tmp_path):
    environment = {**os.environ, "MEMORY_TECHNIQUES_CACHE": str(tmp_path),
                   cache.VARIABLE: "1"}
    command = [sys.executable, "-m", "estimate", "--preset", "tiny", "--steps", "01",
               "--results-dir", str(tmp_path)]
    first, again = (subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environment,
                                   timeout=300) for _ in range(2))
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert "kept from an earlier estimate" not in first.stdout
    rows = [line for line in again.stdout.splitlines() if line.startswith("[")]
    assert rows and all(line.endswith("(kept from an earlier estimate)") for line in rows)
    table = [[line for line in done.stdout.splitlines() if line.startswith("|")] for done in (first, again)]
    assert table[0] == table[1] and len(table[0]) == len(rows) + 2  # a header, a rule, the rows


def test_a_kept_parameter_count_holds_while_the_files_that_built_the_model_do(kept, monkeypatch):
    """The count a question asked again reads (estimate/command.py's model_parameters): gone
    once a file of this repository the counting process had loaded (a preset, the model's code)
    reads otherwise, or another transformers is installed."""
    name = cache.key(Row(script_path("10"), TINY), False)
    cache.note_parameters(name, 1234)
    assert cache.parameters_kept(name) == 1234
    presets = cache.ROOT / "common" / "presets.py"
    real = cache.file_digest
    monkeypatch.setattr(cache, "file_digest",
                        lambda path: "edited" if path == presets else real(path))
    assert cache.parameters_kept(name) is None
    monkeypatch.setattr(cache, "file_digest", real)
    monkeypatch.setattr(cache, "counting_versions", lambda: {"transformers": "another"})
    assert cache.parameters_kept(name) is None


# a second ask in a process of its own, which says which of these it imported
ASKED_AGAIN = """import runpy, sys
sys.argv = ["estimate", *sys.argv[1:]]
try:
    runpy.run_module("estimate", run_name="__main__")
finally:
    print("imported:", [name for name in ("estimate.fake.run", "torch.distributed._tools",
                                          "common.memory") if name in sys.modules])
"""


def test_a_question_asked_again_reads_its_runs_back_without_the_fake_runs_machinery(tmp_path):
    """Another --gpu-memory: every estimate of the stack is read back, not run, and the process
    imports no fake tensors, no memory tracker (the parameter count kept beside the runs); the
    first ask, which imported them, kept its runs under the keys the second computes."""
    environment = {**os.environ, cache.VARIABLE: str(tmp_path / "kept")}
    flags = ["--preset", "tiny", "--stack-only", "--results-dir", str(tmp_path)]
    first = subprocess.run([sys.executable, "-m", "estimate", *flags, "--gpu-memory", "1GB"],
                           cwd=ROOT, capture_output=True, text=True, env=environment, timeout=300)
    again = subprocess.run([sys.executable, "-c", ASKED_AGAIN, *flags, "--gpu-memory", "2GB"],
                           cwd=ROOT, capture_output=True, text=True, env=environment, timeout=300)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert "kept from an earlier estimate" not in first.stdout
    estimates = [line for line in again.stdout.splitlines() if line.startswith("[stack]")]
    assert len(estimates) == 3 and all(line.endswith("(kept from an earlier estimate)")
                                       for line in estimates)
    assert "imported: []" in again.stdout
    commands = [[line for line in done.stdout.splitlines() if "python 10_combined.py" in line]
                for done in (first, again)]
    assert commands[0] == commands[1] and commands[0]


def test_a_package_installed_in_editable_mode_is_checked_with_its_files(tmp_path, monkeypatch):
    """pip install -e: an edit in place keeps the version, so the files' sizes and times count."""
    source = tmp_path / "transformers-checkout"
    (source / "src").mkdir(parents=True)
    module = source / "src" / "modeling.py"
    module.write_text("x = 1\n")

    class Editable:
        def read_text(self, name):
            return json.dumps({"url": source.as_uri(), "dir_info": {"editable": True}})

    monkeypatch.setattr(cache.metadata, "distribution", lambda name: Editable())
    first = cache.editable_sources("transformers")
    assert first and cache.editable_sources("transformers") == first
    module.write_text("x = 22\n")  # edited in place, the version unchanged
    assert cache.editable_sources("transformers") != first

    class Installed:
        def read_text(self, name):
            return None  # a wheel's install has no direct_url.json
    monkeypatch.setattr(cache.metadata, "distribution", lambda name: Installed())
    assert cache.editable_sources("transformers") == ""
