"""Two simulated nodes on one machine: every rank in a mount namespace of its own (as ``unshare
-m``; ``integration/workers/on_node.py``) with its node's directory bound at the one checkpoint
path, as node-local disks are mounted at the same path on every node. Used by the node-local
and tiered integration tests."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from _compare import assert_same

from deepspeed_async_ckpt.tools import warm_start
from deepspeed_async_ckpt.tools.launch import free_port

ON_NODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration", "workers", "on_node.py")

NODES, PER_NODE = 2, 2


def require_mount_namespaces() -> None:
    """Fail, saying why, where this machine cannot make a mount namespace (not root, or a
    container without CAP_SYS_ADMIN): these tests simulate nodes with them. The probe enters one
    as a rank does (``on_node.py``, an empty script)."""
    with tempfile.TemporaryDirectory() as node, tempfile.TemporaryDirectory() as common:
        probe = subprocess.run([sys.executable, ON_NODE, node, common, os.devnull], capture_output=True,
                               text=True, timeout=30)
    if probe.returncode != 0:
        pytest.fail("node-local tests simulate nodes with mount namespaces, and entering one failed "
                    f"here (exit {probe.returncode}: {probe.stderr.strip()[-500:]}); run them as root "
                    "or with CAP_SYS_ADMIN")


def run_nodes(env, tmp_path, *args, worker, timeout=420, per_node=PER_NODE):
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
        argv = [str(node_dir), str(common), worker, *map(str, args),
                "--ckpt", str(common), "--out", str(tmp_path / "out")]
        with open(tmp_path / f"{args[0]}.rank{rank}.log", "w") as log:  # forked warm where env asks
            procs.append(warm_start.popen(ON_NODE, argv, e, stdout=log.fileno(), stderr=log.fileno()))
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


def assert_every_rank_resumed(tmp_path, name: str, ranks: int) -> None:
    """Every rank of a load phase loaded checkpoint ``name`` (at the common path) and got, bitwise,
    the state it dumped when it saved (``out/saved_rank<r>.pt`` against ``loaded_rank<r>.pt``)."""
    for r in range(ranks):
        with open(tmp_path / "out" / f"loaded_rank{r}.json") as f:
            assert os.path.dirname(json.load(f)["path"]) == str(tmp_path / "ckpt" / name)
        saved = torch.load(tmp_path / "out" / f"saved_rank{r}.pt", weights_only=False)
        loaded = torch.load(tmp_path / "out" / f"loaded_rank{r}.pt", weights_only=False)
        assert_same(saved, loaded, f"rank {r}")
