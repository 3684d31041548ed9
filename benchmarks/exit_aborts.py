"""Benchmark: how often a two-process run of 07-09 fails after it has finished its work.

  python benchmarks/exit_aborts.py [--runs 60] [--parallel 2] [--steps 07 08 09]

Launches each step as a user would (`torchrun --standalone --nproc_per_node=2 ... --device cpu
--max-steps 3 --epochs 1`) `--runs` times in all, `--parallel` groups at once (two groups of two
processes on two cores give the load under which an abort at exit was seen: 2 of 100 runs of 07
before the memory meter removed its tracker's gradient hooks). Prints, per step, how many runs
ended with exit code 0 and the exit codes and last lines of the others. Target: no failure.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {path.name[:2]: path.name for path in ROOT.glob("0[789]_*.py")}


def launch(step, results_dir):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", SCRIPTS[step], "--device", "cpu", "--max-steps", "3",
               "--epochs", "1", "--results-dir", results_dir]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return step, done.returncode, done.stdout + done.stderr


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=60, help="launches in all, spread over steps")
    parser.add_argument("--parallel", type=int, default=2, help="groups running at once")
    parser.add_argument("--steps", nargs="+", default=sorted(SCRIPTS), choices=sorted(SCRIPTS))
    parser.add_argument("--logs", default="/tmp/exit-aborts", help="where failed runs' output goes")
    args = parser.parse_args()

    start = time.perf_counter()
    outcomes = defaultdict(Counter)
    failures = []
    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(args.parallel) as pool:
        jobs = [pool.submit(launch, args.steps[i % len(args.steps)], os.path.join(scratch, str(i)))
                for i in range(args.runs)]
        for done, job in enumerate(jobs, 1):
            step, code, output = job.result()
            outcomes[step][code] += 1
            if code:
                log = Path(args.logs) / f"run{done}_{step}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(output)
                reasons = [line.strip() for line in output.splitlines()
                           if "terminate called" in line or "Signal" in line or "Error" in line]
                failures.append((step, code, log, reasons[:3]))
            print(f"\r{done}/{args.runs} runs, {len(failures)} failed", end="", flush=True)
    print(f"\n== benchmark: two-process runs, {args.parallel} at once, "
          f"{time.perf_counter() - start:.0f} s ==")
    for step in args.steps:
        codes = outcomes[step]
        print(f"{SCRIPTS[step]:<24} {codes[0]}/{sum(codes.values())} exited 0"
              + "".join(f", {n} exited {code}" for code, n in sorted(codes.items()) if code))
    for step, code, log, reasons in failures:
        print(f"-- {SCRIPTS[step]} exited {code} ({log}):", *reasons, sep="\n   ")
    print("target met" if not failures else "target NOT met")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
