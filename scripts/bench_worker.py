"""One rank of ``bench_checkpoint.py``: trains a DeepSpeed MLP and times every checkpoint engine.

Started by ``scripts/bench_checkpoint.py`` (one process per rank, torchrun-style environment);
not meant to be run by hand. All engines run in this one process on the same model, so they
see the same weights, the same memory and the same step time:

1. ``deepspeed.initialize`` with the ``"async_checkpoint"`` key (this package's engine);
2. warm-up steps (after the first, this engine faults its host pool in, in the background; the
   worker waits for that), then a baseline window of K steps without checkpoints;
3. per engine: a cadence (the engine's first checkpoints, one-time costs included): K steps
   without a checkpoint, ``--saves`` checkpoints every K steps as a training loop makes them,
   drained, and K steps more, every step timed (the lost time of each save, see
   ``bench.lost_time``); then ``--repeats`` times a paired baseline window of K steps and the
   timed window: ``save_checkpoint`` followed by K training steps, drained;
4. DeepSpeed's decoupled writer engine, which is chosen at ``initialize``: tiny engines with
   writer configs from DeepSpeed's default up record why each fails; the first that completes
   a save lends its ``checkpoint_engine``, timed the same way;
5. a second baseline window (drift/noise check).

The engines are swapped by assigning ``engine.checkpoint_engine``; DeepSpeed queries that
object at every save, so the swap is what ``initialize`` would have built. Each rank writes its
measurements to ``<result>.rank<N>.json``; times are seconds, sizes bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from deepspeed_async_ckpt.bench.adapters import (Adapter, AsyncAdapter, DCPAdapter, DecoupledAdapter,  # noqa: E402
                                                 DeepSpeedAdapter, use_checkpoint_engine)
from deepspeed_async_ckpt.bench.usage import dir_bytes, tensor_bytes, timed, usage, usage_delta  # noqa: E402
from deepspeed_async_ckpt.bench.model import batch, build_model  # noqa: E402

now = time.perf_counter


def ds_config(batch_size: int, zero_stage: int, extra: dict | None = None) -> dict:
    """fp32 with torch's fused Adam. Checkpoint bytes per parameter: 12 without ZeRO (weights and
    two Adam moments in one model-states file), 16 with ZeRO-1/2 (plus the fp32 master
    partition, in per-rank optimizer files)."""
    cfg = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 10**9,
        "checkpoint": {"tag_validation": "Ignore"},
    }
    cfg.update(extra or {})
    return cfg


class Trainer:
    """The training loop, instrumented: per step, forward+backward and optimizer seconds, and
    any wait the checkpoint engine adds before the optimizer step."""

    def __init__(self, engine, hidden: int, rank: int) -> None:
        self.engine, self.hidden, self.rank = engine, hidden, rank
        self.step_no = 0
        self.waits: list[float] = []
        self.pre_step: Callable[[], None] | None = None  # e.g. DCP's staging wait

    def step(self) -> dict:
        eng = self.engine
        x, y = batch(self.step_no, self.rank, eng.train_micro_batch_size_per_gpu(), self.hidden,
                     torch.float32)
        t0 = now()
        loss = nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        t1 = now()
        if self.pre_step is not None:
            w0 = now()
            self.pre_step()
            self.pre_step = None
            self.waits.append(now() - w0)
        eng.step()
        t2 = now()
        self.step_no += 1
        waits, self.waits = self.waits, []
        return {"step_s": t2 - t0, "fb_s": t1 - t0, "opt_s": t2 - t1, "wait_s": sum(waits)}

    def window(self, k: int, on_start: Callable[[], None] | None = None) -> dict:
        dist.barrier()
        if on_start is not None:
            on_start()
        u0, t0 = usage(), now()
        steps = [self.step() for _ in range(k)]
        t1, u1 = now(), usage()
        # perf_counter is CLOCK_MONOTONIC, one clock for every process: the launcher uses the
        # absolute times to measure other processes' CPU use during each window.
        return {"window_s": t1 - t0, "steps": steps, "t0": t0, "t1": t1, "usage": usage_delta(u0, u1)}

    def timed(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Wrap a wait the engine performs inside ``engine.step`` so its seconds are counted."""

        return timed(fn, lambda seconds: self.waits.append(seconds))  # the list is swapped per step


# --------------------------------------------------------------------------- engines
# --------------------------------------------------------------------------- measurement
def one_checkpoint(trainer: Trainer, adapter: Adapter, save_dir: str, tag: str, steps: int,
                   rank: int) -> dict:
    """save, then ``steps`` training steps (the first one includes any wait the engine adds
    before the optimizer step), then drain; returns this rank's figures."""
    dist.barrier()
    u0, t0 = usage(), now()
    token = adapter.save(save_dir, tag)
    t1 = now()
    step_stats = [trainer.step() for _ in range(steps)]
    t2, u2 = now(), usage()
    done_at = adapter.drain(token)
    dist.barrier()
    out = {
        "save_s": t1 - t0,
        "wait_s": step_stats[0]["wait_s"] if step_stats else 0.0,
        "next_step_s": step_stats[0]["step_s"] if step_stats else None,
        "window_s": t2 - t0,
        "persist_s": done_at - t0,
        "steps": step_stats,
        "t0": t0,
        "t1": t2,
        "usage": usage_delta(u0, u2),  # save + steps, as window_s
    }
    out["stall_s"] = out["save_s"] + out["wait_s"]
    out.update(adapter.stats(token))
    if rank == 0:
        out["bytes_on_disk"] = dir_bytes(os.path.join(save_dir, tag))
    return out


def cadence(trainer: Trainer, adapter: Adapter, save_dir: str, k: int, saves: int, rank: int) -> dict:
    """``saves`` checkpoints every ``k`` steps, as a training loop makes them, between two
    windows of ``k`` steps with no checkpoint in flight (before the engine's first save, and
    after its last one completed): the step times a lost-time figure is computed from
    (``bench.lost_time``). Per save: the save call, the fence wait inside the next step, the
    steps until the next save, and this process's CPU seconds and page faults over them."""
    before = trainer.window(k)
    records, token = [], None
    for i in range(saves):
        dist.barrier()
        u0, t0 = usage(), now()
        token = adapter.save(save_dir, f"cadence{i}")
        save_s = now() - t0
        steps = [trainer.step() for _ in range(k)]
        records.append({"save_s": save_s, "wait_s": steps[0]["wait_s"], "steps_s": [s["step_s"] for s in steps],
                        "usage": usage_delta(u0, usage())})
    t_drain = now()
    done_at = adapter.drain(token)
    # the last save still in flight after its k steps: the next save would wait for it
    records[-1]["tail_s"] = now() - t_drain
    records[-1]["persist_s"] = done_at - t0
    stats = adapter.stats(token)
    adapter.forget()
    dist.barrier()
    after = trainer.window(k)
    first = records[0]
    return {"before": [s["step_s"] for s in before["steps"]], "after": [s["step_s"] for s in after["steps"]],
            "quiet_usage": [before["usage"], after["usage"]], "saves": records, "last_stats": stats,
            # the engine's first save in this process, in the figures of a timed one
            "first": {"save_s": first["save_s"], "wait_s": first["wait_s"],
                      "stall_s": first["save_s"] + first["wait_s"], "next_step_s": first["steps_s"][0]}}


def run_engine(trainer: Trainer, adapter: Adapter, root: str, k: int, rank: int,
               repeats: int = 1, saves: int = 5) -> dict:
    """A cadence of ``saves`` checkpoints (the engine's first ones), then ``repeats`` times:
    K steps without a checkpoint (the paired baseline), a timed checkpoint and its K steps."""
    save_dir = os.path.join(root, adapter.name)
    res: dict = {"ok": False, "durable": adapter.durable, "note": adapter.note, "runs": []}
    try:
        res["cadence"] = cadence(trainer, adapter, save_dir, k, saves, rank)
        res["first"] = res["cadence"]["first"]
        clean(save_dir, rank)
        for i in range(repeats):
            # The overhead's reference: K steps without a checkpoint right before the timed
            # window (the step time drifts over a run; adjacent windows agree better).
            base = trainer.window(k)
            timed = one_checkpoint(trainer, adapter, save_dir, f"timed{i}", k, rank)
            res["runs"].append({"paired_baseline": base, "timed": timed})
            clean(save_dir, rank)
        res["ok"] = True
    except Exception as exc:  # record and go on with the other engines
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc(limit=8)
        print(f"rank {rank}: {adapter.name} failed: {res['error']}", file=sys.stderr, flush=True)
    finally:
        clean(save_dir, rank)
    return res


def clean(path: str, rank: int) -> None:
    """Delete a checkpoint directory and flush the page cache's dirty data, so the next engine
    starts from a quiet disk (the TorchCheckpointEngine leaves its writes unsynced)."""
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()
    dist.barrier()


DECOUPLED_VARIANTS = [  # from DeepSpeed's documented default up to what initializes on CPU
    ({"decoupled": True}, {}),
    ({"decoupled": True}, {"CROSS_RANK": "0", "CROSS_SIZE": "1"}),  # one node; torchrun sets neither
    ({"decoupled": True, "data_parallel": "replica"}, {"CROSS_RANK": "0", "CROSS_SIZE": "1"}),
    ({"type": "python", "decoupled": True, "data_parallel": "replica"}, {"CROSS_RANK": "0", "CROSS_SIZE": "1"}),
]


def decoupled_engine(rank: int, batch_size: int, zero_stage: int, work_dir: str,
                     variants: list) -> tuple[list[dict], dict | None, Any]:
    """Build DeepSpeed's decoupled engine with each writer config in turn, on a tiny model,
    through one save and the commit at the next step. Returns every attempt (the stage it
    failed at and the error), the first config that worked, and its engine, still alive: its
    ``checkpoint_engine`` is what ``initialize`` builds for that config, whatever the model."""
    import deepspeed
    from deepspeed.runtime.checkpoint_engine import decoupled_checkpoint_engine as dce

    # DeepSpeed checks its writer process every 10 s while a commit waits; a writer that died
    # at start-up would cost 10 s per probe. A commit still returns as soon as it is done.
    dce.PROCESS_HEALTH_CHECK_INTERVAL_SECONDS = 1
    attempts: list[dict] = []
    for writer, env in variants:
        os.environ.update(env)
        entry: dict = {"writer": writer, "env": env, "error": None}
        stage = "initialize"
        eng = None
        try:
            model = build_model(64, 1)
            cfg = ds_config(batch_size, zero_stage, {"checkpoint": {"tag_validation": "Ignore", "writer": writer}})
            eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            trainer = Trainer(eng, 64, rank)
            trainer.step()
            stage = "save"
            eng.save_checkpoint(os.path.join(work_dir, "probe"), tag="probe")
            stage = "commit at the next step"
            trainer.step()
            clean(os.path.join(work_dir, "probe"), rank)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["failed_at"] = stage
            if eng is not None:
                try:
                    eng.destroy()
                except Exception:
                    pass
            eng = None
            gc.collect()
        finally:
            for key in env:
                os.environ.pop(key, None)
        attempts.append(entry)
        if eng is not None:
            return attempts, {"writer": writer, "env": env}, eng
    return attempts, None, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--k", type=int, required=True, help="steps per checkpoint")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="timed checkpoints per engine")
    p.add_argument("--saves", type=int, default=5, help="checkpoints every K steps per engine (lost time)")
    p.add_argument("--engines", required=True, help="comma list")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--result", required=True, help="path prefix of the per-rank JSON")
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--async-config", default="{}",
                   help="async_checkpoint keys beyond enabled and mode, for this engine (JSON)")
    p.add_argument("--decoupled-probe", default=None,
                   help="JSON of an earlier probe of decoupled-writer configs (skips probing)")
    args = p.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils import logger as ds_logger

    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.integrations.activation import install
    from deepspeed_async_ckpt.integrations.deepspeed.engine import AsyncCheckpointEngine

    install()  # what the .pth hook does at import; idempotent, so no dependence on the hook
    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # DS_ACCELERATOR=cpu, set by the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    engines = [e for e in args.engines.split(",") if e]
    root = os.path.abspath(args.work_dir)
    out: dict = {"rank": rank, "world_size": world, "hidden": args.hidden, "layers": args.layers,
                 "batch": args.batch, "k": args.k, "zero_stage": args.zero_stage, "loadavg_start": os.getloadavg(), "engines": {}}
    dcp_pg = dist.new_group(backend="gloo")  # DCP's collectives run on its own thread

    torch.manual_seed(1234)
    model = build_model(args.hidden, args.layers)
    t0 = now()
    async_cfg = {"enabled": True, "mode": "async", **json.loads(args.async_config)}  # else the defaults
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args.batch, args.zero_stage, {"async_checkpoint": async_cfg}))
    out["init_s"] = now() - t0
    trainer = Trainer(engine, args.hidden, rank)
    out["warmup"] = trainer.window(args.warmup)["steps"]
    # After the first step the engine faults its host pool in, in the background, sized from
    # the live state; wait for it, so it does not run inside the baseline window.
    t_res = now()
    reservation = engine.checkpoint_engine.reservation
    if reservation is not None:
        reservation.join()
    out["reserve_wait_s"] = now() - t_res
    out["reserved_bytes"] = engine.checkpoint_engine.checkpointer.pool.held_bytes
    phases = out["phases_s"] = {"init": out["init_s"]}  # wall seconds per phase, for budgeting
    t_phase = now()
    out["params"] = sum(p.numel() for p in engine.module.parameters())
    out["module_bytes"] = tensor_bytes(engine.module.state_dict())
    out["optim_bytes"] = tensor_bytes(engine.optimizer.state_dict())  # Adam state exists after a step
    out["baseline"] = [trainer.window(args.k)]
    out["ds_floor_s"] = deepspeed_floor(trainer, root, rank)

    builders: dict[str, Callable[[], Adapter]] = {
        "async": lambda: AsyncAdapter("async", trainer, async_engine),
        "sync": lambda: AsyncAdapter("sync", trainer, AsyncCheckpointEngine(
            engine._config, AsyncCheckpointConfig(enabled=True, mode="sync"),
            zero_stage=args.zero_stage)),
        "ds_torch": lambda: DeepSpeedAdapter("ds_torch", trainer, TorchCheckpointEngine(engine._config),
                                             durable=False, note="torch.save, no fsync"),
        "dcp_async": lambda: DCPAdapter(trainer, dcp_pg, partitioned=args.zero_stage > 0),
    }
    async_engine = engine.checkpoint_engine
    if not isinstance(async_engine, AsyncCheckpointEngine):
        raise SystemExit(f"rank {rank}: the async_checkpoint key did not select AsyncCheckpointEngine "
                         f"(got {type(async_engine).__name__})")
    for name in engines:
        if name not in builders:
            continue
        adapter = builders[name]()
        out["engines"][name] = run_engine(trainer, adapter, root, args.k, rank, args.repeats, args.saves)
        adapter.close()
        del adapter
        gc.collect()
        phases[name], t_phase = now() - t_phase, now()
    if "ds_decoupled" in engines:
        async_engine = None
        out["engines"]["ds_decoupled"] = run_decoupled(args, trainer, rank, root)
        phases["ds_decoupled"], t_phase = now() - t_phase, now()
    # what this rank writes in a checkpoint with this engine: its share of the model-states
    # file, which the replicas split (without ZeRO it holds the optimizer state too), and its
    # ZeRO optimizer file
    model_file = out["module_bytes"] + (0 if args.zero_stage > 0 else out["optim_bytes"])
    mine = model_file // dist.get_world_size() + (out["optim_bytes"] if args.zero_stage > 0 else 0)
    out["bare_write"] = bare_write(trainer, root, rank, mine, args.k)
    phases["bare_write"], t_phase = now() - t_phase, now()
    out["baseline"].append(trainer.window(args.k))
    use_checkpoint_engine(engine, TorchCheckpointEngine(engine._config))
    async_engine = None
    engine.destroy()
    out["loadavg_end"] = os.getloadavg()
    with open(f"{args.result}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    dist.barrier()
    return 0


def bare_write(trainer: Trainer, root: str, rank: int, nbytes: int, k: int) -> dict:
    """The floor for any engine that writes in the background: ``nbytes`` written by a thread
    of this process the way this engine writes them (``O_DIRECT`` from page-aligned huge pages,
    fsync, rename), but with no snapshot copy and no checksum, during a window of ``k`` training
    steps. Gives the disk's bandwidth under this training load, and what the write alone costs
    the steps."""
    from deepspeed_async_ckpt.storage import LocalStorage, host_buffer

    storage = LocalStorage(fsync=True)
    buf = memoryview(host_buffer(64 << 20))  # the engine's kind of memory (huge pages)
    buf[:] = b"\x01" * len(buf)  # faulted in before the window: the engine's pool is, too
    path = os.path.join(root, "bare", f"rank{rank}.bin")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    box: dict = {}

    def write() -> None:
        t0 = now()
        f = storage.open_write(path + ".tmp")
        try:
            put = getattr(f, "write_stable", f.write)  # the buffer never changes
            left = nbytes
            while left > 0:
                left -= put(buf[:min(left, len(buf))])
            storage.sync_file(f)
        finally:
            f.close()
        storage.replace(path + ".tmp", path)
        box["write_s"] = now() - t0

    thread = threading.Thread(target=write, name="bare-write", daemon=True)
    paired = trainer.window(k)
    window = trainer.window(k, on_start=thread.start if nbytes else None)
    if nbytes:
        thread.join()
    clean(os.path.dirname(path), rank)
    res = {"bytes": nbytes, "window": window, "paired_baseline": paired}
    if nbytes:
        res["write_s"] = box.get("write_s")
        res["gbps"] = nbytes / box["write_s"] / 1e9 if box.get("write_s") else None
    return res


def deepspeed_floor(trainer: Trainer, root: str, rank: int, reps: int = 3) -> float:
    """Median wall time of ``engine.save_checkpoint`` with a checkpoint engine that writes
    nothing: DeepSpeed's own part of every engine's stall (state dicts, its two barriers,
    `latest`, the recovery script it copies), which no checkpoint engine can remove."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class NullEngine(TorchCheckpointEngine):
        def save(self, state_dict, path: str) -> None:
            pass

    eng = trainer.engine
    kept = eng.checkpoint_engine
    use_checkpoint_engine(eng, NullEngine(eng._config))
    times = []
    try:
        for i in range(reps):
            t0 = now()
            eng.save_checkpoint(os.path.join(root, "floor"), tag=f"floor{i}")
            times.append(now() - t0)
    finally:
        use_checkpoint_engine(eng, kept)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(root, "floor"), ignore_errors=True)
    return statistics.median(times)


def run_decoupled(args, trainer: Trainer, rank: int, root: str) -> dict:
    """DeepSpeed's decoupled engine on the benchmark's model: probed (or, after the first
    worker of a setting, rebuilt from the probe's answer), then swapped in like the others."""
    probe = None
    if args.decoupled_probe and os.path.exists(args.decoupled_probe):
        with open(args.decoupled_probe, encoding="utf-8") as f:
            probe = json.load(f)
    if probe is None:
        attempts, working, tiny = decoupled_engine(rank, args.batch, args.zero_stage, root, DECOUPLED_VARIANTS)
        if rank == 0 and args.decoupled_probe:
            with open(args.decoupled_probe, "w", encoding="utf-8") as f:
                json.dump({"attempts": attempts, "working": working}, f, indent=1)
    else:
        attempts, working, tiny = probe["attempts"], probe["working"], None
        if working is not None:
            again, working, tiny = decoupled_engine(rank, args.batch, args.zero_stage, root,
                                                    [(working["writer"], working["env"])])
            if tiny is None:
                attempts = attempts + again
    default_error = f"{attempts[0]['error']} (at {attempts[0].get('failed_at')})"
    res: dict = {"ok": False, "attempts": attempts, "working_config": working, "durable": False}
    if tiny is None:
        last = attempts[-1]
        res["error"] = (f"default config: {default_error}; last try, writer={last['writer']}: "
                        f"{last['error']} (at {last.get('failed_at')})")
        res["note"] = "no decoupled-writer config completes a save on this machine"
        return res
    adapter = DecoupledAdapter(trainer, tiny.checkpoint_engine, working["writer"].get("type", "fast"))
    try:
        res.update(run_engine(trainer, adapter, root, args.k, rank, args.repeats, args.saves))
    finally:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        use_checkpoint_engine(trainer.engine, TorchCheckpointEngine(trainer.engine._config))
        tiny.destroy()  # stops the writer process
    res["note"] = (f"default config fails: {default_error}; runs with writer={working['writer']}, "
                   f"env {working['env']}; " + adapter.note)
    return res


if __name__ == "__main__":  # the decoupled engine spawns a child that re-imports this file
    code = main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # as torch asks (see README, "CPU and CI")
    sys.exit(code)
