"""The memory tier under DeepSpeed, 2 real ranks (CPU, gloo): saving at every step with
``persist_every: 3``, the checkpoint directory holds exactly the saves that persist, the node
keeper's newest checkpoint is always the last save (its state, and for a save on disk its
manifest and bytes), and the keeper ends with the job, leaving no shared-memory segment."""

import json
import os

import pytest

from conftest import REPO
from deepspeed_async_ckpt.memory.address import KeeperAddress
from deepspeed_async_ckpt.tools.launch import launch


WORKER = os.path.join(REPO, "tests", "integration", "workers", "ds_memory_worker.py")

pytestmark = pytest.mark.slow


def keeper_pids(save_dir: str) -> list[int]:
    """Live keepers of ``save_dir`` on this machine, by their command line."""
    want = f"--save-dir\0{os.path.realpath(save_dir)}\0".encode()
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"deepspeed_async_ckpt.memory.keeper" in cmd and want in cmd and state not in "ZX":
            pids.append(int(entry))
    return pids


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
