"""The command line every numbered script shares, with checks that say what was wrong."""
import argparse
import importlib.util
import math
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from common.presets import PRESETS, SYNTHETIC, TASKS, for_task


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def true_or_false(text):
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    if math.isinf(value):  # (1e400 reads as infinity too): a rate of inf trains to NaN
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def seed(text):
    """--seed: a whole number from 0 to 2**63 - 1, as torch.manual_seed takes it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be from 0 to {2**63 - 1}, got {text}")
    return value


def fraction(text):
    """A number from 0 to 1 (05k's --memory-budget, 10's --checkpointing budget:F)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def unwritable(directory):
    """Why a file cannot be written in --results-dir `directory` (created if missing), in words
    that say what to do, or None: checked before any training, so that a long run never ends
    unable to write its record."""
    if not directory.strip():
        return ("--results-dir is empty: name a directory for the record (default: results), "
                "or leave the flag out")
    path = Path(directory)
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(0, "it is a file, not a directory")
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".writable-", suffix=".tmp"):
            pass
    except OSError as error:
        return (f"--results-dir {directory}: cannot write there ({error.strerror or error}). "
                "Name a directory this user can write to (it is created if missing)")
    return None


def run_main(main):
    """Run a script's `main()` as its command (the script's last lines call this; main() itself
    leaves Ctrl-C to its caller). On Ctrl-C: one line instead of a traceback, then the end of an
    interrupted program, as Python's own (killed by SIGINT, so that a shell loop stops too)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C): stopped before the end, so no record was written; earlier "
              "records in the results directory are as they were", file=sys.stderr, flush=True)
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)
        raise SystemExit(130)  # where SIGINT's default action does not end the process


# the flags that mean the same in every entry point: the scripts, python -m estimate, python -m tour
SHARED_FLAGS = {
    "--preset": dict(choices=sorted(PRESETS),
                     help="tiny: offline, CPU, seconds; article: ViT-L/16 on CIFAR-10; tiny-text: "
                          "offline, a MiniLM on movie reviews; imdb: BLOOM-560m on IMDb (article "
                          "and imdb: GPU and network)"),
    "--model": dict(metavar="NAME_OR_DIR",
                    help="this Hugging Face image or sequence classifier (or decoder, with --task "
                         "causal-lm) instead of the preset's model: a Hub id, or a directory "
                         "holding its config.json (weights optional); the data comes from the "
                         "preset"),
    "--task": dict(choices=TASKS,
                   help="classification: the label of each image or text; causal-lm (text "
                        "presets): the next-token loss of a decoder over each text, padding "
                        "ignored, reported as loss and perplexity"),
    "--seq-len": dict(type=positive_int,
                      help="with --model, text: tokens per sequence (default: the preset's)"),
    "--max-positions": dict(type=positive_int, metavar="N",
                            help="with --model, rotary positions (Llama, Mistral, Qwen2): "
                                 "positions for N tokens, past its config's maximum; the rotary "
                                 "frequencies are stretched by the same ratio (position "
                                 "interpolation, as long-context fine-tunes do), so the "
                                 "pretrained weights see every position at a new angle"),
    "--image-size": dict(type=positive_int,
                         help="with --model, images: height and width (default: the model's)"),
    "--num-labels": dict(type=positive_int,
                         help="with --model: classes of its new head (default: the data's)"),
    "--data": dict(choices=["preset", "synthetic"], default="preset",
                   help="preset: the preset's data set; synthetic: random inputs and labels of its "
                        "shapes, nothing read or downloaded (memory and time only: accuracy is "
                        "not measured)"),
    "--pack": dict(action="store_true",
                   help="with --task causal-lm: the texts joined end to end (each as its "
                        "tokenizer encodes it, with its own start and end tokens) and cut into "
                        "sequences of the full length: no padding, no attention mask, so the "
                        "model makes no tensor of length x length; attention runs across the "
                        "texts of a sequence"),
    "--epochs": dict(type=positive_int, help="default: the preset's"),
    "--batch-size": dict(type=positive_int, help="samples per optimizer step, over all processes "
                                                 "(default: the preset's)"),
    "--max-steps": dict(type=positive_int,
                        help="stop after this many optimizer steps (for quick runs)"),
    "--gpu": dict(metavar="NAME",
                  help="the GPU whose kernels the estimate emulates: a100 (the study's), h100, "
                       "v100 or t4 (no flash attention, bfloat16 attention on the math path)"),
    "--world-size": dict(type=positive_int, metavar="N",
                         help="the processes (GPUs) the estimate runs a sharded step (07 on) in"),
}
SCRIPT_FLAGS = ["--preset", "--model", "--task", "--seq-len", "--max-positions", "--image-size",
                "--num-labels", "--data", "--pack", "--epochs", "--batch-size", "--max-steps",
                "--gpu"]
# a script takes these only with --estimate (a real run uses the GPU it has, the processes
# torchrun starts), and says so
ESTIMATE_ONLY = {"--gpu": "names the GPU --estimate emulates",
                 "--world-size": "is the process count --estimate assumes (torchrun sets a run's)",
                 "--exact": "makes --estimate run every micro-batch (a real run always does)"}


def add_shared_flags(parser, names, defaults=None):
    """Declare the flags `names` of SHARED_FLAGS on `parser`; `defaults`: {flag: (this entry
    point's default, that default in words for --help)}."""
    for name in names:
        options = dict(SHARED_FLAGS[name])
        if name in (defaults or {}):
            options["default"], words = defaults[name]
            options["help"] += f" (default: {words})"
        parser.add_argument(name, **options)


def refused(reason):
    """An argparse action for a flag a script refuses (04a's --accum-steps): using it stops the
    parse with `reason`, which --help shows too."""
    class Refused(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            kwargs.setdefault("help", f"refused: {reason}")
            super().__init__(option_strings, dest, **kwargs)

        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(reason)
    return Refused


def parse_args(description, argv=None, task=None, flags=None):
    """Parse the flags every script shares; `flags`, a function given the parser, declares the
    script's own (its technique's: 04's --accum-steps, 07's --reshard-after-forward, 07a's
    --lora-*, 10's switches), so a script's diff and a copy of it carry them; `task`, the only
    task a script trains (05g: causal-lm), is --task's default, and any other is refused.

    The preset the run trains (with --model's model in place of its own, when given) is
    resolved here once and travels on `args` (`preset_for(args)` returns it). Preset defaults
    fill --epochs and --batch-size; --lr stays None unless given, so each script picks its
    optimizer's default from the preset. A script without --accum-steps runs one micro-batch a
    step (`args.accum_steps` is 1); with it, the batch must split into equal micro-batches.
    """
    # no abbreviations: --world 2 would be taken for --world-size 2 where a script has it, and
    # for nothing where another program (the stack's walk) looks for the flag by its name
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_flags(parser, SCRIPT_FLAGS, {
        "--preset": (None, "tiny; tiny-text under --task causal-lm, or for a --model of text"),
        "--task": (task or "classification", task or "classification")})
    parser.add_argument("--lr", type=positive_float, help="learning rate (default: the preset's)")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda if available, else cpu")
    parser.add_argument("--results-dir", default="results", help="where the JSON record goes")
    parser.add_argument("--estimate", action="store_true",
                        help="predict this run's peak GPU memory on fake tensors instead of training")
    parser.add_argument("--exact", action="store_true", default=None,
                        help="with --estimate: run every micro-batch, not two (the same bytes, "
                             "slower: a check)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer block: its first call generates fused "
                             "kernels for the device (C++ on a CPU, Triton on a GPU), reused by "
                             "later steps and by the blocks alike")
    parser.add_argument("--check-estimate", action="store_true",
                        help="on a GPU, predict this run too (--estimate, in a subprocess while it "
                             "trains) and record the prediction beside the measured peak")
    parser.add_argument("--memory-snapshot", metavar="FILE",
                        help="on a GPU, write PyTorch's memory snapshot of the tracked steps to "
                             "FILE (a pickle for https://pytorch.org/memory_viz)")
    if flags is not None:
        flags(parser)
    args = parser.parse_args(argv)

    for flag in ESTIMATE_ONLY:
        if not args.estimate and getattr(args, flag[2:].replace("-", "_"), None) is not None:
            parser.error(f"{flag} {ESTIMATE_ONLY[flag]}: add --estimate, or leave {flag} out")
    if args.estimate and importlib.util.find_spec("estimate") is None:
        parser.error("--estimate needs the estimator, the folder estimate/, which this copy of "
                     "the script lacks: copy it beside common/ (or run it from the repository)")
    problem = unwritable(args.results_dir)
    if problem:
        parser.error(problem)
    if task is not None and args.task != task:
        parser.error(f"--task {args.task}: this script trains --task {task} only (its technique "
                     "has nothing to do in another); run its parent for the other task")
    given, args.preset = args.preset is not None, args.preset or "tiny"
    if args.task == "causal-lm" and not given:  # the offline text preset
        args.preset = "tiny-text"
    try:
        preset = for_task(PRESETS[args.preset], args.task)
    except ValueError as problem:
        parser.error(str(problem))
    if args.model is not None:
        preset = model_preset(parser, args, given, only_task=task)
    elif args.seq_len or args.max_positions or args.image_size or args.num_labels:
        parser.error("--seq-len, --max-positions, --image-size and --num-labels shape the model "
                     "named by --model; the presets have their own (add --model NAME_OR_DIR)")
    if args.data == "synthetic":  # no data set read: random samples of its shapes
        preset = replace(preset, dataset=SYNTHETIC)
    if args.pack and preset.task != "causal-lm":
        parser.error("--pack joins texts end to end for their next tokens, and a classifier "
                     "learns one label a text: add --task causal-lm, or leave --pack out")
    if args.pack:  # no padding and no attention mask (common/data.py)
        preset = replace(preset, packed=True)
    shortest = 3 if args.data == "synthetic" else 2  # (a synthetic text's last token is padding)
    if args.task == "causal-lm" and preset.max_length < shortest:
        parser.error(f"--seq-len {preset.max_length}: under --task causal-lm each token predicts the "
                     f"next, so a text needs at least {shortest} tokens"
                     + (" (--data synthetic pads its last one)" if args.data == "synthetic" else "")
                     + f" for a loss: ask for --seq-len {shortest} or more")
    args.preset_settings = preset  # preset_for(args): the preset, resolved once
    args.epochs = args.epochs or preset.epochs
    args.batch_size = args.batch_size or preset.batch_size
    if getattr(args, "accum_steps", None) is None:  # a script without micro-batches
        args.accum_steps = 1
    elif args.batch_size % args.accum_steps:
        parser.error(f"--batch-size {args.batch_size} is not divisible by --accum-steps "
                     f"{args.accum_steps}: every micro-batch must have the same size")
    if args.memory_snapshot:  # the script's MemoryMeter records it
        check_snapshot(parser, args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available() and not args.estimate:
        parser.error("--device cuda was asked for, but this PyTorch sees no CUDA device "
                     f"(torch {torch.__version__}); use --device cpu, or --estimate to "
                     "predict GPU memory without a GPU")
    args.device = torch.device(args.device)
    if args.check_estimate:
        check_estimate_flag(parser, args)  # the script's main() starts it (estimate/check.py)
    if args.compile and not args.estimate:  # the estimate generates no kernels (compiled.py)
        if importlib.util.find_spec("common.compiled_memory") is None:
            parser.error("--compile needs common/compiled_memory.py (how a compiled model's memory "
                         "is counted), which this copy of the script lacks: copy it beside "
                         "common/memory.py")
        problem = compiler_problem(args.device)
        if problem:
            parser.error(f"--compile: {problem}; " + (
                "this script always compiles (its technique is the compiler's): run its parent "
                "for a run without the compiler" if parser.get_default("compile")
                else "or run without --compile"))
    return args


def check_estimate_flag(parser, args):
    """--check-estimate: stops with a message where there is nothing to check (on a GPU, the
    script's main() then starts the estimate beside the run: estimate/check.py)."""
    if args.estimate:
        parser.error("--check-estimate checks a training run against its estimate, and --estimate "
                     "only estimates: leave one of them out")
    if args.device.type != "cuda":
        parser.error("--check-estimate compares a GPU's allocator with the estimate, and this run "
                     "is on the CPU, where the estimate is the run's own count (--estimate "
                     "--device cpu): run it on a GPU, or leave --check-estimate out")
    if args.compile:
        parser.error("--check-estimate checks that the GPU's count equals the estimate's, and "
                     "a compiled run's estimate is a range (its kernels are not generated "
                     "there: estimate/compiled.py), so nothing would be checked: leave "
                     "one of them out")
    if importlib.util.find_spec("estimate") is None:
        parser.error("--check-estimate needs the estimator, the folder estimate/, which this copy "
                     "lacks: copy it beside common/, or leave --check-estimate out")


def check_snapshot(parser, args):
    """--memory-snapshot: a GPU run's, or with --estimate the emulated GPU's; stops otherwise."""
    if Path(args.memory_snapshot).is_dir():
        parser.error(f"--memory-snapshot {args.memory_snapshot} is a folder: name the file to "
                     "write, such as snapshot.pickle")
    folder = Path(args.memory_snapshot).resolve().parent
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        parser.error(f"--memory-snapshot {args.memory_snapshot}: cannot write in {folder} (no "
                     "such folder, or not writable); name a file in a folder that is")
    for path in (Path(args.memory_snapshot), Path(f"{args.memory_snapshot}.png")):  # (and its picture)
        try:  # written for real, before the run: a file that cannot be (read-only) says so now
            existed = path.exists()
            with open(path, "ab"):
                pass
            if not existed:
                path.unlink()
        except OSError as error:
            parser.error(f"--memory-snapshot {args.memory_snapshot}: cannot write {path} "
                         f"({error.strerror or error}); name a file that can be written")
    if args.estimate and args.device == "cpu":
        parser.error("--memory-snapshot with --estimate writes the emulated GPU's snapshot, and "
                     "--device cpu asks for the CPU's count: leave --device cpu out")
    if not args.estimate and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--memory-snapshot records the CUDA allocator, and this run is on the CPU: "
                     "run it on a GPU, or add --estimate for the predicted snapshot")


def model_preset(parser, args, given, only_task=None):
    """Check --model and the flags that shape it; pick the preset of its task (tiny or
    tiny-text) when --preset was not given. Stops with a message on any problem."""
    from common.any_model import ModelProblem, read_config, task_of, with_model
    from common.presets import is_text
    try:
        config, _ = read_config(args.model)
        task = "text" if args.task == "causal-lm" else task_of(config.model_type)
        if task is not None and not given:
            args.preset = "tiny-text" if task == "text" else "tiny"
        preset = for_task(PRESETS[args.preset], args.task)
        holds = "text" if is_text(preset) else "images"
        if task is not None and task != holds:
            alike = [name for name, other in PRESETS.items()
                     if ("text" if is_text(other) else "images") == task]
            raise ModelProblem(f"--model {args.model} classifies {task}, but --preset "
                               f"{args.preset} holds {holds}: choose a preset of {task} "
                               f"({', '.join(alike)}), or leave --preset out")
        if task == "text" and args.image_size or task == "images" and args.seq_len:
            raise ModelProblem(f"--model {args.model} classifies {task}: "
                               + ("--image-size is for images; use --seq-len" if task == "text"
                                  else "--seq-len is for text; use --image-size"))
        model_preset = with_model(preset, args.model, args.seq_len, args.image_size,
                                  args.num_labels, args.max_positions)
    except ModelProblem as problem:
        said = str(problem)
        if only_task is not None:  # (05g, 05h: no classifier to fall back on)
            said = said.replace(", or leave --task out to train it as a classifier",
                                f"; this script trains --task {only_task} only")
        parser.error(said)
    if not args.estimate and model_preset.num_classes < preset.num_classes:
        parser.error(f"--num-labels {args.num_labels}: the data of preset {args.preset} has "
                     f"{preset.num_classes} classes; training needs at least as many")
    return model_preset


def compiler_problem(device):
    """Why torch.compile cannot build code for `device` here (in words that say what to
    install), or None. Asked the way inductor itself asks (torch 2.13), before any training.

    On a CPU inductor writes C++ and builds it with the compiler that torch._inductor.cpp_builder
    finds: $CXX, else g++ (clang++ on macOS, which also needs OpenMP: torch's own message says how
    when the build fails), else cl on Windows (found only in a Visual Studio developer prompt).
    On CUDA it writes Triton kernels, which need the triton package (a dependency of the Linux
    CUDA wheels of torch; triton-windows on Windows) and a GPU of compute capability 7.0 or more.
    """
    from torch._dynamo.eval_frame import check_if_dynamo_supported
    try:
        check_if_dynamo_supported()  # this Python version at all
    except RuntimeError as error:
        return str(error)
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return ("torch.compile generates Triton kernels for a GPU, and found no working "
                    "Triton here. Install it (pip install triton; on Windows, triton-windows) "
                    "or use a GPU of compute capability 7.0 or more")
        return None
    from torch._inductor import cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
    except RuntimeError as error:  # InvalidCxxCompiler, or an MSVC that torch cannot use
        return (f"torch.compile builds C++ code for a CPU, and found no compiler it can use "
                f"({error}). Install g++ (Linux), the Xcode command line tools (macOS: "
                "xcode-select --install) or Visual Studio's C++ build tools (Windows: run from "
                "their developer prompt), or name a compiler in the CXX environment variable")
    return None


def check_batch_split(args, world_size):
    """Exit with a message unless every process gets --accum-steps micro-batches of equal size.

    Each process takes an equal slice of every batch; a process with fewer micro-batches than
    the others would wait forever in a collective they never join. Every process runs this
    same check on the same numbers, so all of them stop together.
    """
    micro_batches_per_step = world_size * args.accum_steps
    if world_size > args.batch_size:
        problem = (f"{world_size} processes share batches of {args.batch_size} (--batch-size): "
                   "some processes would get no sample at all")
    elif args.batch_size % micro_batches_per_step:
        problem = (f"--batch-size {args.batch_size} does not split into {world_size} processes x "
                   f"{args.accum_steps} micro-batches (--accum-steps) of equal size")
        if args.batch_size % world_size == 0:
            problem += (f": each process gets {args.batch_size // world_size} samples, "
                        f"not divisible by {args.accum_steps}")
    else:
        return
    raise SystemExit(f"error: {problem}.\n  Use a --batch-size divisible by processes x "
                     f"--accum-steps ({micro_batches_per_step} here), fewer processes, "
                     "or another --accum-steps.")
