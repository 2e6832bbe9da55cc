"""One DeepSpeed rank of the node-local tests (tests/integration/test_node_local.py, and with an
S3 tier behind the node-local one, test_tiers_node_local.py), in a mount namespace of its own in
which its node's directory is bound at the checkpoint path: ranks of one node share that
directory, no directory is shared by all.

Phases:
  save  ``checkpoint.use_node_local_storage`` (with ``--url``: and an S3 tier): train, save
        ``s1``, train, save ``s2`` and dump this rank's state as saved, train on (mutating every
        tensor), destroy (which flushes: ``s2`` committed on every node, then drained by every
        node's leader); this rank's save history, and a leader's drained names, written out.
  load  in a fresh process (after the test took a node's disk away, if it did):
        ``load_checkpoint`` (which restores from the tiers first) and dump the state loaded.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_worker import dump_engine_state, ds_config, init, train  # noqa: E402


def config(args):
    engine = {"enabled": True, "host_buffer_gb": 0.05, "writer_threads": 2, "keep_last": 2}
    if args.url:
        engine["tiers"] = [{"url": args.url, "endpoint_url": args.endpoint, "keep_last": 2,
                            "marker_timeout_s": 120}]
    cfg = ds_config(args, engine)
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
    train(engine, args, 1, start=3)
    drainers = ckpt.tiers.drainers if ckpt.tiers is not None else []
    engine.destroy()  # closes the checkpointer: its last drain finishes first
    with open(os.path.join(args.out, f"saved_rank{rank}.json"), "w") as f:
        json.dump({"history": [h.tag for h in ckpt.history],
                   "errors": [repr(h.error) for h in ckpt.history if h.error is not None]}, f)
    if drainers:
        with open(os.path.join(args.out, f"drained_rank{rank}.json"), "w") as f:
            json.dump({"drained": drainers[0].drained, "failures": drainers[0].failures}, f)


def phase_load(args):
    engine = init(args, config(args))
    rank = torch.distributed.get_rank()
    path, _ = engine.load_checkpoint(args.ckpt)
    assert path is not None, "nothing loaded"
    dump_engine_state(engine, os.path.join(args.out, f"loaded_rank{rank}.pt"))
    with open(os.path.join(args.out, f"loaded_rank{rank}.json"), "w") as f:
        json.dump({"path": path}, f)
    engine.destroy()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "load"])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--url", help="an S3 tier behind the node-local one")
    p.add_argument("--endpoint", help="the S3 tier's endpoint_url")
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--tied", type=int, default=0, help="the first two Linear layers share their weight")
    args = p.parse_args()
    args.bf16, args.offload, args.pipeline_stages = 0, 0, 0
    {"save": phase_save, "load": phase_load}[args.phase](args)


if __name__ == "__main__":
    main()
