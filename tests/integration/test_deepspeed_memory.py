"""The memory tier under DeepSpeed, 2 real ranks (CPU, gloo): saving at every step with
``persist_every: 3``, the checkpoint directory holds exactly the saves that persist, the node
keeper's newest checkpoint is always the last save (its state, and for a save on disk its
manifest and bytes), and the keeper ends with the job, leaving no shared-memory segment."""

import json
import os
import signal
import time

import pytest

from conftest import REPO
from deepspeed_async_ckpt.memory.address import KeeperAddress
from deepspeed_async_ckpt.tools.launch import launch

from _memory import keeper_pids, kill_keepers


WORKER = os.path.join(REPO, "tests", "integration", "workers", "ds_memory_worker.py")

pytestmark = pytest.mark.slow


def test_deepspeed_saves_to_memory_every_step_and_to_disk_every_third(tmp_path, repo_env):
    env = dict(repo_env, XDG_RUNTIME_DIR=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    save_dir = str(tmp_path / "ckpt")
    codes = launch(WORKER, ["--out", str(tmp_path), "--zero-stage", "1", "--saves", "7"], 2, timeout=300, env=env)
    assert codes == [0, 0]
    on_disk = sorted(n for n in os.listdir(save_dir) if n.startswith("global_step"))
    assert on_disk == ["global_step1", "global_step4", "global_step7"]  # saves 0, 3 and 6 of the run
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read() == "global_step7"
    with open(tmp_path / "memory.json") as f:
        seen = json.load(f)
    assert [s["newest"] for s in seen] == [f"global_step{i}" for i in range(1, 8)]
    assert all(s["manifest_tag"] == s["newest"] and s["same_state"] for s in seen)
    assert [s["on_disk"] for s in seen] == [True, False, False, True, False, False, True]
    assert all(s["same_bytes"] and s["same_manifest"] for s in seen if s["on_disk"])
    # each rank's ZeRO optimizer file is in its own part; the model states whole in one part
    files = seen[-1]["files"]
    assert sorted(files) == ["0", "1"]
    assert sum(f.endswith("model_states.pt") for fs in files.values() for f in fs) == 1
    assert all(any("optim_states" in f for f in fs) for fs in files.values())
    # the last save persisted: the keeper ended with the job and left no segment
    assert keeper_pids(save_dir) == []
    assert KeeperAddress.of(save_dir).segments_on_node() == []


def _losses(log: str) -> dict:
    with open(log) as f:
        return {(e["rank"], e["step"]): e["loss"] for e in map(json.loads, f) if e["event"] == "step"}


def _starts(log: str) -> dict:
    with open(log) as f:
        return {e["rank"]: e["step"] for e in map(json.loads, f) if e["event"] == "resumed"}


def _resumes_bitwise(run, save_dir, straight, at):
    """Resume the killed job: every rank starts at step ``at`` and trains to step 14 with the
    losses of the ``straight`` run, bit for bit; that run's losses."""
    codes, resumed = run("resumed", save_dir, "--resume")
    assert codes == [0, 0]
    assert _starts(resumed) == {0: at, 1: at}
    got, want = _losses(resumed), _losses(straight)
    assert sorted(step for _, step in got) == [s for s in range(at + 1, 15) for _ in (0, 1)]
    assert got == {k: v for k, v in want.items() if k[1] > at}
    return want


def _trainer(tmp_path, repo_env, per_node=None):
    """``run(name, save_dir, *args, steps=14) -> (exit codes, log)``: ``scripts/ds_train.py`` on
    2 ranks (``per_node``: ranks per node), a save every 2 steps, every 3rd also on disk."""
    env = dict(repo_env, XDG_RUNTIME_DIR=str(tmp_path))
    config = json.load(open(os.path.join(REPO, "configs", "deepspeed_async.json")))
    config["async_checkpoint"]["memory"] = {"enabled": True, "persist_every": 3, "idle_timeout_s": 120}
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config))
    train = os.path.join(REPO, "scripts", "ds_train.py")
    common = ["--config", str(cfg), "--save-every", "2", "--hidden", "64", "--layers", "2"]

    def run(name, save_dir, *extra, steps=14):
        log = str(tmp_path / f"{name}.jsonl")
        codes = launch(train, [*common, "--steps", str(steps), "--save-dir", save_dir, "--log", log, *extra], 2,
                       timeout=300, env=env, log_prefix=str(tmp_path / name), per_node=per_node)
        return codes, log
    return run


def test_every_rank_sigkilled_between_disk_saves_resumes_from_the_last_memory_save_bitwise(tmp_path, repo_env):
    """2 ranks save every 2 steps, every 3rd save also on disk (steps 2 and 8): SIGKILLed right
    after issuing step 12's save, the job resumes from step 10, which only memory held, and
    trains on with the losses of a run never killed; then the keeper ends, no segment left."""
    from deepspeed_async_ckpt.memory.client import KeeperClient

    run = _trainer(tmp_path, repo_env)

    codes, straight = run("straight", str(tmp_path / "straight"))
    assert codes == [0, 0]
    save_dir = str(tmp_path / "ckpt")
    codes, _ = run("killed", save_dir, "--kill-at-step", "12")
    assert codes == [-9, -9]
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read() == "global_step8"  # the newest on disk
    assert not os.path.exists(os.path.join(save_dir, "global_step10"))
    assert keeper_pids(save_dir)  # the keeper outlived every rank
    _resumes_bitwise(run, save_dir, straight, at=10)
    # the straight run's last save (step 14, its 7th) persisted: its keeper ended with it; the
    # resumed run's (its 2nd) stayed in memory only, so its keeper stays for a restart: the job
    # is over, end it as an operator would
    assert KeeperClient.find(str(tmp_path / "straight")) is None
    KeeperClient.find(save_dir).shutdown()
    for d in (save_dir, str(tmp_path / "straight")):
        deadline = time.monotonic() + 30
        while keeper_pids(d) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keeper_pids(d) == []
        assert KeeperAddress.of(d).segments_on_node() == []


def test_two_nodes_keep_their_own_ranks_files_and_a_restart_fetches_the_rest_bitwise(tmp_path, repo_env):
    """The kill above on two nodes (one rank each, a keeper each): each node's keeper holds its
    own rank's files only, and the restart from step 10 (memory only) gets the files its rank
    reads from the other node's keeper, with the losses of a run never killed. Then node 1's
    keeper is SIGKILLed (a node replaced): the next restart loads from disk on every rank,
    saying which node had no keeper."""
    from deepspeed_async_ckpt.memory.client import KeeperClient

    run = _trainer(tmp_path, repo_env, per_node=1)

    codes, straight = run("straight", str(tmp_path / "straight"))
    assert codes == [0, 0]
    save_dir = str(tmp_path / "ckpt")
    codes, _ = run("killed", save_dir, "--kill-at-step", "12")
    assert codes == [-9, -9]
    assert len(keeper_pids(save_dir)) == 2  # a keeper per node outlived its rank
    for node in (0, 1):
        client = KeeperClient.find(save_dir, node=node)
        copy = client.newest()
        assert (copy.name, sorted(copy.ranks)) == ("global_step10", [node])  # its own rank's files only
        assert any("optim_states" in f for f in copy.files(node))
        copy.close()
        client.close()
    want = _resumes_bitwise(run, save_dir, straight, at=10)

    # the resumed run's last save (step 14) is in memory only, step 12 on disk; node 1 replaced
    node1 = [pid for pid in keeper_pids(save_dir) if pid != KeeperClient.find(save_dir).keeper_pid]
    os.kill(node1[0], signal.SIGKILL)
    codes, again = run("replaced", save_dir, "--resume", steps=16)
    assert codes == [0, 0]
    assert _starts(again) == {0: 12, 1: 12}
    with open(tmp_path / "replaced.rank0.log") as f:
        assert "not loading global_step14 from the memory tier (rank 1: " in f.read()
    assert _losses(again)[(0, 14)] == want[(0, 14)]
    kill_keepers(save_dir)
