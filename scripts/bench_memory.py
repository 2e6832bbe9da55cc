"""The memory tier, end to end: every rank SIGKILLed at a random step, the job restarted, and
where it resumed from; what a memory-only save costs training against a save to disk.

    python scripts/bench_memory.py [--workdir bench_out/memory] [--nproc 2] [--trials 3]
                                   [--hidden 4096] [--layers 6] [--steps 24] [--save-every 2]
                                   [--persist-every 3] [--out bench_out/memory.json]

One uninterrupted run gives the reference losses. Then, per trial, the same run with
``"memory": {"enabled": true, "persist_every": P}`` saves every K steps (every P-th save also to
disk) and every rank is SIGKILLed right after issuing the save of a random step (once the first
disk save and the save before it in memory committed, as ``ds_train.py --kill-at-step`` waits);
the restarted job loads with
``load_checkpoint`` and trains to the end. Reported per trial: the step killed at, the step
resumed from, the newest step on disk (what a restart without the tier resumes from), whether
every loss after the resume equals the uninterrupted run's bit for bit, and the load's time.
Then the saves of the runs: the save call plus the wait at the next step's fence, memory-only
saves against saves that also went to disk and against the same run without the tier (every
save to disk). Prints a table and writes JSON.

The ranks run on the CPU (``DS_ACCELERATOR=cpu``) unless told otherwise. The load from memory
against a cold checkpoint directory alone: ``scripts/bench_memory_load.py``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # this checkout's package, before an installed one
from deepspeed_async_ckpt.memory.client import KeeperClient  # noqa: E402
from deepspeed_async_ckpt.tools.launch import POSITIVE, launch, scratch_dir  # noqa: E402


def _config(workdir: str, persist_every: int, memory: bool) -> str:
    with open(os.path.join(REPO, "configs", "deepspeed_async.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["async_checkpoint"]["host_buffer_gb"] = 4
    if memory:
        config["async_checkpoint"]["memory"] = {"enabled": True, "persist_every": persist_every, "keep_last": 2}
    path = os.path.join(workdir, f"ds_config_{'memory' if memory else 'disk'}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def _run(workdir: str, name: str, args: list[str], nproc: int, expect_kill: bool = False) -> list[dict]:
    log = os.path.join(workdir, f"{name}.jsonl")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("DS_ACCELERATOR", "cpu")
    codes = launch(os.path.join(HERE, "ds_train.py"), [*args, "--log", log], nproc, timeout=1800, env=env,
                   log_prefix=os.path.join(workdir, name))
    if expect_kill and not all(c == -9 for c in codes):
        raise SystemExit(f"{name}: expected every rank SIGKILLed, exit codes {codes} (logs: {workdir}/{name}.rank*.log)")
    if not expect_kill and codes != [0] * nproc:
        raise SystemExit(f"{name}: ranks failed with exit codes {codes} (logs: {workdir}/{name}.rank*.log)")
    with open(log, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _end_keeper(save_dir: str) -> None:
    """A run whose last save stayed in memory leaves its keeper up for a restart (until its
    idle timeout): end it, so that the next trial's keeper does not share the memory with it."""
    client = KeeperClient.find(save_dir)
    if client is not None:
        client.shutdown()


def _losses(events: list[dict]) -> dict[tuple[int, int], float]:
    return {(e["rank"], e["step"]): e["loss"] for e in events if e["event"] == "step"}


def _on_disk(save_dir: str) -> int | None:
    try:
        with open(os.path.join(save_dir, "latest"), encoding="utf-8") as f:
            return int(f.read().strip()[len("global_step"):])
    except (OSError, ValueError):
        return None


def _stalls(events: list[dict], save_every: int, persist_every: int) -> dict[str, list[float]]:
    """Per save (rank 0): the call plus the next step's fence wait, by kind."""
    out: dict[str, list[float]] = {"memory-only": [], "memory + disk": []}
    for e in events:
        if e["event"] == "checkpoint" and e["rank"] == 0:
            index = e["step"] // save_every - 1  # the save's index in its run, from 0
            out["memory + disk" if index % persist_every == 0 else "memory-only"].append(e["stall_s"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(REPO, "bench_out", "memory"))
    p.add_argument("--out", default=os.path.join(REPO, "bench_out", "memory.json"))
    p.add_argument("--nproc", type=POSITIVE, default=2)
    p.add_argument("--trials", type=POSITIVE, default=3)
    p.add_argument("--hidden", type=POSITIVE, default=4096)
    p.add_argument("--layers", type=POSITIVE, default=6)
    p.add_argument("--steps", type=POSITIVE, default=24)
    p.add_argument("--save-every", type=POSITIVE, default=2)
    p.add_argument("--persist-every", type=POSITIVE, default=3)
    p.add_argument("--seed", type=int, default=None, help="of the kill steps (default: from the clock)")
    a = p.parse_args()
    first_disk_save = a.save_every  # save 0 persists
    kill_steps = [s for s in range(first_disk_save + a.save_every, a.steps, a.save_every)]
    if not kill_steps:
        p.error("--steps leaves no save after the first one to kill at")
    workdir = scratch_dir(a.workdir)
    rng = random.Random(a.seed if a.seed is not None else time.time_ns())
    common = ["--steps", str(a.steps), "--save-every", str(a.save_every), "--hidden", str(a.hidden),
              "--layers", str(a.layers)]
    memory_config = _config(workdir, a.persist_every, memory=True)

    print(f"reference: {a.steps} steps, {a.nproc} ranks, a save every {a.save_every} steps, "
          f"every {a.persist_every}-th also to disk, no kill", flush=True)
    ref_dir = os.path.join(workdir, "ckpt_reference")
    try:
        reference = _run(workdir, "reference", [*common, "--config", memory_config, "--save-dir", ref_dir], a.nproc)
    finally:
        _end_keeper(ref_dir)
    want = _losses(reference)
    stalls = _stalls(reference, a.save_every, a.persist_every)
    newest = os.path.join(ref_dir, f"global_step{_on_disk(ref_dir)}")
    state_bytes = sum(os.path.getsize(f) for f in glob.glob(os.path.join(newest, "*.pt")))

    print("the same run without the memory tier: every save to disk", flush=True)
    disk_dir = os.path.join(workdir, "ckpt_disk_only")
    disk_only = _run(workdir, "disk_only", [*common, "--config", _config(workdir, a.persist_every, memory=False),
                                            "--save-dir", disk_dir], a.nproc)
    stalls["disk only (no memory tier)"] = [e["stall_s"] for e in disk_only if e["event"] == "checkpoint"
                                            and e["rank"] == 0]

    trials = []
    for t in range(a.trials):
        kill = rng.choice(kill_steps)
        save_dir = os.path.join(workdir, f"ckpt_trial{t}")
        print(f"trial {t}: SIGKILL every rank after issuing the save of step {kill}", flush=True)
        _run(workdir, f"trial{t}_killed", [*common, "--config", memory_config, "--save-dir", save_dir,
                                           "--kill-at-step", str(kill)], a.nproc, expect_kill=True)
        disk = _on_disk(save_dir)
        try:
            resumed = _run(workdir, f"trial{t}_resumed", [*common, "--config", memory_config, "--save-dir", save_dir,
                                                          "--resume"], a.nproc)
        finally:
            _end_keeper(save_dir)
        start = next(e for e in resumed if e["event"] == "resumed" and e["rank"] == 0)
        got = _losses(resumed)
        equal = bool(got) and all(want.get(k) == v for k, v in got.items())
        for kind, values in _stalls(resumed, a.save_every, a.persist_every).items():
            stalls[kind] += values
        trials.append({"killed_at": kill, "resumed_from": start["step"], "on_disk": disk,
                       "steps_back": kill - start["step"], "losses_bitwise_equal": equal,
                       "load_s": start.get("load_s"), "path": start.get("path")})
        print(f"   resumed from step {start['step']} (disk held step {disk}); losses after it "
              f"{'bitwise equal' if equal else 'DIFFER'}", flush=True)

    summary = {kind: {"saves": len(v), "median_ms": statistics.median(v) * 1e3 if v else None,
                      "max_ms": max(v) * 1e3 if v else None} for kind, v in stalls.items()}
    result = {"config": vars(a), "state_bytes_per_save_rank0_files": state_bytes, "trials": trials,
              "save_cost": summary}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)

    print(f"\nstate: {state_bytes / 1e9:.2f} GB in one checkpoint's files")
    print(f"{'trial':>5} | {'killed at':>9} | {'resumed from':>12} | {'disk held':>9} | {'steps back':>10} "
          f"| {'losses':>14} | {'load (s)':>8}")
    for i, t in enumerate(trials):
        load = "-" if t["load_s"] is None else f"{t['load_s']:.2f}"
        print(f"{i:>5} | {t['killed_at']:>9} | {t['resumed_from']:>12} | {str(t['on_disk']):>9} | "
              f"{t['steps_back']:>10} | {'bitwise equal' if t['losses_bitwise_equal'] else 'DIFFER':>14} | {load:>8}")
    print(f"\n{'save (rank 0)':>26} | {'saves':>5} | {'call + fence, median (ms)':>26} | {'max (ms)':>8}")
    for kind, s in summary.items():
        med = "-" if s["median_ms"] is None else f"{s['median_ms']:.1f}"
        mx = "-" if s["max_ms"] is None else f"{s['max_ms']:.1f}"
        print(f"{kind:>26} | {s['saves']:>5} | {med:>26} | {mx:>8}")
    print(f"\nwrote {a.out}")
    ok = all(t["losses_bitwise_equal"] and t["steps_back"] <= a.save_every for t in trials)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
