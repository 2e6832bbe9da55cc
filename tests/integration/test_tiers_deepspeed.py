"""A real 2-rank DeepSpeed ZeRO-1 run (CPU, gloo) with an S3 tier: save, lose the first tier
(a replaced node's empty disk), resume from the durable tier: the state loaded is bitwise the
state saved; and where the tier's newest has lost a file too, the newest checkpoint the tier
holds whole is loaded instead, on every rank."""

import json
import os
import shutil

import pytest
import torch

from _compare import assert_same
from conftest import REPO
from deepspeed_async_ckpt.tools.launch import launch
from s3server import s3, s3_server  # noqa: F401  (fixtures)

WORKER = os.path.join(REPO, "tests", "integration", "workers", "tiers_ds_worker.py")

pytestmark = pytest.mark.slow


def test_resume_from_the_s3_tier_after_losing_the_first_tier(tmp_path, s3, repo_env):
    env = dict(repo_env, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    args = ["--out", str(tmp_path), "--url", s3.url("job"), "--endpoint", s3.endpoint]
    assert launch(WORKER, ["save", *args], 2, timeout=300, env=env) == [0, 0]
    assert json.load(open(tmp_path / "drained.json"))[-1] == "global_step3"
    local = tmp_path / "ckpt" / "global_step3"
    for rel in json.load(open(local / ".async_ckpt" / "manifest.json"))["files"]:
        assert s3.get(f"job/global_step3/{rel}") == (local / rel).read_bytes()
    assert s3.get("job/latest") == b"global_step3"
    shutil.rmtree(tmp_path / "ckpt")
    assert launch(WORKER, ["resume", *args], 2, timeout=300, env=env) == [0, 0]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"saved_rank{rank}.pt", weights_only=False)
        loaded = torch.load(tmp_path / f"loaded_rank{rank}.pt", weights_only=False)
        assert_same(loaded, saved)
    # the first tier gone again, and one file of the tier's newest lost: the one drained before
    # it instead (global_step2, or global_step1 where the backlog rule skipped global_step2)
    older = json.load(open(tmp_path / "drained.json"))[-2]
    shutil.rmtree(tmp_path / "ckpt")
    s3.client.delete_object(Bucket=s3.name, Key="job/global_step3/mp_rank_00_model_states.pt")
    assert launch(WORKER, ["resume", *args], 2, timeout=300, env=env) == [0, 0]
    assert (tmp_path / "ckpt" / "latest").read_text() == older
    assert not (tmp_path / "ckpt" / "global_step3").exists()
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"saved_rank{rank}_step{older[len('global_step'):]}.pt", weights_only=False)
        loaded = torch.load(tmp_path / f"loaded_rank{rank}.pt", weights_only=False)
        assert_same(loaded, saved)
