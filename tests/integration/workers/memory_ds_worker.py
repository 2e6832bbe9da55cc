"""A DeepSpeed rank for the memory tier's load test: ``save`` trains and saves three
checkpoints into the checkpoint directory, dumping the state after each
(``saved_rank<r>_step<n>.pt``); ``resume`` loads from the same save directory with the memory
tier on and dumps the state it loaded (``loaded_rank<r>.pt``) and the path it was given."""

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_worker import init, state_of, train  # noqa: E402


def config():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "async_checkpoint": {"enabled": True, "host_buffer_gb": 0.05, "keep_last": 3},
    }


def main():
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "resume"])
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default=None)
    args = p.parse_args()
    args.zero_stage, args.pipeline_stages, args.tied, args.offload = 1, 0, 0, 0
    cfg = config()
    if args.phase == "resume":  # the memory tier on for the restart's load
        cfg["async_checkpoint"]["memory"] = {"enabled": True, "idle_timeout_s": 120}
    engine = init(args, cfg)
    rank = torch.distributed.get_rank()
    save_dir = os.path.join(args.out, "ckpt")
    if args.phase == "save":
        for step in range(3):
            train(engine, args, 1, start=step)
            engine.save_checkpoint(save_dir)
            torch.save(state_of(engine), os.path.join(args.out, f"saved_rank{rank}_step{step + 1}.pt"))
    else:
        path, _ = engine.load_checkpoint(save_dir, tag=args.tag)
        assert path is not None, "nothing loaded"
        torch.save(state_of(engine), os.path.join(args.out, f"loaded_rank{rank}.pt"))
        with open(os.path.join(args.out, f"loaded_path_rank{rank}.txt"), "w") as f:
            f.write(path)
    engine.checkpoint_engine.cleanup()
    engine.destroy()


if __name__ == "__main__":
    main()
