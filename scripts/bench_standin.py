"""A CPU stand-in for a GPU training step, and what a checkpoint costs it, measured A/B.

On a GPU the training thread launches kernels: thousands of small calls a step, each one
short, the data on the device. Its host-side cost is Python and the dispatcher on one core,
and it waits for the GIL whenever another thread of the process holds it. This stand-in
reproduces that on a CPU: one training thread (``OMP_NUM_THREADS=1``) runs many small torch
ops on 32x32 tensors (a working set far inside L2) for about ``--step-ms`` a step, then a
DeepSpeed step of a tiny head, through which the engine's fence runs. Beside it the model
holds a frozen parameter of ``--gb`` (1e9 bytes) that every checkpoint saves: the state to
copy and write, which the training step itself never touches. One rank; on a 2-core machine
one core is spare, as a GPU node's host cores are while the GPUs compute.

Per engine (``--engines``: ``torch`` = DeepSpeed's ``TorchCheckpointEngine``, ``threads`` =
this engine with its defaults, ``process`` = this engine with ``persist_in: "process"``), in
one process, on the same model: ``--events`` events every ``--interval`` steps in ABBA order,
real saves and shams (``lost_time.abba``). A sham is the same branch of the loop at the same
step with the same timers and the same wait for the previous event's work, the
``save_checkpoint`` call left out: nothing is copied or written. Each event's loss is its call
+ the extra time of the ``--window`` steps after it against the median of the ``--base`` steps
just before it + any wait for it at the next event; a real save's cost is mean(real) -
mean(sham) with a 95% interval, beside the sham-against-sham floor (``lost_time.ab_summary``).
The previous real save's directory is deleted after that wait, between steps, for every
engine alike.

Beside each event (``thread_probe``): every thread's CPU seconds, run-queue wait and wake-ups
(the persist worker's too), the training thread's split of each step into on-CPU,
waiting-for-a-core and asleep (GIL or fence), the fence's waits, the process's page faults
and resident memory, the machine's page cache and dirty bytes. ``--thread-steps`` also
samples every thread after every step (off by default: it costs time between steps).

    PYTHONPATH=. python scripts/bench_standin.py --out bench_out/standin.json   # ~6 min, 2 idle cores

Prints a table and writes every step's time, every event and the summaries to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's package, before an installed one
from deepspeed_async_ckpt.bench import lost_time  # noqa: E402
from deepspeed_async_ckpt.bench import thread_probe  # noqa: E402
from deepspeed_async_ckpt.bench.usage import timed  # noqa: E402

now = time.perf_counter
ENGINES = {"torch": "DS TorchCheckpointEngine", "threads": "this engine (threads)",
           "process": 'this engine (persist_in "process")'}


def _single_rank_env() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


class Loop:
    """The launch-bound step: ``ops`` small matmul+tanh pairs, then a DeepSpeed step of the head."""

    def __init__(self, engine, torch) -> None:
        self.engine, self.torch = engine, torch
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 32, generator=g)
        self.w = torch.randn(32, 32, generator=g) * 0.1
        self.ops = 50
        self.fence_waits: list[float] = []

    def step(self) -> None:
        torch, x = self.torch, self.x
        for _ in range(self.ops):
            x = torch.tanh(torch.mm(x, self.w))
        loss = self.engine(x).square().mean()
        self.engine.backward(loss)
        self.engine.step()

    def calibrate(self, step_s: float) -> None:
        """Set ``ops`` so that a step takes about ``step_s``."""
        for _ in range(3):
            self.step()
        for _ in range(3):
            t = now()
            self.step()
            took = now() - t
            self.ops = max(1, round(self.ops * step_s / max(took, 1e-6)))


class Recorder:
    """Every step's wall time and the training thread's split of it."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.rq: list[float] = []
        self.thread_steps: list[dict] | None = None
        self._own = thread_probe.own_times()
        self._threads = None

    def mark(self) -> None:
        """Start the next step's accounting here: what ran since the last step (a save call)
        is not the step's."""
        self._own = thread_probe.own_times()

    def step(self) -> None:
        t = now()
        self.loop.step()
        wall = now() - t
        own = thread_probe.own_times()  # between steps, never in the timed one
        self.wall.append(wall)
        self.cpu.append(own[0] - self._own[0])
        self.rq.append(own[1] - self._own[1])
        self._own = own
        if self.thread_steps is not None:
            s = thread_probe.sample()
            self.thread_steps.append(thread_probe.delta(self._threads, s) if self._threads else {})
            self._threads = s
            self._own = thread_probe.own_times()


class Adapter:
    """How the loop saves with one engine, waits for it, and removes it afterwards."""

    def __init__(self, name: str, engine, ckpt_engine, root: str) -> None:
        from deepspeed_async_ckpt.integrations.deepspeed.patches import use_checkpoint_engine

        self.name, self.engine, self.ckpt_engine = name, engine, ckpt_engine
        self.root = os.path.join(root, name)
        self.pending: list[str] = []
        use_checkpoint_engine(engine, ckpt_engine)
        self.checkpointer = getattr(ckpt_engine, "checkpointer", None)

    def event(self, kind: str, tag: str) -> None:
        """The event at its step: a real save, or (``kind`` "S") the same branch without it."""
        if kind == "R":
            self.engine.save_checkpoint(self.root, tag=tag)
            self.pending.append(tag)

    def drain(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def clean(self) -> None:
        for tag in self.pending:
            shutil.rmtree(os.path.join(self.root, tag), ignore_errors=True)
        self.pending = []

    def close(self) -> None:
        self.drain()
        self.clean()
        if self.checkpointer is not None:
            self.ckpt_engine.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)


def run_engine(adapter: Adapter, loop: Loop, args) -> dict:
    """One engine's ABBA run: a warm-up save, then ``args.events`` events; every step kept."""
    ck = adapter.checkpointer
    if ck is not None:  # the fence's waits, timed where the optimizer step makes them
        fence = ck.fence  # a new list of waits per event: looked up at each call
        ck.fence = timed(fence, lambda seconds: loop.fence_waits.append(seconds))
    rec = Recorder(loop)
    adapter.event("R", "warmup")  # one-time costs (a pool, a worker's start) out of the figure
    for _ in range(args.interval):
        rec.step()
    adapter.drain()
    adapter.clean()
    if args.thread_steps:
        rec.thread_steps = []
    for _ in range(args.base):
        rec.step()
    labels = lost_time.abba(args.events)
    events: list[dict] = []
    deadline = getattr(args, "deadline", None)  # time.perf_counter() to be done by, if any
    for e, kind in enumerate(labels + ["end"]):
        if deadline is not None and e % 4 == 0 and kind != "end" and events:
            block = 4 * args.interval * statistics.median(rec.wall) + 2 * max(
                ev["call_s"] + ev.get("tail_s", 0.0) for ev in events)
            if now() + block > deadline:  # whole ABBA blocks only, so drift still cancels
                labels, kind = labels[:e], "end"
        t = now()
        adapter.drain()
        if events:
            events[-1]["tail_s"] = now() - t
        t = now()
        adapter.clean()
        if events:
            events[-1]["clean_s"] = now() - t
            events[-1]["threads"] = thread_probe.delta(threads0, thread_probe.sample())
            events[-1]["memory_after"] = thread_probe.memory()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            events[-1]["minflt"], events[-1]["majflt"] = ru.ru_minflt - ru0.ru_minflt, ru.ru_majflt - ru0.ru_majflt
        if kind == "end":
            break
        threads0, ru0 = thread_probe.sample(), resource.getrusage(resource.RUSAGE_SELF)
        memory0 = thread_probe.memory()
        loop.fence_waits = []
        t = now()
        adapter.event(kind, f"e{e}")
        call = now() - t
        rec.mark()
        start = len(rec.wall)
        for _ in range(args.interval):
            rec.step()
        events.append({"kind": kind, "step": start, "call_s": call, "fence_s": sum(loop.fence_waits),
                       "fence_waits": len(loop.fence_waits), "memory_before": memory0})
    for ev in events:
        s = ev["step"]
        ev["loss_s"], ev["baseline_s"] = lost_time.event_loss(
            rec.wall[s - args.base:s], rec.wall[s:s + args.window], ev["call_s"], ev["tail_s"])
        win = slice(s, s + args.window)
        ev["train_cpu_s"], ev["train_rq_s"] = sum(rec.cpu[win]), sum(rec.rq[win])
        ev["train_asleep_s"] = sum(rec.wall[win]) - ev["train_cpu_s"] - ev["train_rq_s"]
    interval_s = args.interval * statistics.median(rec.wall)
    out = {"label": ENGINES[adapter.name], "labels": labels, "events": events, "interval_s": interval_s,
           "steps_s": rec.wall, "train_cpu_s": rec.cpu, "train_rq_s": rec.rq,
           "summary": lost_time.ab_summary(labels, [ev["loss_s"] for ev in events], interval_s)}
    out["by_kind"] = by_kind(events)
    if rec.thread_steps is not None:
        out["thread_steps"] = rec.thread_steps
    if ck is not None:
        ck.fence = fence
    return out


def by_kind(events: list[dict]) -> dict:
    """Mean per event of real saves and of shams: the call, the fence, the training thread's
    split, faults, and every thread's CPU, run-queue wait and wake-ups."""
    out = {}
    for kind in ("R", "S"):
        evs = [ev for ev in events if ev["kind"] == kind]
        if not evs:
            continue
        n = len(evs)
        mean = {k: sum(ev[k] for ev in evs) / n for k in ("call_s", "tail_s", "fence_s", "train_cpu_s",
                                                           "train_rq_s", "train_asleep_s", "minflt", "majflt")}
        mean["rss_change_bytes"] = sum(ev["memory_after"]["rss_bytes"] - ev["memory_before"]["rss_bytes"]
                                       for ev in evs) / n
        mean["threads"] = {k: {f: v[f] / n for f in v} for k, v in thread_probe.total(ev["threads"] for ev in evs).items()}
        out[kind] = mean
    return out


def build(args):
    _single_rank_env()
    import torch
    import deepspeed
    from deepspeed.utils import logger as ds_logger
    import logging

    from deepspeed_async_ckpt.integrations.activation import install

    install()
    ds_logger.setLevel(logging.WARNING)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    deepspeed.init_distributed(dist_backend="gloo")

    class StandIn(torch.nn.Module):
        def __init__(self, nbytes: int) -> None:
            super().__init__()
            self.frozen = torch.nn.Parameter(torch.empty(max(1, nbytes // 4)), requires_grad=False)
            self.frozen.data.uniform_(-1, 1)
            self.head = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.head(x)

    model = StandIn(int(args.gb * 1e9))
    cfg = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
           "checkpoint": {"tag_validation": "Ignore"},
           "async_checkpoint": {"enabled": True, **json.loads(args.async_config)}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.head.parameters(), config=cfg)
    return torch, engine, cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="the frozen state every checkpoint saves, 1e9 bytes")
    p.add_argument("--step-ms", type=float, default=20.0, help="target step time")
    p.add_argument("--interval", type=int, default=150, help="steps between events")
    p.add_argument("--window", type=int, default=None, help="steps counted after an event (default: --interval)")
    p.add_argument("--base", type=int, default=50, help="steps before an event whose median is its baseline")
    p.add_argument("--events", type=int, default=32, help="events per engine, half real (>= 20 for the figure)")
    p.add_argument("--engines", default="torch,threads,process")
    p.add_argument("--async-config", default="{}", help="more async_checkpoint keys for this engine (JSON)")
    p.add_argument("--thread-steps", action="store_true", help="sample every thread after every step")
    p.add_argument("--work-dir", default=os.path.join(os.path.dirname(HERE), "bench_out", "standin"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.window = args.window or args.interval
    if not 1 <= args.window <= args.interval or args.base > args.interval or args.base < 1:
        p.error("--window must be 1..--interval and --base 1..--interval")
    engines = [e for e in args.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        p.error(f"--engines: unknown {bad}; choose from {sorted(ENGINES)}")
    from deepspeed_async_ckpt.tools.launch import scratch_dir

    root = scratch_dir(args.work_dir)
    t_start = now()
    torch, engine, cfg = build(args)
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.integrations.deepspeed.engine import AsyncCheckpointEngine

    ours = engine.checkpoint_engine
    if ours.reservation is not None:
        ours.reservation.join()
    loop = Loop(engine, torch)
    loop.calibrate(args.step_ms / 1e3)
    result = {"config": {**vars(args), "ops_per_step": loop.ops, "cores": os.cpu_count(),
                         "loadavg_start": os.getloadavg(), "torch": torch.__version__},
              "engines": {}}
    for name in engines:
        if name == "torch":
            ckpt = TorchCheckpointEngine(engine._config)
        elif name == "threads":
            ckpt = ours
        else:
            keys = {**cfg["async_checkpoint"], "persist_in": "process"}
            ckpt = AsyncCheckpointEngine(engine._config, AsyncCheckpointConfig(**keys), zero_stage=0)
        adapter = Adapter(name, engine, ckpt, root)
        result["engines"][name] = run_engine(adapter, loop, args)
        adapter.close()
        print(f"{name}: done at {now() - t_start:.0f} s", flush=True)
    engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
    shutil.rmtree(root, ignore_errors=True)
    result["config"]["loadavg_end"] = os.getloadavg()
    result["config"]["seconds"] = now() - t_start
    print(table(result))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"wrote {args.out}")
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def table(result: dict) -> str:
    """The figure per engine, and the threads that ran more after a real save than a sham."""
    engines = result["engines"]
    torch_diff = engines.get("torch", {}).get("summary", {}).get("real_minus_sham", {}).get("diff_s")
    lines = ["| engine | save call (median) | lost per checkpoint: real - sham [95%] | A/A floor [95%] | "
             "Torch engine / this | % of interval | step | interval |", "|---|---|---|---|---|---|---|---|"]
    for name, r in engines.items():
        d, aa = r["summary"]["real_minus_sham"], r["summary"]["sham_a_minus_sham_b"]
        call = statistics.median(ev["call_s"] for ev in r["events"] if ev["kind"] == "R")
        ratio = (f"{torch_diff / d['diff_s']:.1f}x" if torch_diff and torch_diff > 0 and d["diff_s"] and d["diff_s"] > 0
                 and name != "torch" else "-")
        frac = r["summary"].get("fraction_of_interval")
        lines.append(f"| {r['label']} | {_ms(call)} ms | {_ms(d['diff_s'])} ms [{_ms(d['lo_s'])}, {_ms(d['hi_s'])}] | "
                     f"{_ms(aa['diff_s'])} ms [{_ms(aa['lo_s'])}, {_ms(aa['hi_s'])}] | {ratio} | "
                     f"{'-' if frac is None else f'{frac * 100:.2f}%'} | "
                     f"{statistics.median(r['steps_s']) * 1e3:.1f} ms | {r['interval_s']:.2f} s |")
    lines += ["", "| engine | training thread, real - sham per event: on CPU, waiting for a core, asleep | "
              "fence per real save | threads beside it, real - sham per event (CPU ms, wake-ups) |", "|---|---|---|---|"]
    for name, r in engines.items():
        k = r["by_kind"]
        if "R" not in k or "S" not in k:
            continue
        R, S = k["R"], k["S"]
        beside = []
        for label in sorted(R["threads"], key=lambda t: -(R["threads"][t]["cpu_s"] - S["threads"].get(t, {}).get("cpu_s", 0))):
            if label == "MainThread" or "(all threads)" in label:
                continue
            dc = R["threads"][label]["cpu_s"] - S["threads"].get(label, {}).get("cpu_s", 0)
            dw = R["threads"][label]["wakeups"] - S["threads"].get(label, {}).get("wakeups", 0)
            if abs(dc) >= 1e-3 or dw >= 5:
                beside.append(f"{label} {dc * 1e3:.0f} ms, {dw:.0f}")
        total = sum(R["threads"].get(t, {}).get("cpu_s", 0) - S["threads"].get(t, {}).get("cpu_s", 0)
                    for t in ("(all threads)", "worker:(all threads)"))
        beside.insert(0, f"all threads {total * 1e3:.0f} ms")
        lines.append(f"| {r['label']} | {_ms(R['train_cpu_s'] - S['train_cpu_s'])}, "
                     f"{_ms(R['train_rq_s'] - S['train_rq_s'])}, {_ms(R['train_asleep_s'] - S['train_asleep_s'])} ms | "
                     f"{_ms(R['fence_s'])} ms | {'; '.join(beside[:8]) or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
