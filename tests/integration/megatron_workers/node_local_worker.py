"""One rank of the Megatron node-local tests (tests/integration/test_node_local.py, and with an
S3 tier behind the node-local one, test_tiers_node_local.py), in a mount namespace of its own
in which its node's directory is bound at the save path: a tiny megatron-core GPT at TP=2 on
two nodes of one rank each, saved with ``node_local``.

``save``: train, save iteration 2 and, after a step, iteration 3 (its state dumped as the
    reference), take one more step at once (the checkpoint must hold the pre-step values),
    close (with ``--url``: every node's leader drains, rank 0 commits the tier; the names each
    drained written out).
``load``: with ``--url``, restore from the tiers first (each node's leader brings every file of
    the newest checkpoint into its node's directory); load the iteration the tracker on this
    node names, and dump what was read.
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


def config(a) -> AsyncCheckpointConfig:
    tiers = [{"url": a.url, "endpoint_url": a.endpoint, "marker_timeout_s": 120}] if a.url else []
    return AsyncCheckpointConfig(enabled=True, mode="async", host_buffer_gb=0.25, writer_threads=2,
                                 fsync=False, node_local=True, keep_last=2, tiers=tiers)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=("save", "load"))
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--url", help="an S3 tier behind the node-local one")
    p.add_argument("--endpoint", help="the S3 tier's endpoint_url")
    a = p.parse_args()
    r = Rank(2, 1)
    if a.action == "save":
        ckpt = MegatronCheckpointer(config(a))
        r.train_step()
        r.train_step()
        ckpt.save(r.state(), a.ckpt, r.iteration, content_metadata=r.metadata)
        r.train_step([ckpt])
        r.dump(a.out, "reference")
        ckpt.save(r.state(), a.ckpt, r.iteration, content_metadata=r.metadata)
        r.train_step([ckpt])  # the async copies must come before this step changes the weights
        tiers = ckpt.checkpointer.tiers
        ckpt.close()
        if tiers is not None:
            with open(os.path.join(a.out, f"drained.rank{r.rank}.json"), "w", encoding="utf-8") as f:
                json.dump({"drained": tiers.drainers[0].drained, "failures": tiers.drainers[0].failures}, f)
    else:
        reader = MegatronCheckpointer(config(a))
        if a.url:
            reader.restore(a.ckpt)
        iteration = read_tracker(a.ckpt)
        read = r.load_into_model(checkpoint_dir(a.ckpt, iteration), reader.load)
        r.dump(a.out, "reloaded", read=read, extra={"tracker": iteration})
        reader.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
