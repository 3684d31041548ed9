"""Fake runs kept on disk, so that no run is made twice: the table, the --gpu-memory search and
the stack (and a script's --estimate) share them, within a question and across questions.

What is kept is a KeptRun: what a fake run (estimate/fake/run.py, or the probes of blocks.py)
leaves for the prediction, its allocation trace and the few counts beside it, not its record.
The run is the slow part (seconds); a record is the trace replayed through the caching allocator
for one GPU (milliseconds, estimate/predict.py), so another --gpu or --gpu-memory asks no new
run, and the trace is written for other micro-batch sizes (sizes.py). A run is kept under two
things:

- a key of what it was asked: the script (name and source), its flags, the processes, the data
  set's size rule, --exact, the model's config files under --model, the environment variables
  that choose PyTorch's kernels or its compiler (ATEN_*, MKL_*, TORCH*, PYTORCH*), the CPU's
  instruction sets (which pick the kernels) and the Python version; and FORMAT;
- beside it, what the run found it depends on, checked when it is read back: the GPU's
  properties the run read (a flash-attention GPU or not; the multiprocessors of bitsandbytes'
  4-bit rule: gpu_choices.ReadGpu), every file of this repository the process had loaded, with
  its SHA-256, and the version of every installed distribution it had imported (and, for one
  installed in editable mode, its files' sizes and times of change).

A change to any of them reads as nothing kept, and the new run replaces what no longer holds.
Failures are not kept. The runs live in `traces/` under the cache folder (MEMORY_TECHNIQUES_CACHE,
else ~/.cache/memory-techniques), a file per key; ESTIMATE_CACHE=0 (or false, no, off) turns this
off, ESTIMATE_CACHE=FOLDER keeps them in FOLDER instead. The folder is held under
ESTIMATE_CACHE_MB megabytes (default 1024): the runs read longest ago go first.
"""
import hashlib
import json
import os
import platform
import sys
import zlib
from dataclasses import dataclass, field, fields
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from common.packaged import cache_root
from estimate.gpu_choices import reads_match

VARIABLE = "ESTIMATE_CACHE"  # 0: every run made afresh, none kept; or their folder
SIZE_VARIABLE = "ESTIMATE_CACHE_MB"
DEFAULT_MEGABYTES = 1024
FORMAT = 3  # what a kept file holds (KeptRun's fields, this module's layout)
ROOT = Path(__file__).resolve().parents[2]  # the repository
MODEL_FILES = ("*.json",)  # a --model folder's config (and tokenizer) files: not its weights
# what picks PyTorch's CPU kernels (and so a CPU estimate's temporaries), the allocator's ways,
# the compiler's choices
ENVIRONMENT_PREFIXES = ("ATEN_", "MKL_", "TORCH", "PYTORCH_")
# of those, where a library keeps its files, which chooses nothing: torch._inductor sets its own as
# it is imported (in a process that has made a fake run, not in one that answered from kept runs)
PLACES = {"TORCHINDUCTOR_CACHE_DIR"}
OFF, ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")


@dataclass
class KeptRun:
    script: str
    emulate_cuda: bool
    record: dict                # what the script reported: preset, model, world size, batch, ...
    events: list                # the training steps' allocation events (fake/recording.py)
    creation: list              # model creation's events
    parameter_count: int
    parameters_held: int
    offloaded: bool = False     # FSDP keeps the sharded state in host memory
    compiled: bool = False
    compiled_eagerly: bool = False
    fused: bool = True          # compiled: pointwise operations fused (compiled.py)
    unfused_events: list = None  # compiled: the training events with nothing fused (the bound)
    batch_bytes: int = 0
    blocks: list = None         # [blocks of the model, [blocks of each probe]] (blocks.py)
    cpu_figures: dict = None    # without GPU emulation: the meter's own peak, breakdown, creation
    gpu_read: dict = field(default_factory=dict)  # what the run read of its GPU (gpu_choices.ReadGpu)
    size_choices: list = field(default_factory=list)  # choices made by the micro-batch's size
    phases: list = None         # each training event's part of the step (a whole run's only)
    learned: dict = None        # by blocks: the probes another size is written from (blocks.py)

    def to_dict(self):
        return {item.name: getattr(self, item.name) for item in fields(self)}

    @classmethod
    def from_dict(cls, values):
        known = {item.name for item in fields(cls)}
        kept = cls(**{name: value for name, value in values.items() if name in known})
        kept.events, kept.creation = as_events(kept.events), as_events(kept.creation)
        if kept.unfused_events is not None:
            kept.unfused_events = as_events(kept.unfused_events)
        if kept.learned is not None:
            kept.learned["traces"] = [as_events(trace) for trace in kept.learned["traces"]]
        return kept


def as_events(items):
    """Events as the trace holds them (tuples), from JSON's lists."""
    return [tuple(item) for item in items]


def from_fake_run(run, unfused_run=None, fused=True):
    """The KeptRun of a FakeRun (fake/run.py); `unfused_run`: the same compiled run with nothing
    fused, for the bound above a compiled prediction."""
    cpu = None
    if not run.emulate_cuda:
        cpu = {"peak_bytes": run.meter_result["peak_memory_bytes"],
               "breakdown_bytes": run.meter_result["breakdown_bytes"],
               "creation_peak_bytes": run.creation.peak_bytes if run.creation else 0,
               "unfused_peak_bytes": unfused_run and unfused_run.meter_result["peak_memory_bytes"]}
    return KeptRun(
        script=run.script, emulate_cuda=run.emulate_cuda, record=dict(run.record),
        events=list(run.training_events()), creation=list(run.trace.events[run.creation_events]),
        parameter_count=run.meter_result["parameter_count"],
        parameters_held=run.meter_result["parameters_held"], offloaded=run.offloaded,
        compiled=run.compiled, compiled_eagerly=run.compiled_eagerly, fused=fused,
        unfused_events=list(unfused_run.training_events()) if unfused_run else None,
        batch_bytes=run.batch_bytes, blocks=run.blocks and [run.blocks[0], list(run.blocks[1])],
        cpu_figures=cpu, gpu_read=dict(run.gpu_read.read) if run.gpu_read else {},
        size_choices=sorted(set(run.size_choices)),
        phases=run.training_phases() if run.trace.phases else None, learned=run.learned)


def enabled():
    return os.environ.get(VARIABLE, "1").strip().lower() not in OFF


def folder():
    chosen = os.environ.get(VARIABLE, "1").strip()
    return (cache_root() / "traces" if chosen.lower() in ON
            else Path(chosen).expanduser() / "traces")


@lru_cache(maxsize=1)
def processor():
    """The CPU's instruction sets as the kernels' dispatch sees them (Linux: cpuinfo's flags)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return hashlib.sha256(line.encode()).hexdigest()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment():
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(ENVIRONMENT_PREFIXES) and name not in PLACES}


def model_digest(argv):
    """The SHA-256 of the config files the flags' --model names ("" without --model), or None
    where they cannot be found here (a Hub name not in the local cache: not kept)."""
    if "--model" not in argv or argv.index("--model") + 1 >= len(argv):
        return ""
    name = argv[argv.index("--model") + 1]
    folder_ = Path(name).expanduser()
    if folder_.is_dir():
        files = sorted(path for pattern in MODEL_FILES for path in folder_.glob(pattern))
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
    """The name a row's run is kept under, or None if it is not to be kept."""
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
    asked = {"format": FORMAT, "script": script.name, "source": source,
             "argv": list(map(str, row.argv)), "world_size": row.world_size,
             "any_batch_size": row.any_batch_size, "exact": bool(exact),
             "unfused": row.unfused, "model": model, "environment": environment(),
             "processor": processor(), "python": sys.version}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def file_digest(path):
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def loaded_sources():
    """{path in the repository: SHA-256} of every file of this repository that this process has
    loaded as a module (the script under its private name too)."""
    found = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name:
            continue
        path = Path(name).resolve()
        if path.suffix != ".py" or not path.is_relative_to(ROOT) or "site-packages" in path.parts:
            continue
        found[str(path.relative_to(ROOT))] = file_digest(path)
    return dict(sorted(found.items()))


def imported_distributions():
    """{distribution: version} of every installed distribution this process has imported."""
    tops = {name.partition(".")[0] for name in list(sys.modules)}
    owners = distributions_of_modules()
    names = sorted({owner for top in tops for owner in owners.get(top, ())})
    return {name: installed(name) for name in names}


@lru_cache(maxsize=1)
def distributions_of_modules():
    return metadata.packages_distributions()


@lru_cache(maxsize=None)
def installed(name):
    """A distribution's version (and its sources' sizes and times under pip install -e)."""
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    editable = editable_sources(name)
    return f"{version} {editable}" if editable else version


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


def still_holds(variant, gpu):
    """Whether a kept variant's run is the one a new run would make for `gpu` (a Gpu, or None
    without emulation): the GPU's properties it read, the repository's files it loaded, the
    distributions it imported."""
    if gpu is not None and not reads_match(variant["gpu_read"], gpu):
        return False
    if not sources_hold(variant["sources"]):
        return False
    return all(installed(name) == version for name, version in variant["distributions"].items())


def read(name):
    """The kept variants under `name` ([] if none, or a file that cannot be read)."""
    try:
        return json.loads(zlib.decompress((folder() / f"{name}.kept").read_bytes()))["variants"]
    except (OSError, ValueError, KeyError, zlib.error):
        return []


def load(name, gpu):
    """The KeptRun under `name` that still holds for `gpu` (a Gpu, None without emulation), or
    None; the file read is marked as used (the eviction keeps what was read last)."""
    for variant in read(name):
        if still_holds(variant, gpu):
            try:
                os.utime(folder() / f"{name}.kept")
            except OSError:
                pass
            return KeptRun.from_dict(variant["run"])
    return None


def keep(name, kept):
    """Keep `kept` (a KeptRun this process just made) under `name`, beside the variants made for
    GPUs read otherwise, in place of any that no longer hold; where the folder cannot be
    written, nothing is kept."""
    made = {"gpu_read": kept.gpu_read, "sources": loaded_sources(),
            "distributions": imported_distributions(), "run": kept.to_dict()}
    variants = [variant for variant in read(name)
                if variant["gpu_read"] != kept.gpu_read and variant["sources"] == made["sources"]
                and variant["distributions"] == made["distributions"]]
    try:
        folder().mkdir(parents=True, exist_ok=True)
        partial = folder() / f"{name}.{os.getpid()}.tmp"
        partial.write_bytes(zlib.compress(json.dumps({"variants": [*variants, made]},
                                                     separators=(",", ":")).encode(), 1))
        partial.replace(folder() / f"{name}.kept")  # whole or not at all, for other processes
    except OSError:
        return
    evict()


def noted(name, suffix):
    """What note() wrote under `name` with `suffix` (JSON), or None: none, or unreadable."""
    try:
        return json.loads((folder() / f"{name}.{suffix}").read_text())
    except (OSError, ValueError):
        return None


def note(name, suffix, value):
    """Write `value` (JSON) beside the runs under `name` with `suffix`, whole or not at all, for
    other processes; nothing where the folder cannot be written."""
    try:
        folder().mkdir(parents=True, exist_ok=True)
        partial = folder() / f"{name}.{os.getpid()}.{suffix}.tmp"
        partial.write_text(json.dumps(value))
        partial.replace(folder() / f"{name}.{suffix}")
    except OSError:
        pass


def sizes_kept(family):
    """The micro-batch sizes whose runs were kept for `family` (the key of a search's row with
    no size: estimate/question.py), as noted by note_size; [] if none."""
    return noted(family, "sizes") or []


def note_size(family, size):
    """Note that a run of `family` at micro-batch `size` was kept (for later searches)."""
    if family is not None:
        note(family, "sizes", sorted(set(sizes_kept(family)) | {size}))


def sources_hold(sources):
    """Whether every file of this repository in `sources` ({path: SHA-256}, as loaded_sources
    gives them) reads as it did."""
    return all(file_digest(ROOT / path) == digest for path, digest in sources.items())


def parameters_kept(name):
    """The parameter count note_parameters kept under `name` (a row's key), or None: none kept,
    or counted with other versions of torch or transformers, or with other files of this
    repository (the presets, the model's code) than those here now."""
    kept = noted(name, "parameters")
    try:
        holds = kept["versions"] == counting_versions() and sources_hold(kept["sources"])
    except (TypeError, KeyError, AttributeError):
        return None
    return kept.get("count") if holds else None


def note_parameters(name, count):
    """Keep the parameter count of the model a row's key `name` builds (for a later question),
    with the files of this repository this process has loaded (those that built the model)."""
    if name is not None:
        note(name, "parameters", {"count": count, "versions": counting_versions(),
                                  "sources": loaded_sources()})


def counting_versions():
    """The libraries whose classes build a model from its config: what a count depends on."""
    return {name: installed(name) for name in ("torch", "transformers")}


def limit_bytes():
    value = os.environ.get(SIZE_VARIABLE, "")
    try:
        return int(float(value) * 2**20) if value.strip() else DEFAULT_MEGABYTES * 2**20
    except ValueError:
        return DEFAULT_MEGABYTES * 2**20


def evict(limit=None):
    """Remove the files read (or made) longest ago until the folder holds at most 3/4 of
    `limit` bytes (ESTIMATE_CACHE_MB), when it holds more than `limit`."""
    limit = limit_bytes() if limit is None else limit
    try:
        files = [(path.stat().st_mtime, path.stat().st_size, path)
                 for path in folder().glob("*.kept")]
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    if total <= limit:
        return
    for _, size, path in sorted(files, key=lambda item: item[0]):
        if total <= limit * 3 // 4:
            break
        try:
            path.unlink()
            total -= size
        except OSError:
            pass
