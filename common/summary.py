"""The end-of-run summary: printed for people, written as JSON for the tour table (its fields:
docs/development.md, "The record of a run")."""
import json
from pathlib import Path

import torch
import torch.distributed as dist

from common.atomic_write import write_json_atomically
from common.presets import SYNTHETIC, preset_for
from common.progress import is_main_process


def mib(nbytes):
    return f"{nbytes / 2**20:,.2f} MiB"


def model_state_words(per_parameter, parameter_count, world_size):
    """The model state at the peak per parameter, in words: per parameter of a process's share
    when `world_size` processes shard the model (steps 07-09), then per parameter of the whole."""
    words = "model state (parameters, gradients, optimizer state): "
    if per_parameter is None:
        return words + "n/a (no parameters)"
    whole = f"{parameter_count / 1e6:.3g}M parameters"
    if world_size == 1:
        return words + f"{per_parameter:.2f} bytes per parameter ({whole})"
    return words + (f"{per_parameter:.2f} bytes per parameter of a process's 1/{world_size} share "
                    f"of the {whole} ({per_parameter / world_size:.2f} per parameter of the "
                    "whole model)")


def score_fields(score):
    """The record's fields of a test score: accuracy and its samples, or under --task causal-lm
    the next-token loss, its perplexity and its tokens (accuracy null); None: not measured."""
    if score is None:
        return {"test_accuracy": None, "test_samples": None}
    if getattr(score, "name", "accuracy") == "accuracy":
        return {"test_accuracy": float(score), "test_samples": getattr(score, "samples", None)}
    return {"test_accuracy": None, "test_samples": None, "test_loss": round(float(score), 6),
            "test_perplexity": round(score.perplexity, 3), "test_tokens": score.tokens}


def run_words(record):
    """"preset tiny", or "model NAME on preset tiny-text" under --model."""
    model = record.get("model")
    return f"model {model} on preset {record['preset']}" if model else f"preset {record['preset']}"


def report(args, script, creation, meter, progress, test_score):
    """Print the summary of a finished run and write results/<script>.json; returns the record.

    `creation` is what measure_creation() gave, `meter` the run's MemoryMeter, `progress` its
    Progress, `test_score` what evaluate() gave on the test split (an accuracy, or under
    --task causal-lm a next-token loss). Training time is the Progress clock less the steps the
    meter tracked (tracking slows them down).
    """
    memory = meter.result()  # under several processes: collectives, so every process calls them
    synthetic = preset_for(args).dataset == SYNTHETIC  # --data synthetic: nothing to score
    created = creation.result()
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    train_seconds = progress.seconds - meter.tracked_seconds
    record = {
        "script": Path(script).stem,
        "preset": args.preset,
        "model": args.model,  # --model's classifier in place of the preset's (None: the preset's)
        # 07-09: whether each block's gathered weights were freed after forward (ZeRO-3)
        "reshard_after_forward": getattr(args, "reshard_after_forward", None),
        "device": args.device.type,
        "world_size": world_size,
        "batch_size": args.batch_size,
        "accum_steps": args.accum_steps,
        **memory,
        **created,
        "train_seconds": round(train_seconds, 3),
        "task": getattr(args, "task", "classification"),
        "data": "synthetic" if synthetic else "preset",
        **score_fields(None if synthetic else test_score),
        "steps": progress.steps,
        "epochs": args.epochs,
        "seed": args.seed,
        "torch_version": torch.__version__,
        "losses": progress.loss_values(),
        "final_lr": meter.first_optimizer.param_groups[0]["lr"],
    }
    check = getattr(args, "estimate_check", None)  # --check-estimate: its prediction beside
    if check is not None:
        record.update(check.result(memory))
    if not is_main_process():
        return record
    breakdown = " | ".join(f"{name.replace('_', ' ')} {mib(value)}"
                           for name, value in memory["breakdown_bytes"].items())
    sharding = {True: ", ZeRO-3", False: ", gathered weights kept to backward (ZeRO-2)"}.get(
        record["reshard_after_forward"], "")  # --reshard-after-forward, 07-09
    print(f"\n== {record['script']}  ({run_words(record)}, {args.device.type}, "
          f"{world_size} process{'es' if world_size > 1 else ''}{sharding}) ==")
    print(f"peak memory of training  {mib(memory['peak_memory_bytes'])}")
    rank_peaks = memory.get("rank_peak_memory_bytes", [])
    if len(rank_peaks) > 1:  # the highest is the one above
        print(f"  per process: {' | '.join(mib(peak) for peak in rank_peaks)}")
    print(f"  at the peak: {breakdown}")
    if memory.get("memory_counted_by", "MemTracker") != "MemTracker":  # --compile: say how
        print(f"  counted from {memory['memory_counted_by']}: MemTracker cannot watch compiled code")
    print("  " + model_state_words(memory["model_state_bytes_per_parameter"],
                                   memory["parameter_count"], world_size))
    trainable = memory["trainable_parameter_count"]
    if trainable < memory["parameter_count"]:  # frozen weights (07a): say how few are trained
        print(f"  trainable parameters: {trainable / 1e6:.3g}M "
              f"({trainable / memory['parameter_count']:.2%} of the model's)")
    if "cuda_max_reserved_bytes" in memory:  # another window, another count: say which
        print(f"CUDA allocator, whole run (evaluation included): allocated "
              f"{mib(memory['cuda_max_allocated_bytes'])} | reserved "
              f"{mib(memory['cuda_max_reserved_bytes'])}")
    if "measured_over_predicted_allocated" in record and "measured_over_predicted_reserved" in record:
        print(f"predicted ({record['predicted_gpu']}): allocated "
              f"{mib(record['predicted_allocated_bytes'])} | reserved "
              f"{mib(record['predicted_reserved_bytes'])}\n  measured over the same two steps: "
              f"allocated {mib(memory['cuda_steps_max_allocated_bytes'])} | reserved "
              f"{mib(memory['cuda_steps_max_reserved_bytes'])}; measured / predicted "
              f"{record['measured_over_predicted_allocated']:.3f} | "
              f"{record['measured_over_predicted_reserved']:.3f}")
    elif "estimate_problem" in record:
        print(f"--check-estimate: the estimate failed ({record['estimate_problem']})")
    print(f"peak memory of creation  {mib(created['init_peak_memory_bytes'])}"
          + (f"  (host memory {mib(created['init_host_peak_memory_bytes'])})"
             if args.device.type == "cuda" else ""))
    print(f"training time            {train_seconds:.1f} s ({progress.steps} optimizer steps)")
    name = getattr(test_score, "name", "accuracy")
    if synthetic:
        print(f"test {name:<20}not measured (--data synthetic: random inputs and labels)")
    else:
        print(f"test {name:<20}" + (f"{test_score:.2%}" if name == "accuracy"
                                    else str(test_score).removeprefix(name).strip()))
    path = Path(args.results_dir) / f"{record['script']}.json"
    try:
        write_json_atomically(path, record)
    except OSError as error:  # a disk that filled up, a directory removed during the run
        print(json.dumps(record, indent=2))  # the run's outcome, not lost: on standard output
        reason = error.strerror or error
        raise SystemExit(f"error: the record could not be written to {path} ({reason}); it is "
                         "printed in full above: save it as that file by hand, or free space and "
                         "run again")
    print(f"record                   {path}")
    return record
