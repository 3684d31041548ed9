"""`python -m estimate`: every numbered script's prediction in one table."""
import argparse
import os
import resource
import time
from concurrent.futures import as_completed

import estimate
from common.cli import positive_int, unwritable
from estimate.fit import fit_table, parse_size, search_all
from estimate.gpu_choices import DEFAULT_GPU, GPUS
from estimate.predict import (GB, PER_PARAMETER, PER_PARAMETER_NOTE, Row, attempt, in_units,
                              published_gb, save_records, setting)
from estimate.published import STUDY_RESERVED_GB
from estimate.workers import worker_pool
from common.presets import PRESETS, TASKS
from steps import scripts as numbered_scripts, step_id, step_of, with_parent


def processes_for(batch_size, accum_steps, most):
    """The most processes, at most `most`, over which a batch of `batch_size` splits into
    `accum_steps` equal micro-batches in every process (1 at least)."""
    return max(count for count in range(1, max(most, 1) + 1)
               if batch_size % (count * accum_steps) == 0 or count == 1)


def rows_for(script, preset, device, world_size, model_flags=(), gpu=DEFAULT_GPU):
    """The script's default setting, plus every other setting the study published for it (on
    its A100). `model_flags`: --model and the flags that shape it, --batch-size; then only the
    one row. `gpu`: the GPU emulated (a key of GPUS)."""
    base = ["--preset", preset, "--device", device, *model_flags]
    distributed = step_of(script).sharded  # 07 on: they take a world size
    default = (PRESETS[preset].batch_size, step_of(script).accum_steps)
    if distributed:  # as many of the GPUs as the batch splits over (the setting names them)
        batch_size = (int(model_flags[model_flags.index("--batch-size") + 1])
                      if "--batch-size" in model_flags else default[0])
        world_size = processes_for(batch_size, default[1], world_size)
    rows = [Row(script, base, world_size if distributed else 1, gpu)]
    if (preset == "article" and device == "cuda" and gpu == DEFAULT_GPU and not distributed
            and not model_flags):
        for (name, batch_size, accum_steps) in STUDY_RESERVED_GB:
            if name != script.stem or (batch_size, accum_steps) == default:
                continue
            flags = ["--batch-size", str(batch_size)]
            if accum_steps != default[1]:
                flags += ["--accum-steps", str(accum_steps)]
            rows.append(Row(script, base + flags, gpu=gpu))
    return rows


def select_scripts(names):
    """The numbered scripts matching `names` (prefixes such as 03), or all; notes for the rest."""
    every, notes = numbered_scripts(), []
    if not names:
        return every, notes
    chosen = []
    for name in names:
        matches = [script for script in every if script.name.startswith(name)]
        if not matches:
            have = ", ".join(step_id(script) for script in every)
            notes.append(f"{name}: no numbered script starts with {name!r} (have: {have})")
        chosen += [match for match in matches if match not in chosen]
    return chosen, notes


def run_rows(rows, jobs):
    """Each row's (record, problem, seconds), in order; up to `jobs` rows at a time."""
    if jobs <= 1 or len(rows) <= 1:
        return [report_progress(done, rows[done], attempt(row), len(rows))
                for done, row in enumerate(rows)]
    import estimate.fake_run  # noqa: F401 - imported once here, shared by the forked workers
    import transformers.models.vit.modeling_vit  # noqa: F401
    outcomes = [None] * len(rows)
    # the workers share the imports; the longest rows start first
    with worker_pool(jobs, lambda: f"after {sum(map(bool, outcomes))} of {len(rows)} estimates: "
                     "no table, and results/estimate.json is as it was") as pool:
        pending = {pool.submit(attempt, rows[index]): index for index in
                   sorted(range(len(rows)), key=lambda index: -expected_work(rows[index]))}
        for done, future in enumerate(as_completed(pending)):
            index = pending[future]
            try:
                outcome = future.result()
            except Exception as error:  # noqa: BLE001 - a worker that died takes only its rows
                outcome = (None, f"the estimating process stopped: {error}", 0.0)
            outcomes[index] = report_progress(done, rows[index], outcome, len(rows))
    return outcomes


def expected_work(row):
    """Rough cost of a row, to start the longest first: forward and backward passes run."""
    accum = row.argv[row.argv.index("--accum-steps") + 1] if "--accum-steps" in row.argv else None
    passes = int(accum) if accum else step_of(row.script).accum_steps
    return passes * (2 if step_of(row.script).sharded else 1)  # sharding doubles the operators


def report_progress(done, row, outcome, total):
    record, problem, seconds = outcome
    state = f"{in_units(record['allocated_bytes'])} allocated" if record else "failed"
    print(f"[{done + 1}/{total}] {row.label}: {state} ({seconds:.1f} s)", flush=True)
    return outcome


def table(rows, outcomes, not_estimated=()):
    """The Markdown table of all predictions, with the study's figure where there is one, and a
    row for each script in `not_estimated` (the estimate cannot run it: the notes say why)."""
    lines = ["| script | setting | allocated | reserved | study (reserved) | ratio | creation "
             f"| {PER_PARAMETER} | activations |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row, (record, problem, _) in zip(rows, outcomes):
        if record is None:
            flags = " ".join(row.argv) + (f", {row.world_size} processes" if row.world_size > 1 else "")
            lines.append(f"| {with_parent(row.script.name)} | {flags} | failed (see the note) | | | | | | |")
            continue
        published = published_gb(record)
        ratio = f"{record['reserved_bytes'] / GB / published:.2f}" if published else ""
        per_parameter = record["model_state_bytes_per_parameter"]
        lines.append(f"| {with_parent(record['script'])} | {setting(record)} | "
                     f"{in_units(record['allocated_bytes'])} | {in_units(record['reserved_bytes'])} | "
                     f"{f'{published:.2f} GB' if published else ''} | {ratio} | "
                     f"{in_units(record['init_allocated_bytes'])} | "
                     f"{'n/a' if per_parameter is None else f'{per_parameter:.2f}'} | "
                     f"{in_units(record['breakdown_bytes']['activations'])} |")
    lines += [f"| {with_parent(script.name)} | | not estimated (see the note) | | | | | | |"
              for script in not_estimated]
    return "\n".join(lines)


def resources_used():
    """CPU seconds of this process and its finished workers, and the peak resident memory (GB)
    of this process and of the largest worker (Linux reports ru_maxrss in KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime
    return cpu_seconds, own.ru_maxrss * 1024 / GB, workers.ru_maxrss * 1024 / GB


def parse_table_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m estimate", description=estimate.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="default: article (the study's ViT-L/16 setting); with --model, "
                             "tiny or tiny-text, as its task")
    parser.add_argument("--model", metavar="NAME_OR_DIR",
                        help="any Hugging Face image or sequence classifier: a Hub id, or a "
                             "directory holding its config.json (only the config is read)")
    parser.add_argument("--task", choices=TASKS, default="classification",
                        help="causal-lm: a decoder's next-token loss over each text (a text "
                             "preset, imdb by default, or --model DECODER); default: classification")
    parser.add_argument("--seq-len", type=positive_int, help="with --model, text: tokens")
    parser.add_argument("--image-size", type=positive_int, help="with --model, images: pixels")
    parser.add_argument("--num-labels", type=positive_int, help="with --model: classes")
    parser.add_argument("--batch-size", type=positive_int,
                        help="samples per optimizer step, over all GPUs (default: the preset's)")
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="for each step, whether the batch fits in SIZE (for example 24GB, "
                             "24GiB) and the largest batch or micro-batch that does")
    parser.add_argument("--world-size", type=positive_int, default=4,
                        help="processes (GPUs) for the distributed steps, 07 on (default: 4)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: predict a GPU (default); cpu: no emulation, as a CPU run counts")
    parser.add_argument("--gpu", choices=sorted(GPUS), default=DEFAULT_GPU,
                        help="the GPU whose kernels are emulated (default: a100, the study's): "
                             "v100 and t4 have no flash attention and run bfloat16 attention "
                             "on the math path")
    parser.add_argument("--scripts", nargs="+", metavar="NN",
                        help="only these steps, e.g. --scripts 01 03 (default: all)")
    parser.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                        help="estimates run at once, one process each (default: 2)")
    parser.add_argument("--results-dir", default="results", help="where estimate.json goes")
    args = parser.parse_args(argv)
    problem = unwritable(args.results_dir)
    if problem:
        parser.error(problem)
    if args.gpu_memory is not None:
        try:
            args.capacity = parse_size(args.gpu_memory)
        except ValueError as error:
            parser.error(str(error))
        if args.device != "cuda":
            parser.error("--gpu-memory asks what fits on a GPU: leave --device cpu out")
    if args.device == "cpu" and args.gpu != DEFAULT_GPU:
        parser.error(f"--gpu {args.gpu} names the GPU to emulate: leave --device cpu out")
    return args


def model_flags(args):
    """The flags each script gets for --model and --batch-size; the preset the model's task
    picks when --preset is not given (checked here once, as a script would check them)."""
    flags = ["--task", args.task] if args.task != "classification" else []
    if args.model is not None:
        flags += ["--model", args.model]
        for name in ("seq_len", "image_size", "num_labels"):
            if getattr(args, name) is not None:
                flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        from common.cli import parse_args
        script_args = parse_args("", [*flags, "--estimate", *(
            ["--preset", args.preset] if args.preset else [])])  # exits with a message if wrong
        args.preset = script_args.preset
    elif args.seq_len or args.image_size or args.num_labels:
        raise SystemExit("error: --seq-len, --image-size and --num-labels shape the model named "
                         "by --model (add --model NAME_OR_DIR)")
    args.preset = args.preset or ("article" if args.task == "classification" else "imdb")
    from common.cli import parse_args
    parse_args("", [*flags, "--preset", args.preset, "--estimate"])  # a preset of the task
    if args.batch_size is not None:
        flags += ["--batch-size", str(args.batch_size)]
    return flags


def main(argv=None):
    """`python -m estimate`: every numbered script, one table; returns the exit status."""
    start = time.perf_counter()
    args = parse_table_args(argv)
    scripts, notes = select_scripts(args.scripts)
    if not scripts:
        raise SystemExit("error: nothing to estimate.\n" + "\n".join(f"  {note}" for note in notes))
    flags = model_flags(args)
    other_task = [script for script in scripts if not step_of(script).trains(args.task)]
    notes += [f"{script.stem} trains --task {step_of(script).task} only: add --task "
              f"{step_of(script).task} to estimate it" for script in other_task if args.scripts]
    scripts = [script for script in scripts if script not in other_task]
    if not scripts:
        raise SystemExit("error: nothing to estimate.\n" + "\n".join(f"  {note}" for note in notes))
    not_estimated = {script: reason for script in scripts if (reason := step_of(script).by_hand)}
    notes += [f"{script.stem} is not estimated: {reason}" for script, reason in not_estimated.items()]
    scripts = [script for script in scripts if script not in not_estimated]
    rows = [row for script in scripts
            for row in rows_for(script, args.preset, args.device, args.world_size, flags, args.gpu)]
    fewer = sorted({row.world_size for row in rows if step_of(row.script).sharded} - {args.world_size})
    if fewer:
        notes.append(f"the distributed steps run on {fewer[0]} of the {args.world_size} GPUs "
                     "(--world-size): the batch does not split into equal micro-batches over more")
    outcomes = run_rows(rows, args.jobs)
    records = [record for record, _, _ in outcomes if record]
    print("\n" + table(rows, outcomes, not_estimated))
    print(f"\n{PER_PARAMETER_NOTE} On a GPU: its own bytes, without what 08-09 offload.\n")
    if args.gpu_memory is not None:
        fits = search_all(rows, outcomes, args.capacity, args.jobs,
                          lambda script: step_of(script).accum_steps > 1)
        print(fit_table(fits, args.gpu_memory) + "\n")
        notes += [f"{fit.script}: {fit.problem}" for fit in fits if fit.problem]
    for row, (_, problem, _) in zip(rows, outcomes):
        if problem:
            notes.append(f"{row.label}: {problem}")
    for note in notes:
        print(f"note: {note}")
    if records:
        print(f"records: {save_records(args.results_dir, records)}")
    cpu_seconds, own, workers = resources_used()
    print(f"wall time {time.perf_counter() - start:.1f} s (CPU {cpu_seconds:.1f} s, "
          f"{args.jobs} at a time); peak memory (RSS) {own:.2f} GB in this process"
          + (f", {workers:.2f} GB in the largest worker" if workers else ""))
    return 1 if any(problem for _, problem, _ in outcomes) else 0

