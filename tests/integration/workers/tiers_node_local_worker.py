"""One DeepSpeed rank of the node-local + S3 tier test (tests/integration/test_tiers_node_local.py),
in a mount namespace of its own in which its node's directory is bound at the checkpoint path.

Phases:
  save    ``use_node_local_storage`` with an S3 tier behind it: train, save ``s1``, train, save
          ``s2`` and dump this rank's state as saved, train on, destroy (which flushes: ``s2``
          committed on every node, then drained by every node's leader); a leader writes the
          names its drainer drained.
  resume  in a fresh process (after the test took a node's disk away): ``load_checkpoint``,
          which restores from the tiers first, and dump the state loaded.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_worker import dump_engine_state, ds_config, init, train  # noqa: E402


def config(args):
    tier = {"url": args.url, "endpoint_url": args.endpoint, "keep_last": 2, "marker_timeout_s": 120}
    cfg = ds_config(args, {"enabled": True, "host_buffer_gb": 0.05, "writer_threads": 2,
                           "keep_last": 2, "tiers": [tier]})
    cfg["checkpoint"] = {"use_node_local_storage": True}
    return cfg


def phase_save(args):
    engine = init(args, config(args))
    rank = torch.distributed.get_rank()
    ckpt = engine.checkpoint_engine.checkpointer
    assert ckpt.config.node_local, "use_node_local_storage on 2 nodes must commit node-local"
    train(engine, args, 2)
    engine.save_checkpoint(args.ckpt, tag="s1")
    train(engine, args, 1, start=2)
    engine.save_checkpoint(args.ckpt, tag="s2")
    dump_engine_state(engine, os.path.join(args.out, f"saved_rank{rank}.pt"))
    train(engine, args, 1, start=3)
    drainers = ckpt.tiers.drainers
    engine.destroy()  # closes the checkpointer: its last drain finishes first
    if drainers:
        with open(os.path.join(args.out, f"drained_rank{rank}.json"), "w") as f:
            json.dump({"drained": drainers[0].drained, "failures": drainers[0].failures}, f)


def phase_resume(args):
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
    p.add_argument("phase", choices=["save", "resume"])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--tied", type=int, default=0, help="the first two Linear layers share their weight")
    args = p.parse_args()
    args.bf16, args.offload, args.pipeline_stages = 0, 0, 0
    {"save": phase_save, "resume": phase_resume}[args.phase](args)


if __name__ == "__main__":
    main()
