"""One rank of the node-local storage tests, run in a mount namespace of its own in which its
node's directory is bound at the checkpoint path (tests/integration/test_node_local.py):
ranks of one node share that directory, no directory is shared by all.

Phases:
  save  DeepSpeed with ``checkpoint.use_node_local_storage``: train, save ``s1``, train, save
        ``s2`` and dump this rank's state as saved, train on (mutating every tensor), destroy
        (which flushes: ``s2`` committed on every node).
  load  in a fresh process: ``load_checkpoint`` (the tag ``latest`` names on this node) and
        dump the restored state.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_worker import dump_engine_state, ds_config, init, train  # noqa: E402


def config(args):
    cfg = ds_config(args, {"enabled": True, "host_buffer_gb": 0.05, "writer_threads": 2})
    cfg["checkpoint"] = {"use_node_local_storage": True}
    return cfg


def phase_save(args):
    engine = init(args, config(args))
    rank = torch.distributed.get_rank()
    ckpt = engine.checkpoint_engine.checkpointer
    assert ckpt.config.node_local, "use_node_local_storage on 2 nodes must commit node-local"
    train(engine, args, 2)
    engine.save_checkpoint(args.ckpt, tag="s1")
    ckpt.wait()  # s1 committed on this node (its leader), or this rank's part persisted
    train(engine, args, 1, start=2)
    engine.save_checkpoint(args.ckpt, tag="s2")
    dump_engine_state(engine, os.path.join(args.out, f"saved_rank{rank}.pt"))
    train(engine, args, 2, start=3)
    engine.destroy()
    with open(os.path.join(args.out, f"saved_rank{rank}.json"), "w") as f:
        json.dump({"history": [h.tag for h in ckpt.history],
                   "errors": [repr(h.error) for h in ckpt.history if h.error is not None]}, f)


def phase_load(args):
    engine = init(args, config(args))
    rank = torch.distributed.get_rank()
    path, _ = engine.load_checkpoint(args.ckpt)
    assert path is not None
    dump_engine_state(engine, os.path.join(args.out, f"loaded_rank{rank}.pt"))
    with open(os.path.join(args.out, f"loaded_rank{rank}.json"), "w") as f:
        json.dump({"path": path}, f)
    engine.destroy()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "load"])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--tied", type=int, default=0, help="the first two Linear layers share their weight")
    args = p.parse_args()
    args.bf16, args.offload, args.pipeline_stages = 0, 0, 0
    {"save": phase_save, "load": phase_load}[args.phase](args)


if __name__ == "__main__":
    main()
