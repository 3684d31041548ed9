"""Join the process group: one process per device, under torchrun or alone.

Under `torchrun --nproc_per_node=N script.py` each process finds its rank and the group's
rendezvous in environment variables that torchrun sets. Started as `python script.py`, the
process forms a group of one, so the same script runs unchanged on a laptop.
"""
import os

import torch
import torch.distributed as dist


def init_distributed(device):
    """Join the process group; returns (rank, world_size, this process's device).

    `device` is the kind asked for on the command line. On CUDA each process takes the GPU
    numbered by its local rank (its rank on this machine) and talks over nccl; on CPU over gloo.
    """
    launched_by_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"process {local_rank} on this machine has no GPU of its own: "
                             f"{torch.cuda.device_count()} visible; start at most that many "
                             "processes per machine (torchrun --nproc_per_node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # collectives and default allocations go to this GPU
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None  # binds nccl to this GPU at once
    if launched_by_torchrun:
        dist.init_process_group(backend, device_id=device_id)  # rendezvous from torchrun's env
    else:
        # alone: a group of one whose store lives in this process (no port, no env variables)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device_id)
    return dist.get_rank(), dist.get_world_size(), device
