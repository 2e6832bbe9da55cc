"""A save killed at every filesystem operation it makes (``workers/crash_points.py``): whatever
the moment, the pointer names a checkpoint that verifies and loads whole (one save's state,
byte for byte), ``ds-async-ckpt verify`` passes, and the next save leaves nothing behind but
itself and the pointer (with ``keep_last=1``)."""

import json
import os
import sys

import pytest
import torch

from deepspeed_async_ckpt.tools.cli import main as cli
from deepspeed_async_ckpt.commit import LOCK_FILE, verify_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "workers"))

import crash_points  # noqa: E402
from helpers import run_rank_script  # noqa: E402


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize("scenario", crash_points.SCENARIOS)
def test_a_save_killed_at_any_filesystem_operation_leaves_a_loadable_checkpoint(tmp_path, repo_env,
                                                                                scenario, capsys):
    out = tmp_path / "runs"
    run = run_rank_script(os.path.join(HERE, "workers", "crash_points.py"), [scenario, out], repo_env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs = report["runs"]
    # every operation was a crash point, and the run past the last one finished
    assert report["operations"] >= 25, report["operations"]
    assert [r["exit"] for r in runs] == [crash_points.CRASH_EXIT] * report["operations"] + [0]
    new_tag = "t2" if scenario == "new" else "t1"
    outcomes = []
    for r in runs:
        root = str(out / str(r["n"]))
        where = f"{scenario}, killed before operation {r['n']} of {report['operations']}"
        assert cli(["verify", root]) == 0, where
        capsys.readouterr()
        assert cli(["list", "--json", root]) == 0, where
        states = {row["name"]: row["state"] for row in json.loads(capsys.readouterr().out)}
        assert not {"damaged", "other"} & set(states.values()), (where, states)  # all ours, readable
        # what a resuming job does: rank 0 finishes a replacement cut short, then all load
        ck = crash_points.checkpointer(scenario)
        ck.wait_all_ranks(action="load", recover=root)
        tag = (out / str(r["n"]) / "latest").read_text()
        assert tag in ("t1", new_tag), where
        ckpt = os.path.join(root, tag)
        verify_checkpoint(ckpt)
        model = ck.load(os.path.join(ckpt, "model.pt"))
        optim = ck.load(os.path.join(ckpt, "optim.pt"))
        step = model["global_steps"]
        assert step in (1, 2) and (tag == new_tag or step == 1), where
        if r["exit"] == 0:
            assert (tag, step) == (new_tag, 2), where  # the save finished: it is what loads
        expected = crash_points.state(step)
        _same(model, {"module": expected["model"], "global_steps": step}, where)
        _same(optim, {"optimizer": expected["optim"]}, where)  # both files of one save
        outcomes.append(step)
        # the next save: committed, and it removes everything the crash left
        crash_points.save(ck, root, "t3", step=3)
        ck.wait()
        ck.close()
        assert (out / str(r["n"]) / "latest").read_text() == "t3", where
        verify_checkpoint(os.path.join(root, "t3"))
        assert sorted(os.listdir(root)) == [LOCK_FILE, "latest", "t3"], where
        assert sorted(os.listdir(os.path.join(root, "t3"))) == [".async_ckpt", "model.pt", "optim.pt"], where
    # the crash points span the commit: the old checkpoint before it, the new one after
    assert outcomes[0] == 1 and outcomes[-1] == 2 and outcomes == sorted(outcomes), outcomes


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ("new", "resave"))
def test_a_megatron_save_killed_at_any_filesystem_operation_leaves_the_tracked_iteration_loadable(
        tmp_path, repo_env, scenario):
    """The same for the Megatron adapter, whose marker files, their record, the swap of a
    re-saved iteration and the tracker come after the engine's commit: per run, the worker's
    checking process loads (with ``dist_checkpointing.load``) what the tracker names and saves
    iteration 3."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "runs"
    run = run_rank_script(os.path.join(HERE, "workers", "crash_points_megatron.py"), [scenario, out], repo_env,
                          timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs, total = report["runs"], report["operations"]
    assert total >= 40, total
    assert [r["exit"] for r in runs] == [crash_points.CRASH_EXIT] * total + [0]
    new_iteration = 2 if scenario == "new" else 1
    for r in runs:
        where = f"{scenario}, killed before operation {r['n']} of {total}: {r}"
        assert "error" not in r, where
        assert r["tracker"] in (1, new_iteration) and r["loaded"] in (1, 2) and r["same"], where
        assert r["tracker"] != 2 or r["loaded"] == 2, where
        if r["exit"] == 0:
            assert (r["tracker"], r["loaded"]) == (new_iteration, 2), where
        assert r["after"] == {"tracker": 3, "listing": [LOCK_FILE, "iter_0000003", "latest_checkpointed_iteration.txt"],
                              "files": [".async_ckpt", ".metadata", "__0_0.distcp", "__0_1.distcp",
                                        "common.pt", "metadata.json"]}, where
    loaded = [r["loaded"] for r in runs]
    assert loaded[0] == 1 and loaded[-1] == 2 and loaded == sorted(loaded), loaded
