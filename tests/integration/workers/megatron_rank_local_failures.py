"""Two ranks (``scripts/launch.py``): saves that fail on rank 1 alone before any collective of
theirs, then saves with an iteration that is no integer, a balanced writer election rank 1
cannot take part in, then a valid async save and ``close()``. Argument: an output directory; each rank writes ``rank<N>.json`` with each failed
save's error, and what it sees of the last checkpoint right after ``close()`` returned.
A rank left waiting in a collective never writes it (the launcher's deadline kills it)."""

import json
import os
import sys

import _megatron_rank  # noqa: F401  (first: the process group, the shim, parallel state)
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from megatron_adapter.checkpointer import MegatronCheckpointer, checkpoint_dir, read_tracker

out = sys.argv[1]
rank = dist.get_rank()
save_dir = os.path.join(out, "ckpt")


def weight():
    return ShardedTensor.from_rank_offsets("w", torch.full((4,), 7.0), (0, rank, 2))


def failing_factory():
    def build(key, t, replica_id, flattened_range=None):
        if rank == 1:
            raise RuntimeError("factory failed on rank 1")
        return ShardedTensor.from_rank_offsets(key, t, (0, rank, 2))
    return {"w": weight(), "f": ShardedTensorFactory("f", torch.ones(4), build, lambda x: x, replica_id=0)}


def unpicklable_common():  # rank 0's (what the validation broadcasts from it)
    import threading

    return {"w": weight(), "x": threading.Lock() if rank == 0 else 1}


def unpicklable_object():
    payload = {"ok": 1} if rank == 0 else {"bad": lambda: 0}
    return {"w": weight(), "obj": ShardedObject("obj", payload, (2,), (rank,), replica_id=0)}


ckpt = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, mode="async", host_buffer_gb=0.01))
result = {}
cases = [("factory_validated", failing_factory, 1, True), ("factory", failing_factory, 1, False),
         ("object", unpicklable_object, 1, True), ("common", unpicklable_common, 1, True),
         ("iteration_true", lambda: {"w": weight()}, True, True),
         ("iteration_tensor", lambda: {"w": weight()}, torch.tensor(6), True)]
for case, state, iteration, validate in cases:
    try:
        ckpt.save(state(), save_dir, iteration, validate_access_integrity=validate)
        result[case] = None
    except Exception as exc:
        result[case] = f"{type(exc).__name__}: {exc}"
# balanced writers: a rank that cannot list its shards for the election fails it on every rank
balanced = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, mode="async", host_buffer_gb=0.01),
                                writers="balanced")
listed = ShardedTensor.without_data


def unlisted(self):
    raise RuntimeError("cannot list its shards on rank 1")


ShardedTensor.without_data = unlisted if rank == 1 else listed
try:
    balanced.save({"w": weight()}, os.path.join(out, "balanced"), 1, validate_access_integrity=False)
    result["election"] = None
except Exception as exc:
    result["election"] = f"{type(exc).__name__}: {exc}"
finally:
    ShardedTensor.without_data = listed
balanced.close()
ckpt.save({"w": weight()}, save_dir, 4)
ckpt.close()  # collective: rank 0 has moved the tracker when it returns, on every rank
result["tracker"] = read_tracker(save_dir)
result["metadata"] = os.path.exists(os.path.join(checkpoint_dir(save_dir, 4), "metadata.json"))
with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
    json.dump(result, f)
os._exit(0)  # before interpreter teardown (see megatron_invalid_sharding.py)
