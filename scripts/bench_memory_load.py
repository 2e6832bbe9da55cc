"""Restart time from the memory tier: DeepSpeed's ``load_checkpoint`` of one checkpoint from
the node keeper's memory, against the same checkpoint read from the checkpoint directory with
a cold page cache (and warm, for reference), same model, same engine, ``verify_on_load`` on.

One process (DeepSpeed ZeRO-1 on CPU, gloo, world size 1): the engine saves one checkpoint
(``--layers`` x ``--hidden``: 15 x 2048 is 0.96 GB), which is copied into the save
directory's keeper as each rank's save would copy it (the keeper's client API), then it is
loaded ``--repeats`` times each way, alternating. Cold: each file fsynced and dropped from the
page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``, or all caches with
``/proc/sys/vm/drop_caches`` where it is writable (the output says which). The memory load
includes laying the checkpoint out on tmpfs and removing it; it is also timed alone. Prints a
table and writes JSON; the keeper is shut down at the end.

    PYTHONPATH=. DS_ACCELERATOR=cpu python scripts/bench_memory_load.py --out bench_out/memory_load.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop_page_cache(root: str) -> str:
    """Drop ``root``'s files from the page cache; how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(POSIX_FADV_DONTNEED)"


def fill_keeper(save_dir: str, ckpt_dir: str, memory) -> object:
    """Copy the committed ``ckpt_dir`` into ``save_dir``'s keeper (rank 0's part of the slot)
    and commit it with its manifest; the connected client."""
    from deepspeed_async_ckpt.commit.manifest import read_manifest
    from deepspeed_async_ckpt.memory.client import KeeperClient

    manifest = read_manifest(ckpt_dir)
    name = os.path.basename(ckpt_dir)
    client = KeeperClient.connect(save_dir, memory)
    sizes = {rel: os.path.getsize(os.path.join(ckpt_dir, rel)) for rel in manifest["files"]}
    res = client.reserve(name, manifest["save_id"], 0, (0,), sizes)
    for rel in sizes:
        with open(os.path.join(ckpt_dir, rel), "rb") as f:
            res.write(rel, f.read())
    res.report()
    client.commit(name, manifest["save_id"], manifest)
    return client


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=15, help="15 x hidden 2048: a 0.96 GB checkpoint")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default=os.path.join(REPO, "bench_out", "memory_load"))
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, REPO)  # this checkout's package, before an installed one
    from deepspeed_async_ckpt.tools.launch import free_port, scratch_dir

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch

    import deepspeed_async_ckpt
    from deepspeed_async_ckpt.agreement import alone
    from deepspeed_async_ckpt.bench.model import build_model
    from deepspeed_async_ckpt.memory.config import MemoryConfig
    from deepspeed_async_ckpt.memory.restore import restore_from_memory

    deepspeed_async_ckpt.install()
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "async_checkpoint": {"enabled": True, "verify_on_load": True}}
    torch.manual_seed(0)
    model = build_model(args.hidden, args.layers)
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    eng.backward(eng(torch.randn(2, args.hidden)).sum())
    eng.step()

    args.work_dir = scratch_dir(args.work_dir)  # refuses a directory these scripts did not make
    save_dir = os.path.join(args.work_dir, "ckpt")
    eng.save_checkpoint(save_dir)
    checkpointer = eng.checkpoint_engine.checkpointer
    checkpointer.wait()
    tag = open(os.path.join(save_dir, "latest")).read().strip()
    ckpt_dir = os.path.join(save_dir, tag)
    nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt_dir) for f in fs)
    on, off = MemoryConfig(enabled=True, idle_timeout_s=600), MemoryConfig(enabled=False)
    client = fill_keeper(save_dir, ckpt_dir, on)
    try:
        def use(memory):
            object.__setattr__(checkpointer.config, "memory", memory)

        times: dict[str, list[float]] = {"memory": [], "disk cold": [], "disk warm": [], "memory lay-out alone": []}
        how = ""
        for _ in range(args.repeats):
            use(off)
            how = drop_page_cache(save_dir)
            t0 = time.perf_counter()
            eng.load_checkpoint(save_dir)
            times["disk cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.load_checkpoint(save_dir)
            times["disk warm"].append(time.perf_counter() - t0)
            use(on)
            drop_page_cache(save_dir)  # the memory load gets no help from a warm disk copy
            t0 = time.perf_counter()
            path, _ = eng.load_checkpoint(save_dir)
            times["memory"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            laid = restore_from_memory(save_dir, on, rank=0, world_size=1, pointer_name="latest", tag=tag,
                                       exchange=alone)
            laid.close()
            times["memory lay-out alone"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"checkpoint: {nbytes / 1e9:.2f} GB ({tag}); {args.repeats} loads each, medians; cold page cache "
              f"by {how}; verify_on_load on")
        print("| load_checkpoint from | time | GB/s | vs disk cold |\n|---|---|---|---|")
        for k, v in med.items():
            print(f"| {k} | {v:.2f} s | {nbytes / 1e9 / v:.2f} | {med['disk cold'] / v:.1f}x |")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"bytes": nbytes, "hidden": args.hidden, "layers": args.layers, "cold_by": how,
                           "times_s": times, "medians_s": med}, f, indent=1)
    finally:
        client.shutdown()
        eng.checkpoint_engine.cleanup()
        shutil.rmtree(args.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
