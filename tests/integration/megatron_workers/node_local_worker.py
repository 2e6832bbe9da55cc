"""One rank of the Megatron node-local test, in a mount namespace of its own in which its
node's directory is bound at the save path (tests/integration/test_node_local.py): a tiny
megatron-core GPT at TP=2 on two nodes of one rank each, saved with ``node_local``.

``save``: train, save iteration 2 and, after a step, iteration 3 (its state dumped as the
    reference), take one more step at once (the checkpoint must hold the pre-step values), close.
``load``: load the iteration the tracker on this node names, and dump what was read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_worker import Rank  # noqa: E402

import torch.distributed as dist  # noqa: E402

from deepspeed_async_ckpt.config import AsyncCheckpointConfig  # noqa: E402
from megatron_adapter.checkpointer import MegatronCheckpointer, checkpoint_dir, read_tracker  # noqa: E402


def config() -> AsyncCheckpointConfig:
    return AsyncCheckpointConfig(enabled=True, mode="async", host_buffer_gb=0.25, writer_threads=2,
                                 fsync=False, node_local=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=("save", "load"))
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    r = Rank(2, 1)
    if a.action == "save":
        ckpt = MegatronCheckpointer(config())
        r.train_step()
        r.train_step()
        ckpt.save(r.state(), a.ckpt, r.iteration, content_metadata=r.metadata)
        r.train_step([ckpt])
        r.dump(a.out, "reference")
        ckpt.save(r.state(), a.ckpt, r.iteration, content_metadata=r.metadata)
        r.train_step([ckpt])  # the async copies must come before this step changes the weights
        ckpt.close()
    else:
        reader = MegatronCheckpointer(config())
        iteration = read_tracker(a.ckpt)
        read = r.load_into_model(checkpoint_dir(a.ckpt, iteration), reader.load)
        r.dump(a.out, "reloaded", read=read, extra={"tracker": iteration})
        reader.close()
    with open(os.path.join(a.out, f"{a.action}.done.rank{r.rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": r.rank}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
