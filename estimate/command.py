"""`python -m estimate`: every numbered script's prediction in one table."""
import argparse
import io
import math
import os
import re
import sys
import time
from concurrent.futures import as_completed
from contextlib import redirect_stderr
from pathlib import Path

import estimate
from common.cli import add_shared_flags, parse_args, positive_int, unwritable
from common.presets import PRESETS
from estimate import records
from estimate.gpu_choices import DEFAULT_GPU, GPUS, gpu_problem
from estimate.output import (
    print_whole,
    quiet_while_working,
    report_progress,
    resources_used,
    rows_table,
    worker_pool,
)
from estimate.predict import EXACT_VARIABLE, Row, attempt, compiles
from estimate.records import GB, PER_PARAMETER_NOTE, STUDY_RESERVED_GB, in_study_setting, save_records
from estimate.search import longest, walk
from estimate.search.answers import adapters_text, chain_text, fit_table, stack_text
from estimate.search.costs import Costs
from estimate.search.fit import search_all, without_batch_flags
from estimate.shortcuts import cache
from estimate.stack import COST
from steps import STEPS, UnknownStep, select, step_of

UNITS = {"": GB, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
         "g": 2**30, "t": 2**40}


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
    asked = {"preset": preset, "device": device, "gpu": GPUS[gpu].name, "world_size": rows[0].world_size}
    if in_study_setting(asked) and not model_flags:
        for (name, batch_size, accum_steps) in STUDY_RESERVED_GB:
            if name != script.stem or (batch_size, accum_steps) == default:
                continue
            flags = ["--batch-size", str(batch_size)]
            if accum_steps != default[1]:
                flags += ["--accum-steps", str(accum_steps)]
            rows.append(Row(script, base + flags, gpu=gpu))
    return rows


def run_rows(rows, jobs):
    """Each row's (record, problem, seconds), in order; up to `jobs` rows at a time."""
    if jobs <= 1 or len(rows) <= 1:
        return [report_progress(done, rows[done], attempt(row), len(rows))
                for done, row in enumerate(rows)]
    import transformers.models.vit.modeling_vit  # noqa: F401

    import estimate.fake.run  # noqa: F401 - imported once here, shared by the forked workers
    outcomes = [None] * len(rows)
    # the workers share the imports; the longest rows start first
    with worker_pool(jobs, lambda: f"after {sum(map(bool, outcomes))} of {len(rows)} estimates: "
                     f"no table, and {records.KEPT} is as it was") as pool:
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
    """Rough cost of a row, to start the longest first: forward and backward passes run; a
    compiled run (05k) first of all (its graphs are made, then run an operation at a time)."""
    accum = row.argv[row.argv.index("--accum-steps") + 1] if "--accum-steps" in row.argv else None
    passes = int(accum) if accum else step_of(row.script).accum_steps
    compiled = 100 if compiles(row.script, row.argv) else 1
    return compiled * passes * (2 if step_of(row.script).sharded else 1)  # sharding doubles the operators


def parse_table_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m estimate", description=estimate.__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_flags(parser, ["--preset", "--model", "--task", "--seq-len", "--image-size",
                              "--num-labels", "--batch-size"], {
        "--preset": (None, "article, the study's ViT-L/16 setting; imdb under --task causal-lm; "
                           "with --model, tiny or tiny-text, as its task"),
        "--task": ("classification", "classification")})
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="for each step, whether the batch fits in SIZE (for example 24GB, "
                             "24GiB) and the largest batch or micro-batch that does")
    add_shared_flags(parser, ["--world-size", "--gpu"], {"--world-size": (4, "4"),
                                                         "--gpu": (None, DEFAULT_GPU)})
    parser.add_argument("--host-memory", metavar="SIZE",
                        help="with --gpu-memory: the host memory of one machine; a stack whose "
                             "offloaded state needs more is passed over (default: no limit)")
    parser.add_argument("--interconnect", metavar="RATE",
                        help="with --gpu-memory and --world-size: the bytes a second each GPU's "
                             "all-gather and reduce-scatter reach, which price the stack's sharded "
                             "links (for example 200GB/s, the default: an A100's NVLink; 12GB/s: "
                             "100 Gb/s InfiniBand)")
    parser.add_argument("--longest-sequence", nargs="?", const=1024, type=positive_int,
                        metavar="GRANULE",
                        help="with --gpu-memory and --task causal-lm: the longest sequence that "
                             "fits at the batch (default 1), to GRANULE tokens (default 1024), "
                             "with its command (estimate/search/longest.py)")
    parser.add_argument("--stack-only", action="store_true",
                        help="with --gpu-memory: only the stack (10_combined.py's switches that "
                             "fit), without the table of every script")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: predict a GPU (default); cpu: no emulation, as a CPU run counts")
    parser.add_argument("--steps", nargs="+", metavar="NN",
                        help="only these steps, e.g. --steps 01 03 (default: all)")
    parser.add_argument("--scripts", nargs="+", help=argparse.SUPPRESS)  # the old name
    parser.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                        help="estimates run at once, one process each (default: 2)")
    parser.add_argument("--results-dir", default="results", help="where estimate.json goes")
    parser.add_argument("--quiet", action="store_true",
                        help="print only the answer: the stack and its command under --gpu-memory "
                             "(no table computed), else the table")
    parser.add_argument("--exact", action="store_true",
                        help="run every micro-batch of each row, not two (the same bytes, slower: "
                             "a check)")
    words = list(sys.argv[1:] if argv is None else argv)
    for index, word in enumerate(words[:-1]):  # a negative size reads as a flag: take it whole,
        if (word in ("--gpu-memory", "--host-memory", "--interconnect")
                and words[index + 1].startswith("-")):
            words[index + 1] = f"{word}={words[index + 1]}"  # and say what is wrong
            words[index] = None
    words = [word for word in words if word is not None]
    args = parser.parse_args(words)
    records.KEPT = Path(args.results_dir) / records.ESTIMATE_FILE
    # the stack runs one GPU unless --world-size is given (the table's default is 4)
    args.stack_world_size = args.world_size if any(
        word.startswith("--world-size") for word in (sys.argv[1:] if argv is None else argv)) else 1
    if args.scripts:
        parser.error("--scripts is now --steps (as in python -m tour): --steps "
                     + " ".join(args.scripts))
    problem = unwritable(args.results_dir) or gpu_problem(args.gpu, args.device == "cuda")
    if problem:
        parser.error(problem)
    args.gpu = args.gpu or DEFAULT_GPU
    if args.gpu_memory is not None:
        try:
            args.capacity = parse_size(args.gpu_memory)
            args.host_capacity = args.host_memory and parse_size(args.host_memory, "--host-memory")
            args.interconnect = args.interconnect and parse_rate(args.interconnect)
        except ValueError as error:
            parser.error(str(error))
        if args.device != "cuda":
            parser.error("--gpu-memory asks what fits on a GPU: leave --device cpu out")
        if args.interconnect and args.stack_world_size == 1:
            parser.error("--interconnect prices what sharded GPUs send each other: add --world-size N "
                         "(N above 1), or leave it out")
        if args.longest_sequence and args.task != "causal-lm":
            parser.error("--longest-sequence asks how long a language model's sequence fits: "
                         "add --task causal-lm")
        if args.longest_sequence and args.longest_sequence % args.stack_world_size:
            parser.error(f"--longest-sequence {args.longest_sequence}: each length is split in "
                         f"{args.stack_world_size} slices (--world-size), so give a granule they "
                         f"divide, such as {math.lcm(args.longest_sequence, args.stack_world_size)}")
    elif args.longest_sequence:
        parser.error("--longest-sequence asks what fits on a GPU: add --gpu-memory SIZE")
    elif args.interconnect:
        parser.error("--interconnect prices the stack's sharded links under --gpu-memory SIZE: add "
                     "it and --world-size N")
    elif args.host_memory:
        parser.error("--host-memory limits the stack's answer to --gpu-memory SIZE: add it")
    elif args.stack_only:
        parser.error("--stack-only answers --gpu-memory SIZE: add it (for example 24GB)")
    if args.stack_only and args.steps:
        parser.error("--steps picks the table's rows, and --stack-only prints no table (the stack "
                     "walks 10_combined.py's switches): leave one of them out")
    return args


def parse_size(text, flag="--gpu-memory"):
    """Bytes in "24GB" (10^9), "24GiB" or "24G" (2^30), "80 GB", "16000MB"; ValueError, naming
    `flag`, if not, or if it comes to less than a byte."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = found and found.group(2).lower()
    if not found or unit not in UNITS or int(float(found.group(1)) * UNITS[unit]) < 1:
        raise ValueError(f"{flag} {text!r}: expected a size such as 24GB, 24GiB or 80GB "
                         "(GB = 10^9 bytes, GiB and G = 2^30; a GPU sold as 24 GB holds 24 GiB)")
    return int(float(found.group(1)) * UNITS[unit])


def parse_rate(text):
    """Bytes a second in "200GB/s" or "25GiB/s" (a size, as --gpu-memory reads one, a second;
    "/s" may be left out); ValueError, naming --interconnect, if not."""
    amount = re.sub(r"\s*/\s*s\s*$", "", text)
    if re.fullmatch(r".*[0-9.\s][kKmMgGtT]b", amount):  # 100Gb/s: bits, as networks are sold
        raise ValueError(f"--interconnect {text!r}: a lower-case b counts bits; give bytes a "
                         "second, such as 12.5GB/s for 100 Gb/s")
    try:
        return parse_size(amount)
    except ValueError:
        raise ValueError(f"--interconnect {text!r}: expected bytes a second, such as 200GB/s "
                         "(an A100's NVLink, the default) or 25GiB/s") from None


def model_flags(args):
    """The flags each script gets for --task, --model and the flags that shape it, --batch-size,
    checked here once as a script checks them (it exits with its message if one is wrong); the
    preset: --preset, else the model's task's (tiny or tiny-text), else article (imdb for
    causal-lm)."""
    flags = ["--task", args.task] if args.task != "classification" else []
    if args.model is not None:
        flags += ["--model", args.model]
    for name in ("seq_len", "image_size", "num_labels"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.preset is None and args.model is None:
        args.preset = "article" if args.task == "classification" else "imdb"
    preset = ["--preset", args.preset] if args.preset else []
    said = io.StringIO()
    try:  # checked as a script checks them; said as python -m estimate's own error
        with redirect_stderr(said):
            args.preset = parse_args("", [*flags, *preset, "--estimate",
                                          "--results-dir", args.results_dir]).preset
    except SystemExit:
        lines = said.getvalue().strip().splitlines() or ["error: the flags were refused"]
        refuse(lines[-1].split('error: ', 1)[-1])
    if args.batch_size is not None:
        flags += ["--batch-size", str(args.batch_size)]
    return flags


def refuse(problem):
    """A usage error found past the parser: said as python -m estimate's own, status 2."""
    print(f"python -m estimate: error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None):
    """`python -m estimate`: every numbered script, one table; returns the exit status."""
    previous = os.environ.get(EXACT_VARIABLE)
    try:
        return table_main(argv)
    finally:  # --exact holds for this call only
        if previous is None:
            os.environ.pop(EXACT_VARIABLE, None)
        else:
            os.environ[EXACT_VARIABLE] = previous


def table_main(argv):
    start = time.perf_counter()
    args = parse_table_args(argv)
    if args.exact:  # every estimate of the table, the search and the stack, in every worker
        os.environ[EXACT_VARIABLE] = "1"
    try:
        steps = select(args.steps, args.task)
    except UnknownStep as problem:
        refuse(f"--steps: {problem}")
    flags = model_flags(args)
    if args.gpu_memory is not None and not args.longest_sequence:  # (there: texts a GPU)
        check_the_batch_splits(args, flags)
    if args.longest_sequence:  # the longest sequence instead of the table (search/longest.py)
        with quiet_while_working(args.quiet):
            answer = longest.answer(args, flags, GPUS[args.gpu].name)
        print(answer)
        return 0
    if args.gpu_memory is not None:  # the answer first, the moment it is known: the stack
        shown = sys.stdout
        with quiet_while_working(args.quiet):  # the work's progress lines, unless --quiet
            chain, adapters = the_stack(args, flags, lambda text: print_whole(text, shown))
    try:  # Ctrl-C from here on leaves the answer on screen, and says what it stopped
        if args.gpu_memory is not None:
            if adapters:
                print(adapters, flush=True)
            if args.stack_only and not args.quiet:
                print(f"\n{chain}\nwall time {time.perf_counter() - start:.1f} s")
            if args.quiet or args.stack_only:  # the answer alone: no table computed
                return 0
        notes = [f"{step.name} trains --task {step.task} only: add --task {step.task} to estimate it"
                 for step in select(args.steps) if args.steps and step not in steps]
        not_estimated = [step for step in steps if step.by_hand]
        notes += [f"{step.name} is not estimated: {step.by_hand}" for step in not_estimated]
        rows = [row for step in steps if not step.by_hand
                for row in rows_for(step.path, args.preset, args.device, args.world_size, flags,
                                    args.gpu)]
        fewer = sorted({row.world_size for row in rows if step_of(row.script).sharded} - {args.world_size})
        if fewer:
            notes.append(f"the distributed steps run on {fewer[0]} of the {args.world_size} GPUs "
                         "(--world-size): the batch does not split into equal micro-batches over more")
        with quiet_while_working(args.quiet):
            outcomes = run_rows(rows, args.jobs)
            if args.gpu_memory is not None:
                fits = search_all(rows, outcomes, args.capacity, args.jobs,
                                  lambda script: step_of(script).accum_steps > 1, search_interrupted)
    except KeyboardInterrupt:  # (one estimate at a time; the workers' pool says so itself)
        raise SystemExit("\ninterrupted (Ctrl-C) " + ("after the answer, which stands: " if
                         args.gpu_memory is not None else "") + f"no table, and {records.KEPT} is "
                         "as it was") from None
    made = [record for record, _, _ in outcomes if record]
    saved = save_records(args.results_dir, made) if made else None  # --quiet too
    failures = [f"{row.label}: {problem}" for row, (_, problem, _) in zip(rows, outcomes)
                if problem]
    status = 1 if failures else 0
    if args.quiet:  # the table alone; a row that failed still says so, on standard error
        print(rows_table(rows, outcomes, not_estimated))
        for failure in failures:
            print(f"note: {failure}", file=sys.stderr)
        return status
    if args.gpu_memory is not None:  # after the answer, what it rests on
        print("\n" + fit_table(fits, args.gpu_memory))
        notes += [f"{fit.script}: {fit.problem or fit.not_searched}" for fit in fits
                  if fit.problem or fit.not_searched]
        notes += [f"{fit.script}: every size its search tried was estimated ({fit.not_by_sizes})"
                  for fit in fits if fit.not_by_sizes and not fit.problem]
    print("\n" + rows_table(rows, outcomes, not_estimated))
    print(f"\n{PER_PARAMETER_NOTE} On a GPU: its own bytes, without what 08-09 offload.")
    if args.gpu_memory is not None:
        print("\n" + chain)
    print()
    for note in [*notes, *failures]:
        print(f"note: {note}")
    if saved:
        print(f"records: {saved}")
    cpu_seconds, own, workers = resources_used()
    print(f"wall time {time.perf_counter() - start:.1f} s (CPU {cpu_seconds:.1f} s, "
          f"{args.jobs} at a time); peak memory (RSS) {own:.2f} GB in this process"
          + (f", {workers:.2f} GB in the largest worker" if workers else ""))
    return status


def search_interrupted():
    """What Ctrl-C during the --gpu-memory search leaves."""
    return f"during the --gpu-memory search: no table of what fits, and {records.KEPT} is as it was"


def stack_preset(args, flags):
    """The preset's settings the stack's runs take: the named preset's, or the --model's."""
    return PRESETS[args.preset] if args.model is None else parse_args(
        "", [*without_batch_flags(flags), "--preset", args.preset, "--estimate"]).preset_settings


def check_the_batch_splits(args, flags):
    """The stack on N GPUs gives each a whole share of the batch: said before anything runs."""
    batch_size = args.batch_size or stack_preset(args, flags).batch_size
    if args.stack_world_size > 1 and batch_size % args.stack_world_size:
        refuse(f"a batch of {batch_size} does not split over {args.stack_world_size} GPUs "
               f"(--world-size), each taking a whole share: give --batch-size a multiple of "
               f"{args.stack_world_size}, or fewer GPUs")


def model_parameters(combined, base, world_size, preset, config):
    """The model's parameter count, for the cost model and the floors: counted on the meta device
    the first time (the fake runs' machinery then imported here, before the workers fork, which
    share it), then kept beside the runs (shortcuts/cache.py): a question asked again, whose
    runs are kept, imports neither (a worker that has a run to make imports it itself)."""
    name = cache.key(Row(combined, base, world_size), False)
    parameters = cache.parameters_kept(name) if name else None
    if parameters is None:
        import torch

        import estimate.fake.run  # noqa: F401 - imported once here, shared by the forked workers
        from common.model import model_class
        with torch.device("meta"):  # in no memory
            parameters = sum(tensor.numel() for tensor in
                             model_class(preset)._from_config(config).parameters())
        cache.note_parameters(name, parameters)
    return parameters


def the_stack(args, flags, show=print):
    """The stack (estimate/stack.py) for the asked batch in --gpu-memory: its answer and command
    given to `show` (to print) the moment they are known; returns the chain and its costs, and
    the adapters' line that ends the answer, as printed."""
    from common.model import model_config
    combined = STEPS["10"].path
    preset = stack_preset(args, flags)
    config = model_config(preset)
    batch_size = args.batch_size or preset.batch_size
    base = ["--preset", args.preset, "--device", args.device, *without_batch_flags(flags)]
    parameters = model_parameters(combined, base, args.stack_world_size, preset, config)
    shown = [*(["--preset", args.preset] if args.model is None else []), *without_batch_flags(flags)]
    tokens = batch_size * (preset.max_length or (preset.image_size // 16) ** 2 or 1)
    tower = getattr(config, "vision_config", config)  # CLIP: its image tower trains
    shape = (tower.num_hidden_layers, tower.hidden_size, getattr(config, "vocab_size", 0))
    costs = Costs(parameters, tokens, *shape,
                  interconnect=args.interconnect or COST["interconnect_bytes_per_s"])
    _, adapters = walk.answer_all(
        combined, base, batch_size, args.stack_world_size, args.capacity, args.task, args.gpu,
        args.jobs, costs=costs, parameters=parameters, host_capacity=args.host_capacity,
        answered=lambda answer: show(stack_text(answer, shown, batch_size, args.capacity,
                                                args.gpu_memory, [])))
    return (chain_text(args.task, parameters, tokens, shape, args.stack_world_size, costs.interconnect),
            adapters_text(adapters))
