"""One rank of the DeepSpeed tests of what load_checkpoint and save_checkpoint refuse
(started by scripts/launch.py), ZeRO-1:

  missing-tag     save and commit one checkpoint; then `latest` names a tag that does not
                  exist, and an explicit tag= names another: each load_checkpoint must be
                  refused on every rank, naming the directory; with `latest` put back, it loads.
  pool-too-small  a model whose flat fp32 partition is larger than host_buffer_gb's pool: the
                  first save_checkpoint must be refused on every rank, naming the record, before
                  anything is staged; training goes on, and nothing is committed.

Each rank writes what it saw to --out/<phase>_rank<N>.json for the test module.
"""

import argparse
import json
import os
import sys

import torch

from ds_worker import ds_config, error_of, read_latest, save_committed  # noqa: E402 (tests/workers)


def init(args, config, hidden):
    import deepspeed
    from deepspeed_async_ckpt.bench.model import build_model

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = build_model(hidden, 3)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, args, steps, start=0):
    from deepspeed_async_ckpt.bench.model import batch

    rank = torch.distributed.get_rank()
    for step in range(start, start + steps):
        x, y = batch(step, rank, 2, args.hidden, torch.float32)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def phase_missing_tag(args):
    args.hidden = 64
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05}), args.hidden)
    rank = torch.distributed.get_rank()
    save_dir = os.path.join(args.out, "ckpt")
    train(engine, args, 1)
    result = {"rank": rank, "committed": save_committed(engine, save_dir, "global_step1")}
    torch.distributed.barrier()  # every rank has read `latest` before rank 0 rewrites it
    if rank == 0:
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write("global_step999")
    torch.distributed.barrier()
    result["from_latest"] = error_of(lambda: engine.load_checkpoint(save_dir))
    result["explicit_tag"] = error_of(lambda: engine.load_checkpoint(save_dir, tag="global_step7"))
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write("global_step1")
    torch.distributed.barrier()
    path, _ = engine.load_checkpoint(save_dir)  # nothing left pending: it loads
    result["loaded"] = os.path.relpath(path, save_dir) if path else None
    result["latest"] = read_latest(save_dir)
    engine.destroy()
    with open(os.path.join(args.out, f"missing_tag_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def phase_pool_too_small(args):
    # 3 x (1024 x 1024) weights: an fp32 flat partition of ~6.3 MB per rank (ZeRO-1, 2 ranks),
    # more than the 4.3 MB pool; each weight (4.2 MB, in the model states) fits it
    args.hidden = 1024
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.004}), args.hidden)
    rank = torch.distributed.get_rank()
    save_dir = os.path.join(args.out, "ckpt")
    train(engine, args, 1)
    result = {"rank": rank, "raised": error_of(lambda: engine.save_checkpoint(save_dir))}
    ckpt = engine.checkpoint_engine.checkpointer
    result["staged_bytes"] = ckpt._files.stager.staged_bytes
    train(engine, args, 1, start=1)  # the next steps' fences find nothing failed
    result["raised_again"] = error_of(lambda: engine.save_checkpoint(save_dir))
    result["waited"] = error_of(ckpt.wait)
    torch.distributed.barrier()
    result["latest_exists"] = os.path.exists(os.path.join(save_dir, "latest"))
    engine.destroy()
    with open(os.path.join(args.out, f"pool_too_small_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["missing-tag", "pool-too-small"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.zero_stage, args.bf16, args.pipeline_stages = 1, 0, 0
    {"missing-tag": phase_missing_tag, "pool-too-small": phase_pool_too_small}[args.phase](args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as ds_worker's phases that end with destroy(): skip gloo's finalization


if __name__ == "__main__":
    main()
