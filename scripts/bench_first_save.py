"""The first save of a process against the later ones: training time lost per checkpoint
(``bench.lost_time``) when the first save comes right after the first optimizer step, as a job
that checkpoints early (or resumes and saves at once) makes it.

One process, DeepSpeed on CPU (gloo, one rank, one compute thread), this package's engine with
its defaults; the model of ``bench_checkpoint.py`` (fp32, torch's fused Adam, no ZeRO: 12
bytes per parameter). Timeline::

    initialize -> step 1 -> save -> K steps -> save -> K steps ... (--saves saves)
    -> wait for the last save -> K quiet steps (the baseline)

The host pool is reserved by the engine on its own (nothing here waits for the reservation),
so a first save that finds it still faulting in waits for it, and that shows as the first
save's lost time against the median of the others. Seconds in the JSON.

    PYTHONPATH=. python scripts/bench_first_save.py --size-gb 0.5 --out bench_out/first_save.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's package, before an installed one


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=0.5, help="checkpoint size, GB (1e9 bytes)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--k", type=int, default=6, help="steps between saves")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--async-config", default="{}", help="extra async_checkpoint keys (JSON)")
    p.add_argument("--work-dir", default=os.path.join(REPO, "bench_out", "first_save"))
    p.add_argument("--out", default=None, help="JSON result (default: stdout only)")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)

    import deepspeed
    import torch
    import torch.nn as nn
    from deepspeed.utils import logger as ds_logger

    from deepspeed_async_ckpt.bench.sizing import layers_for
    from bench_worker import ds_config
    from deepspeed_async_ckpt.bench.model import batch, build_model
    from deepspeed_async_ckpt.bench.lost_time import baseline_step, lost_time, summary
    from deepspeed_async_ckpt.integrations.activation import install

    torch.set_num_threads(1)
    install()
    ds_logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = build_model(args.hidden, layers_for(args.size_gb, args.hidden, 0))
    cfg = ds_config(args.batch, 0, {"async_checkpoint": {"enabled": True,
                                                          **json.loads(args.async_config)}})
    t_init = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t_init
    ours = engine.checkpoint_engine
    n = 0

    def step() -> float:
        nonlocal n
        x, y = batch(n, 0, args.batch, args.hidden, torch.float32)
        t0 = time.perf_counter()
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        n += 1
        return time.perf_counter() - t0

    save_dir = os.path.join(args.work_dir, "ckpt")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    first_step = step()
    reservation = ours.reservation
    reserved = reservation is not None and not reservation.is_alive()  # before the first save
    records = []
    for i in range(args.saves):
        t0 = time.perf_counter()
        engine.save_checkpoint(save_dir, tag=f"s{i}")
        save_s = time.perf_counter() - t0
        records.append({"save_s": save_s, "steps_s": [step() for _ in range(args.k)]})
    t0 = time.perf_counter()
    ours.checkpointer.wait()
    records[-1]["tail_s"] = time.perf_counter() - t0
    quiet = [step() for _ in range(args.k)]
    base = baseline_step(quiet)
    lost = [lost_time(r["save_s"], r["steps_s"], base, r.get("tail_s", 0.0)) for r in records]
    pool = ours.checkpointer.pool
    fence = [h.fence_wait_s for h in list(ours.checkpointer.history)[-args.saves:]]
    out = {"size_gb": args.size_gb, "k": args.k, "init_s": init_s, "first_step_s": first_step,
           "baseline_step_s": base, "lost_s": lost, "first_lost_s": lost[0],
           "later_median_lost_s": statistics.median(lost[1:]) if len(lost) > 1 else None,
           "summary": summary(lost), "fence_wait_s": fence, "records": records, "quiet_steps_s": quiet,
           "reserved_at_first_save": reserved,
           "pool_allocations": pool.allocations, "pool_held_bytes": pool.held_bytes,
           "async_config": json.loads(args.async_config)}
    engine.destroy()
    shutil.rmtree(args.work_dir, ignore_errors=True)
    print(f"{args.size_gb:g} GB, K={args.k}: baseline step {base * 1e3:.0f} ms; lost per save "
          f"{', '.join(f'{x * 1e3:.0f}' for x in lost)} ms (first {lost[0] * 1e3:.0f}, later median "
          f"{(out['later_median_lost_s'] or 0) * 1e3:.0f}); first save call {records[0]['save_s'] * 1e3:.0f} ms, "
          f"next step {records[0]['steps_s'][0] * 1e3:.0f} ms; fence waits {', '.join(f'{x * 1e3:.0f}' for x in fence)} ms; "
          f"reserved by the first save: {out['reserved_at_first_save']}; pool allocations {pool.allocations}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
