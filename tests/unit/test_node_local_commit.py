"""Node-local storage in one process: the records through a real ``torch.distributed`` store
(``HashStore``, ``TCPStore``), the manifest's ``nodes``, each node's commit, and verification
of a checkpoint spread across nodes."""

import datetime
import json
import os
import threading
import time

import pytest
import torch.distributed as dist

from deepspeed_async_ckpt.commit import Pointer, commit, commit_on_node, poll_delay, verify_checkpoint
from deepspeed_async_ckpt.commit.exchange import StoreExchange
from deepspeed_async_ckpt.commit.manifest import manifest_problem, read_manifest
from deepspeed_async_ckpt.commit.nodes import local_world_size, node_leader, node_of
from deepspeed_async_ckpt.errors import CommitError, IntegrityError
from deepspeed_async_ckpt.storage import LocalStorage


def _entry(data: bytes) -> dict:
    return {"bytes": len(data), "xxh128": _xxh(data)}


def _xxh(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _record(rank: int, node: int, files: dict[str, bytes], save_id: str = "s1") -> dict:
    return {"rank": rank, "save_id": save_id, "checksum": "xxh128", "node": node,
            "files": {rel: _entry(data) for rel, data in files.items()}}


# what each of 4 ranks on 2 nodes (2 per node) writes: the model states once per node, with
# different bytes on node 1 (a replica's own BatchNorm statistics), a shard per rank
WRITES = {0: (0, {"model.pt": b"node0-model", "zero_0.pt": b"z0"}),
          1: (0, {"zero_1.pt": b"z1"}),
          2: (1, {"model.pt": b"node1-model!", "zero_2.pt": b"z2"}),
          3: (1, {"zero_3.pt": b"z3"})}


@pytest.fixture
def two_nodes(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")


def test_node_of_a_rank_comes_from_the_ranks_per_node(monkeypatch, two_nodes):
    assert [node_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [node_leader(r, 4) for r in range(4)] == [0, 0, 2, 2]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_world_size(4) == 4 and node_of(3, 4) == 0  # no launcher variable: one node


def test_store_exchange_commits_lists_nodes_and_deletes_its_keys(tmp_path, two_nodes):
    """Rank 0 reads every record from the store, writes a manifest placing each file on its
    node(s), tells node 1 its own manifest (its model states' checksum is its copy's), and
    leaves no key of the save behind once node 1's leader took its word."""
    store = dist.HashStore()
    exchange = StoreExchange(store, 4)
    d = str(tmp_path / "global_step1")
    os.makedirs(os.path.join(d, ".async_ckpt"))  # as rank 0's begin makes it
    for r in (3, 1, 2):  # any order; rank 0's own last
        exchange.publish(d, _record(r, *WRITES[r]))
    assert not exchange.look(d, save_id="s1", world_size=4)[0]
    exchange.publish(d, _record(0, *WRITES[0]))
    manifest, _ = commit(LocalStorage(fsync=False), d, tag="global_step1", save_id="s1", world_size=4,
                         checksum="xxh128", timeout_s=10, pointer=Pointer(str(tmp_path / "latest"),
                                                                          "global_step1"),
                         exchange=exchange)
    assert manifest["nodes"] == {"0": ["model.pt", "zero_0.pt", "zero_1.pt"],
                                 "1": ["model.pt", "zero_2.pt", "zero_3.pt"]}
    assert manifest["files"]["model.pt"] == _entry(b"node0-model")
    assert read_manifest(d) == json.loads(json.dumps(manifest))
    assert (tmp_path / "latest").read_text() == "global_step1"
    for key in ["s1/count", *(f"s1/rank/{r}" for r in range(4))]:
        assert not store.check([key]), key
    node1, late = exchange.await_commit(d, tag="global_step1", save_id="s1", node=1, timeout_s=1,
                                        poll_delay=poll_delay)
    assert late == {}
    assert node1["files"]["model.pt"] == _entry(b"node1-model!")
    assert {k: v for k, v in node1.items() if k != "files"} == \
        {k: v for k, v in manifest.items() if k != "files"}
    assert not store.check(["s1/commit/1"])


def test_a_rank_failure_stops_rank_0_and_the_node_leaders_at_once(tmp_path, two_nodes):
    """A rank's failure in the store ends rank 0's wait at once (not after commit_timeout_s),
    with the rank's reason; rank 0 tells the other nodes' leaders, who stop waiting too."""
    store = dist.HashStore()
    exchange = StoreExchange(store, 4)
    d = str(tmp_path / "t")
    exchange.publish(d, _record(0, *WRITES[0]))
    exchange.publish(d, _record(2, *WRITES[2]))
    exchange.fail(d, rank=3, save_id="s1", message="OSError: [Errno 28] No space left on device")
    start = time.monotonic()
    with pytest.raises(CommitError, match=r"rank\(s\) 3 failed to persist their part \(OSError: "
                                          r"\[Errno 28\] No space left"):
        commit(LocalStorage(fsync=False), d, tag="t", save_id="s1", world_size=4, checksum="xxh128",
               timeout_s=600, pointer=Pointer(str(tmp_path / "latest"), "t"), exchange=exchange)
    assert time.monotonic() - start < 5
    assert not os.path.exists(tmp_path / "latest")
    for key in ["s1/count", "s1/rank/0", "s1/rank/2", "s1/failed/3"]:
        assert not store.check([key]), key
    with pytest.raises(CommitError, match="rank 0 did not commit it .*No space left"):
        exchange.await_commit(d, tag="t", save_id="s1", node=1, timeout_s=1, poll_delay=poll_delay)


def test_a_late_rank_times_out_naming_it(tmp_path, two_nodes):
    exchange = StoreExchange(dist.HashStore(), 2)
    exchange.publish(str(tmp_path), _record(0, 0, {}))
    with pytest.raises(CommitError, match=r"rank\(s\) 1 did not finish persisting within 0 s"):
        commit(LocalStorage(fsync=False), str(tmp_path / "t"), tag="t", save_id="s1", world_size=2,
               checksum="xxh128", timeout_s=0.05, pointer=None, exchange=exchange)


def test_records_through_a_tcp_store_from_other_threads(tmp_path, two_nodes):
    """The exchange over a real TCPStore, each rank a client of its own on its own thread (as
    committer threads are), rank 0 polling while the others publish."""
    server = dist.TCPStore("127.0.0.1", 0, 5, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    clients = [dist.PrefixStore("async_ckpt/", dist.TCPStore(
        "127.0.0.1", server.port, 5, False, timeout=datetime.timedelta(seconds=30))) for _ in range(4)]
    d = str(tmp_path / "t")
    os.makedirs(os.path.join(d, ".async_ckpt"))
    threads = [threading.Thread(target=lambda r=r: (time.sleep(0.05 * r),
                                                    StoreExchange(clients[r], 4).publish(d, _record(r, *WRITES[r]))))
               for r in (1, 2, 3)]
    for t in threads:
        t.start()
    StoreExchange(clients[0], 4).publish(d, _record(0, *WRITES[0]))
    manifest, _ = commit(LocalStorage(fsync=False), d, tag="t", save_id="s1", world_size=4,
                         checksum="xxh128", timeout_s=30, pointer=None,
                         exchange=StoreExchange(clients[0], 4))
    for t in threads:
        t.join()
    assert sorted(manifest["ranks"]) == ["0", "1", "2", "3"]
    assert manifest["nodes"]["1"] == ["model.pt", "zero_2.pt", "zero_3.pt"]
    got, _ = StoreExchange(clients[2], 4).await_commit(d, tag="t", save_id="s1", node=1, timeout_s=5,
                                                       poll_delay=poll_delay)
    assert got["files"]["zero_3.pt"] == _entry(b"z3")
    assert server.num_keys() <= 1  # (the server counts a key of its own)


def test_two_ranks_of_one_node_writing_different_bytes_to_one_name_is_refused(tmp_path, two_nodes):
    """Different bytes under one name are each node's own only across nodes; within a node
    (one directory) the manifest would describe one file and the disk hold the other."""
    exchange = StoreExchange(dist.HashStore(), 2)
    writes = {0: (0, {"a.pt": b"one"}), 1: (0, {"a.pt": b"two"})}
    for r in (0, 1):
        exchange.publish(str(tmp_path), _record(r, *writes[r]))
    with pytest.raises(CommitError, match="ranks 0 and 1 both wrote a.pt, with different contents"):
        commit(LocalStorage(fsync=False), str(tmp_path / "t"), tag="t", save_id="s1", world_size=2,
               checksum="xxh128", timeout_s=5, pointer=None, exchange=exchange)


def test_commit_on_node_writes_the_manifest_then_the_pointer(tmp_path):
    """A node's leader: the manifest rank 0 sent, then the pointer; a damaged manifest is
    written nowhere and moves nothing."""
    manifest = {"format": "deepspeed_async_ckpt/1", "tag": "t2", "save_id": "s", "world_size": 2,
                "checksum": "xxh128", "committed_at": 1.0, "files": {"a.pt": _entry(b"x")},
                "ranks": {"0": ["a.pt"], "1": []}, "nodes": {"0": [], "1": ["a.pt"]}}
    (tmp_path / "latest").write_text("t1")
    d = str(tmp_path / "t2")
    with pytest.raises(CommitError, match="the manifest rank 0 sent is damaged"):
        commit_on_node(LocalStorage(fsync=False), d, dict(manifest, nodes={"1": []}),
                       pointer=Pointer(str(tmp_path / "latest"), "t2"))
    assert (tmp_path / "latest").read_text() == "t1" and not os.path.exists(d)
    commit_on_node(LocalStorage(fsync=False), d, manifest, pointer=Pointer(str(tmp_path / "latest"), "t2"))
    assert read_manifest(d) == manifest
    assert (tmp_path / "latest").read_text() == "t2"


@pytest.mark.parametrize("nodes,problem", [
    ({"0": ["a.pt"], "1": ["a.pt", "b.pt"]}, None),
    ({"0": ["a.pt"]}, "'nodes' places 'b.pt' on no node"),
    ({"0": ["a.pt", "b.pt", "c.pt"]}, "'nodes' places 'c.pt' on node 0, which 'files' does not list"),
    ({"x": ["a.pt", "b.pt"]}, "'nodes' is not an object"),
    ({"0": "a.pt"}, "'nodes' is not an object"),
    (["a.pt", "b.pt"], "'nodes' is not an object"),
])
def test_manifest_nodes_are_validated(nodes, problem):
    manifest = {"format": "deepspeed_async_ckpt/1", "tag": "t", "save_id": "s", "world_size": 2,
                "checksum": "xxh128", "committed_at": 1.0,
                "files": {"a.pt": _entry(b"a"), "b.pt": _entry(b"b")}, "nodes": nodes}
    got = manifest_problem(manifest)
    assert got == problem if problem is None else problem in got


def test_each_node_verifies_the_files_its_directory_holds(tmp_path, two_nodes):
    """On node 1's disk (no node 0 files there) ranks 2 and 3 split node 1's files between
    them and pass; a corrupted file there fails the rank that reads it."""
    files = {"model.pt": b"node1-model!", "zero_2.pt": b"z2", "zero_3.pt": b"z3"}
    d = tmp_path / "t"
    (d / ".async_ckpt").mkdir(parents=True)
    for rel, data in files.items():
        (d / rel).write_bytes(data)
    manifest = {"format": "deepspeed_async_ckpt/1", "tag": "t", "save_id": "s", "world_size": 4,
                "checksum": "xxh128", "committed_at": 1.0,
                "files": {"zero_0.pt": _entry(b"z0"), "zero_1.pt": _entry(b"z1"),
                          **{rel: _entry(data) for rel, data in files.items()}},
                "nodes": {"0": ["model.pt", "zero_0.pt", "zero_1.pt"], "1": sorted(files)}}
    (d / ".async_ckpt" / "manifest.json").write_text(json.dumps(manifest))
    import deepspeed_async_ckpt.commit.verify as verify_mod

    read = []
    real = verify_mod.hash_ranges
    verify_mod.hash_ranges = lambda path, *a: read.append(os.path.basename(path)) or real(path, *a)
    try:
        for rank in (2, 3):
            verify_checkpoint(str(d), rank=rank, world_size=4)
        assert sorted(read) == sorted(files)  # each file once, by one of the node's ranks
        with pytest.raises(IntegrityError, match=r"zero_[01].pt: listed in the manifest .* but cannot be read"):
            verify_checkpoint(str(d), rank=0, world_size=4)  # node 0's files are not here
        (d / "zero_3.pt").write_bytes(b"zX")
        with pytest.raises(IntegrityError, match="zero_3.pt: xxh128"):
            for rank in (2, 3):
                verify_checkpoint(str(d), rank=rank, world_size=4)
    finally:
        verify_mod.hash_ranges = real


class _Marker:
    """A finalize step, as Megatron's markers are: a file written from the committed manifest."""

    files = ("marker.json",)

    def __call__(self, ctx):
        ctx.write_file("marker.json", json.dumps({"tag": ctx.manifest["tag"], "files": sorted(ctx.manifest["files"])}))


def test_the_late_files_reach_every_node_and_verify_there(tmp_path, two_nodes):
    """Rank 0's finalize steps run on its node; the files they wrote travel with node 1's
    manifest, and node 1's leader writes them, records them, then moves its pointer: node 1's
    copy verifies, late files included, on node 1's ranks alone."""
    exchange = StoreExchange(dist.HashStore(), 4)
    d0, d1 = tmp_path / "node0" / "t", tmp_path / "node1" / "t"
    for d, node in ((d0, 0), (d1, 1)):
        (d / ".async_ckpt").mkdir(parents=True)
        for r, (n, files) in WRITES.items():
            for rel, data in files.items():
                if n == node:
                    (d / rel).write_bytes(data)
    for r in range(4):
        exchange.publish(str(d0), _record(r, *WRITES[r]))
    storage = LocalStorage(fsync=False)
    manifest, written = commit(storage, str(d0), tag="t", save_id="s1", world_size=4, checksum="xxh128",
                               timeout_s=10, pointer=Pointer(str(tmp_path / "node0" / "latest"), "t"),
                               finalize=[_Marker()], exchange=exchange)
    assert manifest["late_files"] == ["marker.json"]
    node1, late = exchange.await_commit(str(d1), tag="t", save_id="s1", node=1, timeout_s=1,
                                        poll_delay=poll_delay)
    assert late == written == {"marker.json": (d0 / "marker.json").read_bytes()}
    with pytest.raises(CommitError, match=r"late files \['marker.json'\], rank 0 sent \[\]"):
        commit_on_node(storage, str(d1), node1, pointer=Pointer(str(tmp_path / "node1" / "latest"), "t"))
    assert not (tmp_path / "node1" / "latest").exists()
    commit_on_node(storage, str(d1), node1, pointer=Pointer(str(tmp_path / "node1" / "latest"), "t"),
                   late=late)
    assert (tmp_path / "node1" / "latest").read_text() == "t"
    assert (d1 / "marker.json").read_bytes() == (d0 / "marker.json").read_bytes()
    for rank in (2, 3):
        verify_checkpoint(str(d1), rank=rank, world_size=4)
    (d1 / "marker.json").write_text("{}")
    with pytest.raises(IntegrityError, match="marker.json"):
        verify_checkpoint(str(d1), rank=2, world_size=4)  # node 1's first rank checks them


class _TwoRanks:
    """``begin``'s collective for two checkpointers on two threads of this process: rank 0's
    value, and every rank's error."""

    def __init__(self):
        self.barrier, self.sent = threading.Barrier(2, timeout=30), [None, None]

    def of(self, rank):
        def exchange(value, error):
            self.sent[rank] = (value, error)
            self.barrier.wait()
            got = self.sent[0][0], {r: e for r, (_, e) in enumerate(self.sent) if e}
            self.barrier.wait()
            return got
        return exchange


def _two_nodes_of_one_rank(monkeypatch, tmp_path, storages):
    """Rank 0 (node 0) and rank 1 (node 1, its leader), each saving into its own node's
    directory, the records through one HashStore."""
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.core import AsyncCheckpointer, committer

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    store = dist.HashStore()
    monkeypatch.setattr(committer, "default_store", lambda: store)
    exchange = _TwoRanks()
    return [AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, node_local=True,
                                                    commit_timeout_s=60),
                              rank=r, world_size=2, exchange=exchange.of(r), storage=storages[r])
            for r in (0, 1)]


def _save_on_both(cks, tmp_path, tag, errors):
    import torch

    def run(r):
        root = tmp_path / f"node{r}"
        d = str(root / tag)
        try:
            cks[r].begin(d, tag=tag, pointer=Pointer(str(root / "latest"), tag))
            cks[r].save({"w": torch.full((64,), float(r))}, os.path.join(d, f"model_{r}.pt"))
            cks[r].end()
            cks[r].wait()
        except Exception as exc:  # noqa: BLE001 - what each rank raised, for the test
            errors[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def test_each_node_leader_commits_its_copy_and_a_rank_0_failure_stops_it(monkeypatch, tmp_path, two_nodes):
    """Two checkpointers as ranks 0 and 1 on two nodes: a save commits on both nodes (each
    pointer moved, each manifest placing each rank's file on its node); then rank 0's own write
    fails: node 1's leader stops waiting at once (not after twice commit_timeout_s), its
    pointer where it was."""
    from fakes import FullDisk

    full = FullDisk(fsync=False)
    cks = _two_nodes_of_one_rank(monkeypatch, tmp_path, [full, LocalStorage(fsync=False)])
    try:
        errors = {}
        _save_on_both(cks, tmp_path, "t1", errors)
        assert errors == {}
        for node in (0, 1):
            root = tmp_path / f"node{node}"
            assert (root / "latest").read_text() == "t1"
            assert read_manifest(str(root / "t1"))["nodes"] == {"0": ["model_0.pt"], "1": ["model_1.pt"]}
            assert sorted(os.listdir(root / "t1" / ".async_ckpt")) == ["manifest.json"]
        full.full = True
        start = time.monotonic()
        _save_on_both(cks, tmp_path, "t2", errors)
        assert time.monotonic() - start < 20
        assert "No space left on device" in str(errors[0])
        assert "rank 0 did not commit it" in str(errors[1]) and "No space left" in str(errors[1])
        assert (tmp_path / "node1" / "latest").read_text() == "t1"
    finally:
        full.full = False
        for ck in cks:
            try:
                ck.close()
            except Exception:  # noqa: BLE001 - the failed save, raised again
                pass
