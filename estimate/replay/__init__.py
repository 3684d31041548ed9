"""Replaying a run's allocation trace through a model of PyTorch's CUDA caching allocator: the
figures `torch.cuda.max_memory_allocated` and `max_memory_reserved` would report, the host
memory beside them, and the memory snapshot of the steps."""
