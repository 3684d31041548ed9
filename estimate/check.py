"""A script's two ways into the estimate, each started by its main() once its flags are checked.

`NN_script.py --estimate [flags]`: that run's estimate, printed, and its record written. The
flags only the estimate takes are read here, and the rest go to predict.py's run as the script's
own.

`--check-estimate`: a GPU run predicted beside itself. While the run trains, a subprocess runs the
same command with --estimate for the GPU model nearest to this one (an H200 is estimated as an
H100, estimate/gpu_choices.py), for the world size of the run (process 0 alone runs it). The
run's record then holds the prediction beside what the allocator measured over the same two
optimizer steps (`cuda_steps_max_*`, memory.py): `predicted_allocated_bytes`,
`predicted_reserved_bytes`, `predicted_gpu` and the ratio measured / predicted of each. An
estimate that fails leaves `estimate_problem` and the run as it was.
"""
import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common.summary import model_state_words, run_words
from estimate.fake.run import world_size_from_environment
from estimate.gpu_choices import DEFAULT_GPU, GPUS, gpu_problem, nearest_gpu, wants_cuda_emulation
from estimate.length_growth import asked_length
from estimate.length_growth import report as length_report
from estimate.output import took_text
from estimate.predict import Row, attempt, compiles, failure_message
from estimate.records import read_estimate, save_records, size_text


def summary(record):
    """The printed prediction for one run."""
    gpu = record["device"] == "cuda"
    what = f"{record.get('gpu') or 'GPU'} (emulated)" if gpu else "CPU (no GPU emulation)"
    read = read_estimate(record)
    lines = [f"\n== {record['script']} estimate  ({run_words(record)}, {read.setting()}, "
             f"{what}) ==",
             f"peak memory allocated  {size_text(record['allocated_bytes'])}"
             + ("   (as torch.cuda.max_memory_allocated)" if gpu else "   (as MemoryMeter counts)"),
             f"peak memory reserved   {size_text(record['reserved_bytes'])}"
             + ("   (as torch.cuda.max_memory_reserved)" if gpu else "   (the CPU caches nothing)"),
             "  at the peak: " + " | ".join(f"{name.replace('_', ' ')} {size_text(value)}"
                                            for name, value in record["breakdown_bytes"].items())]
    lines.append("  " + model_state_words(record["model_state_bytes_per_parameter"],
                                          record["parameter_count"], record["world_size"]))
    if record["host_bytes"]:  # a GPU's: what the run offloads or keeps in host memory
        lines.append(f"  host memory: {size_text(record['host_bytes'])} at its peak, beside the "
                     "GPU's (what is offloaded or kept there)")
        if record.get("pinned_host_bytes"):
            lines.append(f"    pinned host memory {size_text(record['pinned_host_bytes'])} of it, as "
                         "the caching host allocator holds it (each block rounded up to\n    a "
                         "power of two, kept once freed); the rest counted exactly")
    lines.append(f"peak memory of creation {size_text(record['init_allocated_bytes'])}"
                 + ("   (allocated on the GPU while the model is built, per process)" if gpu
                    else "   (as measure_creation counts)"))
    if record.get("blocks"):
        whole, probes = record["blocks"]
        if len(probes) == 2:  # the rules of another size's probes (shortcuts/blocks.py)
            lines.append(f"  from runs of {probes[0]} and {probes[1]} of the model's {whole} "
                         f"blocks, written out to {whole} by the rules three probes gave at another "
                         "batch size (--exact runs them all)")
        else:
            lines.append(f"  from runs of {', '.join(map(str, probes[:-1]))} and {probes[-1]} of "
                         f"the model's {whole} blocks, written out to {whole} (--exact runs them all)")
    if record.get("compiled_eagerly"):
        lines.append("--compile: predicted for the eager run (the model ran uncompiled here);\n"
                     "  torch.compile fuses operations and chooses what backward keeps, so a "
                     "compiled run's\n  activations and temporaries differ: a compiled run "
                     "measures its own")
    elif record.get("compiled") and not record.get("fused", True):
        lines.append("compiled: predicted from the graphs torch.compile makes, with nothing fused "
                     "(the fusion\n  of their pointwise operations could not be emulated here): "
                     "the upper side of the range")
    elif record.get("compiled"):
        lines.append("compiled: predicted from the graphs torch.compile makes (what backward "
                     "keeps, as its\n  partition chooses), each chain of pointwise operations "
                     "fused into one kernel")
        if record.get("unfused_allocated_bytes"):
            lines.append("  with nothing fused they would hold "
                         f"{size_text(record['unfused_allocated_bytes'])} at their peak: a "
                         "compiled run's is expected\n  near the first (measured on a CPU: "
                         "docs/estimator.md#compiled-runs)")
    if read.published_gb:
        lines.append(f"  the study measured {read.published_gb:.2f} GB reserved: ratio "
                     f"{read.ratio():.2f}")
    return "\n".join(lines)


def estimate(script, argv):
    """`NN_script.py --estimate [flags]`: predict that run, print it, update estimate.json."""
    argv = sys.argv[1:] if argv is None else list(argv)
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the script took them
    own.add_argument("--results-dir", default="results")
    own.add_argument("--gpu")
    own.add_argument("--world-size", type=int)
    own.add_argument("--memory-snapshot")
    own.add_argument("--exact", action="store_true")
    asked, script_argv = own.parse_known_args(argv)
    script_argv += ["--results-dir", asked.results_dir]  # checked as the script checks it
    problem = gpu_problem(asked.gpu, wants_cuda_emulation(script_argv))
    if problem:
        raise SystemExit(f"error: {problem}")
    try:
        world_size = asked.world_size or world_size_from_environment()
    except Exception as error:  # noqa: BLE001
        raise SystemExit(f"error: {failure_message(error, script)}")
    record, problem, seconds = attempt(Row(Path(script), script_argv, world_size,
                                           asked.gpu or DEFAULT_GPU, snapshot=asked.memory_snapshot,
                                           exact=asked.exact,
                                           unfused=compiles(script, script_argv)))
    if problem:
        raise SystemExit(f"error: cannot estimate {Path(script).name}: {problem}")
    print(summary(record))
    if asked_length(script_argv) and not compiles(script, script_argv):  # a length x length tensor?
        print("\n".join(length_report(Path(script), script_argv, world_size,
                                       asked.gpu or DEFAULT_GPU)))
    if asked.memory_snapshot:
        print(f"memory snapshot        {asked.memory_snapshot} (open it at "
              f"https://pytorch.org/memory_viz) and its picture {asked.memory_snapshot}.png")
    print(f"record                 {save_records(asked.results_dir, [record])}  ({took_text(seconds)})")
    return record


# a run's own flags that the estimate takes otherwise or not at all
NOT_FOR_THE_ESTIMATE = {"--check-estimate": 0, "--device": 1, "--memory-snapshot": 1,
                        "--results-dir": 1}
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def flag_named(word):
    """The flag of NOT_FOR_THE_ESTIMATE that `word` names, whole or abbreviated as argparse
    allows (--memory-snap), or None."""
    name = word.split("=", 1)[0]
    if not name.startswith("--") or len(name) < 3:
        return None
    found = [flag for flag in NOT_FOR_THE_ESTIMATE if flag.startswith(name)]
    return found[0] if len(found) == 1 else None


def estimate_argv(argv):
    """`argv` without the flags the estimate does not take (each with its value)."""
    kept, skip = [], 0
    for word in argv:
        if skip:
            skip -= 1
            continue
        flag = flag_named(word)
        if flag is not None:
            skip = NOT_FOR_THE_ESTIMATE[flag] if "=" not in word else 0
            continue
        kept.append(word)
    return kept


def check_estimate(script, argv, device):
    """The EstimateCheck of this run, started now, on process 0 (torchrun's RANK; None on the
    others); `argv`: the script's own flags (None: the command line's)."""
    if int(os.environ.get("RANK", 0)) != 0:
        return None
    return EstimateCheck(script, sys.argv[1:] if argv is None else argv, device,
                         int(os.environ.get("WORLD_SIZE", 1)))


class EstimateCheck:
    """The estimate of this run, started now in a subprocess; `result()` waits for it."""

    def __init__(self, script, argv, device, world_size):
        capability = torch.cuda.get_device_capability(device)
        self.gpu = nearest_gpu(capability)
        self.words = (f"{GPUS[self.gpu].name} emulated, for the {torch.cuda.get_device_name(device)}"
                      f" (compute capability {capability[0]}.{capability[1]})")
        self.folder = tempfile.TemporaryDirectory(prefix="check-estimate-")
        command = [sys.executable, str(script), *estimate_argv(argv), "--estimate", "--gpu",
                   self.gpu, "--results-dir", self.folder.name]
        environment = {name: value for name, value in os.environ.items()
                       if name not in LAUNCHER_VARIABLES}
        if "WORLD_SIZE" in os.environ:  # the processes the estimate emulates (torchrun's, 1 too:
            environment["WORLD_SIZE"] = str(world_size)  # 10 then shards as a group of one)
        environment["CUDA_VISIBLE_DEVICES"] = ""  # the estimate needs no GPU: it leaves this one be
        environment["OMP_NUM_THREADS"] = "1"  # and takes as little of the CPU from training
        self.process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        atexit.register(self.stop)  # a run that stops early leaves no estimate running

    def result(self, memory):
        """Record fields: the prediction and measured / predicted over the tracked steps."""
        output, _ = self.process.communicate()
        try:
            (record,) = json.loads((Path(self.folder.name) / "estimate.json").read_text())
        except (OSError, ValueError):
            lines = [line for line in output.splitlines() if line.strip()]
            return {"estimate_problem": lines[-1] if lines else "the estimate wrote no record"}
        finally:
            self.folder.cleanup()
        fields = {"predicted_gpu": self.words,
                  "predicted_allocated_bytes": record["allocated_bytes"],
                  "predicted_reserved_bytes": record["reserved_bytes"]}
        for kind in ("allocated", "reserved"):
            measured = memory.get(f"cuda_steps_max_{kind}_bytes")
            if measured is not None and record[f"{kind}_bytes"]:
                fields[f"measured_over_predicted_{kind}"] = round(
                    measured / record[f"{kind}_bytes"], 4)
        return fields

    def stop(self):
        """End the subprocess (the run stopped early)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.folder.cleanup()
