"""Training killed again and again at random moments resumes to exactly the run that was never
killed (2 CPU ranks, DeepSpeed ZeRO-1, this engine in async mode, ``keep_last: 3``).

``scripts/ds_train.py`` checkpoints every 3 steps; each segment is SIGKILLed (every rank at
once, as a node failure does) a random time after its first step, then relaunched with
``--resume``, until one segment finishes. Every step ever run, in any segment, must give the
loss the uninterrupted run gave at that step, bit for bit (each segment starts from a checkpoint
exactly as saved); each resume loads what ``latest`` named when the segment started, and
resume points never go backward (``latest`` only moves to committed checkpoints); the final
checkpoint equals the uninterrupted run's; and what the kills left (partial saves, staging,
temporaries) is gone once training ends, leaving the ``keep_last`` newest checkpoints and
``latest``: if the last kill cut the final save's retention short, once one more save commits
(retention runs after a commit, so what a kill left during it can only go at the next one).
The seed is in the test id, the kill delays in each failure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

from _compare import assert_same
from conftest import REPO
from deepspeed_async_ckpt.tools.launch import spawn, stop

from deepspeed_async_ckpt.commit import LOCK_FILE, REMOVING_PREFIX, verify_checkpoint

TRAIN = os.path.join(REPO, "scripts", "ds_train.py")
CONFIG = os.path.join(REPO, "configs", "deepspeed_async.json")  # ZeRO-1, keep_last 3
STEPS, EVERY, NPROC = 54, 3, 2


def train_args(steps: int = STEPS) -> list[str]:
    return ["--config", CONFIG, "--steps", str(steps), "--save-every", str(EVERY),
            "--hidden", "512", "--layers", "4"]


pytestmark = pytest.mark.slow


def events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]  # a killed rank's last line may be cut


def run_segment(args: list[str], env: dict, prefix: str, log: str, kill_after: float | None) -> bool:
    """One launch; with ``kill_after``, SIGKILL every rank that long after the first step.
    Returns True if the ranks finished on their own."""
    procs = spawn(TRAIN, [*args, "--log", log], NPROC, env, log_prefix=prefix)
    deadline = time.monotonic() + 240
    killed_at = None
    try:
        while None in [p.poll() for p in procs]:
            assert time.monotonic() < deadline, f"{prefix}: ranks still running"
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank failed on its own: stop the others, the caller reports it
            if kill_after is not None and killed_at is None and \
                    any(e["event"] == "step" for e in events(log)):
                killed_at = time.monotonic() + kill_after
            if killed_at is not None and time.monotonic() >= killed_at:
                break  # every rank at once, as a node failure does: stop() SIGKILLs them
            time.sleep(0.01)
    finally:
        stop(procs)
    codes = [p.returncode for p in procs]
    if codes == [0] * NPROC:
        return True
    assert killed_at is not None and set(codes) <= {0, -signal.SIGKILL}, \
        (codes, [open(f"{prefix}.rank{r}.log").read()[-3000:] for r in range(NPROC)])
    return False


def checkpoint_tensors(ckpt: str) -> dict:
    return {name: torch.load(os.path.join(ckpt, name), weights_only=False)
            for name in sorted(os.listdir(ckpt)) if name.endswith(".pt")}


@pytest.mark.parametrize("seed", [0])
def test_training_killed_at_random_moments_resumes_to_exactly_the_uninterrupted_run(tmp_path, repo_env, seed):
    env = dict(repo_env, PYTHONWARNINGS="ignore")
    straight_dir, chaos_dir = tmp_path / "straight", tmp_path / "chaos"
    assert run_segment([*train_args(), "--save-dir", str(straight_dir)], env, str(tmp_path / "straight"),
                       str(tmp_path / "straight.jsonl"), None)
    straight = events(str(tmp_path / "straight.jsonl"))
    want = {(e["rank"], e["step"]): e["loss"] for e in straight if e["event"] == "step"}
    assert len(want) == NPROC * STEPS
    # training time per step, saves included, from the first step to the end of the run
    first_step = min(e["t"] for e in straight if e["event"] == "step")
    per_step = (max(e["t"] for e in straight if e["event"] == "done") - first_step) / STEPS

    rng = random.Random(seed)
    delays, resumed_at, expected_resumes, seen, kills = [], [], [], 0, 0
    for segment in range(12):
        # a moment in what is left of training (from the checkpoint it will resume from), or in
        # the final flush after it
        latest = chaos_dir / "latest"
        committed = int(latest.read_text()[len("global_step"):]) if latest.exists() else 0
        expected_resumes.append(committed)
        left = (STEPS - committed) * per_step
        # three kills early enough to leave training behind them, one near the end or in the
        # final flush, then let it finish
        kill_after = (rng.uniform(0.0, 0.8 * left) if kills < 3 else
                      rng.uniform(0.8 * left, 1.1 * left) if kills == 3 else None)
        delays.append(None if kill_after is None else round(kill_after, 3))
        args = [*train_args(), "--save-dir", str(chaos_dir)] + (["--resume"] if segment else [])
        log = str(tmp_path / f"seg{segment}.jsonl")
        done = run_segment(args, env, str(tmp_path / f"seg{segment}"), log, kill_after)
        segment_events = events(log)
        where = f"seed {seed}, kill delays {delays}, segment {segment}"
        for e in segment_events:
            if e["event"] == "step":  # every step run, in any segment, as in the straight run
                assert e["loss"] == want[(e["rank"], e["step"])], (where, e)
                seen += 1
            if e["event"] == "resumed" and e["rank"] == 0:
                resumed_at.append(e["step"])
        if done:
            break
        kills += 1
    else:
        pytest.fail(f"training never finished: kill delays {delays}")
    where = f"seed {seed}, kill delays {delays}, resumed at {resumed_at}"
    assert kills >= 3 and seen > NPROC * STEPS, where  # some steps ran twice
    # every resume from the checkpoint `latest` named when it started (training is
    # deterministic: an older one would give the same losses), never going backward
    assert resumed_at == expected_resumes[1:], (where, expected_resumes)
    assert all(step % EVERY == 0 for step in resumed_at), where
    assert resumed_at == sorted(resumed_at), where
    # the end: the uninterrupted run's final checkpoint
    assert (chaos_dir / "latest").read_text() == f"global_step{STEPS}", where
    final = f"global_step{STEPS}"
    assert_same(checkpoint_tensors(str(chaos_dir / final)), checkpoint_tensors(str(straight_dir / final)),
                f"{final} ({where})")
    last = STEPS
    extra = set(checkpoint_names(chaos_dir)) - set(newest(last))
    if extra and resumed_at[-1] == STEPS:
        # The last kill came after the final commit, in the exit flush, before its retention
        # was done; the segment that finished had nothing left to train and committed nothing,
        # and a retention cut short is finished by the next commit (README, "Retention").
        # What is left must be older committed checkpoints or removals begun; one more save
        # must remove them.
        for name in extra:
            if not name.startswith(REMOVING_PREFIX):
                assert name.startswith("global_step") and int(name[len("global_step"):]) < STEPS - 2 * EVERY, \
                    (where, extra)
                verify_checkpoint(str(chaos_dir / name))
        last = STEPS + EVERY
        assert run_segment([*train_args(last), "--save-dir", str(chaos_dir), "--resume"], env,
                           str(tmp_path / "more"), str(tmp_path / "more.jsonl"), None)
    # nothing else the kills left: the keep_last newest checkpoints and latest
    assert checkpoint_names(chaos_dir) == newest(last), (where, os.listdir(chaos_dir))
    for name in newest(last):
        verify_checkpoint(str(chaos_dir / name))


def newest(last: int) -> list[str]:
    """The checkpoints keep_last (3) keeps when ``last`` is the newest step saved, sorted."""
    return sorted(f"global_step{last - EVERY * i}" for i in (2, 1, 0))


def checkpoint_names(chaos_dir) -> list[str]:
    """What the save directory holds besides latest (which must be there) and what DeepSpeed
    and the engine keep beside the checkpoints (recovery scripts, the lock file)."""
    names = set(os.listdir(chaos_dir)) - {"zero_to_fp32.py", "zero_to_torch.py", LOCK_FILE}
    assert "latest" in names, names
    return sorted(names - {"latest"})
