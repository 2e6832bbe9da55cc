"""The main job: a short DeepSpeed training on 2 CPU ranks with `"async_checkpoint"` set,
killed mid-run, resumed from `latest`; then the same model with DeepSpeed's own
TorchCheckpointEngine, to print the training time each checkpoint cost, side by side.

    python scripts/demo.py [--workdir demo_out] [--steps 30] [--kill-at 20] [--nproc 2]

The kill waits until an earlier checkpoint has committed (``--commit-timeout``), so that the run
has one to resume from however slow the machine is; if none commits in time, the demo stops
with an error naming the save directory.

The ranks run on the CPU unless ``DS_ACCELERATOR`` says otherwise (``DS_ACCELERATOR=cuda
scripts/demo.py --nproc 1`` on one GPU, as ``scripts/gpu_check.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # this checkout's package, before an installed one
from deepspeed_async_ckpt.tools.launch import POSITIVE, _seconds, launch, scratch_dir  # noqa: E402
from deepspeed_async_ckpt.bench.lost_time import lost_times, ratio, summary  # noqa: E402


def run(tag, workdir, extra, nproc=2, expect_kill=False, save_dir=None):
    log = os.path.join(workdir, f"{tag}.jsonl")
    args = ["--config", os.path.join(REPO, "configs", "deepspeed_async.json"), "--log", log, *extra]
    print(f"\n$ launch --nproc {nproc} scripts/ds_train.py {' '.join(args)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    codes = launch(os.path.join(HERE, "ds_train.py"), args, nproc, timeout=900, env=env)
    with open(log) as f:
        events = [json.loads(line) for line in f]
    if expect_kill:
        late = [e for e in events if e["event"] == "no_commit"]
        if late:
            raise SystemExit(f"{tag}: no checkpoint committed in {save_dir} within "
                             f"{late[0]['timeout_s']:g} s before the kill at step {late[0]['step']}: "
                             f"nothing to resume from (a very slow disk or machine? raise "
                             f"--commit-timeout)")
        if not all(c == -9 for c in codes):
            raise SystemExit(f"{tag}: expected every rank to be SIGKILLed, exit codes {codes}")
        if not os.path.isfile(os.path.join(save_dir, "latest")):
            raise SystemExit(f"{tag}: killed with no committed checkpoint in {save_dir} (no "
                             f"`latest`): nothing to resume from")
    elif codes != [0] * nproc:
        raise SystemExit(f"{tag}: ranks failed with exit codes {codes}")
    return events


def stalls(events):
    return {e["step"]: e["stall_s"] for e in events if e["event"] == "checkpoint" and e["rank"] == 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", default=os.path.join(REPO, "demo_out"),
                   help="emptied first: a new or empty directory, or one this script made")
    p.add_argument("--steps", type=POSITIVE, default=30)
    p.add_argument("--save-every", type=POSITIVE, default=5)
    p.add_argument("--kill-at", type=POSITIVE, default=20)
    p.add_argument("--nproc", type=POSITIVE, default=2, help="ranks (one GPU each with DS_ACCELERATOR=cuda)")
    p.add_argument("--hidden", type=POSITIVE, default=1024)
    p.add_argument("--layers", type=POSITIVE, default=6)
    p.add_argument("--commit-timeout", type=_seconds, default=300.0, metavar="S",
                   help="how long the killed run waits for an earlier checkpoint to commit before "
                        "the kill (default 300)")
    a = p.parse_args()
    if not (a.save_every < a.kill_at < a.steps and a.kill_at % a.save_every == 0):
        p.error(f"--kill-at {a.kill_at} must be a multiple of --save-every {a.save_every} above it "
                f"and below --steps {a.steps}: the run is killed right after that step's checkpoint "
                f"is issued, and resumes from an earlier one")
    a.workdir = scratch_dir(a.workdir)
    ours_dir, torch_dir = os.path.join(a.workdir, "ckpt_async"), os.path.join(a.workdir, "ckpt_torch")
    common = ["--steps", str(a.steps), "--save-every", str(a.save_every), "--hidden", str(a.hidden),
              "--layers", str(a.layers)]

    print(f"1) async engine: train, checkpoint every {a.save_every} steps, SIGKILL every rank "
          f"right after issuing the step-{a.kill_at} checkpoint (once an earlier one has committed)")
    first = run("async_killed", a.workdir, [*common, "--save-dir", ours_dir, "--kill-at-step", str(a.kill_at),
                                            "--commit-timeout", str(a.commit_timeout)],
                nproc=a.nproc, expect_kill=True, save_dir=ours_dir)
    with open(os.path.join(ours_dir, "latest")) as f:
        latest = f.read()
    print(f"   killed at step {a.kill_at}; `latest` -> {latest} (a checkpoint still being written "
          f"when the process died is never pointed to)")

    print("2) resume from `latest` and finish")
    second = run("async_resumed", a.workdir, [*common, "--save-dir", ours_dir, "--resume"], nproc=a.nproc)
    resumed = next(e for e in second if e["event"] == "resumed" and e["rank"] == 0)
    with open(os.path.join(ours_dir, "latest")) as f:
        latest = f.read()
    print(f"   resumed at step {resumed['step']}, trained to {a.steps}; `latest` -> {latest}")
    kept = sorted((n for n in os.listdir(ours_dir) if n.startswith("global_step")),
                  key=lambda n: int(n[len("global_step"):]))
    print(f"   checkpoints on disk (keep_last=3 in configs/deepspeed_async.json): {', '.join(kept)}")

    print("3) the same model with DeepSpeed's TorchCheckpointEngine (key removed)")
    third = run("torch", a.workdir, [*common, "--save-dir", torch_dir, "--no-async"], nproc=a.nproc)

    ours, theirs = {**stalls(first), **stalls(second)}, stalls(third)
    lost_ours = {**lost_times(first, a.save_every), **lost_times(second, a.save_every)}
    lost_theirs = lost_times(third, a.save_every)
    step_s = statistics.median(e["step_s"] for e in third if e["event"] == "step" and e["rank"] == 0)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(ours_dir, latest))
               for f in fs if f.endswith(".pt"))
    where = os.environ.get("DS_ACCELERATOR", "cpu")
    print(f"\nCheckpoint of {size / 1e6:.0f} MB ({a.nproc} rank(s) on {where}, ZeRO-1, Adam); "
          f"median training step {step_s * 1e3:.0f} ms")
    so, st = summary(list(lost_ours.values())), summary(list(lost_theirs.values()))
    r = ratio(st, so)

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f} ms"

    print(f"Training time lost per checkpoint: async median {ms(so['median_s'])} (worst "
          f"{ms(so['worst_s'])}), TorchCheckpointEngine median {ms(st['median_s'])} (worst "
          f"{ms(st['worst_s'])})" + (f": {r:.1f}x less" if r else ""))
    print(f"{'step':>6} | {'async stall (ms)':>17} | {'TorchCheckpointEngine (ms)':>27} "
          f"| {'async lost (ms)':>16} | {'Torch lost (ms)':>16}")
    for step in sorted(set(ours) & set(theirs)):
        lo, lt = lost_ours.get(step), lost_theirs.get(step)
        print(f"{step:>6} | {ours[step] * 1e3:>17.1f} | {theirs[step] * 1e3:>27.1f} "
              f"| {'-' if lo is None else f'{lo * 1e3:.1f}':>16} | {'-' if lt is None else f'{lt * 1e3:.1f}':>16}")
    print("\nlost = save_checkpoint() time + the extra time of every step until the next save, against "
          "the median step before the run's first save (the first step left out)"
          "\nstall = save_checkpoint() time + any wait for copies at the next optimizer step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
