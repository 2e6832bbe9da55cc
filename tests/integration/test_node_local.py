"""Node-local storage on two simulated nodes (2 ranks each), no directory shared by all ranks:
each rank runs in a mount namespace of its own (``tests/nodes.py``) with its node's directory
bound at the one checkpoint path, as node-local disks are mounted at the same path on every
node. The records travel through the process group's store; each node's leader commits its
node's copy; every rank resumes from its own node, bitwise equal to what it saved."""

import glob
import json
import os
import shutil

import pytest
import torch

from _compare import assert_same
from conftest import REPO
from nodes import NODES, PER_NODE, assert_every_rank_resumed, require_mount_namespaces, run_nodes

WORKER = os.path.join(REPO, "tests", "integration", "workers", "node_local_worker.py")
MEGATRON_WORKER = os.path.join(REPO, "tests", "integration", "megatron_workers", "node_local_worker.py")

pytestmark = pytest.mark.slow


# ZeRO-3 under node-local storage is run by test_tiers_node_local.py (the same save, then a
# node restored from the durable tier)
@pytest.mark.parametrize("stage,tied", [pytest.param(1, 1, id="zero1-tied")])
def test_deepspeed_node_local_storage_commits_and_resumes_on_every_node(repo_env, tmp_path, stage, tied):
    require_mount_namespaces()
    (tmp_path / "out").mkdir()
    run_nodes(repo_env, tmp_path, "save", "--zero-stage", stage, "--tied", tied, worker=WORKER)
    assert not os.listdir(tmp_path / "ckpt"), "a rank wrote outside its node's directory"
    manifests = {}
    for node in range(NODES):
        root = tmp_path / f"node{node}"
        assert (root / "latest").read_text() == "s2", f"node {node}'s pointer"
        for tag in ("s1", "s2"):
            with open(root / tag / ".async_ckpt" / "manifest.json") as f:
                manifests[node, tag] = json.load(f)
        on_disk = sorted(os.path.relpath(p, root / "s2") for p in glob.glob(str(root / "s2" / "*")))
        assert on_disk == manifests[node, "s2"]["nodes"][str(node)], f"node {node} holds what its list says"
        assert not glob.glob(str(root / "s2" / ".async_ckpt" / "rank_*")), "records went through the store"
    first, second = manifests[0, "s2"], manifests[1, "s2"]
    assert {k: v for k, v in first.items() if k != "files"} == {k: v for k, v in second.items() if k != "files"}
    assert sorted(first["nodes"]) == ["0", "1"]
    shard = lambda r: [f for f in first["files"] if f"zero_pp_rank_{r}_" in f and "optim_states" in f]  # noqa: E731
    for r in range(NODES * PER_NODE):  # each rank's optimizer shard on its own node only
        assert shard(r) and shard(r)[0] in first["nodes"][str(r // PER_NODE)], (r, first["nodes"])
        assert shard(r)[0] not in first["nodes"][str(1 - r // PER_NODE)]
    if stage < 3:  # the model states, written by each node's first rank: on both nodes
        both = set(first["nodes"]["0"]) & set(first["nodes"]["1"])
        assert both == {"mp_rank_00_model_states.pt"}, both
        if tied:  # rank 0 alone lists the tied weights: node 1's copy differs, its manifest says so
            assert first["files"]["mp_rank_00_model_states.pt"] != second["files"]["mp_rank_00_model_states.pt"]
    for r in range(NODES * PER_NODE):
        with open(tmp_path / "out" / f"saved_rank{r}.json") as f:
            assert json.load(f) == {"history": ["s1", "s2"], "errors": []}
    run_nodes(repo_env, tmp_path, "load", "--zero-stage", stage, "--tied", tied, worker=WORKER)
    assert_every_rank_resumed(tmp_path, "s2", NODES * PER_NODE)


def test_megatron_node_local_tp2_on_two_nodes_commits_on_each(repo_env, tmp_path):
    """Megatron TP=2 on two nodes of one rank each, ``node_local``: each node's directory holds
    its rank's shards, its own ``common.pt`` and the markers rank 0 wrote, and its tracker
    names the newest iteration. A rank's load also reads what another rank wrote (a tensor
    replicated across TP is written once): once each node has the other's files as well (as a
    restore from a shared tier gives them), every rank resumes from its own node's copy,
    verified there, bitwise equal to what it saved (the step taken right after the save not
    in it)."""
    pytest.importorskip("megatron.core")
    require_mount_namespaces()
    (tmp_path / "out").mkdir()
    env = dict(repo_env, PYTHONWARNINGS="ignore")
    run_nodes(env, tmp_path, "save", worker=MEGATRON_WORKER, per_node=1)
    manifests = []
    for node in range(NODES):
        root = tmp_path / f"node{node}" / "iter_0000003"
        assert (root.parent / "latest_checkpointed_iteration.txt").read_text() == "3"
        with open(root / ".async_ckpt" / "manifest.json") as f:
            manifests.append(json.load(f))
        mine = manifests[node]["nodes"][str(node)]
        assert "common.pt" in mine and all(f"__{node}_" in rel for rel in mine if rel.endswith(".distcp")), mine
        assert sorted(os.listdir(root)) == sorted([*mine, ".async_ckpt", ".metadata", "metadata.json"])
    assert (tmp_path / "node0" / "iter_0000003" / ".metadata").read_bytes() == \
        (tmp_path / "node1" / "iter_0000003" / ".metadata").read_bytes()
    for node in range(NODES):  # each node gets the files it lacks from the other
        here, there = tmp_path / f"node{node}" / "iter_0000003", tmp_path / f"node{1 - node}" / "iter_0000003"
        for name in os.listdir(there):
            if not (here / name).exists():
                shutil.copy2(there / name, here / name)
    run_nodes(env, tmp_path, "load", worker=MEGATRON_WORKER, per_node=1)
    for r in range(NODES):
        reference = torch.load(tmp_path / "out" / f"reference.rank{r}.pt")
        reloaded = torch.load(tmp_path / "out" / f"reloaded.rank{r}.pt")
        assert_same(reference, reloaded, f"rank {r}")
        with open(tmp_path / "out" / f"reloaded.rank{r}.json") as f:
            assert json.load(f)["tracker"] == 3
