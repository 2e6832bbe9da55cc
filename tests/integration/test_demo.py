"""The README's first command, `make demo` (= ``scripts/demo.py``), end to end: two CPU ranks
train with async checkpoints, are SIGKILLed right after issuing a save, resume from `latest`
and finish; then the same model with DeepSpeed's TorchCheckpointEngine for the stall table. The
kill waits for an earlier checkpoint to commit, so a slow machine still has one to resume from."""

import json
import os
import re
import subprocess
import sys

import pytest

from deepspeed_async_ckpt.commit import verify_checkpoint

from conftest import REPO  # noqa: E402


@pytest.mark.slow
def test_demo_kills_resumes_from_a_committed_checkpoint_and_prints_the_stall_table(tmp_path, repo_env):
    work = tmp_path / "demo"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--workdir", str(work)],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]

    # After the kill, `latest` names a checkpoint every rank had persisted: 15, or 20 if the
    # step-20 save happened to finish before the SIGKILL; never one that is half written.
    killed_at = re.search(r"killed at step 20; `latest` -> (global_step(\d+))", out)
    assert killed_at, out[-3000:]
    assert int(killed_at.group(2)) in (15, 20)
    resumed = re.search(r"resumed at step (\d+), trained to 30; `latest` -> global_step30", out)
    assert resumed and resumed.group(1) == killed_at.group(2), out[-3000:]
    # the resumed run's first step continues from the checkpoint it loaded
    with open(work / "async_resumed.jsonl") as f:
        events = [json.loads(line) for line in f]
    first_step = min(e["step"] for e in events if e["event"] == "step")
    assert first_step == int(resumed.group(1)) + 1

    ckpt = work / "ckpt_async"
    assert (ckpt / "latest").read_text() == "global_step30"
    # keep_last=3: only the three newest committed checkpoints are left, whichever the kill hit
    kept = sorted(n for n in os.listdir(ckpt) if n.startswith("global_step"))
    assert kept == ["global_step20", "global_step25", "global_step30"], kept
    assert "checkpoints on disk (keep_last=3 in configs/deepspeed_async.json): " \
           "global_step20, global_step25, global_step30" in out, out[-3000:]
    for name in kept:
        verify_checkpoint(str(ckpt / name))
    manifest = verify_checkpoint(str(ckpt / "global_step30"))  # sizes and checksums of every file
    assert any(name.endswith("model_states.pt") for name in manifest["files"])
    assert any("optim_states" in name for name in manifest["files"])  # ZeRO-1: per-rank shards

    rows = re.findall(r"^\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \|", out, flags=re.M)
    assert {int(step) for step, _, _ in rows} >= {5, 10, 15}, out[-3000:]
    assert all(float(ours) > 0 and float(theirs) > 0 for _, ours, theirs in rows)


# The first `latest` a killed run's rank writes comes late: a stand-in for a loaded machine,
# where the saves before the kill have not committed when it comes. Python imports
# `sitecustomize` from PYTHONPATH at start, in the demo's ranks too.
_LATE_FIRST_POINTER = '''
import os
import sys
import time

_replace = os.replace
_late = [float(os.environ["DEMO_TEST_FIRST_POINTER_LATE_S"])]


def replace(src, dst, *args, **kwargs):
    if _late and os.path.basename(os.fspath(dst)) == "latest" and "--kill-at-step" in sys.argv:
        time.sleep(_late.pop())
    return _replace(src, dst, *args, **kwargs)


os.replace = replace
'''

SMALL_DEMO = ["--steps", "8", "--save-every", "2", "--kill-at", "4", "--hidden", "64", "--layers", "2"]


def _demo_with_a_late_first_commit(tmp_path, repo_env, late_s, *extra):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_LATE_FIRST_POINTER)
    env = dict(repo_env, DEMO_TEST_FIRST_POINTER_LATE_S=str(late_s),
               PYTHONPATH=os.pathsep.join([repo_env["PYTHONPATH"], str(hook)]))
    work = tmp_path / "demo"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--workdir", str(work),
                           *SMALL_DEMO, *extra], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    return proc, work


@pytest.mark.slow
def test_the_kill_waits_for_a_commit_so_a_slow_machine_still_has_one_to_resume_from(tmp_path, repo_env):
    """The step-2 save commits 20 s late; the kill after issuing the step-4 save waits for it,
    and the resumed run starts from it."""
    proc, work = _demo_with_a_late_first_commit(tmp_path, repo_env, 20)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    killed_at = re.search(r"killed at step 4; `latest` -> global_step(\d+)", out)
    assert killed_at and killed_at.group(1) in ("2", "4"), out[-3000:]
    with open(work / "async_killed.jsonl") as f:
        killed = [json.loads(line) for line in f]
    assert {e["step"] for e in killed if e["event"] == "killed"} == {4}  # killed mid-training
    assert max(e["step"] for e in killed if e["event"] == "step") == 4
    assert re.search(rf"resumed at step {killed_at.group(1)}, trained to 8; `latest` -> global_step8", out), \
        out[-3000:]


@pytest.mark.slow
def test_no_commit_before_the_kill_is_an_error_naming_the_save_dir(tmp_path, repo_env):
    proc, work = _demo_with_a_late_first_commit(tmp_path, repo_env, 300, "--commit-timeout", "3")
    assert proc.returncode != 0
    assert f"no checkpoint committed in {work / 'ckpt_async'} within 3 s before the kill at step 4" \
        in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("async_killed: ")[-1]
    assert not (work / "async_resumed.jsonl").exists()  # it stopped there
