"""Under torchrun on GPUs: build a sharded model as 07 does (meta device, fully_shard, then
fill_shards over NCCL) and write whether every whole parameter, gathered back, equals the model
create_model builds on the CPU from the same seed.

  python -m torch.distributed.run --standalone --nproc_per_node=2 tests/support/nccl_fill_probe.py OUT
  (a second argument, cpu, runs it on gloo: a check of the probe itself)
"""
import json
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.distributed import end_distributed, init_distributed  # noqa: E402
from common.model import create_model, fill_shards, transformer_blocks  # noqa: E402
from common.presets import PRESETS  # noqa: E402

rank, world_size, device = init_distributed(torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda"))
try:
    preset = PRESETS["tiny"]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = create_model(preset, dtype=torch.bfloat16)
    mesh = init_device_mesh(device.type, (world_size,))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fill_shards(model, preset, device)  # process 0 builds the host copy after its own seed
    whole = {name: param.full_tensor().cpu() for name, param in model.named_parameters()}
    torch.manual_seed(0)
    expected = create_model(preset, dtype=torch.bfloat16)
    equal = {name: torch.equal(whole[name], param) for name, param in expected.named_parameters()}
    local_on_device = all(param.to_local().device.type == device.type  # on the device
                       for param in model.parameters())
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
        {"equal": equal, "local_on_device": local_on_device}))
finally:
    end_distributed()
