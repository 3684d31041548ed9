"""Estimates kept on disk (estimate/cache.py): a row asked again is answered from the record of
its first estimate, and anything its bytes depend on makes it a new row."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, script_path
from estimate import cache
from estimate.predict import Row, attempt


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Estimates kept in a folder of the test's own; predict() counted, and its record made up."""
    monkeypatch.setenv("MEMORY_TECHNIQUES_CACHE", str(tmp_path))
    monkeypatch.setenv(cache.VARIABLE, "1")
    calls = []

    def predict(script, argv, *args):
        calls.append(list(argv))
        return {"script": script.stem, "allocated_bytes": len(calls), "reserved_bytes": 7,
                "blocks": [16, [2, 3, 4]]}
    monkeypatch.setattr(sys.modules["estimate.predict"], "predict", predict)
    return calls


def test_a_row_asked_again_is_answered_from_its_first_estimate(kept):
    row = Row(script_path("04"), ["--preset", "tiny", "--batch-size", "8"])
    first = attempt(row)
    again = attempt(Row(script_path("04"), ["--preset", "tiny", "--batch-size", "8"]))
    assert again == (first[0], None, None) and len(kept) == 1  # None: no time, it was kept


@pytest.mark.parametrize("other", [
    Row(script_path("04"), ["--preset", "tiny", "--batch-size", "16"]),
    Row(script_path("05"), ["--preset", "tiny", "--batch-size", "8"]),
    Row(script_path("04"), ["--preset", "tiny", "--batch-size", "8"], world_size=2),
    Row(script_path("04"), ["--preset", "tiny", "--batch-size", "8"], gpu="h100"),
    Row(script_path("04"), ["--preset", "tiny", "--batch-size", "8"], exact=True),
    Row(script_path("04"), ["--preset", "tiny", "--batch-size", "8"], any_batch_size=True),
])
def test_a_row_that_differs_in_anything_is_estimated(kept, other):
    attempt(Row(script_path("04"), ["--preset", "tiny", "--batch-size", "8"]))
    record, _, seconds = attempt(other)
    assert seconds is not None and record["allocated_bytes"] == 2 and len(kept) == 2


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


def test_what_is_not_kept(kept, tmp_path, monkeypatch):
    """A failure, a memory snapshot (a file the run writes) and a Hub model not on this machine
    are estimated each time; ESTIMATE_CACHE=0 keeps nothing."""
    assert cache.key(Row(script_path("04"), [], snapshot=str(tmp_path / "s.pickle")), False) is None
    assert cache.key(Row(script_path("04"), ["--model", "no-such-org/no-such-model"]), False) is None
    monkeypatch.setattr(sys.modules["estimate.predict"], "predict", lambda *args: 1 / 0)
    row = Row(script_path("04"), ["--preset", "tiny"])
    assert attempt(row)[0] is None and not list(cache.folder().glob("*.json"))
    for off in ("0", "off", "False"):
        monkeypatch.setenv(cache.VARIABLE, off)
        assert cache.key(row, False) is None
    monkeypatch.setenv(cache.VARIABLE, "1")
    (tmp_path / "unreadable").mkdir()  # a --model "folder" whose config cannot be read
    (tmp_path / "unreadable" / "config.json").mkdir()
    assert cache.key(Row(script_path("04"), ["--model", str(tmp_path / "unreadable")]), False) is None


def test_the_kernels_asked_of_pytorch_are_part_of_the_key(kept, monkeypatch):
    row = Row(script_path("04"), ["--preset", "tiny", "--device", "cpu"])
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    before = cache.key(row, False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert cache.key(row, False) != before


def test_the_table_asked_again_answers_from_kept_estimates_with_the_same_table(tmp_path):
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


def test_what_the_key_leaves_out_makes_no_records_bytes():
    """The modules that only ask for estimates and table them are left out of the code's digest
    (a change to the search keeps the estimates): predict() must not import them."""
    program = "import json, sys, estimate.predict; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    loaded = set(json.loads(done.stdout))
    left_out = {path.removesuffix(".py").replace("/", ".") for path in cache.ASKERS}
    assert left_out - {"estimate.cache"} and not (left_out - {"estimate.cache"}) & loaded


def test_a_package_installed_in_editable_mode_enters_the_key_with_its_files(tmp_path, monkeypatch):
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
