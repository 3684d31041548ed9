"""No library warning reaches a user of these scripts or of the estimate that says nothing they
can act on (common/library_warnings.py): each known one is silenced by its own words where it
comes from, and nothing else from those libraries is."""
import logging
import re
import subprocess
import sys
import warnings

import pytest

import common  # noqa: F401 - applies the filters, as every script's first import does
from common.library_warnings import SILENCED_LOGS, silence
from conftest import ROOT
from support.architecture_matrix import model_flags, write_model

MEMTRACKER_WARNINGS = [
    ("Module is None. Skipping PRE_BW hook.", "torch.distributed._tools.mod_tracker"),
    ("Module is None. Skipping POST_BW hook.", "torch.distributed._tools.mod_tracker"),
    ("Expected a tensor or a traceable wrapper-subclass of tensor, but got <class 'NoneType'>",
     "torch.distributed._tools.mem_tracker"),
]
# what a library's warning or logging machinery prints: "path.py:12: UserWarning: ...",
# torch's "W1127 17:38:48.859000 3454 path] ...", logging's "WARNING:name:..." and a bare
# "Failed to load ..." of bitsandbytes' logger without a handler
LIBRARY_LINE = re.compile(r"\.py:\d+: \w*Warning|^[WE]\d{4} \d\d:\d\d|^WARNING:|^Failed to load|"
                          r"^\s*warnings\.warn|Skipping (PRE|POST)_BW|context_fn is passed")


@pytest.mark.parametrize("message, module", MEMTRACKER_WARNINGS)
def test_memtrackers_own_warnings_are_silenced_and_no_other(message, module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        silence()
        warnings.warn_explicit(message, UserWarning, "mem_tracker.py", 1, module=module)
        warnings.warn_explicit("another warning", UserWarning, "mem_tracker.py", 2, module=module)
        warnings.warn_explicit(message, UserWarning, "elsewhere.py", 3, module="elsewhere")
    assert [str(warning.message) for warning in caught] == ["another warning", message]


@pytest.mark.parametrize("name, words", SILENCED_LOGS.items())
def test_the_libraries_log_messages_are_silenced_and_no_other(name, words):
    logger, seen = logging.getLogger(name), []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("%s: No module named 'kernels'. Please ...", words)
        logger.warning("another message of %s", name)
    finally:
        logger.removeHandler(handler)
    assert seen == [f"another message of {name}"]


@pytest.mark.timeout(600)
def test_the_estimate_prints_no_library_warning(tmp_path):
    """The paths that printed one: MemTracker's hooks on the probes (every script), an output it
    tracks that is None (05i), bitsandbytes' 4-bit CPU kernel (07b, on a CPU with AVX-512 BF16),
    compiling with a checkpointing policy (05d --compile), the search and the stack."""
    folder = write_model(tmp_path / "llama", "Llama")
    command = [sys.executable, "-m", "estimate", *model_flags(folder, "Llama"), "--task",
               "causal-lm", "--steps", "04_grad_accum", "05i", "07b", "09", "--gpu-memory", "1GB",
               "--results-dir", str(tmp_path)]
    compiled = [sys.executable, "05d_selective_checkpointing.py", *model_flags(folder, "Llama"),
                "--task", "causal-lm", "--compile", "--estimate", "--results-dir", str(tmp_path)]
    for each in (command, compiled):
        done = subprocess.run(each, cwd=ROOT, capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, done.stderr[-2000:]
        printed = [line for line in (done.stdout + done.stderr).splitlines()
                   if LIBRARY_LINE.search(line)]
        assert not printed, "\n".join(printed)


@pytest.mark.parametrize("script", sorted(path.name for path in ROOT.glob("[01][0-9]*.py")
                                          if "from bitsandbytes" in path.read_text()))
def test_a_script_that_imports_bitsandbytes_prints_no_library_warning(script):
    """bitsandbytes logs its optional kernel's absence as it is imported (on a CPU with AVX-512
    BF16): each script imports `common` first, which silences it."""
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line for line in (done.stdout + done.stderr).splitlines() if LIBRARY_LINE.search(line)]
    assert not printed, "\n".join(printed)
