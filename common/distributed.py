"""Join the process group (one process per device, under torchrun or alone), and leave it.

Under `torchrun --nproc_per_node=N script.py` each process finds its rank and the group's
rendezvous in environment variables that torchrun sets. Started as `python script.py`, the
process forms a group of one, so the same script runs unchanged on a laptop.
"""
import gc
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

# How long a collective may wait for the slowest process. Process 0 alone loads the pretrained
# weights (on a first run, downloads them: minutes for a large model) while the others wait in
# the first broadcast; NCCL's default of 10 minutes would end such a job. A process that hangs
# is then found after an hour rather than ten minutes.
GROUP_TIMEOUT = timedelta(hours=1)


def cuda_index(local_rank, visible, restricted, torchrun=False):
    """The GPU for the process with this local rank when it sees `visible` GPUs.

    torchrun shows every process of a machine the same GPUs (CUDA_VISIBLE_DEVICES, if set, is
    passed on unchanged; under --virtual-local-rank it shows each its own, as local rank 0,
    which this also gives): process N takes GPU N, so a machine needs one visible GPU per process
    (with CUDA_VISIBLE_DEVICES=0 and --nproc_per_node=2 both would take GPU 0, and NCCL would
    stop on a "Duplicate GPU"). Another launcher that shows each process only its own GPU
    (`restricted`: CUDA_VISIBLE_DEVICES set for it, as SLURM's --gpus-per-task does) leaves one
    visible: that one.
    """
    if visible == 1 and restricted and not torchrun:
        return 0
    if local_rank >= visible:
        shown = f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})" if restricted else ""
        raise SystemExit(f"error: process {local_rank} on this machine has no GPU of its own: "
                         f"{visible} visible{shown}, and torchrun shows every process of a machine "
                         "the same GPUs. Start at most that many processes per machine "
                         "(torchrun --nproc_per_node), make more GPUs visible, or show each "
                         "process one GPU" if torchrun else
                         f"error: process {local_rank} on this machine has no GPU of its own: "
                         f"{visible} visible{shown}; start at most that many processes per "
                         "machine, or show each process one GPU")
    return local_rank


def init_distributed(device):
    """Join the process group; returns (rank, world_size, this process's device).

    `device` is the kind asked for on the command line. On CUDA each process takes the GPU
    numbered by its local rank (its rank on this machine) and talks over nccl; on CPU over gloo.
    """
    launched_by_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched_by_torchrun:
        check_launch_environment()
    if device.type == "cuda":
        device = torch.device("cuda", cuda_index(int(os.environ.get("LOCAL_RANK", 0)),
                                                 torch.cuda.device_count(),
                                                 "CUDA_VISIBLE_DEVICES" in os.environ,
                                                 "TORCHELASTIC_RUN_ID" in os.environ))
        torch.cuda.set_device(device)  # collectives and default allocations go to this GPU
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None  # binds nccl to this GPU at once
    if launched_by_torchrun:  # rendezvous from torchrun's env
        dist.init_process_group(backend, device_id=device_id, timeout=GROUP_TIMEOUT)
    else:
        # alone: a group of one whose store lives in this process (no port, no env variables)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device_id)
    return dist.get_rank(), dist.get_world_size(), device


def check_launch_environment():
    """Stop with one line where the variables a launcher sets cannot form a group (set by hand,
    or left over); say what a process started by hand waits for (torchrun starts them all)."""
    world, rank = os.environ["WORLD_SIZE"], os.environ["RANK"]
    if not (world.isdigit() and int(world) >= 1 and rank.isdigit() and int(rank) < int(world)):
        raise SystemExit(f"error: WORLD_SIZE={world} and RANK={rank} do not name a process of a "
                         "group (WORLD_SIZE a count from 1, RANK from 0 to WORLD_SIZE - 1): start "
                         "the script with torchrun --nproc_per_node=N, which sets them, or unset "
                         "both to train in one process")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise SystemExit(f"error: WORLD_SIZE and RANK are set but {' and '.join(missing)} not: the "
                         "processes meet at MASTER_ADDR:MASTER_PORT. Start the script with "
                         "torchrun --nproc_per_node=N, which sets them all, or unset WORLD_SIZE "
                         "and RANK to train in one process")
    if int(world) > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:  # started by hand
        print(f"process {rank} of {world}: waiting at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']} for the other {int(world) - 1} (each started with "
              "its own RANK; torchrun starts them all)", file=sys.stderr, flush=True)


def end_distributed():
    """Leave the process group and free it now, so that its threads end before Python does.

    `destroy_process_group` only forgets the group: the group is freed, and its threads joined,
    once nothing holds it. Two things still do: DTensor, which FSDP's shards are, caches how it
    shards each operator it has seen, with the device mesh and through it the group; and a
    sharded model is a reference cycle (FSDP's state and its module point at each other), which
    only the garbage collector frees. A gloo group still alive when Python shuts down keeps its
    worker threads, and one that then releases a finished collective's tensors aborts the
    process ("terminate called without an active exception") after a run that succeeded.
    Called while an error propagates, it first lets go of the failed run's variables, which
    the error's traceback would keep until Python shuts down (the traceback still prints), and
    on NCCL it aborts the group rather than waiting for its queued work.
    """
    error = sys.exc_info()[1]
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    _clear_sharding_prop_cache()  # this thread's: 07-09 run no DTensor operator in another
    if error is not None and dist.get_backend() == "nccl":
        # failed, maybe alone: destroying would first wait for the queued collectives, which
        # the other processes may never join (until torchrun ends the job); aborting does not
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    gc.collect()  # the model's cycle, while Python can still run the group's threads to the end
