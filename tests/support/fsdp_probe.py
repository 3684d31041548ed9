"""Run a numbered FSDP step as one process of a group, in float32, noting what the process holds.

  python -m torch.distributed.run --standalone --nproc_per_node=2 \\
      tests/support/fsdp_probe.py OUT_DIR 07 --max-steps 3 ...
  python -m torch.distributed.run ... tests/support/fsdp_probe.py --runs RUNS_JSON

(RUNS_JSON: a list of [OUT_DIR, script id, argv], run one after another in one launch.)

Test-only changes, made from outside as the memory estimator does: the script's DTYPE becomes
float32 (so that runs can be compared closely), and its train_step is wrapped to note, before
every step, this process's batch (size and a fingerprint), the size of its shard of each
parameter, where parameters and optimizer state live and FSDP's offload setting; in the
optimizer step, where the gradients live; after the first forward, which FSDP unit holds the token
embeddings and whether they are gathered; at the end, how many graphs torch.compile made. It
copies the gradients of the first step the memory meter does not watch, so that the copy stays
out of the measured peak (the run needs --max-steps above common.memory.TRACKED_STEPS). Each
process writes OUT_DIR/rank<N>.json and OUT_DIR/grads_rank<N>.pt.
"""
import json
import os
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for common/
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest
import common.data  # noqa: E402
from common.memory import TRACKED_STEPS  # noqa: E402
from conftest import SMALL_SNIPPET_SPLITS, load_script  # noqa: E402


def local(tensor):
    """This process's part of a sharded tensor (the tensor itself if it is not sharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def device_types(tensors):
    return sorted({tensor.device.type for tensor in tensors})


def offload_settings(model):
    """(offloaded to CPU, pinned) as FSDP holds them for each parameter (private FSDP2 state)."""
    return sorted({(fsdp_param.offload_to_cpu, fsdp_param.pin_memory)
                   for module in model.modules() if isinstance(module, FSDPModule)
                   for fsdp_param in module._get_fsdp_state()._fsdp_param_group.fsdp_params})


class Probe:
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.notes = {"between_steps": [], "in_optimizer_step": [], "batches": []}
        self.gradients = None

    def watch(self, train_step):
        def watched_train_step(model, optimizer, *args, **kwargs):
            if not self.notes["between_steps"]:
                self.first_look(model, optimizer)
            # the batch: 07-09's (inputs, labels, ...), 10's (scaler, inputs, labels, ...)
            inputs, labels = next((args[at], args[at + 1]) for at in range(len(args))
                                  if isinstance(args[at], dict))
            self.notes["batches"].append({"size": len(labels), "input_sum": sum(
                tensor.double().sum().item() for tensor in inputs.values())})
            state = [value for stepped in getattr(optimizer, "stepped", [optimizer])
                     for per_parameter in stepped.state.values()
                     for value in per_parameter.values() if torch.is_tensor(value)]
            self.notes["between_steps"].append({
                "parameters": device_types(local(p) for p in model.parameters()),
                "optimizer_state": device_types(state)})
            return train_step(model, optimizer, *args, **kwargs)
        return watched_train_step

    def first_look(self, model, optimizer):
        self.notes["shards"] = {name: [local(p).numel(), p.numel(), p.shape[0] if p.dim() else 1]
                                for name, p in model.named_parameters()}
        self.notes["offload"] = offload_settings(model)
        names = {p: name for name, p in model.named_parameters()}

        def in_optimizer_step(optimizer, args, kwargs):
            gradients = {names[p]: local(p.grad) for group in optimizer.param_groups
                         for p in group["params"] if p.grad is not None}
            self.notes["in_optimizer_step"].append({
                "gradients": device_types(gradients.values()), "gradient_count": len(gradients)})
            if len(self.notes["in_optimizer_step"]) == TRACKED_STEPS + 1:
                self.gradients = {name: grad.detach().clone() for name, grad in gradients.items()}
        for stepped in getattr(optimizer, "stepped", [optimizer]):  # 10's: the optimizers it steps
            stepped.register_step_pre_hook(in_optimizer_step)
        self.watch_embeddings(model)

    def watch_embeddings(self, model):
        """Note, once the first forward has returned (the root's own post-forward run), whether
        the token embeddings are tied to the output layer, an FSDP unit of their own, held by the
        root's unit, and still gathered (a plain tensor, not this process's DTensor shard)."""
        try:
            embeddings = model.get_input_embeddings()
        except NotImplementedError:  # a model without them
            return
        if not isinstance(embeddings, torch.nn.Embedding):  # ViT's patch projection
            return

        def after_forward(module, args, output):
            head = model.get_output_embeddings()
            root = model._get_fsdp_state()._fsdp_param_group
            self.notes["embeddings_after_forward"] = {
                "tied": head is not None and head.weight is embeddings.weight,
                "own_unit": isinstance(embeddings, FSDPModule),
                "in_root": any(embeddings in (param._module_info.module, *param._module_info.shared_modules)
                               for param in root.fsdp_params),
                "gathered": not isinstance(embeddings.weight, DTensor)}
            handle.remove()
        handle = model.register_forward_hook(after_forward)

    def write(self, rank):
        self.notes["compiled_graphs"] = counters["stats"]["unique_graphs"]  # under --compile
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{rank}.json").write_text(json.dumps(self.notes))
        torch.save(self.gradients, self.out_dir / f"grads_rank{rank}.pt")


def probed(out_dir, name, argv):
    script = load_script(name)
    script.DTYPE = torch.float32
    probe = Probe(out_dir)
    script.train_step = probe.watch(script.train_step)
    script.main(argv)
    probe.write(rank=int(os.environ.get("RANK", 0)))  # torchrun's; the group is gone by now


def main():
    common.data.SNIPPET_SPLITS = SMALL_SNIPPET_SPLITS  # tiny-text: quick evaluations
    if sys.argv[1] == "--runs":  # several in one launch, each group under keys of its own
        from sharded_runs import groups_apart
        with groups_apart():
            for out_dir, name, argv in json.loads(Path(sys.argv[2]).read_text()):
                probed(Path(out_dir), name, argv)
    else:
        probed(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])


if __name__ == "__main__":
    main()
