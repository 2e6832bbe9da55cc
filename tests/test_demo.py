"""The README's first command, `make demo` (= ``scripts/demo.py``), end to end: two CPU ranks
train with async checkpoints, are SIGKILLed right after issuing a save, resume from `latest`
and finish; then the same model with DeepSpeed's TorchCheckpointEngine for the stall table."""

import json
import os
import re
import subprocess
import sys

import pytest

from deepspeed_async_ckpt.commit import verify_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
