"""Draining committed checkpoints to a path tier and to S3 (a real server over HTTP): the
tier's copy is byte for byte the first tier's, each tier keeps its own number, the backlog is
at most one drain running and one waiting, the tier's pointer is written only after the
manifest it names, the first tier's retention leaves a checkpoint while it drains, and a
tier's retention removes the partial copies no live drain is writing."""

import json
import os
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.tiers.mirror import drain_checkpoint
from deepspeed_async_ckpt.tiers.keys import POINTER_KEY, manifest_key
from deepspeed_async_ckpt.tiers.remote import PathRemote

from fakes import GatedRemote
from helpers import eventually, make, save_small
from s3server import s3, s3_server  # noqa: F401  (fixtures)


def local_files(ckpt_dir):
    """Every file of a committed checkpoint a tier holds: its files and its manifest."""
    manifest = json.load(open(os.path.join(ckpt_dir, ".async_ckpt", "manifest.json")))
    return sorted(manifest["files"]) + [".async_ckpt/manifest.json"]


def save_states(ck, save_dir, steps, wait_each=False):
    for i in steps:
        d = os.path.join(save_dir, f"step{i}")
        ck.begin(d, tag=f"step{i}", pointer=Pointer(os.path.join(save_dir, "latest"), f"step{i}"))
        torch.manual_seed(i)
        ck.save({"w": torch.randn(64, 64), "step": i}, os.path.join(d, "model.pt"))
        ck.save({"opt": torch.randn(128)}, os.path.join(d, "optim.pt"))
        ck.end()
        ck.fence()
        if wait_each:
            ck.wait()
            assert ck.tiers.wait_idle(60)


def test_drain_to_a_path_tier_copies_every_file_byte_for_byte(tmp_path):
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    save_states(ck, str(local), [1, 2], wait_each=True)
    ck.close()
    for step in (1, 2):
        for rel in local_files(local / f"step{step}"):
            assert (tier / f"step{step}" / rel).read_bytes() == (local / f"step{step}" / rel).read_bytes()
    assert (tier / "latest").read_text() == "step2"  # a save directory DeepSpeed reads as it is
    assert json.loads((tier / ".async_ckpt" / "pointer.json").read_text())["checkpoint"] == "step2"


def test_drain_to_s3_copies_every_file_byte_for_byte(tmp_path, s3):
    local = tmp_path / "local"
    ck = make(gb=0.05, tiers=[s3.tier("run", part_size_mb=5)])
    save_states(ck, str(local), [1], wait_each=True)
    big = {"w": torch.randn(3 * 1024 * 1024)}  # 12 MiB: a multipart upload in 5 MiB parts
    d = local / "step2"
    ck.begin(str(d), tag="step2", pointer=Pointer(str(local / "latest"), "step2"))
    ck.save(big, str(d / "model.pt"))
    ck.end()
    ck.wait()
    assert ck.tiers.wait_idle(60)
    ck.close()
    for step in (1, 2):
        for rel in local_files(local / f"step{step}"):
            assert s3.get(f"run/step{step}/{rel}") == (local / f"step{step}" / rel).read_bytes()
    assert s3.get("run/latest") == b"step2"
    assert json.loads(s3.get("run/.async_ckpt/pointer.json"))["checkpoint"] == "step2"


@pytest.mark.parametrize("kind", ["path", "s3"])
def test_each_tier_keeps_its_own_number_across_ten_saves(tmp_path, kind, request):
    local = tmp_path / "local"
    if kind == "path":
        tier = {"url": str(tmp_path / "tier"), "keep_last": 5}
    else:
        bucket = request.getfixturevalue("s3")
        tier = bucket.tier("run", keep_last=5)
    ck = make(keep_last=2, tiers=[tier])
    save_states(ck, str(local), range(10), wait_each=True)
    ck.close()
    assert sorted(n for n in os.listdir(local) if n.startswith("step")) == ["step8", "step9"]
    if kind == "path":
        names = sorted(n for n in os.listdir(tmp_path / "tier") if n.startswith("step"))
    else:
        names = sorted({k.split("/")[1] for k in bucket.keys("run/step")})
    assert names == [f"step{i}" for i in range(5, 10)]


def test_every_nth_commit_drains(tmp_path):
    ck = make(tiers=[{"url": str(tmp_path / "tier"), "every": 2}])
    save_states(ck, str(tmp_path / "local"), range(1, 6), wait_each=True)
    ck.close()
    assert ck.tiers.drainers[0].drained == ["step2", "step4"]


def gated(ck, remote):
    drainer = ck.tiers.drainers[0]
    drainer.remote = ck.tiers.remotes[0] = remote
    return drainer


def steps_in(path):
    return sorted(n for n in os.listdir(path) if n.startswith("step"))


def test_backlog_is_one_drain_running_and_one_waiting_the_newest(tmp_path):
    ck = make(keep_last=1, tiers=[{"url": str(tmp_path / "tier")}])
    remote = GatedRemote(str(tmp_path / "tier"))
    drainer = gated(ck, remote)
    local = tmp_path / "local"
    backlog = []
    for i in range(1, 5):
        save_states(ck, str(local), [i])
        ck.wait()
        assert ck.tiers.wait_queued(10)  # its commit callback submitted it
        backlog.append(drainer.backlog)
    assert max(backlog) <= 2
    assert drainer.replaced == ["step2", "step3"]  # each replaced by the newer one
    # the first tier keeps the checkpoint being drained and the one waiting, beyond keep_last=1
    assert eventually(lambda: steps_in(local) == ["step1", "step4"]), steps_in(local)
    remote.gate.set()
    assert drainer.wait_idle(60)
    assert drainer.drained == ["step1", "step4"]
    assert eventually(lambda: steps_in(local) == ["step4"]), steps_in(local)  # released: removed
    ck.close()


def test_tier_pointer_written_only_after_the_files_and_manifest_it_names(tmp_path):
    ck = make(tiers=[{"url": str(tmp_path / "tier")}])
    remote = GatedRemote(str(tmp_path / "tier"))
    remote.gate.set()
    gated(ck, remote)
    save_states(ck, str(tmp_path / "local"), [1, 2, 3], wait_each=True)
    ck.close()
    for i, key in enumerate(remote.writes):
        if key == POINTER_KEY:
            before = remote.writes[:i]
            named = [k for k in before if k.endswith("manifest.json")][-1].split("/")[0]
            assert before[-1] == manifest_key(named)  # the manifest right before the pointer
            assert {f"{named}/model.pt", f"{named}/optim.pt"} <= set(before)
    assert remote.writes.count(POINTER_KEY) == 3


def test_a_node_waits_for_no_marker_without_nodes_and_writes_none(tmp_path):
    ck = make()
    save_states(ck, str(tmp_path / "local"), [1])
    ck.wait()
    ck.close()
    remote = PathRemote(str(tmp_path / "tier"))
    drain_checkpoint(remote, str(tmp_path / "local" / "step1"), None, node=0, coordinator=True,
                     marker_timeout_s=1)
    assert sorted(os.listdir(tmp_path / "tier" / "step1" / ".async_ckpt")) == ["manifest.json"]


def test_node_local_first_tier_each_node_uploads_its_files_and_rank0_waits_for_markers(tmp_path):
    """A manifest with ``nodes`` (a node-local first tier): each node uploads the files it
    holds and writes its marker; global rank 0 commits the tier only after every marker."""
    ck = make()
    save_states(ck, str(tmp_path / "node0"), [1])
    ck.wait()
    ck.close()
    node0 = tmp_path / "node0" / "step1"
    manifest_path = node0 / ".async_ckpt" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["nodes"] = {"0": ["model.pt"], "1": ["optim.pt"]}
    manifest_path.write_text(json.dumps(manifest))
    node1 = tmp_path / "node1" / "step1"
    (node1 / ".async_ckpt").mkdir(parents=True)
    (node1 / "optim.pt").write_bytes((node0 / "optim.pt").read_bytes())
    (node0 / "optim.pt").unlink()  # node 0 does not hold it
    (node1 / ".async_ckpt" / "manifest.json").write_text(json.dumps(manifest))
    remote = GatedRemote(str(tmp_path / "tier"))
    remote.gate.set()
    pointer = Pointer(str(tmp_path / "node0" / "latest"), "step1")
    coordinator = threading.Thread(target=drain_checkpoint, args=(remote, str(node0), pointer),
                                   kwargs=dict(node=0, coordinator=True, marker_timeout_s=30))
    coordinator.start()
    coordinator.join(1.0)
    assert coordinator.is_alive() and POINTER_KEY not in remote.writes  # waiting for node 1
    drain_checkpoint(remote, str(node1), pointer, node=1, coordinator=False, marker_timeout_s=30)
    coordinator.join(30)
    assert remote.writes.index("step1/optim.pt") < remote.writes.index("step1/.async_ckpt/drained.1.json") \
        < remote.writes.index(manifest_key("step1")) < remote.writes.index(POINTER_KEY)
    assert (tmp_path / "tier" / "step1" / "optim.pt").read_bytes() == (node1 / "optim.pt").read_bytes()
    assert (tmp_path / "tier" / "step1" / "model.pt").read_bytes() == (node0 / "model.pt").read_bytes()


def leave_partial(local, tier_put, name, source="step1"):
    """What a drain killed mid-way leaves on a tier: one file of ``name``, no manifest."""
    tier_put(f"{name}/model.pt", (local / source / "model.pt").read_bytes())


def test_retention_removes_a_partial_copy_no_live_drain_writes_and_keeps_the_others(tmp_path):
    """A partial copy left by a killed run (older step, objects older than the grace) goes; one
    a live drain may be writing (objects within the grace, or a step after the tier's pointer),
    a committed one, a damaged manifest and a name without a step stay."""
    local, tier = tmp_path / "local", tmp_path / "tier"
    ck = make(tiers=[{"url": str(tier)}])
    save_states(ck, str(local), [1, 2], wait_each=True)
    ck.close()
    remote = PathRemote(str(tier))
    for name in ("step4", "step5", "step9", "notes"):  # killed runs, step5 written a minute ago
        leave_partial(local, remote.put_bytes, name)
    old = time.time() - 2 * 3600
    for name in ("step4", "step9", "notes"):
        os.utime(tier / name / "model.pt", (old, old))
    os.utime(tier / "step5" / "model.pt", (time.time() - 60,) * 2)
    (tier / "step3" / ".async_ckpt").mkdir(parents=True)
    (tier / "step3" / ".async_ckpt" / "manifest.json").write_text("{not json")

    ck = make(tiers=[{"url": str(tier)}])  # a later run, on the same tier
    save_states(ck, str(local), [6], wait_each=True)
    ck.close()
    assert steps_in(tier) == ["step1", "step2", "step3", "step5", "step6", "step9"]
    assert (tier / "notes" / "model.pt").exists()  # no step: perhaps no checkpoint at all


def test_retention_removes_a_partial_copy_on_s3_never_a_committed_one(tmp_path, s3, monkeypatch):
    from deepspeed_async_ckpt.tiers import mirror

    local = tmp_path / "local"
    ck = make(tiers=[s3.tier("run", keep_last=2)])
    save_states(ck, str(local), [1, 2], wait_each=True)
    ck.close()
    leave_partial(local, lambda key, data: s3.put(f"run/{key}", data), "step4")
    leave_partial(local, lambda key, data: s3.put(f"run/{key}", data), "step8")  # a newer step
    time.sleep(1.1)  # the store's clock counts whole seconds
    monkeypatch.setattr(mirror, "PARTIAL_GRACE_S", 1.0)  # S3 keeps the time it was written

    ck = make(tiers=[s3.tier("run", keep_last=2)])
    save_states(ck, str(local), [6], wait_each=True)
    ck.close()
    assert sorted({k.split("/")[1] for k in s3.keys("run/step")}) == ["step2", "step6", "step8"]
