"""A node-local first tier with a durable S3 tier behind it, end to end on two simulated nodes
(each rank in a mount namespace with its node's directory bound at the one checkpoint path, as
in test_node_local.py; moto's S3 server over HTTP as the durable tier): each node's leader
uploads the files its node holds and its drained marker, global rank 0 the manifest and then
the tier's pointer; then a node loses its disk and every rank resumes from the newest
checkpoint committed on any tier, bitwise equal to what it saved.

The fast tests check the rules that make this work, on a path tier in one process: a file
written on several nodes goes up once, from the lowest of them; a node restores the files its
directory held, or every file of the checkpoint where its ranks read other nodes' files; the
catch-up at start has every node upload its share before global rank 0 commits the tier."""

import json
import os
import shutil
import threading

import pytest
import torch

from _compare import assert_same
from conftest import REPO
from deepspeed_async_ckpt.commit import Pointer, verify_checkpoint
from deepspeed_async_ckpt.errors import Failure
from deepspeed_async_ckpt.tiers.mirror import drain_checkpoint
from deepspeed_async_ckpt.tiers.remote import PathRemote
from deepspeed_async_ckpt.tiers.restore import restore
from helpers import make
from nodes import NODES, PER_NODE, assert_every_rank_resumed, require_mount_namespaces, run_nodes
from s3server import s3, s3_server  # noqa: F401  (fixtures)

WORKER = os.path.join(REPO, "tests", "integration", "workers", "node_local_worker.py")
MEGATRON_WORKER = os.path.join(REPO, "tests", "integration", "megatron_workers", "node_local_worker.py")
AWS = dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")


# -- fast: the rules, on a path tier -------------------------------------------------------

def _save(save_dir, seed):
    """One committed checkpoint ``step1`` (model.pt, optim.pt) in ``save_dir``; its manifest."""
    ck = make()
    d = os.path.join(save_dir, "step1")
    ck.begin(d, tag="step1", pointer=Pointer(os.path.join(save_dir, "latest"), "step1"))
    torch.manual_seed(seed)
    ck.save({"w": torch.randn(64, 64)}, os.path.join(d, "model.pt"))
    ck.save({"opt": torch.randn(128)}, os.path.join(d, "optim.pt"))
    ck.end()
    ck.close()
    with open(os.path.join(d, ".async_ckpt", "manifest.json")) as f:
        return json.load(f)


def _two_nodes(tmp_path):
    """Node 0 holds model.pt and optim.pt, node 1 its own, different model.pt (as DeepSpeed's
    model states with tied weights differ between nodes): each node's manifest as the commit
    writes it, rank 0's carrying node 0's entry for the shared file."""
    manifest = _save(str(tmp_path / "node0"), seed=1)
    other = _save(str(tmp_path / "other"), seed=2)
    manifest["nodes"] = {"0": ["model.pt", "optim.pt"], "1": ["model.pt"]}
    node1 = tmp_path / "node1" / "step1"
    (node1 / ".async_ckpt").mkdir(parents=True)
    shutil.copy(tmp_path / "other" / "step1" / "model.pt", node1 / "model.pt")
    (tmp_path / "node1" / "latest").write_text("step1")
    (node1 / ".async_ckpt" / "manifest.json").write_text(
        json.dumps(dict(manifest, files=dict(manifest["files"], **{"model.pt": other["files"]["model.pt"]}))))
    (tmp_path / "node0" / "step1" / ".async_ckpt" / "manifest.json").write_text(json.dumps(manifest))
    assert (node1 / "model.pt").read_bytes() != (tmp_path / "node0" / "step1" / "model.pt").read_bytes()
    return tmp_path / "node0" / "step1", node1


def test_a_file_on_several_nodes_goes_up_once_from_the_lowest_node(tmp_path):
    node0, node1 = _two_nodes(tmp_path)
    tier = tmp_path / "tier"
    remote = PathRemote(str(tier))
    pointer = Pointer(str(tmp_path / "node0" / "latest"), "step1")
    coordinator = threading.Thread(target=drain_checkpoint, args=(remote, str(node0), pointer),
                                   kwargs=dict(node=0, coordinator=True, marker_timeout_s=30))
    coordinator.start()  # node 0's files go up first, then it waits for node 1's marker
    drain_checkpoint(remote, str(node1), pointer, node=1, coordinator=False, marker_timeout_s=30)
    coordinator.join(30)
    assert not coordinator.is_alive()
    assert (tier / "step1" / "model.pt").read_bytes() == (node0 / "model.pt").read_bytes()
    assert (tier / "step1" / ".async_ckpt" / "manifest.json").read_bytes() == \
        (node0 / ".async_ckpt" / "manifest.json").read_bytes()
    verify_checkpoint(str(tier / "step1"))  # every object matches the manifest the tier holds
    assert (tier / "latest").read_text() == "step1"


def test_a_node_restores_its_own_files_or_every_file(tmp_path):
    node0, node1 = _two_nodes(tmp_path)
    tier = tmp_path / "tier"
    remote = PathRemote(str(tier))
    pointer = Pointer(str(tmp_path / "node0" / "latest"), "step1")
    drain_checkpoint(remote, str(node1), pointer, node=1, coordinator=False, marker_timeout_s=30)
    drain_checkpoint(remote, str(node0), pointer, node=0, coordinator=True, marker_timeout_s=30)
    shutil.rmtree(tmp_path / "node1")  # node 1 lost its disk
    assert restore(str(tmp_path / "node1"), [remote], pointer_name="latest", node=1) == "step1"
    assert sorted(os.listdir(node1)) == [".async_ckpt", "model.pt"]  # node 1's files only
    assert (node1 / "model.pt").read_bytes() == (node0 / "model.pt").read_bytes()  # the tier's copy
    assert (tmp_path / "node1" / "latest").read_text() == "step1"
    (node0 / "optim.pt").unlink()  # and every file, the other nodes' too, where asked
    assert restore(str(tmp_path / "node0"), [remote], pointer_name="latest", node=0) == "step1"
    assert restore(str(tmp_path / "node1"), [remote], pointer_name="latest", node=1, every_file=True) == "step1"
    for node in (node0, node1):
        assert (node / "optim.pt").read_bytes() == (tier / "step1" / "optim.pt").read_bytes()


class _Rank0Proposes:
    """A checkpointer's ``exchange`` as node 1's leader sees it: rank 0 proposes each of
    ``names`` in turn (the first exchange of each round), and a round's second exchange reports
    the errors this rank sent (kept, in order) as the group's."""

    def __init__(self, *names):
        self.names, self.errors = list(names), []

    def exchange(self, value, error, key=""):
        self.errors.append(error)
        if len(self.errors) % 2:
            return self.names.pop(0), {}
        return None, ({2: error} if error else {})


def test_nodes_load_the_newest_checkpoint_every_node_can_make_whole(tmp_path, monkeypatch):
    """Node 1 lost its disk and the tier's newest is ``step1``, while rank 0's node holds a
    newer ``step2`` (its drain failed, say): node 1 cannot make ``step2`` whole and says so, and
    every node then loads ``step1``, rank 0's next proposal."""
    from deepspeed_async_ckpt.tiers.config import TierConfig
    from deepspeed_async_ckpt.tiers.durable import DurableTiers

    node0, node1 = _two_nodes(tmp_path)
    remote = PathRemote(str(tmp_path / "tier"))
    pointer = Pointer(str(tmp_path / "node0" / "latest"), "step1")
    drain_checkpoint(remote, str(node1), pointer, node=1, coordinator=False, marker_timeout_s=30)
    drain_checkpoint(remote, str(node0), pointer, node=0, coordinator=True, marker_timeout_s=30)
    shutil.rmtree(tmp_path / "node1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    tiers = DurableTiers((TierConfig(url=str(tmp_path / "tier")),), rank=2, world_size=4, node_local=True,
                         hold=lambda name: lambda: None, remotes=[remote])
    fake = _Rank0Proposes("step2", "step1")
    try:
        assert tiers.restore_all_ranks(fake, str(tmp_path / "node1"), pointer_name="latest") == "step1"
    finally:
        tiers.close()
    assert fake.errors == [None, Failure("IntegrityError", "checkpoint step2: no tier holds its manifest"),
                           None, None]
    assert sorted(os.listdir(tmp_path / "node1")) == [".async_ckpt.pointer.json", "latest", "step1"]
    assert (tmp_path / "node1" / "latest").read_text() == "step1"
    assert (node1 / "model.pt").read_bytes() == (node0 / "model.pt").read_bytes()  # the tier's copy


def test_the_catch_up_at_start_has_every_node_upload_its_share_before_rank0_commits(tmp_path,
                                                                                   monkeypatch):
    """A checkpoint the tier lacks (a drain cut short): each node's leader queues the one its
    node's pointer names; global rank 0 commits the tier only once node 1's marker is up."""
    from deepspeed_async_ckpt.tiers.config import TierConfig
    from deepspeed_async_ckpt.tiers.durable import DurableTiers

    node0, node1 = _two_nodes(tmp_path)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    tier = TierConfig(url=str(tmp_path / "tier"), marker_timeout_s=30)
    leaders = [DurableTiers((tier,), rank=rank, world_size=4, node_local=True,
                            hold=lambda name: lambda: None, remotes=[PathRemote(tier.url)])
               for rank in (0, 2)]  # node 0's leader (global rank 0) and node 1's
    pointer_file = tmp_path / "tier" / ".async_ckpt" / "pointer.json"
    try:
        leaders[0].catch_up(str(tmp_path / "node0"), str(tmp_path / "node0" / "latest"))
        assert not leaders[0].wait_idle(1.0) and not pointer_file.exists()  # waits for node 1
        leaders[1].catch_up(str(tmp_path / "node1"), str(tmp_path / "node1" / "latest"))
        assert all(t.wait_idle(60) for t in leaders)
    finally:
        for t in leaders:
            t.close()
    assert [t.drainers[0].drained for t in leaders] == [["step1"], ["step1"]]
    assert json.loads(pointer_file.read_text())["checkpoint"] == "step1"
    assert (tmp_path / "tier" / "step1" / ".async_ckpt" / "drained.1.json").exists()
    assert (tmp_path / "tier" / "step1" / "model.pt").read_bytes() == (node0 / "model.pt").read_bytes()


# -- slow: two simulated nodes, real DeepSpeed and Megatron ranks --------------------------

def _s3_args(s3, prefix):
    return ["--url", s3.url(prefix), "--endpoint", s3.endpoint]


def _owner(manifest, rel):
    """The node whose copy of ``rel`` the tier holds: the lowest that lists it."""
    return min(int(n) for n, rels in manifest["nodes"].items() if rel in rels)


def _assert_drained(s3, prefix, tmp_path, name, pointer_text, pointer_name):
    """The tier holds ``name`` whole: every object the bytes of its owner node's file, every
    node's drained marker, rank 0's manifest, then the pointers. Returns rank 0's manifest."""
    manifest_bytes = (tmp_path / "node0" / name / ".async_ckpt" / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    assert sorted(manifest["nodes"]) == [str(n) for n in range(NODES)]
    for rel in manifest["files"]:
        local = tmp_path / f"node{_owner(manifest, rel)}" / name / rel
        assert s3.get(f"{prefix}/{name}/{rel}") == local.read_bytes(), rel
    for rel in manifest.get("late_files", ()):
        assert s3.get(f"{prefix}/{name}/{rel}") == (tmp_path / "node0" / name / rel).read_bytes(), rel
    for node in range(NODES):
        marker = json.loads(s3.get(f"{prefix}/{name}/.async_ckpt/drained.{node}.json"))
        assert marker == {"save_id": manifest["save_id"]}
    assert s3.get(f"{prefix}/{name}/.async_ckpt/manifest.json") == manifest_bytes
    record = json.loads(s3.get(f"{prefix}/.async_ckpt/pointer.json"))
    assert record["checkpoint"] == name and record["save_id"] == manifest["save_id"]
    assert s3.get(f"{prefix}/{pointer_name}") == pointer_text.encode()
    return manifest


def _lose_disk(tmp_path, node):
    """A replaced node: its directory empty (still there, as the mount point of its disk)."""
    shutil.rmtree(tmp_path / f"node{node}")
    (tmp_path / f"node{node}").mkdir()


@pytest.mark.slow
@pytest.mark.parametrize("stage,tied", [pytest.param(1, 1, id="zero1-tied"),
                                        pytest.param(3, 0, id="zero3")])
def test_deepspeed_node_local_drains_to_s3_and_a_node_without_its_disk_resumes(
        repo_env, tmp_path, s3, stage, tied):
    """ZeRO-1 (tied weights: the model states differ between the nodes' copies) and ZeRO-3.
    ZeRO-1: node 1 loses its disk. ZeRO-3: node 0 (rank 0's) loses its disk, and node 1's
    pointer is older than the tier's (its copy of ``s2`` gone, its ``latest`` back on ``s1``):
    the load takes the newest checkpoint committed on any tier on every node."""
    require_mount_namespaces()
    (tmp_path / "out").mkdir()
    env = dict(repo_env, **AWS)
    args = ["--zero-stage", stage, "--tied", tied, *_s3_args(s3, "job")]
    run_nodes(env, tmp_path, "save", *args, worker=WORKER)
    for leader in range(0, NODES * PER_NODE, PER_NODE):
        drained = json.load(open(tmp_path / "out" / f"drained_rank{leader}.json"))
        assert drained["drained"][-1] == "s2" and not drained["failures"], (leader, drained)
    assert not (tmp_path / "out" / "drained_rank1.json").exists(), "only node leaders drain"
    manifest = _assert_drained(s3, "job", tmp_path, "s2", "s2", "latest")
    if tied:  # one key, one copy: node 0's, which rank 0's manifest (the tier's) describes
        node1 = json.load(open(tmp_path / "node1" / "s2" / ".async_ckpt" / "manifest.json"))
        rel = "mp_rank_00_model_states.pt"
        assert node1["files"][rel] != manifest["files"][rel]
        assert s3.get(f"job/s2/{rel}") != (tmp_path / "node1" / "s2" / rel).read_bytes()
    if stage == 1:
        _lose_disk(tmp_path, 1)
    else:
        _lose_disk(tmp_path, 0)
        assert (tmp_path / "node1" / "s1").is_dir()
        shutil.rmtree(tmp_path / "node1" / "s2")
        (tmp_path / "node1" / "latest").write_text("s1")
    run_nodes(env, tmp_path, "load", *args, worker=WORKER)
    for node in range(NODES):
        root = tmp_path / f"node{node}"
        assert (root / "latest").read_text() == "s2", f"node {node}'s pointer"
        for rel in manifest["nodes"][str(node)]:  # what the node's ranks read: its listed files
            assert (root / "s2" / rel).is_file(), (node, rel)
    restored = 1 if stage == 1 else 0
    for rel in manifest["nodes"][str(restored)]:  # the lost node's files: the tier's bytes
        assert (tmp_path / f"node{restored}" / "s2" / rel).read_bytes() == s3.get(f"job/s2/{rel}"), rel
    assert_every_rank_resumed(tmp_path, "s2", NODES * PER_NODE)


@pytest.mark.slow
def test_megatron_node_local_drains_to_s3_and_restore_brings_every_file_to_each_node(repo_env, tmp_path, s3):
    """Megatron TP=2 on two nodes of one rank each: a node's copy alone does not load (a
    tensor replicated across TP is written once, by one rank, on one node). Node 1 loses its
    disk; at resume each node's leader restores every file of the checkpoint from the tier,
    node 0 those listed under node 1 as well, and every rank resumes bitwise."""
    pytest.importorskip("megatron.core")
    require_mount_namespaces()
    (tmp_path / "out").mkdir()
    env = dict(repo_env, PYTHONWARNINGS="ignore", **AWS)
    args = _s3_args(s3, "mg")
    run_nodes(env, tmp_path, "save", *args, worker=MEGATRON_WORKER, per_node=1)
    for rank in range(NODES):
        drained = json.load(open(tmp_path / "out" / f"drained.rank{rank}.json"))
        assert drained["drained"][-1] == "iter_0000003" and not drained["failures"], (rank, drained)
    name = "iter_0000003"
    manifest = _assert_drained(s3, "mg", tmp_path, name, "3", "latest_checkpointed_iteration.txt")
    only_node1 = set(manifest["nodes"]["1"]) - set(manifest["nodes"]["0"])
    assert only_node1 and not (tmp_path / "node0" / name / sorted(only_node1)[0]).exists()
    _lose_disk(tmp_path, 1)
    run_nodes(env, tmp_path, "load", *args, worker=MEGATRON_WORKER, per_node=1)
    for node in range(NODES):
        root = tmp_path / f"node{node}"
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
        for rel in [*manifest["files"], *manifest["late_files"]]:  # every file, from the tier
            assert (root / name / rel).read_bytes() == s3.get(f"mg/{name}/{rel}"), (node, rel)
    for r in range(NODES):
        reference = torch.load(tmp_path / "out" / f"reference.rank{r}.pt")
        reloaded = torch.load(tmp_path / "out" / f"reloaded.rank{r}.pt")
        assert_same(reference, reloaded, f"rank {r}")
        with open(tmp_path / "out" / f"reloaded.rank{r}.json") as f:
            assert json.load(f)["tracker"] == 3
