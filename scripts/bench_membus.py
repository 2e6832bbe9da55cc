"""What the host memory bus alone costs training: the engine's memory traffic without the engine.

One process, one training thread (one intra-op thread, as in ``bench_checkpoint.py --lost``)
trains the benchmark's MLP (hidden 2048, fp32, Adam). Every K steps a background thread, on the
spare core, does what a save does to host memory, with no disk and no engine:

- ``copy``: copies every parameter and Adam moment into a preallocated, populated buffer (the
  snapshot's memcpy: on a CPU-only host the "device-to-host" copy);
- ``copy+xxh128``: the same, then hashes the buffer with xxh128 (the default checksum).

Reported per variant: the extra time of the K steps after each start against the median of
steps with nothing running (the lost-time accounting of ``deepspeed_async_ckpt.bench.lost_time``, without a save
call), median and worst over the rounds. If it is of the size of the engine's lost time, the
loss is memory traffic, which no scheduling of the disk writes removes.

    PYTHONPATH=. python scripts/bench_membus.py --gb 2 --out docs/bench_results/membus.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
import xxhash

from deepspeed_async_ckpt.bench.lost_time import baseline_step, lost_time, summary as lost_summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="checkpoint bytes (weights + 2 Adam moments), 1e9")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--k", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    per_layer = 3 * 4 * (args.hidden * args.hidden + args.hidden)  # weights + 2 moments, fp32
    layers = max(1, round(args.gb * 1e9 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(args.hidden, args.hidden) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.hidden)

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t

    for _ in range(3):
        step()
    tensors = [t for p_ in model.parameters() for t in (p_, opt.state[p_]["exp_avg"], opt.state[p_]["exp_avg_sq"])]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.zero_()  # populated, as the engine's reserved pool is

    def job(kind: str, done: dict) -> None:
        t = time.perf_counter()
        at = 0
        for src in tensors:
            n = src.numel() * src.element_size()
            buf[at:at + n].copy_(src.detach().reshape(-1).view(torch.uint8))  # releases the GIL
            at += n
        done["copy_s"] = time.perf_counter() - t
        if kind == "copy+xxh128":
            t = time.perf_counter()
            h = xxhash.xxh3_128()
            view = memoryview(buf.numpy())
            for i in range(0, nbytes, 64 << 20):
                h.update(view[i:i + (64 << 20)])
            done["hash_s"] = time.perf_counter() - t

    quiet = [step() for _ in range(args.k)]
    results = {}
    for kind in ("copy", "copy+xxh128"):
        lost, jobs = [], []
        for _ in range(args.rounds):
            done: dict = {}
            th = threading.Thread(target=job, args=(kind, done))
            th.start()
            times = [step() for _ in range(args.k)]
            th.join()
            quiet += [step() for _ in range(2)]  # nothing running: more baseline
            lost.append(times)
            jobs.append(done)
        results[kind] = {"rounds": lost, "jobs": jobs}
    base = baseline_step(quiet)
    print(f"{layers} layers, {nbytes / 1e9:.2f} GB of weights and Adam moments; baseline step "
          f"{base * 1e3:.0f} ms (median of {len(quiet)} quiet steps)")
    print("| background work every K steps | lost: median | worst | per round | work alone (copy, hash) |")
    print("|---|---|---|---|---|")
    summary = {}
    for kind, r in results.items():
        per = [lost_time(0.0, times, base) for times in r["rounds"]]  # no save call
        lost = lost_summary(per)
        copy_s = statistics.median(j["copy_s"] for j in r["jobs"])
        hash_s = statistics.median(j.get("hash_s", 0.0) for j in r["jobs"])
        summary[kind] = {"median_s": lost["median_s"], "worst_s": lost["worst_s"], "per_round_s": per,
                         "copy_s": copy_s, "hash_s": hash_s}
        print(f"| {kind} | {lost['median_s'] * 1e3:.0f} ms | {lost['worst_s'] * 1e3:.0f} ms | "
              f"{', '.join(f'{v * 1e3:.0f}' for v in per)} ms | {copy_s * 1e3:.0f} ms, {hash_s * 1e3:.0f} ms |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"gb": nbytes / 1e9, "layers": layers, "k": args.k, "baseline_step_s": base,
                       "quiet_steps": len(quiet), "variants": summary}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
