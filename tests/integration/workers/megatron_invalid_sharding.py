"""Two ranks (``scripts/launch.py``): saves whose sharding megatron-core's validation refuses,
on rank 0 only, then a valid one. Argument: an output directory; each rank writes
``rank<N>.json`` with each invalid save's error, and the iteration the tracker names after
the valid save; rank 0 also whether rank 1 had raised while rank 0, having raised, was still
outside any collective (``peer_raised_first``)."""

import json
import os
import sys
import time

import _megatron_rank  # noqa: F401  (first: the process group, the shim, parallel state)
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from megatron_adapter.checkpointer import MegatronCheckpointer, read_tracker

out = sys.argv[1]
rank = dist.get_rank()
ckpt = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01, fsync=False))
save_dir = os.path.join(out, "ckpt")
result = {}
# both ranks hold the main replica of the same whole tensor; then neither does
for iteration, (case, replica_id) in enumerate((("two_main_replicas", 0), ("no_main_replica", 1)), 1):
    raised = os.path.join(out, f"rank1_raised_{case}")
    try:
        ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=replica_id)},
                  save_dir, iteration)
        result[case] = {"error": None}
    except Exception as exc:
        result[case] = {"error": f"{type(exc).__name__}: {exc}"}
        if rank == 1:
            open(raised, "w").close()
    if rank == 0 and result[case]["error"] is not None:
        # a trainer that reports the error and goes on, outside any collective: rank 1 must
        # raise too, not wait in plan_save's collective for as long as rank 0 lives
        deadline = time.monotonic() + 60
        while not os.path.exists(raised) and time.monotonic() < deadline:
            time.sleep(0.01)
        result[case]["peer_raised_first"] = os.path.exists(raised)
    dist.barrier()  # the next case starts together
ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=rank)}, save_dir, 3)
ckpt.close()
result["tracker"] = read_tracker(save_dir)
with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
    json.dump(result, f)
# All written: leave before interpreter teardown, where a gloo worker thread can abort the
# process ("terminate called without an active exception"; README, "CPU and CI").
os._exit(0)
