"""--check-estimate: a GPU run predicted beside itself (a script's main() starts it, after its
flags are checked, as it starts --estimate).

While the run trains, a subprocess runs the same command with --estimate (estimate/) for the GPU
model nearest to this one (an H200 is estimated as an H100, estimate/gpu_choices.py), for the
world size of the run (process 0 alone runs it). The run's record then holds the prediction beside
what the allocator measured over the same two optimizer steps (`cuda_steps_max_*`, memory.py):
`predicted_allocated_bytes`, `predicted_reserved_bytes`, `predicted_gpu` and the ratio measured /
predicted of each. An estimate that fails leaves `estimate_problem` and the run as it was.
"""
import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from estimate.gpu_choices import GPUS, nearest_gpu

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
