"""Benchmark (GPU): what 04c's projection holds beyond what the estimate counts, and its time.

  python benchmarks/galore_svd.py [--model docs/models/llama-3.1-8b] [--rank R]

For each shape of 2-D weight in the model's blocks (read from its config on the meta device), on
a CUDA GPU: a bfloat16 gradient of that shape, then 04c's `projection` (the float32 SVD, r of its
vectors kept, r a quarter of the narrower side unless --rank), measured by the caching allocator.
The estimate counts what the SVD's meta kernel allocates (U, S and Vh) beside the float32 copy and
the projector; torch's CUDA SVD (svd_cusolver, driver gesvdj) also makes a column-major copy of
its input and allocates cuSOLVER's workspace (lwork, from gesvdj's bufferSize, which cuSOLVER's
documentation gives no formula for), both freed as it returns. Printed per shape: the peak above
the gradient, what the estimate counts, the rest (the copy and the workspace), and the SVD's time
with the rate Golub and Van Loan's count for a thin SVD (4 k^2 l + 22 k^3 FLOPs, k <= l) gives it,
which estimate/stack.py's COST["svd_flops"] assumes. Without a GPU it says so and stops.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.model import transformer_blocks  # noqa: E402
from steps import STEPS, import_script  # noqa: E402


def block_shapes(model_dir):
    """The shapes of the 2-D weights of the model's blocks, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sorted({tuple(weight.shape) for block in transformer_blocks(model)
                   for weight in block.parameters() if weight.ndim == 2})


def allocated(*shapes, element=4):
    """Bytes of float32 tensors of `shapes` as the caching allocator counts them (512-byte blocks)."""
    return sum(-(-element * int(torch.Size(shape).numel()) // 512) * 512 for shape in shapes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "docs" / "models" / "llama-3.1-8b"))
    parser.add_argument("--rank", type=int, help="default: a quarter of each weight's narrower side")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: this measures torch.linalg.svd's memory on a GPU")
    projection = import_script(STEPS["04c"].path, prefix="benchmark").projection
    projection(torch.randn(64, 96, device="cuda"), 16, True)  # cuSOLVER's handle made first
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, linear algebra: "
          f"{torch.backends.cuda.preferred_linalg_library()}")
    print("| shape | rank | peak above the gradient | counted by the estimate | not counted | "
          "not counted / (m x n x 4) | seconds | TFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows, columns in block_shapes(args.model):
        k, longer = min(rows, columns), max(rows, columns)
        rank, left = args.rank or max(1, k // 4), rows < columns
        gradient = torch.randn(rows, columns, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, began = torch.cuda.memory_allocated(), time.perf_counter()
        projector = projection(gradient, rank, left)
        torch.cuda.synchronize()
        seconds, peak = time.perf_counter() - began, torch.cuda.max_memory_allocated() - start
        counted = allocated((rows, columns), (rows, k), (k,), (k, columns)) + allocated(
            projector.shape, element=2)
        rest = peak - counted
        print(f"| {rows} x {columns} | {rank} | {peak / 2**20:.1f} MiB | {counted / 2**20:.1f} MiB | "
              f"{rest / 2**20:.1f} MiB | {rest / (4 * rows * columns):.2f} | {seconds:.3f} | "
              f"{(4 * k * k * longer + 22 * k**3) / seconds / 1e12:.2f} |")
        del gradient, projector


if __name__ == "__main__":
    main()
