"""A short, real DeepSpeed training run that checkpoints every K steps and can resume.

Run one process per rank (``scripts/launch.py`` or ``deepspeed``/``torchrun``); on CPU set
``DS_ACCELERATOR=cpu``. The checkpoint engine is chosen by the DeepSpeed config alone: with the
``"async_checkpoint"`` key this package's engine runs, without it DeepSpeed's
``TorchCheckpointEngine`` does. No code here refers to this package's engine (the flags' types
are its launcher's).

Writes one JSON line per event to ``--log`` (step losses, per-checkpoint blocking time), so
tests and the demo can compare runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
from deepspeed_async_ckpt.bench.model import batch, build_model  # noqa: E402
from deepspeed_async_ckpt.commit.nodes import node_of  # noqa: E402
from deepspeed_async_ckpt.tools.launch import NON_NEGATIVE, POSITIVE, _seconds  # noqa: E402


def _fence_wait_s(engine) -> float:
    """Time the last save made the optimizer step wait (0 for engines without a fence)."""
    history = getattr(getattr(engine.checkpoint_engine, "checkpointer", None), "history", None)
    return history[-1].fence_wait_s if history else 0.0


#: Exit code of a rank whose ``--kill-at-step`` found no committed checkpoint in time.
EXIT_NO_COMMIT = 3


def wait_for_pointer(save_dir: str, timeout_s: float) -> bool:
    """Whether DeepSpeed's ``latest`` pointer exists in ``save_dir``, waiting up to ``timeout_s``
    seconds for it. An async save commits in the background, and its pointer is written last
    (atomically, after every rank persisted): once it exists, a checkpoint is loadable."""
    deadline = time.monotonic() + timeout_s
    pointer = os.path.join(save_dir, "latest")
    while not os.path.isfile(pointer):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for_memory(save_dir: str, tag: str, timeout_s: float, node: int = 0) -> bool:
    """Whether node ``node``'s memory keeper (``async_checkpoint.memory``) commits ``tag``
    within ``timeout_s`` seconds (or already holds a newer one: then it committed that first).
    Each rank waits for its own node's; the save that follows is collective, so no rank goes
    past it before every node's keeper committed."""
    from deepspeed_async_ckpt.memory.client import KeeperClient

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        name = KeeperClient.newest_name(save_dir, node=node)
        if name is not None and int(name[len("global_step"):]) >= int(tag[len("global_step"):]):
            return True
        time.sleep(0.05)
    return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=POSITIVE, default=20)
    p.add_argument("--save-every", type=POSITIVE, default=5)
    p.add_argument("--hidden", type=POSITIVE, default=256)
    p.add_argument("--layers", type=POSITIVE, default=4)
    p.add_argument("--resume", action="store_true", help="load `latest` from --save-dir first")
    p.add_argument("--kill-at-step", type=NON_NEGATIVE, default=0,
                   help="SIGKILL every rank right after this step's checkpoint is issued, once an "
                        "earlier one has committed (`latest` exists; with the memory tier, also the "
                        "save just before it in memory), so there is one to resume from")
    p.add_argument("--commit-timeout", type=_seconds, default=300.0, metavar="S",
                   help="with --kill-at-step: how long to wait for that earlier commit before giving "
                        f"up (exit code {EXIT_NO_COMMIT}, no kill); default 300")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, help="override the config's ZeRO stage")
    p.add_argument("--no-async", action="store_true", help="drop the async_checkpoint key")
    p.add_argument("--pipeline-stages", type=NON_NEGATIVE, default=0)
    p.add_argument("--log", default=None, help="JSON-lines event log")
    args = p.parse_args(argv)

    import deepspeed

    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.no_async:
        config.pop("async_checkpoint", None)

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(1234)
    model = build_model(args.hidden, args.layers, args.pipeline_stages)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    log = open(args.log, "a", encoding="utf-8") if args.log else None

    def emit(**event):
        if log is not None:
            log.write(json.dumps(dict(rank=rank, t=time.time(), **event)) + "\n")
            log.flush()

    start_step = 0
    if args.resume:
        t0 = time.perf_counter()
        path, _ = engine.load_checkpoint(args.save_dir)
        load_s = time.perf_counter() - t0
        if path is None:
            raise SystemExit(f"rank {rank}: --resume but no checkpoint under {args.save_dir}")
        start_step = engine.global_steps
        emit(event="resumed", step=start_step, path=path, load_s=load_s)

    micro = engine.train_micro_batch_size_per_gpu()
    pending_save_s = None
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        if args.pipeline_stages:
            data = tuple(t.to(engine.device) for t in
                         batch(step, engine.grid.data_parallel_id, micro, args.hidden, dtype))
            it = iter([data] * engine.gradient_accumulation_steps())
            loss = engine.train_batch(data_iter=it)
        else:
            x, y = (t.to(engine.device) for t in batch(step, rank, micro, args.hidden, dtype))
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        step_s = time.perf_counter() - t0
        emit(event="step", step=step + 1, loss=float(loss.detach()), step_s=step_s)
        if pending_save_s is not None:  # the save's cost includes any wait at this step's fence
            emit(event="checkpoint", step=step, save_s=pending_save_s, next_step_s=step_s,
                 stall_s=pending_save_s + _fence_wait_s(engine))
            pending_save_s = None
        if (step + 1) % args.save_every == 0:
            kill = args.kill_at_step and step + 1 == args.kill_at_step
            # On a loaded machine the earlier saves may still be in flight here: a kill now
            # would leave nothing to resume from. Wait (before this save, so that the kill
            # still lands while a checkpoint is being written) until one has committed: on
            # disk, and with the memory tier the save just before in memory too.
            memory = config.get("async_checkpoint", {}).get("memory", {}).get("enabled", False)
            if kill and not (wait_for_pointer(args.save_dir, args.commit_timeout) and (
                    not memory or wait_for_memory(args.save_dir, f"global_step{step + 1 - args.save_every}",
                                                  args.commit_timeout, node_of(rank, world_size)))):
                emit(event="no_commit", step=step + 1, timeout_s=args.commit_timeout)
                print(f"rank {rank}: no checkpoint committed in {args.save_dir} within "
                      f"{args.commit_timeout:g} s before the kill at step {step + 1}", file=sys.stderr,
                      flush=True)
                # at once: the engine's flush at exit would wait for the very saves that are late
                os._exit(EXIT_NO_COMMIT)
            t0 = time.perf_counter()
            engine.save_checkpoint(args.save_dir)
            pending_save_s = time.perf_counter() - t0
            if kill:
                emit(event="killed", step=step + 1)
                os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    engine.destroy()  # flushes and commits the last checkpoint
    emit(event="done", step=args.steps, destroy_s=time.perf_counter() - t0)
    torch.distributed.destroy_process_group()  # as torch asks (see README, "CPU and CI")
    return 0


if __name__ == "__main__":
    sys.exit(main())
