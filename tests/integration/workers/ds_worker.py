"""One rank of the DeepSpeed multi-process tests (started by scripts/launch.py).

Phases:
  save    train, then at one step save four ways (this engine async, sync, and async with
          the model states written whole by the first replica; DeepSpeed's
          TorchCheckpointEngine), each with a sparse client_state changed right after it,
          keep training (mutating every tensor), destroy.
  load    in a fresh process, load each saved variant and dump the restored engine state.
  kill    save and commit twice (keep_last=1; a "best" saved aside between them with
          save_latest=False), then SIGKILL one rank in the middle of the
          next persist (with --resave, of the tag `latest` names, saved again two steps on).
  diskfull  one rank's disk fills mid-persist; the next save raises on every rank, then recovers.
  diskfull-load  the same failure, then load_checkpoint: refused on every rank, a retry loads.
  diskfull-sync  the same failure in sync mode: that save_checkpoint raises on every rank.
  exit    save, train one more step, and return without destroy(): interpreter exit commits.
  sigterm each rank gets SIGTERM; its handler's flag makes the loop save and return (committed).
  engines check which checkpoint engine DeepSpeed builds for several configs.
  buffers save a model with BatchNorm while the copier is held until the fence: the next
          forward changes its running statistics first; the file must have the saved ones.
  export  save_16bit_model through this engine and DeepSpeed's own, then save_checkpoint.
  moe     an expert-parallel MoE model saved through this engine and DeepSpeed's own, both loaded.
  universal  save through this engine and DeepSpeed's own for ds_to_universal (load: --universal).
  gathered  ZeRO-3: a frozen layer changed through GatheredParameters right after a save.
  edit    weights changed in place right after a save without fence_all(): the next step raises.
The test module reads what they write under --out and asserts on it.
"""

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import signal
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/
from deepspeed_async_ckpt.bench.model import batch, build_model  # noqa: E402

HIDDEN, LAYERS = 64, 3
#: `make test-gpu` sets nccl: the same tests on every visible GPU.
BACKEND = os.environ.get("ASYNC_CKPT_TEST_BACKEND", "gloo")


def ds_config(args, async_block=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 5}},
        "zero_optimization": {"stage": args.zero_stage},
    }
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if getattr(args, "offload", 0):  # ZeRO-Offload: fp32 partitions and Adam state in host memory,
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}  # stepped by torch's Adam
        cfg["zero_force_ds_cpu_optimizer"] = False
    if async_block is not None:
        cfg["async_checkpoint"] = async_block
    return cfg


def init(args, config):
    import deepspeed

    deepspeed.init_distributed(dist_backend=BACKEND)
    if BACKEND == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(1234)
    model = build_model(HIDDEN, LAYERS, args.pipeline_stages)
    if getattr(args, "tied", 0):  # one weight used by two layers, as tied embeddings are
        model[3].weight = model[0].weight
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, args, steps, start=0):
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(start, start + steps):
        if args.pipeline_stages:
            dp = engine.grid.data_parallel_id
            data = [tuple(t.to(engine.device) for t in batch(step, dp, 2, HIDDEN, dtype))]
            loss = engine.train_batch(data_iter=iter(data))
        else:
            x, y = (t.to(engine.device) for t in batch(step, rank, 2, HIDDEN, dtype))
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    return losses


def phase_save(args):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.integrations.deepspeed.engine import AsyncCheckpointEngine
    from deepspeed_async_ckpt.integrations.deepspeed.patches import use_checkpoint_engine
    config = ds_config(args, {"enabled": True, "host_buffer_gb": 0.05, "writer_threads": 2,
                              "persist_in": args.persist_in})
    engine = init(args, config)
    ours = engine.checkpoint_engine
    assert isinstance(ours, AsyncCheckpointEngine), type(ours)
    train(engine, args, 3)
    # After the first step the plugin sized the host pool from the live state and faulted it in.
    if ours.reservation is not None:
        ours.reservation.join()
    pool = ours.checkpointer.pool
    reserved = {"reserved_bytes": pool.held_bytes, "allocations_before_save": pool.allocations}
    # a sparse tensor in client_state (DeepSpeed's own engine saves one with torch.save),
    # changed in place right after each save, which must not see the change
    values = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.sparse_coo_tensor([[0, 3, 0], [1, 2, 1]], values.clone(), (4, 4))

    def save(variant):
        mask._values().copy_(values)
        engine.save_checkpoint(os.path.join(args.out, variant), client_state={"mask": mask})
        mask._values().add_(100)

    save("async")
    # The same pipeline run inline, and DeepSpeed's own engine, at the very same state.
    use_checkpoint_engine(engine, AsyncCheckpointEngine(
        engine._config, AsyncCheckpointConfig(enabled=True, mode="sync"), zero_stage=args.zero_stage))
    save("sync")
    engine.checkpoint_engine.cleanup()
    # And without the replicas' shares: the first replica writes the model states whole.
    use_checkpoint_engine(engine, AsyncCheckpointEngine(
        engine._config, AsyncCheckpointConfig(enabled=True, split_replicated_files=False),
        zero_stage=args.zero_stage))
    save("whole")
    engine.checkpoint_engine.cleanup()
    use_checkpoint_engine(engine, TorchCheckpointEngine(engine._config))  # the first replica only
    save("torch")
    use_checkpoint_engine(engine, ours)
    train(engine, args, 2, start=3)  # mutates every parameter and optimizer tensor
    handle = ours.checkpointer.history[0]
    stats = {"rank": torch.distributed.get_rank(), "staged_bytes": ours.checkpointer.staged_bytes,
             "planned_bytes": handle.nbytes, "pool_peak": ours.checkpointer.pool.peak_bytes,
             "pool_capacity": ours.checkpointer.pool.capacity_bytes,
             "pool_allocations": ours.checkpointer.pool.allocations,
             "pool_bytes_needed": ours.checkpointer.pooled_bytes,  # this checkpointer saved once
             "cpu_offload": bool(getattr(engine.optimizer, "cpu_offload", False)), **reserved}
    engine.destroy()
    with open(os.path.join(args.out, f"stats_rank{stats['rank']}.json"), "w") as f:
        json.dump(stats, f)


def count_hashed_bytes():
    """Bytes this rank hashes to verify checkpoint files on load, in ``counter["bytes"]``."""
    import deepspeed_async_ckpt.commit.verify as commit

    counter, hash_ranges = {"bytes": 0}, commit.hash_ranges

    def counting(path, algorithm, ranges):
        hashed = hash_ranges(path, algorithm, ranges)
        counter["bytes"] += sum(size for size, _ in hashed)
        return hashed

    commit.hash_ranges = counting
    return counter


@contextlib.contextmanager
def load_error_recorded(out, rank):
    """An exception from the block written to ``load_error_rank<rank>.txt`` (the corruption
    test reads it from there), then raised."""
    try:
        yield
    except Exception as exc:
        with open(os.path.join(out, f"load_error_rank{rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise


def phase_load(args):
    config = ds_config(args, {"enabled": True})
    if args.universal:  # the variants are DeepSpeed universal checkpoints (`latest_universal`)
        config["checkpoint"] = {"load_universal": True}
    engine = init(args, config)
    rank = torch.distributed.get_rank()
    hashed, counter = {}, count_hashed_bytes()
    if args.partial:  # weights only: optimizer and scheduler must keep their fresh state
        fresh = {"optimizer": engine.optimizer.state_dict(), "lr_scheduler": engine.lr_scheduler.state_dict()}
        with load_error_recorded(args.out, rank):
            engine.load_checkpoint(os.path.join(args.out, "async"), tag=args.partial_tag,
                                   load_optimizer_states=False, load_lr_scheduler_states=False)
        hashed["partial"] = counter["bytes"]  # the files this load reads, not the optimizer's
        torch.save({"module": engine.module.state_dict(), "fresh": fresh,
                    "optimizer": engine.optimizer.state_dict(), "lr_scheduler": engine.lr_scheduler.state_dict()},
                   os.path.join(args.out, f"dump_partial_rank{rank}.pt"))
    for variant in args.variants.split(","):
        counter["bytes"] = 0
        with load_error_recorded(args.out, rank):
            path, client = engine.load_checkpoint(os.path.join(args.out, variant))
        hashed[variant] = counter["bytes"]
        assert path is not None, variant
        state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                 "lr_scheduler": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps}
        if "mask" in client:  # phase_save's sparse client_state
            torch.save(client["mask"], os.path.join(args.out, f"mask_{variant}_rank{rank}.pt"))
        torch.save(state, os.path.join(args.out, f"dump_{variant}_rank{rank}.pt"))
    with open(os.path.join(args.out, f"hashed_rank{rank}.json"), "w") as f:
        json.dump(hashed, f)
    engine.destroy()


def phase_kill(args):
    from deepspeed_async_ckpt.persist.checksum import ChecksumSink

    # keep_last=1: global_step1 is removed once global_step2 commits, and global_step2 must
    # survive the failed save after it (retention runs only after a commit).
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05, "keep_last": 1}))
    save_dir = os.path.join(args.out, "ckpt")
    for step in (1, 2):
        train(engine, args, 1, start=step - 1)
        engine.save_checkpoint(save_dir)
        if step == 1:  # a "best" model kept aside: retention must leave it (save_latest=False)
            engine.save_checkpoint(save_dir, tag="best", save_latest=False)
    engine.checkpoint_engine.checkpointer.wait()  # global_step2 is committed
    torch.distributed.barrier()
    if torch.distributed.get_rank() == args.kill_rank:
        original = ChecksumSink.write

        def write_then_die(self, data):
            if self.nbytes > 4096:  # in the middle of a file's tensor records
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, data)

        ChecksumSink.write = write_then_die
    train(engine, args, 2, start=2)
    # global_step4 (or, --resave, global_step2 again): one rank dies while persisting it
    engine.save_checkpoint(save_dir, tag="global_step2" if args.resave else None)
    engine.checkpoint_engine.checkpointer.wait()
    raise SystemExit("unreachable: a rank should have been killed mid-persist")


def slow_writes():
    """Every file write starts 0.5 s late: the save is still being written when main returns."""
    import time

    import deepspeed_async_ckpt.persist.writer as checkpointer

    real_write_file = checkpointer.write_file

    def slow_write_file(*a, **kw):
        time.sleep(0.5)
        return real_write_file(*a, **kw)

    checkpointer.write_file = slow_write_file


def phase_exit(args):
    """The usual end of a training script: the last save_checkpoint, then return (no destroy,
    no wait). The writers are slowed so the save is still being written when main returns."""
    slow_writes()
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05}))
    rank = torch.distributed.get_rank()
    train(engine, args, 2)
    dump_engine_state(engine, os.path.join(args.out, f"exit_saved_rank{rank}.pt"))
    engine.save_checkpoint(os.path.join(args.out, "exit"))
    train(engine, args, 1, start=2)  # the fence copies the lazy tensors before they change


def phase_sigterm(args):
    """The README's preemption recipe: SIGTERM sets a flag, the loop saves at the next step and
    returns; the exit flush commits that save. The writers are slowed so it is still being
    written when main returns. Each rank sends itself SIGTERM at step 3, as a scheduler would."""
    slow_writes()
    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(asked=True))
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05}))
    rank = torch.distributed.get_rank()
    for step in range(100):
        if stop["asked"]:
            dump_engine_state(engine, os.path.join(args.out, f"sigterm_saved_rank{rank}.pt"))
            engine.save_checkpoint(os.path.join(args.out, "preempted"))
            return  # no wait, no destroy: the exit flush commits it
        train(engine, args, 1, start=step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
    raise SystemExit("unreachable: SIGTERM should have stopped training")


def read_latest(save_dir):
    with open(os.path.join(save_dir, "latest")) as f:
        return f.read()


def save_committed(engine, save_dir, tag):
    """Save ``tag``, wait until it is committed on this rank and every rank got there; returns
    what ``latest`` then names."""
    engine.save_checkpoint(save_dir, tag=tag)
    engine.checkpoint_engine.checkpointer.wait()
    torch.distributed.barrier()
    return read_latest(save_dir)


def error_of(call):
    """None if ``call()`` returns, else "ErrorType: message" of the AsyncCheckpointError it raised."""
    from deepspeed_async_ckpt.errors import AsyncCheckpointError

    try:
        call()
    except AsyncCheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def fill_disk(ckpt):
    """From now on, every checkpoint file this rank writes runs out of space after 4 KiB (at
    the storage seam: the file itself fails). Returns the function that frees the space."""
    import errno

    storage = ckpt.storage
    original = storage.open_write

    def open_write_disk_full(path):  # a share of the model states (open_write_at) is spared
        f = original(path)
        if path.endswith(".pt.tmp." + str(os.getpid())):
            def full(method, budget=[4096]):
                def write(data):
                    budget[0] -= len(memoryview(data).cast("B"))
                    if budget[0] < 0:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return method(data)
                return write
            f.write = full(f.write)
            if hasattr(f, "write_stable"):  # DirectFile: tensor records are written in place
                f.write_stable = full(f.write_stable)
        return f

    storage.open_write = open_write_disk_full
    return lambda: setattr(storage, "open_write", original)


def state_of(engine):
    """What a resume must give back bit for bit: the module, the optimizer, the step."""
    return {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
            "global_steps": engine.global_steps}


def dump_engine_state(engine, path):
    torch.save({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                "lr_scheduler": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps}, path)


def phase_diskfull(args):
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05}))
    rank = torch.distributed.get_rank()
    save_dir = os.path.join(args.out, "ckpt")
    ckpt = engine.checkpoint_engine.checkpointer
    train(engine, args, 2)
    engine.save_checkpoint(save_dir)
    ckpt.wait()
    torch.distributed.barrier()
    restore = fill_disk(ckpt) if rank == args.kill_rank else (lambda: None)
    train(engine, args, 2, start=2)
    engine.save_checkpoint(save_dir)  # global_step4 fails in rank 1's writer
    ckpt.history[-1].wait_committed()
    restore()  # space is back
    torch.distributed.barrier()
    result = {"rank": rank}
    result["latest_after_failure"] = read_latest(save_dir)
    train(engine, args, 1, start=4)
    result["raised"] = error_of(lambda: engine.save_checkpoint(save_dir))
    result["latest_after_recovery"] = save_committed(engine, save_dir, "recovered")
    engine.destroy()
    with open(os.path.join(args.out, f"diskfull_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def phase_diskfull_load(args):
    """A save fails on --kill-rank only; then every rank calls load_checkpoint: every rank must
    raise (none may go on into DeepSpeed's load collectives), and a retry loads the last
    committed checkpoint."""
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05}))
    rank = torch.distributed.get_rank()
    save_dir = os.path.join(args.out, "ckpt")
    ckpt = engine.checkpoint_engine.checkpointer
    train(engine, args, 2)
    engine.save_checkpoint(save_dir)  # global_step2: the last one that commits
    dump_engine_state(engine, os.path.join(args.out, f"diskfull_load_saved_rank{rank}.pt"))
    ckpt.wait()
    torch.distributed.barrier()
    restore = fill_disk(ckpt) if rank == args.kill_rank else (lambda: None)
    train(engine, args, 2, start=2)
    engine.save_checkpoint(save_dir)  # global_step4 fails in --kill-rank's writer, in the background
    result = {"rank": rank}
    # no wait, no barrier first: load_checkpoint itself must wait and agree across ranks
    result["raised"] = error_of(lambda: engine.load_checkpoint(save_dir))
    result["global_steps_after_refusal"] = engine.global_steps  # nothing loaded
    restore()
    # the failed checkpoint asked for by its tag, with verify_on_load off: still refused on
    # every rank as never committed (it went into DeepSpeed's load, and one rank's error left
    # the other waiting in a collective)
    ckpt.config = dataclasses.replace(ckpt.config, verify_on_load=False)
    result["uncommitted_raised"] = error_of(lambda: engine.load_checkpoint(save_dir, tag="global_step4"))
    ckpt.config = dataclasses.replace(ckpt.config, verify_on_load=True)
    result["latest"] = read_latest(save_dir)
    path, _ = engine.load_checkpoint(save_dir)  # the retry: the error was consumed
    result["loaded"] = os.path.relpath(path, save_dir) if path else None
    dump_engine_state(engine, os.path.join(args.out, f"diskfull_load_loaded_rank{rank}.pt"))
    # nothing left pending on any rank: a new save commits
    result["latest_after_save"] = save_committed(engine, save_dir, "after_load")
    engine.destroy()
    with open(os.path.join(args.out, f"diskfull_load_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def phase_diskfull_sync(args):
    """Sync mode: --kill-rank's write fails inside save_checkpoint. Every rank must raise from
    that save_checkpoint (none left waiting in DeepSpeed's barrier for the one that raised),
    `latest` stays, and the next save, with space again, commits on every rank."""
    engine = init(args, ds_config(args, {"enabled": True, "mode": "sync", "host_buffer_gb": 0.05}))
    rank = torch.distributed.get_rank()
    save_dir = os.path.join(args.out, "ckpt")
    ckpt = engine.checkpoint_engine.checkpointer
    train(engine, args, 2)
    engine.save_checkpoint(save_dir)  # global_step2: committed when save_checkpoint returns
    result = {"rank": rank, "latest_before": read_latest(save_dir)}
    restore = fill_disk(ckpt) if args.kill_rank in (rank, -1) else (lambda: None)
    if args.kill_rank == -1 and rank == 0:  # every rank's disk full: rank 0's own copy of
        import deepspeed.runtime.engine as ds_engine  # zero_to_fp32.py fails too

        real_copyfile = ds_engine.copyfile

        def no_space(*a, **k):
            raise OSError(28, "No space left on device")

        ds_engine.copyfile = no_space
        restore_fs = restore
        restore = lambda: (restore_fs(), setattr(ds_engine, "copyfile", real_copyfile))  # noqa: E731
    train(engine, args, 2, start=2)
    result["raised"] = error_of(lambda: engine.save_checkpoint(save_dir))  # global_step4
    restore()
    result["latest_after_failure"] = read_latest(save_dir)
    train(engine, args, 1, start=4)
    engine.save_checkpoint(save_dir, tag="recovered")
    result["latest_after_recovery"] = read_latest(save_dir)  # sync: committed on every rank
    engine.destroy()
    with open(os.path.join(args.out, f"diskfull_sync_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def phase_buffers(args):
    import deepspeed
    from _copier import hold_copier_until_fence

    release = hold_copier_until_fence()
    deepspeed.init_distributed(dist_backend=BACKEND)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    config = ds_config(args, {"enabled": True, "host_buffer_gb": 0.05})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    train(engine, args, 2)
    release.clear()
    engine.save_checkpoint(args.out, tag="t")
    bn = model[1]
    at_save = {f"1.{k}": v.detach().clone() for k, v in bn.named_buffers()}
    train(engine, args, 1, start=2)  # its forward updates the statistics, then the fence
    engine.checkpoint_engine.checkpointer.wait()
    result = {}
    if torch.distributed.get_rank() == 0:
        saved = torch.load(sorted(glob.glob(os.path.join(args.out, "t", "*model_states.pt")))[0],
                           weights_only=False)["module"]  # rank 0's (ZeRO-3: one per rank)
        result = {k: torch.equal(saved[k], v) for k, v in at_save.items()}
        result["changed_since"] = not torch.equal(bn.running_mean, at_save["1.running_mean"])
        with open(os.path.join(args.out, "buffers.json"), "w") as f:
            json.dump(result, f)
    engine.destroy()


def phase_edit(args):
    """Weights changed in place right after a save, without fence_all() (an EMA swap, say), on
    every rank, with the save's copies held until the next step's fence."""
    from _copier import hold_copier_until_fence

    release = hold_copier_until_fence()
    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05}))
    rank, save_dir = torch.distributed.get_rank(), os.path.join(args.out, "ckpt")
    train(engine, args, 2)
    engine.save_checkpoint(save_dir)  # global_step2, copied at the next step's fence
    train(engine, args, 1, start=2)
    engine.checkpoint_engine.checkpointer.wait()
    release.clear()
    engine.save_checkpoint(save_dir)  # global_step3
    with torch.no_grad():
        for p in engine.module.parameters():
            p.mul_(0.5)
    result = {"step": error_of(lambda: train(engine, args, 1, start=3))}
    result["wait"] = error_of(engine.checkpoint_engine.checkpointer.wait)  # global_step3's end
    result["latest_after_failure"] = read_latest(save_dir)
    release.set()
    engine.save_checkpoint(save_dir, tag="recovered")
    engine.checkpoint_engine.checkpointer.wait()
    torch.distributed.barrier()
    result["latest_after_recovery"] = read_latest(save_dir)
    engine.destroy()
    with open(os.path.join(args.out, f"edit_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def phase_export(args):
    """save_16bit_model (DeepSpeed's 16-bit weights export) through this engine, then through
    DeepSpeed's own at the same state; then a save_checkpoint, which must still work."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed_async_ckpt.integrations.deepspeed.patches import use_checkpoint_engine

    cfg = ds_config(args, {"enabled": True, "host_buffer_gb": 0.05})
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine = init(args, cfg)
    ours = engine.checkpoint_engine
    train(engine, args, 2)
    saved = engine.save_16bit_model(os.path.join(args.out, "export_async"))
    exists_on_return = os.path.exists(os.path.join(args.out, "export_async", "pytorch_model.bin"))
    use_checkpoint_engine(engine, TorchCheckpointEngine(engine._config))
    engine.save_16bit_model(os.path.join(args.out, "export_torch"))
    use_checkpoint_engine(engine, ours)
    engine.save_checkpoint(os.path.join(args.out, "ckpt"))
    train(engine, args, 1, start=2)
    ours.checkpointer.wait()
    engine.destroy()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(args.out, "export.json"), "w") as f:
            json.dump({"returned": saved, "exists_on_return": exists_on_return}, f)


def phase_gathered(args):
    """ZeRO-3, a frozen layer (saved as its partitions, lazily): after a save, the layer is
    changed in place through ``zero.GatheredParameters(modifier_rank=0)`` before the next
    step, with the copier held until a fence. The same state saved by DeepSpeed's own engine
    right after ours is the reference (rank 0 compares the files)."""
    import deepspeed
    from _copier import hold_copier_until_fence
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed_async_ckpt.integrations.deepspeed.patches import use_checkpoint_engine

    release = hold_copier_until_fence()
    config = ds_config(args, {"enabled": True, "host_buffer_gb": 0.05})
    deepspeed.init_distributed(dist_backend=BACKEND)
    torch.manual_seed(1234)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(HIDDEN, LAYERS)
    frozen = model[0]
    for p in frozen.parameters():
        p.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    train(engine, args, 2)
    ours = engine.checkpoint_engine
    release.clear()
    engine.save_checkpoint(os.path.join(args.out, "async"))
    use_checkpoint_engine(engine, TorchCheckpointEngine(engine._config))
    engine.save_checkpoint(os.path.join(args.out, "torch"))
    use_checkpoint_engine(engine, ours)
    with deepspeed.zero.GatheredParameters(list(frozen.parameters()), modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            frozen.weight.data += 0.5
    train(engine, args, 1, start=2)
    ours.checkpointer.wait()
    engine.destroy()


def phase_universal(args):
    """Save through this engine and DeepSpeed's own at the same state, with the client state
    DeepSpeed's universal-checkpoint converter requires (Megatron-DeepSpeed's trainer adds it)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed_async_ckpt.integrations.deepspeed.patches import use_checkpoint_engine

    engine = init(args, ds_config(args, {"enabled": True, "host_buffer_gb": 0.05}))
    train(engine, args, 3)
    info = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
    ours = engine.checkpoint_engine
    engine.save_checkpoint(os.path.join(args.out, "async"), client_state=info)
    use_checkpoint_engine(engine, TorchCheckpointEngine(engine._config))
    engine.save_checkpoint(os.path.join(args.out, "torch"), client_state=info)
    use_checkpoint_engine(engine, ours)
    train(engine, args, 1, start=3)
    engine.destroy()


def phase_moe(args):
    """A model with a DeepSpeed MoE layer, its 2 experts split across the 2 ranks (expert
    parallel): DeepSpeed saves each expert to its own file through the checkpoint engine, by
    the expert-data-parallel writers. Saved through this engine and DeepSpeed's own at the same
    state; then, after more training, each loaded back (rank 0 compares the files; every rank
    dumps what each load restored)."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed_async_ckpt.integrations.deepspeed.patches import use_checkpoint_engine

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(HIDDEN, HIDDEN)
            self.moe = MoE(hidden_size=HIDDEN, num_experts=2, ep_size=2, k=1, expert=nn.Sequential(
                nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN)))
            self.out = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            h, aux, _ = self.moe(self.inp(x))
            return self.out(h), aux

    deepspeed.init_distributed(dist_backend=BACKEND)
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234)
    model = Model()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "all"})
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": args.zero_stage},
              "async_checkpoint": {"enabled": True, "host_buffer_gb": 0.05}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(groups, lr=0.01), config=config)

    def steps(start, n):
        for i in range(start, start + n):
            g = torch.Generator().manual_seed(100 * i + rank)
            x, y = torch.randn(4, HIDDEN, generator=g), torch.randn(4, HIDDEN, generator=g)
            out, aux = engine(x)
            engine.backward(nn.functional.mse_loss(out, y) + aux)
            engine.step()

    steps(0, 3)
    ours = engine.checkpoint_engine
    engine.save_checkpoint(os.path.join(args.out, "async"))
    use_checkpoint_engine(engine, TorchCheckpointEngine(engine._config))
    engine.save_checkpoint(os.path.join(args.out, "torch"))
    use_checkpoint_engine(engine, ours)
    steps(3, 2)  # mutates every parameter and optimizer tensor
    for variant in ("async", "torch"):
        engine.load_checkpoint(os.path.join(args.out, variant))
        torch.save({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
                    "global_steps": engine.global_steps},
                   os.path.join(args.out, f"moe_{variant}_rank{rank}.pt"))
    engine.destroy()


def phase_engines(args):
    import deepspeed
    from deepspeed_async_ckpt.errors import ConfigError

    deepspeed.init_distributed(dist_backend=BACKEND)
    result = {}
    for name, block in [("absent", None), ("disabled", {"enabled": False}), ("enabled", {"enabled": True}),
                        ("bad", {"enabled": True, "writer_thread": 3})]:
        model = build_model(8, 1)
        try:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=ds_config(args, block))
            result[name] = type(engine.checkpoint_engine).__name__
            engine.destroy()
        except ConfigError as exc:
            result[name] = f"ConfigError: {exc}"
    with open(os.path.join(args.out, "engines.json"), "w") as f:
        json.dump(result, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "load", "kill", "exit", "sigterm", "engines", "diskfull",
                                     "diskfull-load", "diskfull-sync", "buffers", "export", "moe", "universal", "gathered",
                                     "edit"])
    p.add_argument("--out", required=True)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--bf16", type=int, default=0)
    p.add_argument("--pipeline-stages", type=int, default=0)
    p.add_argument("--tied", type=int, default=0, help="the first two Linear layers share their weight")
    p.add_argument("--offload", type=int, default=0, help="ZeRO-Offload: the optimizer in host memory")
    p.add_argument("--variants", default="async,sync,torch")
    p.add_argument("--persist-in", default="thread", help="the save phase's async variant: thread or process")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--partial", type=int, default=0)
    p.add_argument("--resave", type=int, default=0)
    p.add_argument("--universal", type=int, default=0)
    p.add_argument("--partial-tag", default=None, help="the tag the --partial load asks for")
    args = p.parse_args()
    {"save": phase_save, "load": phase_load, "kill": phase_kill, "exit": phase_exit,
     "sigterm": phase_sigterm,
     "engines": phase_engines, "buffers": phase_buffers, "export": phase_export, "moe": phase_moe,
     "universal": phase_universal, "gathered": phase_gathered,
     "diskfull": phase_diskfull, "diskfull-load": phase_diskfull_load,
     "diskfull-sync": phase_diskfull_sync, "edit": phase_edit}[args.phase](args)
    if args.phase in ("save", "load", "diskfull", "diskfull-load", "diskfull-sync", "engines", "buffers", "export", "moe",
                      "universal", "gathered", "edit"):
        # These end with engine.destroy(): everything is committed and written. Skip the
        # interpreter's finalization, where a gloo worker thread still releasing a ZeRO-3
        # all-gather's tensors takes the GIL and aborts the rank ("terminate called without an
        # active exception", about 1 exit in 25, destroy_process_group() or not). The exit
        # and sigterm phases test the exit flush, so they exit normally.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
