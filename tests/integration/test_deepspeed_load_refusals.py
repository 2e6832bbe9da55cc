"""load_checkpoint of a checkpoint that does not exist (a `latest` naming a tag never saved, or
an explicit tag= naming none), on 2 DeepSpeed ranks: refused on every rank, naming the
directory, before DeepSpeed's load (whose own failure, a bare AssertionError from its
state_dict_factory, named nothing)."""

import json
import os

import pytest

from conftest import REPO
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import IntegrityError
from deepspeed_async_ckpt.tools.launch import launch

WORKER = os.path.join(REPO, "tests", "integration", "workers", "ds_refusals.py")


def test_verify_all_ranks_refuses_a_checkpoint_directory_that_does_not_exist(tmp_path):
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    missing = str(tmp_path / "global_step999")
    with pytest.raises(IntegrityError, match=r"load_checkpoint refused on every rank: IntegrityError: "
                                             r"no checkpoint directory at '.*global_step999'"):
        ck.verify_all_ranks(missing, action="load_checkpoint", include=lambda rel: False)
    os.makedirs(missing)  # another engine's checkpoint (no records of this one) passes as before
    ck.verify_all_ranks(missing, action="load_checkpoint")
    ck.close()


@pytest.mark.slow
def test_load_checkpoint_of_a_missing_tag_is_refused_on_every_rank_naming_it(tmp_path, repo_env):
    out = str(tmp_path)
    codes = launch(WORKER, ["missing-tag", "--out", out], 2, timeout=600, env=repo_env)
    assert codes == [0, 0], codes
    results = [json.load(open(os.path.join(out, f"missing_tag_rank{r}.json"))) for r in (0, 1)]
    save_dir = os.path.join(out, "ckpt")
    for r in results:
        assert r["committed"] == "global_step1", r
        for key, tag in (("from_latest", "global_step999"), ("explicit_tag", "global_step7")):
            message = r[key]
            assert message is not None and message.startswith(
                "IntegrityError: load_checkpoint refused on every rank"), r
            assert f"no checkpoint directory at {os.path.join(save_dir, tag)!r}" in message, r
        # nothing was left pending by the refusals: the next load reads the committed one
        assert r["loaded"] is not None and r["loaded"].startswith("global_step1" + os.sep), r
        assert r["latest"] == "global_step1"
