"""One rank: ``MegatronCheckpointer(on_saved=...)`` with a slow callback, two async saves, then
``close()`` at once. Prints one JSON line: each callback's start and end, with its thread."""

import json
import os
import sys
import tempfile
import threading
import time

import _one_megatron_rank  # noqa: F401  (first: the process group, the shim, parallel state)
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from megatron_adapter.checkpointer import MegatronCheckpointer, read_tracker

events = []


def on_saved(iteration, info):
    events.append(["start", iteration, threading.current_thread().name])
    time.sleep(0.5 if iteration == 1 else 0.0)  # an upload of the first checkpoint, say
    events.append(["end", iteration, threading.current_thread().name, os.path.isdir(info.ckpt_dir)])


ckpt = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, fsync=False,
                                                  keep_last=1), on_saved=on_saved)
save_dir = tempfile.mkdtemp()
for iteration in (1, 2):
    ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(iteration)), replica_id=0)},
              save_dir, iteration)
    ckpt.fence()
ckpt.close()
print(json.dumps({"events": events, "tracker": read_tracker(save_dir)}))
sys.stdout.flush()
os._exit(0)
