"""One rank: an async save whose file is held open-pending until ``wait(timeout=0.5)`` has
returned (so a wait that ignores its timeout never sees it commit), then that wait. Prints one
JSON line: wait's error and how long it took."""

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
from deepspeed_async_ckpt.storage import LocalStorage
from megatron_adapter.checkpointer import MegatronCheckpointer


waited = threading.Event()  # set once wait() has returned or raised


class SlowStorage(LocalStorage):
    def open_write(self, path):
        waited.wait(60)  # a wait without a bound returns after 60 s, without an error
        return super().open_write(path)


ckpt = MegatronCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, fsync=False),
                            storage=SlowStorage(fsync=False))
ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), replica_id=0)}, tempfile.mkdtemp(), 1)
t0 = time.monotonic()
try:
    ckpt.wait(timeout=0.5)
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
seconds = time.monotonic() - t0
waited.set()
ckpt.close()
print(json.dumps({"error": error, "seconds": seconds}))
sys.stdout.flush()
# All written: leave before interpreter teardown, where a gloo worker thread can abort the
# process ("terminate called without an active exception"; README, "CPU and CI").
os._exit(0)
