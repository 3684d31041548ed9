"""Estimates kept on disk, so that no estimate is computed twice: the table, the --gpu-memory
search and the stack (and a script's --estimate) share them, within a run and across runs.

A record is kept under a key made of everything its bytes depend on: the row (script, flags,
processes, GPU, --exact), the source of this repository's scripts and packages, the installed
versions of the packages that run it (and, for one installed in editable mode, its files' sizes
and times of change), the model's config files under --model, and the
environment variables that choose PyTorch's kernels. A change to
any of them is a new key, so a kept record is the one a new estimate would give. Failures are
not kept. The records live in `estimates/` under the cache folder (MEMORY_TECHNIQUES_CACHE, else
~/.cache/memory-techniques), one small file each; ESTIMATE_CACHE=0 (or false, no, off) turns
this off, and ESTIMATE_CACHE=FOLDER keeps them in FOLDER instead.
"""
import hashlib
import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from common.packaged import cache_root

VARIABLE = "ESTIMATE_CACHE"  # 0: every estimate computed afresh, none kept; or their folder
ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("*.py", "common/*.py", "estimate/*.py")
# what asks for estimates and tables them, but makes no record's bytes (predict() imports none)
ASKERS = ("estimate/table.py", "estimate/fit.py", "estimate/stack.py", "estimate/workers.py",
          "estimate/cache.py", "estimate/__main__.py")
PACKAGES = ("torch", "transformers", "bitsandbytes", "torchao", "peft", "accelerate",
            "huggingface_hub", "safetensors", "tokenizers", "datasets")
MODEL_FILES = ("*.json",)  # a --model folder's config (and tokenizer) files: not its weights
# what picks PyTorch's CPU kernels (and so a CPU estimate's temporaries) or the allocator's ways
ENVIRONMENT = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "PYTORCH_CUDA_ALLOC_CONF")
OFF, ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")


def enabled():
    return os.environ.get(VARIABLE, "1").strip().lower() not in OFF


@lru_cache(maxsize=1)
def code_digest():
    """The SHA-256 of this repository's scripts and packages and of the packages' versions."""
    digest = hashlib.sha256()
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            if str(path.relative_to(ROOT)) in ASKERS:
                continue
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    for name in PACKAGES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}={version}\0{editable_sources(name)}\0".encode())
    return digest.hexdigest()


def editable_sources(name):
    """For a package installed in editable mode (pip install -e), whose source can change under
    one version: the size and time of change of each of its Python files. "" otherwise."""
    try:
        direct_url = json.loads(metadata.distribution(name).read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        return ""
    if not direct_url.get("dir_info", {}).get("editable") or not direct_url.get(
            "url", "").startswith("file://"):
        return ""
    from urllib.parse import unquote, urlparse
    source = Path(unquote(urlparse(direct_url["url"]).path))
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*.py")):
        try:
            stat = path.stat()
        except OSError:
            continue
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def model_digest(argv):
    """The SHA-256 of the config files the flags' --model names ("" without --model), or None
    where they cannot be found here (a Hub name not in the local cache: not kept)."""
    if "--model" not in argv or argv.index("--model") + 1 >= len(argv):
        return ""
    name = argv[argv.index("--model") + 1]
    folder = Path(name).expanduser()
    if folder.is_dir():
        files = sorted(path for pattern in MODEL_FILES for path in folder.glob(pattern))
    else:
        try:
            from huggingface_hub import try_to_load_from_cache
            found = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - not a Hub name it can look up: not kept
            return None
        files = [Path(found)] if isinstance(found, str) else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def key(row, exact):
    """The name a row's record is kept under, or None if it is not to be kept."""
    if row.snapshot or not enabled():
        return None  # a memory snapshot is a file the run writes: it runs
    try:
        model = model_digest(row.argv)
        script = Path(row.script).resolve()
        source = hashlib.sha256(script.read_bytes()).hexdigest()
    except OSError:  # a file it cannot read: the estimate runs, and says what is wrong
        return None
    if model is None:
        return None
    asked = {"script": script.name, "source": source, "argv": list(map(str, row.argv)),
             "world_size": row.world_size, "gpu": row.gpu, "any_batch_size": row.any_batch_size,
             "exact": bool(exact), "unfused": row.unfused, "model": model, "code": code_digest(),
             "environment": {name: os.environ.get(name) for name in ENVIRONMENT}}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def folder():
    chosen = os.environ.get(VARIABLE, "1").strip()
    return cache_root() / "estimates" if chosen.lower() in ON else Path(chosen).expanduser()


def load(name):
    """The kept record, or None (none kept, or a file that cannot be read)."""
    try:
        return json.loads((folder() / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def keep(name, record):
    """Keep `record` under `name`; where the folder cannot be written, nothing is kept."""
    try:
        folder().mkdir(parents=True, exist_ok=True)
        partial = folder() / f"{name}.{os.getpid()}.tmp"
        partial.write_text(json.dumps(record))
        partial.replace(folder() / f"{name}.json")  # whole or not at all, for other processes
    except OSError:
        pass
