"""ZeRO-1 on 2 DeepSpeed ranks with a flat fp32 partition larger than the host staging pool
(``host_buffer_gb``): the first save_checkpoint is refused on every rank, naming the record
and the host_buffer_gb that holds it, before anything is staged; training goes on and nothing
is committed. Accepted, the save would fail in the background copier, at the next optimizer
step, with no checkpoint saved."""

import json
import os

import pytest

from conftest import REPO
from deepspeed_async_ckpt.tools.launch import launch

WORKER = os.path.join(REPO, "tests", "integration", "workers", "ds_refusals.py")

pytestmark = pytest.mark.slow


def test_a_partition_larger_than_the_pool_is_refused_by_the_first_save_on_every_rank(tmp_path, repo_env):
    out = str(tmp_path)
    codes = launch(WORKER, ["pool-too-small", "--out", out], 2, timeout=600, env=repo_env)
    assert codes == [0, 0], codes
    for rank in (0, 1):
        r = json.load(open(os.path.join(out, f"pool_too_small_rank{rank}.json")))
        for key in ("raised", "raised_again"):
            message = r[key]
            assert message is not None and message.startswith("SnapshotError: "), r
            assert f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt: tensor record" in message, r
            assert "host_buffer_gb 0.004 allows" in message, r
            assert "Nothing of this save was staged; set host_buffer_gb to at least 0.01" in message, r
        # the refused record (6.3 MB, more than the whole pool) never reached the copier: what
        # may be staged by then is the model-states share of the abandoned save (one 4.2 MB weight)
        assert r["staged_bytes"] < 6311944, r
        assert r["waited"] is None, r  # nothing failed in the background
        assert not r["latest_exists"], r
