"""Benchmark: the README's main command, `python -m tour`, end to end.

  python benchmarks/tour_time.py [--results-dir /tmp/tour-benchmark] [-- extra tour flags]

Runs the tour as a user would (a fresh process, the default preset) into a results directory
of its own, with an empty folder of kept estimate runs (a temporary ESTIMATE_CACHE: runs kept
from an earlier estimate of the same code would make its estimate step take seconds; --kept
FOLDER keeps them there instead), then prints what its targets are about: the whole
command's wall time (target: at most 300 s on 2 cores), each step's share of it, and 01's test
accuracy (target: at least 93%). It only prints: wall time depends on the machine and on what
else runs on it, so the load average before the run is printed beside it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_SECONDS, TARGET_ACCURACY = 300, 0.93


def verdict(met):
    return "target met" if met else "target NOT met"


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default="/tmp/tour-benchmark")
    parser.add_argument("--kept", metavar="FOLDER",
                        help="the folder of kept estimate runs (default: an empty temporary one)")
    parser.add_argument("tour_flags", nargs="*", help="passed to python -m tour")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as empty:
        environment = {**os.environ, "ESTIMATE_CACHE": args.kept or empty}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "tour", "--results-dir", args.results_dir,
                               *args.tour_flags], cwd=ROOT, stdout=subprocess.DEVNULL, env=environment)
        seconds = time.perf_counter() - start
    results = Path(args.results_dir)
    tour = json.loads((results / "tour.json").read_text())

    print("== benchmark: python -m tour ==")
    for outcome in [*tour["steps"], tour["estimate"]]:
        wall = outcome.get("wall_seconds")
        share = f"{wall:7.1f} s  {wall / seconds:5.1%}" if wall is not None else "    n/a"
        waited = outcome.get("waited_seconds")  # a CPU tour's estimate, beside every step
        print(f"{outcome['script']:<30} {share}  {outcome['status']}" + (
            "" if waited is None else f"  (from the start, beside the steps; the tour waited "
                                      f"{waited:.1f} s for it after the last step)"))
    print(f"{'whole command':<30} {seconds:7.1f} s  (load average before {load_before:.1f} on "
          f"{os.cpu_count()} cores)  {verdict(seconds <= TARGET_SECONDS)}")
    baseline = json.loads((results / "01_baseline.json").read_text())
    print(f"01_baseline test accuracy      {baseline['test_accuracy']:.1%}  "
          f"{verdict(baseline['test_accuracy'] >= TARGET_ACCURACY)}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
