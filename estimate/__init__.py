"""The GPU-memory estimator: predict a training run's peak GPU memory on a machine without a GPU, in seconds.

  python 03_bf16.py --preset article --batch-size 16 --estimate   # that exact run, on one GPU
  python 07_fsdp.py --preset article --estimate --world-size 4     # sharded over 4 processes
  python 03_bf16.py --preset article --estimate --gpu v100         # on a V100 (default: A100)
  python -m estimate             # every numbered script at the article preset: one table
  python -m estimate --preset tiny --device cpu   # no GPU emulation (see below)
  python -m estimate --model DIR_OR_HUB_ID --seq-len 512 --batch-size 16 --gpu-memory 24GB
      # any Hugging Face classifier: every step, whether it fits, and the largest batch that does

Each prediction runs the script's own main() for two optimizer steps (a run's peak falls within
them) on fake tensors, which have shapes but no data, under the script's own MemoryMeter
(PyTorch's MemTracker; FSDPMemTracker for sharded steps); only the helpers that need data, a
network or other processes are stood in for (estimate/fake/stand_ins.py). So a change to a script
changes its prediction. The order in which the run allocated and freed its tensors is then
replayed through a model of the CUDA caching allocator (estimate/replay/allocator.py and
trace.py; estimate/gpu_choices.py lists every choice a GPU makes differently from
the CPU) to give what `torch.cuda.max_memory_allocated`
and `max_memory_reserved` would report, with a breakdown at the allocated peak.

--device cpu switches the GPU emulation off: the CPU's own kernels and optimizer defaults, bytes
counted exactly as MemoryMeter counts them on the CPU, and reserved = allocated. On the tiny
preset that equals the peak a real `--device cpu --max-steps 2 --epochs 1` run measures.

Distributed steps (07 on) run as rank 0 of a fake process group of --world-size processes (for
a script's own --estimate, WORLD_SIZE if not given, else 1, as `python 07_fsdp.py` alone).
Both write results/estimate.json (--results-dir): one record per script and setting, updated
in place, so a single script's estimate keeps the others' records.
"""
__all__ = ["estimate"]


def __getattr__(name):
    """`estimate`, imported when first asked for (estimate.predict is a module; its predict(), the
    prediction alone): `python -m estimate` answering from kept runs imports neither fake tensors
    nor a memory tracker."""
    if name == "estimate":
        from estimate.check import estimate
        return estimate
    raise AttributeError(f"module 'estimate' has no attribute {name!r}")
