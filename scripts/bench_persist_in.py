"""A/B of ``persist_in``: the training time one checkpoint costs with the files written by
writer threads in the training process (``"thread"``) or by a worker process (``"process"``).

One process, one rank, no DeepSpeed: an MLP trained with Adam (``--device``; on the CPU with
``--threads`` intra-op threads), its model and optimizer state (``--gb``, 1e9 bytes) saved every ``--k``
steps. Lost time per checkpoint = the save call (``begin``/``save``/``end``) + what the ``k``
steps after it took beyond the median step without a save in flight. On busy cores that is
noisy, so CPU time is counted too, which load does not change: the training process's CPU
seconds per checkpoint beyond its training thread's (the background work run in its
interpreter), and the worker process's. The two modes take turns,
checkpoint by checkpoint, so that load on a shared machine falls on both alike.

    python scripts/bench_persist_in.py --gb 0.25 --saves 6 --out /tmp/bench_persist_in
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_async_ckpt.commit import Pointer  # noqa: E402
from deepspeed_async_ckpt.config import AsyncCheckpointConfig  # noqa: E402
from deepspeed_async_ckpt.core import AsyncCheckpointer  # noqa: E402

MODES = ("thread", "process")


def _process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all threads), or of process ``pid``."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=0.25, help="checkpoint size, 1e9 bytes")
    p.add_argument("--saves", type=int, default=6, help="timed checkpoints per mode")
    p.add_argument("--k", type=int, default=10, help="training steps per checkpoint")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of training")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", default="/tmp/bench_persist_in")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = max(1, round(args.gb * 1e9 / (12 * args.hidden * args.hidden)))  # fp32 weight + 2 moments
    device = torch.device(args.device)
    model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.hidden, device=device)

    def step(ck: AsyncCheckpointer | None) -> float:
        start = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        if ck is not None:
            ck.fence()  # the lazy copies of the last save are done before the weights change
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(3):
        step(None)
    shutil.rmtree(args.out, ignore_errors=True)
    cks = {m: AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=2 * args.gb,
                                                      persist_in=m, keep_last=1)) for m in MODES}
    lost: dict[str, list[float]] = {m: [] for m in MODES}
    calls: dict[str, list[float]] = {m: [] for m in MODES}
    background: dict[str, list[float]] = {m: [] for m in MODES}  # CPU s beside training, here
    worker_cpu: dict[str, list[float]] = {m: [] for m in MODES}
    quiet: list[float] = []
    try:
        for n in range(args.saves + 1):  # the first round starts the worker and fills the pool
            for mode, ck in cks.items():
                quiet += [step(ck) for _ in range(args.k)]  # no save in flight: the baseline
                root = os.path.join(args.out, mode)
                tag = f"s{n}"
                pid = ck._files._persist._worker.process.pid if mode == "process" else None
                cpu0, train0, wcpu0 = _process_cpu_s(), time.thread_time(), pid and _process_cpu_s(pid)
                start = time.perf_counter()
                ck.begin(os.path.join(root, tag), tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
                ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(root, tag, "state.pt"))
                ck.end()
                call = time.perf_counter() - start
                after = [step(ck) for _ in range(args.k)]
                ck.wait()
                training = time.thread_time() - train0
                cpu = _process_cpu_s() - cpu0
                if n:
                    background[mode].append(cpu - training)
                    worker_cpu[mode].append(_process_cpu_s(pid) - wcpu0 if pid else 0.0)
                    calls[mode].append(call)
                    lost[mode].append(call + sum(after) - args.k * statistics.median(quiet))
    finally:
        for ck in cks.values():
            ck.close()
    result = {"gb": args.gb, "layers": layers, "k": args.k, "threads": args.threads, "device": args.device,
              "step_s": statistics.median(quiet),
              **{m: {"lost_s_median": statistics.median(lost[m]), "lost_s": lost[m],
                     "save_call_s_median": statistics.median(calls[m]),
                     "background_cpu_s_median": statistics.median(background[m]),
                     "worker_cpu_s_median": statistics.median(worker_cpu[m])} for m in MODES}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
