"""Run several scripts one after another as one process of a torchrun group, each writing its
record, with each collective waiting until gloo's worker thread has let go of its tensors.

  python -m torch.distributed.run --standalone --nproc_per_node=2 \\
      tests/support/sharded_runs.py OUT_DIR RUNS_JSON

RUNS_JSON is a list of [name, script id, argv]; each run writes its record in OUT_DIR/<name>/,
or, where the script stops on its own check, the words it stops with in OUT_DIR/<name>/stopped.txt;
each process writes OUT_DIR/<name>/rank<R>-steps.json: for each optimizer step, how many of its
tensors were empty, and how many of those came with a gradient.
One launch for several runs: starting torchrun and two Pythons is most of a small run's time.

Test-only changes, made from outside as the estimate does:
- Each run's process group meets under keys of its own in torchrun's store: a second group under
  the same keys reads the first one's addresses, gone with it.
- gloo runs each collective in a worker thread, which holds the collective's tensors, and a
  reduce-scatter's copy of its whole input (estimate/fake/patches.py), until it is done
  with its work: a moment after the call has returned, or at times some operations later, when
  the script has dropped them already. A storage then lives on into the next allocations, and a
  CPU run's tracked peak varies with the threads' timing by up to such a copy (one to four of
  the ten runs of tests/scripts/test_distributed.py's launch, in each of 3 launches, before it waited). Here
  each collective returns once the thread has let go of what it holds, so that it goes as the
  script drops it, in the script's own order.
"""
import itertools
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for steps.py
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest
import common.data  # noqa: E402
from conftest import SMALL_SNIPPET_SPLITS  # noqa: E402
from steps import STEPS, import_script  # noqa: E402

COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast",
               "all_to_all_single")
LET_GO_TIMEOUT = 30  # seconds a worker thread may take to let go of a finished collective's tensors


def storage_uses(tensor):
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class SeenInside(TorchDispatchMode):
    """Notes the tensors that operators take while a collective runs: gloo's copy of a
    reduce-scatter's input is taken apart (split) as its chunk is copied out."""

    def __init__(self):
        super().__init__()
        self.tensors = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.split.Tensor:
            self.tensors.append(args[0])
        return func(*args, **(kwargs or {}))


def wait_until(settled, what):
    deadline = time.monotonic() + LET_GO_TIMEOUT
    while not settled():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gloo's worker thread still holds {what} after {LET_GO_TIMEOUT} s")
        time.sleep(0.0002)  # (lets go of the GIL)


def letting_go(collective):
    """`collective`, waiting on return until gloo's worker thread holds none of its tensors."""
    def run(*args, **kwargs):
        if kwargs.get("async_op"):  # (none of the scripts' collectives is asynchronous)
            return collective(*args, **kwargs)
        given = [value for value in [*args, *kwargs.values()] if torch.is_tensor(value)]
        before = [(tensor, storage_uses(tensor)) for tensor in given]
        with SeenInside() as inside:
            result = collective(*args, **kwargs)
        wait_until(lambda: all(storage_uses(tensor) <= uses for tensor, uses in before),
                   f"the tensors given to {collective.__name__}")
        copies = inside.tensors
        inside.tensors = []
        wait_until(lambda: all(copy._use_count() == 1 for copy in copies),  # this list's own
                   f"{collective.__name__}'s own copies")
        return result
    run.__name__ = collective.__name__
    return run


@contextmanager
def groups_apart():
    """Each process group the scripts start (under torchrun) meets under its own keys."""
    original, started = dist.init_process_group, itertools.count()

    def init_process_group(*args, **kwargs):
        if "store" in kwargs:  # a group of one, its store its own
            return original(*args, **kwargs)
        store, rank, world_size = next(dist.rendezvous("env://"))
        return original(*args, store=dist.PrefixStore(f"run{next(started)}", store), rank=rank,
                        world_size=world_size, **kwargs)

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = original


@contextmanager
def collectives_letting_go():
    originals = {name: getattr(distributed_c10d, name) for name in COLLECTIVES}
    for name, collective in originals.items():
        setattr(distributed_c10d, name, letting_go(collective))
        setattr(dist, name, getattr(distributed_c10d, name))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(distributed_c10d, name, collective)
            setattr(dist, name, collective)


@contextmanager
def empty_tensors_noted(steps):
    """Notes, for each optimizer step, [empty tensors, empty tensors with a gradient] among
    those it steps: a process's shard of a weight with fewer rows than processes is empty."""
    def note(optimizer, args, kwargs):
        params = [param for group in optimizer.param_groups for param in group["params"]]
        empty = [param for param in params if param.numel() == 0]
        steps.append([len(empty), sum(param.grad is not None for param in empty)])

    handle = register_optimizer_step_pre_hook(note)
    try:
        yield
    finally:
        handle.remove()


def main():
    out_dir, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    common.data.SNIPPET_SPLITS = SMALL_SNIPPET_SPLITS  # tiny-text: quick evaluations
    with groups_apart(), collectives_letting_go():
        for name, step, argv in runs:
            steps = []
            try:
                with empty_tensors_noted(steps):
                    import_script(STEPS[step].path).main([*argv, "--results-dir", str(out_dir / name)])
            except SystemExit as stop:  # the script's own check (10's refusals): its words
                (out_dir / name).mkdir(parents=True, exist_ok=True)
                (out_dir / name / "stopped.txt").write_text(str(stop.code))
            (out_dir / name).mkdir(parents=True, exist_ok=True)
            (out_dir / name / f"rank{os.environ['RANK']}-steps.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
