"""A real 2-rank DeepSpeed ZeRO-1 run (CPU, gloo) resuming with the memory tier: the keeper
holds global_step3, the checkpoint directory only global_step2 (rolled back, as after a crash
between two disk saves): the state loaded is bitwise the state saved at step 3, from the
keeper's memory, the save directory unchanged and no tmpfs copy left. With the keeper
SIGKILLed, or one byte of a copy corrupted, the ranks load global_step2 from disk and rank 0
says why in one line (the corrupted file named)."""

import os
import shutil

import pytest
import torch

from _compare import assert_same
from _memory import corrupt_in_memory, fill_keeper, kill_keepers, restore_dirs
from conftest import REPO
from deepspeed_async_ckpt.tools.launch import launch

WORKER = os.path.join(REPO, "tests", "integration", "workers", "memory_ds_worker.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three checkpoints saved by 2 ranks, with the state after each."""
    out = tmp_path_factory.mktemp("saved")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    assert launch(WORKER, ["save", "--out", str(out)], 2, timeout=300, env=env) == [0, 0]
    return out


@pytest.fixture
def job(saved, tmp_path, monkeypatch, repo_env):
    """A copy of the saved job whose keeper holds global_step3 (its ranks' parts as each rank
    would copy them), its checkpoint directory rolled back to global_step2; the environment of
    its ranks. The keepers are killed at teardown."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    save_dir = str(tmp_path / "ckpt")
    client = fill_keeper(save_dir, os.path.join(save_dir, "global_step3"), ranks=(0, 1))
    shutil.rmtree(os.path.join(save_dir, "global_step3"))
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    yield tmp_path, client, dict(repo_env, XDG_RUNTIME_DIR=str(tmp_path / "run"))
    client.close()
    kill_keepers(save_dir)


def resume(out, env, *extra):
    log = str(out / "resume")
    codes = launch(WORKER, ["resume", "--out", str(out), *extra], 2, timeout=300, env=env, log_prefix=log)
    logs = [open(f"{log}.rank{r}.log").read() for r in (0, 1)]
    assert codes == [0, 0], logs
    return logs


def assert_loaded(out, step):
    for rank in (0, 1):
        saved = torch.load(out / f"saved_rank{rank}_step{step}.pt", weights_only=False)
        loaded = torch.load(out / f"loaded_rank{rank}.pt", weights_only=False)
        assert_same(loaded, saved)


def fallback_lines(log):
    return [line for line in log.splitlines() if "from the memory tier" in line and "not loading" in line]


def test_resume_from_the_keepers_newer_checkpoint_bitwise(job):
    out, _, env = job
    listing = sorted(os.listdir(out / "ckpt"))
    logs = resume(out, env)
    assert_loaded(out, 3)
    assert (out / "loaded_path_rank0.txt").read_text().startswith(str(out / "ckpt" / "global_step3"))
    assert sorted(os.listdir(out / "ckpt")) == listing and (out / "ckpt" / "latest").read_text() == "global_step2"
    assert restore_dirs(str(out / "ckpt")) == [] and not any(fallback_lines(log) for log in logs)


def test_an_explicit_tag_loads_the_memory_checkpoint(job):
    out, _, env = job
    resume(out, env, "--tag", "global_step3")
    assert_loaded(out, 3)
    assert restore_dirs(str(out / "ckpt")) == []


def test_a_killed_keeper_resumes_from_disk_in_one_line(job):
    out, client, env = job
    kill_keepers(str(out / "ckpt"))
    logs = resume(out, env)
    assert_loaded(out, 2)
    lines = fallback_lines(logs[0])
    assert len(lines) == 1 and "no memory keeper runs for" in lines[0], logs[0]
    assert fallback_lines(logs[1]) == [] and restore_dirs(str(out / "ckpt")) == []


def test_a_corrupted_byte_in_memory_resumes_from_disk_naming_the_file(job):
    out, client, env = job
    rel = next(n for n in os.listdir(out / "ckpt" / "global_step2") if n.startswith("zero_pp_rank_1_"))
    corrupt_in_memory(client, rel)
    logs = resume(out, env)
    assert_loaded(out, 2)
    lines = fallback_lines(logs[0])
    assert len(lines) == 1 and f"{rel} of rank 1 in memory checkpoint global_step3" in lines[0], logs[0]
    assert restore_dirs(str(out / "ckpt")) == []
