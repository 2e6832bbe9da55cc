"""One rank: a committed checkpoint whose ``.metadata`` is then cut in half, checked as a load
of some of it does (``MegatronCheckpointer.load``, and ``verify_checkpoint_dir`` with a
request or a skip) and in full. Prints one JSON line: each check's error."""

import json
import os
import sys
import tempfile

import _one_megatron_rank  # noqa: F401  (first: the process group, the shim, parallel state)
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from megatron_adapter.checkpointer import MegatronCheckpointer, checkpoint_dir, verify_checkpoint_dir


def error_of(check) -> str | None:
    try:
        check()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


ckpt = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01, fsync=False))
save_dir = tempfile.mkdtemp()
ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=0)}, save_dir, 1)
d = checkpoint_dir(save_dir, 1)
metadata = os.path.join(d, ".metadata")
os.truncate(metadata, os.path.getsize(metadata) // 2)
request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4), replica_id=0)}
print(json.dumps({"load": error_of(lambda: ckpt.load(request, d)),
                  "skip": error_of(lambda: verify_checkpoint_dir(d, skip=("optimizer",))),
                  "full": error_of(lambda: verify_checkpoint_dir(d)), "dir": d}))
sys.stdout.flush()
os._exit(0)
