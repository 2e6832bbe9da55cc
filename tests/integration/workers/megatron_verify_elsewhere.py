"""Two ranks (``scripts/launch.py``): two committed Megatron checkpoints, then each rank checks
a different one, as ranks that read the tracker on either side of a commit would. Argument:
an output directory; each rank writes ``rank<N>.json`` with the error it got."""

import json
import os
import sys

import _megatron_rank  # noqa: F401  (first: the process group, the shim, parallel state)
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from megatron_adapter.checkpointer import MegatronCheckpointer, checkpoint_dir, verify_checkpoint_dir

out = sys.argv[1]
rank = dist.get_rank()
ckpt = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01, fsync=False))
save_dir = os.path.join(out, "ckpt")
for iteration in (1, 2):
    ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(iteration)), replica_id=rank)},
              save_dir, iteration)
ckpt.close()
result = {}
try:
    verify_checkpoint_dir(checkpoint_dir(save_dir, 1 + rank), rank=rank, world_size=2)
    result["error"] = None
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
    json.dump(result, f)
# All written: leave before interpreter teardown, where a gloo worker thread can abort the
# process ("terminate called without an active exception"; README, "CPU and CI").
os._exit(0)
