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

import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's package, before an installed one
from deepspeed_async_ckpt.bench import one_rank  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = one_rank.arguments(__doc__, os.path.join(REPO, "bench_out", "memory_load")).parse_args(argv)
    from deepspeed_async_ckpt.agreement import alone
    from deepspeed_async_ckpt.memory.config import MemoryConfig
    from deepspeed_async_ckpt.memory.restore import restore_from_memory
    from deepspeed_async_ckpt.tools.launch import scratch_dir

    one_rank.init_one_rank()
    eng = one_rank.zero1_engine(args.hidden, args.layers, {"enabled": True, "verify_on_load": True})

    args.work_dir = scratch_dir(args.work_dir)  # refuses a directory these scripts did not make
    save_dir = os.path.join(args.work_dir, "ckpt")
    eng.save_checkpoint(save_dir)
    checkpointer = eng.checkpoint_engine.checkpointer
    checkpointer.wait()
    tag = open(os.path.join(save_dir, "latest")).read().strip()
    ckpt_dir = os.path.join(save_dir, tag)
    nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt_dir) for f in fs)
    on, off = MemoryConfig(enabled=True, idle_timeout_s=600), MemoryConfig(enabled=False)
    client = one_rank.fill_keeper(save_dir, ckpt_dir, on)
    try:
        def use(memory):
            object.__setattr__(checkpointer.config, "memory", memory)

        times: dict[str, list[float]] = {"memory": [], "disk cold": [], "disk warm": [], "memory lay-out alone": []}
        how = ""
        for _ in range(args.repeats):
            use(off)
            how = one_rank.drop_page_cache(save_dir)
            t0 = time.perf_counter()
            eng.load_checkpoint(save_dir)
            times["disk cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.load_checkpoint(save_dir)
            times["disk warm"].append(time.perf_counter() - t0)
            use(on)
            one_rank.drop_page_cache(save_dir)  # the memory load gets no help from a warm disk copy
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
