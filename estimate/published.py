"""The 2023 study's published peak-memory figures, for comparison only (never fitted to).

All are `torch.cuda.max_memory_reserved()` on an A100 with a PyTorch 2.1 nightly, one epoch of
torchvision's ViT-L/16 on CIFAR-10 at 224 px, in GB (10**9 bytes), from the study's own logs.
estimate/records.py says when a prediction is compared with one (`published_gb`).
"""

# (script, batch size, accumulation steps) -> GB, single GPU
STUDY_RESERVED_GB = {
    ("01_baseline", 64, 1): 26.84,
    ("02_mixed_precision", 64, 1): 18.21,
    ("03_bf16", 64, 1): 13.82,
    ("03_bf16", 16, 1): 5.69,
    ("04_grad_accum", 16, 4): 3.91,
    ("05_sgd_cosine", 16, 4): 2.02,  # the study's headline, "about 2 GB": SGD, 4 micro-batches
}
