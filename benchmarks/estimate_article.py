"""Benchmark: the GPU memory estimate of every numbered script at the article preset.

  python benchmarks/estimate_article.py [--jobs 2] [--results-dir results]

Runs `python -m estimate` (article preset, 4 GPUs for the distributed steps) in this
process and prints the numbers its targets are about: wall time (target: under 60 s on 2
cores), peak resident memory of the estimating processes (under 2 GB), and each prediction
against the study's published figure (within 10%). It only prints: wall time depends on the
machine and on what else runs on it, so the load average is printed beside it.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from estimate.command import main as estimate_table
from estimate.output import resources_used
from estimate.records import GB, load_estimates

TARGET_SECONDS, TARGET_RSS_GB, TARGET_RATIO_OFF = 60, 2.0, 0.10


def verdict(met):
    return "target met" if met else "target NOT met"


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="2", help="estimates run at once (default: 2)")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    status = estimate_table(["--results-dir", args.results_dir, "--jobs", args.jobs])
    seconds = time.perf_counter() - start
    cpu_seconds, own_rss, worker_rss = resources_used()

    estimates, problem = load_estimates(args.results_dir)
    if problem:
        raise SystemExit(f"error: {problem}")
    print("\n== benchmark ==")
    print(f"wall time      {seconds:.1f} s  (CPU {cpu_seconds:.1f} s; load average before "
          f"{load_before:.1f} on {os.cpu_count()} cores)  {verdict(seconds < TARGET_SECONDS)}")
    # forked workers share this process's pages, so this sum bounds all of them from above
    bound = own_rss + int(args.jobs) * worker_rss
    print(f"peak RSS       {own_rss:.2f} GB in this process, {worker_rss:.2f} GB in the largest "
          f"of {args.jobs} workers: at most {bound:.2f} GB together  "
          f"{verdict(bound < TARGET_RSS_GB)}")
    for estimate in estimates:
        if estimate.ratio() is None:
            continue
        print(f"{estimate.script:<20} batch {estimate.batch_size:>2} x{estimate.accum_steps}  "
              f"predicted {estimate.reserved_bytes / GB:6.2f} GB reserved, study "
              f"{estimate.published_gb:5.2f} GB, ratio {estimate.ratio():.2f}  "
              f"{verdict(abs(estimate.ratio() - 1) <= TARGET_RATIO_OFF)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
