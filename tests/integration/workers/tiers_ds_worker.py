"""A DeepSpeed rank for the durable-tier test: ``save`` trains and saves into a first tier
with an S3 tier behind it, then dumps the state it saved; ``resume`` (after the test emptied
the first tier) loads from the same save directory and dumps the state it loaded. The state
after each save is dumped too (``saved_rank<r>_step<n>.pt``), for a resume that must fall back
to an older checkpoint."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_worker import init, state_of, train  # noqa: E402


def config(args):
    tier = {"url": args.url, "endpoint_url": args.endpoint, "keep_last": 2}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "async_checkpoint": {"enabled": True, "host_buffer_gb": 0.05, "keep_last": 1, "tiers": [tier]},
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "resume"])
    p.add_argument("--out", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--endpoint", required=True)
    args = p.parse_args()
    args.zero_stage, args.pipeline_stages, args.tied, args.offload = 1, 0, 0, 0
    engine = init(args, config(args))
    rank = torch.distributed.get_rank()
    save_dir = os.path.join(args.out, "ckpt")
    if args.phase == "save":
        for step in range(3):
            train(engine, args, 1, start=step)
            engine.save_checkpoint(save_dir)
            torch.save(state_of(engine), os.path.join(args.out, f"saved_rank{rank}_step{step + 1}.pt"))
        torch.save(state_of(engine), os.path.join(args.out, f"saved_rank{rank}.pt"))
        engine.checkpoint_engine.cleanup()  # close: the last drain finishes on rank 0
        if rank == 0:
            drainer = engine.checkpoint_engine.checkpointer.tiers.drainers[0]
            with open(os.path.join(args.out, "drained.json"), "w") as f:
                json.dump(drainer.drained, f)
    else:
        path, _ = engine.load_checkpoint(save_dir)
        assert path is not None, "nothing loaded"
        torch.save(state_of(engine), os.path.join(args.out, f"loaded_rank{rank}.pt"))
        engine.checkpoint_engine.cleanup()
    engine.destroy()


if __name__ == "__main__":
    main()
