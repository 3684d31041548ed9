"""`NN_script.py --estimate [flags]`: that run's estimate, printed, and its record written.

The script passes its own command line here (its main() starts it, before anything is built);
the flags only the estimate takes are read here, and the rest go to predict.py's run as the
script's own.
"""
import argparse
import sys
from pathlib import Path

from common.summary import model_state_words, run_words
from estimate.fake_run import wants_cuda_emulation, world_size_from_environment
from estimate.gpu_choices import DEFAULT_GPU, gpu_problem
from estimate.length_growth import asked_length
from estimate.length_growth import report as length_report
from estimate.predict import Row, attempt, compiles, failure_message, took_text
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
        lines.append(f"  from runs of {', '.join(map(str, probes[:-1]))} and {probes[-1]} of the "
                     f"model's {whole} blocks, written out to {whole} (--exact runs them all)")
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


