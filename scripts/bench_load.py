"""Load (restart) time: ``load_checkpoint`` of this engine's checkpoint, with and without its
verification, against DeepSpeed's ``TorchCheckpointEngine`` loading its own, same model.

One process (DeepSpeed ZeRO-1 on CPU, gloo, world size 1): each engine saves one checkpoint of
the same model, then each is loaded ``--repeats`` times, alternating, from a cold page cache
(``/proc/sys/vm/drop_caches``, which needs root; without it only warm loads are measured, and
the output says so) and right after from a warm one. Prints a table and writes JSON.

    PYTHONPATH=. DS_ACCELERATOR=cpu python scripts/bench_load.py --out bench_out/load.json
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=15, help="15 x hidden 2048: a 0.96 GB checkpoint")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default=os.path.join(REPO, "bench_out", "load"))
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, REPO)  # this checkout's package, before an installed one
    from deepspeed_async_ckpt.tools.launch import free_port, scratch_dir  # a fixed port failed when another run held it

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch

    import deepspeed_async_ckpt
    from deepspeed_async_ckpt.bench.model import build_model

    deepspeed_async_ckpt.install()
    deepspeed.init_distributed(dist_backend="gloo")
    base = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}

    def engine(async_on: bool, verify: bool = True):
        config = copy.deepcopy(base)
        if async_on:
            config["async_checkpoint"] = {"enabled": True, "verify_on_load": verify}
        torch.manual_seed(0)
        model = build_model(args.hidden, args.layers)
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        loss = eng(torch.randn(2, args.hidden)).sum()
        eng.backward(loss)
        eng.step()
        return eng

    def drop_caches() -> bool:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False

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
