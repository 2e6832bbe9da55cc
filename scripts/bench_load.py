"""Load (restart) time: ``load_checkpoint`` of this engine's checkpoint, with and without its
verification, against DeepSpeed's ``TorchCheckpointEngine`` loading its own, same model.

One process (DeepSpeed ZeRO-1 on CPU, gloo, world size 1): each engine saves one checkpoint of
the same model, then each is loaded ``--repeats`` times, alternating, from a cold page cache
(``/proc/sys/vm/drop_caches``, which needs root; without it only warm loads are measured, and
the output says so) and right after from a warm one. Prints a table and writes JSON.

    PYTHONPATH=. DS_ACCELERATOR=cpu python scripts/bench_load.py --out bench_out/load.json
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
    args = one_rank.arguments(__doc__, os.path.join(REPO, "bench_out", "load")).parse_args(argv)
    from deepspeed_async_ckpt.tools.launch import scratch_dir

    one_rank.init_one_rank()

    def engine(async_on: bool, verify: bool = True):
        return one_rank.zero1_engine(args.hidden, args.layers, {"enabled": True, "verify_on_load": verify} if async_on else None)

    def drop_caches() -> bool:
        return one_rank.drop_page_cache(args.work_dir) == "drop_caches"

    args.work_dir = scratch_dir(args.work_dir)  # refuses a directory these scripts did not make
    ours, theirs = os.path.join(args.work_dir, "async"), os.path.join(args.work_dir, "torch")
    saving = engine(True)
    saving.save_checkpoint(ours)
    saving.checkpoint_engine.checkpointer.wait()
    engine(False).save_checkpoint(theirs)
    nbytes = {label: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
              for label, d in (("async", ours), ("torch", theirs))}
    cases = [("this engine, verify_on_load", saving, ours), ("this engine, no verification",
             engine(True, verify=False), ours), ("DS TorchCheckpointEngine", engine(False), theirs)]
    cold_ok = drop_caches()
    times: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm": []} for name, _, _ in cases}
    for _ in range(args.repeats):
        for name, eng, d in cases:
            if cold_ok:
                drop_caches()
                t0 = time.perf_counter()
                eng.load_checkpoint(d)
                times[name]["cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.load_checkpoint(d)
            times[name]["warm"].append(time.perf_counter() - t0)

    print(f"checkpoint: {nbytes['async'] / 1e9:.2f} GB (this engine), {nbytes['torch'] / 1e9:.2f} GB "
          f"(TorchCheckpointEngine); {args.repeats} loads each, medians")
    if not cold_ok:
        print("cold page cache: not measured (writing /proc/sys/vm/drop_caches needs root)")
    print("| engine | cold load | warm load |\n|---|---|---|")
    for name, _, _ in cases:
        cold = f"{statistics.median(times[name]['cold']):.2f} s" if cold_ok else "-"
        print(f"| {name} | {cold} | {statistics.median(times[name]['warm']):.2f} s |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"bytes": nbytes, "hidden": args.hidden, "layers": args.layers,
                       "cold_measured": cold_ok, "times_s": times}, f, indent=1)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
