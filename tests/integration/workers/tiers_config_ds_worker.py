"""One DeepSpeed rank for the tier-config tests (``tests/integration/test_tiers_deepspeed_config.py``).

Phases:
  secret  train and save twice into --out/ckpt with an S3 tier whose ``endpoint_url`` holds a
          user name and password (--endpoint), DeepSpeed's and this package's logs at INFO and
          DeepSpeed's dump_state on (it then logs its whole config, and every attribute of its
          engine); close, so the last drain ends. With --disabled, the same config with
          ``enabled: false``: DeepSpeed's own checkpoint engine saves, nothing is drained.
  apart   for each tier URL given (--tier, repeated), build an engine with that one path tier
          and call save_checkpoint and load_checkpoint on --out/ckpt; write each call's error
          to --out/apart.json.
"""

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_worker import init, train  # noqa: E402


def config(tier, dump_state=False, enabled=True):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "dump_state": dump_state,  # DeepSpeed then logs every attribute of its engine, its config too
        "async_checkpoint": {"enabled": enabled, "host_buffer_gb": 0.05, "keep_last": 2, "tiers": [tier]},
    }


def phase_secret(args, save_dir):
    from deepspeed.utils.logging import set_log_level_from_string

    logging.basicConfig(level=logging.INFO)
    set_log_level_from_string("info")
    tier = {"url": args.url, "endpoint_url": args.endpoint, "keep_last": 2}
    engine = init(args, config(tier, dump_state=True, enabled=not args.disabled))
    for step in range(2):
        train(engine, args, 1, start=step)
        engine.save_checkpoint(save_dir)
    if args.disabled:
        with open(os.path.join(args.out, "engine.json"), "w") as f:
            json.dump(type(engine.checkpoint_engine).__name__, f)
        engine.destroy()
        return
    engine.checkpoint_engine.cleanup()  # close: the last drain finishes
    drained = engine.checkpoint_engine.checkpointer.tiers.drainers[0].drained
    engine.destroy()
    with open(os.path.join(args.out, "drained.json"), "w") as f:
        json.dump(drained, f)


def phase_apart(args, save_dir):
    from deepspeed_async_ckpt.errors import ConfigError

    errors = {}
    for url in args.tier:
        engine = init(args, config({"url": url}))
        for call in ("save_checkpoint", "load_checkpoint"):
            try:
                getattr(engine, call)(save_dir)
                errors[f"{url} {call}"] = None
            except ConfigError as exc:
                errors[f"{url} {call}"] = str(exc)
        engine.checkpoint_engine.cleanup()
        engine.destroy()
    with open(os.path.join(args.out, "apart.json"), "w") as f:
        json.dump(errors, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["secret", "apart"])
    p.add_argument("--out", required=True)
    p.add_argument("--url")
    p.add_argument("--endpoint")
    p.add_argument("--tier", action="append", default=[])
    p.add_argument("--disabled", action="store_true")
    args = p.parse_args()
    args.zero_stage, args.pipeline_stages, args.tied, args.offload = 1, 0, 0, 0
    save_dir = os.path.join(args.out, "ckpt")
    (phase_secret if args.phase == "secret" else phase_apart)(args, save_dir)


if __name__ == "__main__":
    main()
