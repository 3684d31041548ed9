"""Benchmark: --compile against the eager run of the same step, in time and in memory.

  python benchmarks/compile_speed.py [--preset tiny-text] [--steps 01 04] [-- extra script flags]

Runs each step twice, each run in a fresh process on the CPU, without and with --compile; the
compiled run gets an empty inductor cache of its own, so it compiles from scratch as a first run
does (a second run would find its kernels cached). It prints each run's training time as its
record gives it (the tracked steps are left out, their compilation is not), the part of it
torch.compile spent compiling (its own count, the graphs of validation included), and the peak
memory: the record's, and the allocator's count of the same steps (common/compiled_memory.py).
A compiled run's record holds the allocator's count already (MemTracker cannot watch compiled
code), an eager run's MemTracker's: compare compiled and eager by the allocator's column. It
only prints: time depends on the machine and on what else runs on it, so the load average
before each run is printed beside it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def run_one(step, flags, results_dir):
    """Run `step` here with `flags`, its meter also counting the allocator's events; returns
    what the parent prints."""
    sys.path.insert(0, str(ROOT))
    import torch
    from torch._dynamo.utils import counters

    from common.breakdown import fold_breakdown
    from common.compiled_memory import AllocationTracker
    from common.memory import compile_seconds, device_snapshot
    from steps import import_script

    script = import_script(next(ROOT.glob(f"{step}_*.py")))
    meter_class, meters = script.MemoryMeter, []

    class AlsoCountingAllocations(meter_class):
        def __init__(self, device, model, optimizer):
            super().__init__(device, model, optimizer)
            # a compiled run's own tracker counts the allocator's events already
            self.allocations = (None if self.from_allocations
                                else AllocationTracker(model, optimizer))
            meters.append(self)

        @contextmanager
        def step(self):
            counting = self.allocations is not None and self.tracking()
            with super().step(), self.allocations if counting else nullcontext():
                yield

    script.MemoryMeter = AlsoCountingAllocations
    record = script.main([*flags, "--device", "cpu", "--results-dir", results_dir])
    counted = meters[0].allocations or meters[0].tracker
    stats = device_snapshot(counted.get_tracker_snapshot("peak"), torch.device("cpu"))
    return {"train_seconds": record["train_seconds"], "compile_seconds": compile_seconds(),
            "graphs": counters["stats"]["unique_graphs"],  # training's and evaluation's
            "steps": record["steps"], "test_accuracy": record["test_accuracy"],
            "peak_bytes": record["peak_memory_bytes"], "breakdown_bytes": record["breakdown_bytes"],
            "allocator_peak_bytes": stats["Total"],
            "allocator_breakdown_bytes": fold_breakdown(stats)}


def in_mib(breakdown):
    return " | ".join(f"{name.replace('_', ' ')} {value / MIB:.2f}"
                      for name, value in breakdown.items())


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-text")
    parser.add_argument("--steps", nargs="+", default=["01", "04"])
    parser.add_argument("--results-dir", default="/tmp/compile-benchmark")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one run, in the process started for it
    parser.add_argument("script_flags", nargs="*", help="passed to every run (e.g. --max-steps 20)")
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.script_flags, args.results_dir)))
        return 0

    print(f"== benchmark: --compile, preset {args.preset}, cpu ==")
    for step in args.steps:
        for compiled in (False, True):
            mode = "--compile" if compiled else "eager"
            flags = ["--preset", args.preset, *args.script_flags, *([mode] if compiled else [])]
            results_dir = Path(args.results_dir) / mode.strip("-")
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory() as cache:
                done = subprocess.run([sys.executable, __file__, "--run", step, "--results-dir",
                                       str(results_dir), "--", *flags],
                                      cwd=ROOT, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                                      stdout=subprocess.PIPE, text=True)
            label = f"{step} {mode}"
            if done.returncode:
                print(f"{label}: failed ({done.returncode})")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{label:<14} training {result['train_seconds']:7.1f} s ({result['steps']} steps),"
                  f" compiling {result['compile_seconds']:6.1f} s of it ({result['graphs']} graphs);"
                  f" test accuracy "
                  f"{result['test_accuracy']:.1%}  (load average before {load:.1f} on "
                  f"{os.cpu_count()} cores)")
            print(f"{'':<14} peak, record    {result['peak_bytes'] / MIB:7.2f} MiB  "
                  f"{in_mib(result['breakdown_bytes'])}")
            print(f"{'':<14} peak, allocator {result['allocator_peak_bytes'] / MIB:7.2f} MiB  "
                  f"{in_mib(result['allocator_breakdown_bytes'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
