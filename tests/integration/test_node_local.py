"""Node-local storage on two simulated nodes (2 ranks each), no directory shared by all ranks:
each rank runs in a mount namespace of its own (``unshare -m``) with its node's directory
bound at the one checkpoint path, as node-local disks are mounted at the same path on every
node. The records travel through the process group's store; each node's leader commits its
node's copy; every rank resumes from its own node, bitwise equal to what it saved."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _compare import assert_same
from conftest import REPO
from launch import free_port

WORKER = os.path.join(REPO, "tests", "integration", "workers", "node_local_worker.py")
MEGATRON_WORKER = os.path.join(REPO, "tests", "integration", "megatron_workers", "node_local_worker.py")
NODES, PER_NODE = 2, 2

pytestmark = pytest.mark.slow


def _require_mount_namespaces() -> None:
    """Fail, saying why, where this machine cannot make a mount namespace (not root, or a
    container without CAP_SYS_ADMIN): these tests simulate nodes with them."""
    try:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.fail("node-local tests need `unshare` (util-linux) to simulate nodes")
    if probe.returncode != 0:
        pytest.fail("node-local tests simulate nodes with mount namespaces, and `unshare -m true` "
                    f"failed here (exit {probe.returncode}: {probe.stderr.strip()}); run them as root "
                    "or with CAP_SYS_ADMIN")


def run_nodes(env, tmp_path, *args, timeout=420, worker=WORKER, per_node=PER_NODE):
    """Every rank of the two nodes, each with its node's directory at ``tmp_path/ckpt``."""
    port = free_port()
    common = tmp_path / "ckpt"
    common.mkdir(exist_ok=True)
    procs = []
    for rank in range(NODES * per_node):
        node_dir = tmp_path / f"node{rank // per_node}"
        node_dir.mkdir(exist_ok=True)
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(NODES * per_node),
                 LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # $0: this node's directory, $1: the common path, then the command
        cmd = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"',
               str(node_dir), str(common), sys.executable, worker, *map(str, args),
               "--ckpt", str(common), "--out", str(tmp_path / "out")]
        log = open(tmp_path / f"{args[0]}.rank{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * len(procs):
        logs = "\n".join(f"--- rank {r}:\n" + (tmp_path / f"{args[0]}.rank{r}.log").read_text()[-3000:]
                         for r in range(len(procs)))
        pytest.fail(f"{args[0]}: rank exit codes {codes}\n{logs}")


@pytest.mark.parametrize("stage,tied", [pytest.param(1, 1, id="zero1-tied"),
                                        pytest.param(3, 0, id="zero3")])
def test_deepspeed_node_local_storage_commits_and_resumes_on_every_node(repo_env, tmp_path, stage, tied):
    _require_mount_namespaces()
    (tmp_path / "out").mkdir()
    run_nodes(repo_env, tmp_path, "save", "--zero-stage", stage, "--tied", tied)
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
    run_nodes(repo_env, tmp_path, "load", "--zero-stage", stage, "--tied", tied)
    for r in range(NODES * PER_NODE):
        with open(tmp_path / "out" / f"loaded_rank{r}.json") as f:
            assert os.path.dirname(json.load(f)["path"]) == str(tmp_path / "ckpt" / "s2")
        saved = torch.load(tmp_path / "out" / f"saved_rank{r}.pt", weights_only=False)
        loaded = torch.load(tmp_path / "out" / f"loaded_rank{r}.pt", weights_only=False)
        assert_same(saved, loaded, f"rank {r}")


def test_megatron_node_local_tp2_on_two_nodes_commits_on_each(repo_env, tmp_path):
    """Megatron TP=2 on two nodes of one rank each, ``node_local``: each node's directory holds
    its rank's shards, its own ``common.pt`` and the markers rank 0 wrote, and its tracker
    names the newest iteration. A rank's load also reads what another rank wrote (a tensor
    replicated across TP is written once): once each node has the other's files as well (as a
    restore from a shared tier gives them), every rank resumes from its own node's copy,
    verified there, bitwise equal to what it saved (the step taken right after the save not
    in it)."""
    pytest.importorskip("megatron.core")
    _require_mount_namespaces()
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
