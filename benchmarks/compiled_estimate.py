"""Benchmark: the estimate of a compiled run against the compiled run, measured on the CPU.

  python benchmarks/compiled_estimate.py [--presets tiny tiny-text] [--steps 01 04 ...]

For each single-device script (steps.py: neither sharded nor the combined script) and preset,
in a fresh process each: the estimate with --compile --device cpu (its prediction, every chain
of pointwise operations fused, and its bound above, nothing fused: estimate/compiled.py), then
the compiled run itself, its peak counted from the allocator's events (common/compiled_memory.py):
"measured" leaves out the scratch space an operation frees before it returns, which the estimate
does not count (estimate/compiled.py's measured_peak); "allocator" is the whole count.
05k compiles always, at each of --budgets. A script that refuses --compile says why. It prints a
table (MiB), the measured peak over each side of the range, and whether it lies within the bound
estimate/compiled.py's within_bound states; the tests check two rows of it
(tests/scripts/test_compile.py, tests/estimate/test_compiled.py). The CPU run validates the graphs and
their partition, not a GPU's kernels.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MIB = 2**20
QUICK = ["--epochs", "1", "--max-steps", "2", "--device", "cpu", "--compile"]


def measure(step, flags):
    """{predicted, unfused, measured} bytes of `step` run with `flags`, here."""
    from common.presets import PRESETS  # noqa: F401 - the scripts' own imports, before the timing
    from estimate import estimate
    from steps import STEPS, import_script

    with tempfile.TemporaryDirectory() as results:
        predicted = estimate(str(STEPS[step].path), [*flags, "--estimate", "--results-dir", results])
        script = import_script(STEPS[step].path)
        # the peak is the tracked training steps'; evaluation, slow on a CPU without bfloat16
        # arithmetic (tiny-text), adds nothing to it
        script.evaluate = lambda *args, **kwargs: float("nan")
        record = script.main([*flags, "--results-dir", results])
    from estimate.compiled import measured_peak, within_bound
    return {"predicted": predicted["allocated_bytes"], "unfused": predicted["unfused_allocated_bytes"],
            "measured": measured_peak(record), "allocator": record["peak_memory_bytes"],
            "within": within_bound(record, predicted)}


def single_device_steps():
    from steps import STEPS
    return [step for step in STEPS.values() if not (step.sharded or step.combined)]


def rows(presets, steps, budgets):
    """(step id, preset, flags) for each run to make."""
    from common.presets import PRESETS, is_text
    for preset in presets:
        for step in single_device_steps():
            if steps and step.id not in steps:
                continue
            task = step.task or "classification"
            if task != "classification" and not is_text(PRESETS[preset]):
                continue
            flags = ["--preset", preset, *QUICK, *([] if step.task is None else ["--task", step.task])]
            for budget in budgets if step.compiles else [None]:
                yield step.id, preset, flags + ([] if budget is None else ["--memory-budget", str(budget)])


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "tiny-text"])
    parser.add_argument("--steps", nargs="*", help="only these (default: every single-device script)")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    parser.add_argument("--one", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one row, in the process started for it
        print("RESULT " + json.dumps(measure(args.one[0], args.one[1:])))
        return 0
    print("| script | preset | flags | predicted (fused) | measured | unfused | measured / predicted "
          "| measured / unfused | within the bound | allocator |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    planned = list(rows(args.presets, args.steps, args.budgets))
    for number, (step, preset, flags) in enumerate(planned, 1):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--one", step, *flags], cwd=ROOT,
                              capture_output=True, text=True)
        shown = " ".join(flag for flag in flags[len(["--preset", preset]) + len(QUICK):])
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        print(f"row {number} of {len(planned)} ({step}, {preset} {shown}): "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if not found:
            said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            print(f"| {step} | {preset} | {shown} | {said} | | | | | | |", flush=True)
            continue
        result = json.loads(found[-1].removeprefix("RESULT "))
        predicted, measured, unfused = result["predicted"], result["measured"], result["unfused"]
        print(f"| {step} | {preset} | {shown} | {predicted / MIB:.2f} | {measured / MIB:.2f} | "
              f"{unfused / MIB:.2f} | {measured / predicted:.3f} | {measured / unfused:.3f} | "
              f"{'yes' if result['within'] else 'no'} | {result['allocator'] / MIB:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
