"""The keeper's slot rules, run without a keeper process (real segments in /dev/shm): a slot
is copied only when every rank of the node reported its files, committed only when asked,
kept by keep_last, bounded by max_gb; a slot nobody can finish is dropped; nothing leaks."""

import os

import pytest

from deepspeed_async_ckpt.memory import segment
from deepspeed_async_ckpt.memory.address import KeeperAddress
from deepspeed_async_ckpt.memory.messages import (Abandon, Busy, Commit, Done, FileDigest, FileSpace, Newest, NoSlot, Refused,
                                                  Report, Reserve, Reserved, SlotView)
from deepspeed_async_ckpt.memory.slots import SlotTable

MB = 1 << 20


@pytest.fixture
def table(tmp_path):
    address = KeeperAddress.of(str(tmp_path))
    t = SlotTable(address, os.getpid(), keep_last=2, max_bytes=None)
    yield t
    t.release_all()
    assert address.segments_on_node() == []


def reserve(t, name, rank, files, ranks=(0, 1), conn=None, save_id=None):
    spaces = tuple(FileSpace(n, c) for n, c in files.items())
    return t.reserve(rank if conn is None else conn, Reserve(name, save_id or f"id-{name}", rank, ranks, spaces))


def report(t, name, rank, files, save_id=None):
    return t.report(Report(name, save_id or f"id-{name}", rank, "xxh128",
                           tuple(FileDigest(n, s, f"sum-{n}") for n, s in files.items())))


def save(t, name, ranks=(0, 1), nbytes=1000):
    for r in ranks:
        assert isinstance(reserve(t, name, r, {f"r{r}.pt": nbytes}, ranks), Reserved)
    for r in ranks:
        report(t, name, r, {f"r{r}.pt": nbytes})
    return t.commit(Commit(name))


def test_a_slot_is_copied_only_when_every_rank_of_the_node_reported_and_committed_only_when_asked(table):
    r0 = reserve(table, "s1", 0, {"a.pt": 5000, "b.pt": 10})
    assert [(p.name, p.capacity) for p in r0.files] == [("a.pt", 5000), ("b.pt", 10)]
    segs = [p.segment for p in r0.files]  # a segment per file, whole pages, allocated
    assert len(set(segs)) == 2 and [os.path.getsize(segment.path_of(n)) for n in segs] == [2 * 4096, 4096]
    reserve(table, "s1", 1, {"c.pt": 10})
    assert report(table, "s1", 0, {"a.pt": 4000, "b.pt": 10}).state == "open"
    # reported: each segment is cut to its file's size, so that a load can hard-link it as the file
    assert [os.path.getsize(segment.path_of(n)) for n in segs] == [4000, 10]
    refused = table.commit(Commit("s1"))
    assert isinstance(refused, Refused) and "ranks [1] of the node have not copied" in refused.reason
    assert isinstance(table.newest(), NoSlot)
    assert report(table, "s1", 1, {"c.pt": 10}).state == "copied"
    assert isinstance(table.newest(), NoSlot)  # copied on this node is not committed
    assert table.commit(Commit("s1", "id-s1", {"save_id": "id-s1"})).state == "committed"
    view = table.newest()
    assert isinstance(view, SlotView) and (view.name, view.save_id, view.algorithm) == ("s1", "id-s1", "xxh128")
    assert view.manifest == {"save_id": "id-s1"}  # the checkpoint's manifest comes back with it
    assert [(f.name, f.segment, f.size, f.checksum) for f in view.ranks[0].files] == [
        ("a.pt", segs[0], 4000, "sum-a.pt"), ("b.pt", segs[1], 10, "sum-b.pt")]


@pytest.mark.parametrize("files, message", [
    ({"a.pt": 11}, "a.pt has 11 bytes, reserved 10"),
    ({"z.pt": 1}, "reported files ['z.pt'] are not the reserved ones ['a.pt']"),
])
def test_a_report_that_does_not_match_the_reservation_is_refused(table, files, message):
    reserve(table, "s1", 0, {"a.pt": 10}, (0,))
    reply = report(table, "s1", 0, files)
    assert isinstance(reply, Refused) and message in reply.reason
    assert report(table, "s1", 0, {"a.pt": 10}).state == "copied"


def test_keep_last_frees_older_committed_slots_and_the_next_save_reuses_their_segments(table):
    first = [reserve(table, "s0", r, {f"r{r}.pt": 1000}).files[0].segment for r in (0, 1)]
    for r in (0, 1):
        report(table, "s0", r, {f"r{r}.pt": 1000})
    table.commit(Commit("s0"))
    for step in range(1, 4):
        save(table, f"s{step}")
    assert [s.name for s in table.slots] == ["s2", "s3"]
    # keep_last slots plus one slot's worth of spares (the next save's), two ranks' segments each
    assert len(table.address.segments_on_node()) == 6 and len(table.spares) == 2
    assert first[0] in [f.segment for s in table.slots for p in s.parts.values() for f in p.places]  # s2 took s0's
    table.configure(keep_last=1, max_bytes=None)
    assert [s.name for s in table.slots] == ["s3"] and table.newest().name == "s3"
    assert len(table.spares) == 4 and table.held_bytes == 6 * 4096
    reserve(table, "s4", 0, {"big.pt": 1 << 21}, (0,))  # fits no spare: the spares go, a new segment comes
    assert table.spares == [] and len(table.address.segments_on_node()) == 3


def test_the_segments_of_a_slot_lent_to_a_load_are_never_reused(table):
    save(table, "s1")
    lent = [f.segment for part in table.newest(Newest(lend=True)).ranks for f in part.files]
    save(table, "s2")
    save(table, "s3")  # keep_last=2 retires s1: a load may still map its segments
    assert [s.name for s in table.slots] == ["s2", "s3"] and table.spares == []
    assert not set(lent) & set(table.address.segments_on_node())
    save(table, "s4")  # s2, never lent, is the next save's spare as before
    assert len(table.spares) == 2


def test_a_reservation_over_max_gb_is_refused_naming_the_setting_and_the_bytes(table):
    table.configure(keep_last=2, max_bytes=3 * MB)
    save(table, "s1", ranks=(0,), nbytes=MB)
    save(table, "s2", ranks=(0,), nbytes=MB)
    reply = reserve(table, "s3", 0, {"a.pt": MB + 1}, (0,))
    assert isinstance(reply, Refused)
    assert reply.reason.startswith("async_checkpoint.memory.max_gb is 0.00292969 (3145728 bytes): rank 0 for s3")
    assert f"asked {MB + 4096} bytes while the keeper holds {2 * MB} bytes" in reply.reason
    assert "keep_last=2" in reply.reason
    assert [s.name for s in table.slots] == ["s1", "s2"]  # the kept checkpoints stay
    assert isinstance(reserve(table, "s3", 0, {"a.pt": MB}, (0,)), Reserved)  # what fits is taken


def test_one_slot_is_written_at_a_time_and_one_nobody_can_finish_is_dropped(table):
    reserve(table, "s1", 0, {"a.pt": 10}, conn=100)
    busy = reserve(table, "s2", 0, {"a.pt": 10}, conn=101)
    assert isinstance(busy, Busy) and "s1 (save id-s1) is open, ranks [0, 1] still copying" in busy.reason
    report(table, "s1", 0, {"a.pt": 10})
    table.connection_closed(100)  # rank 0 reported, then died; rank 1 never came
    assert isinstance(reserve(table, "s2", 0, {"a.pt": 10}, conn=101), Reserved)
    assert [s.name for s in table.slots] == ["s2"]
    table.connection_closed(101)  # died holding a reservation it never reported
    assert table.slots == [] and table.address.segments_on_node() == []


def test_a_copied_slot_waits_for_its_commit_and_an_abandoned_one_is_freed(table):
    reserve(table, "s1", 0, {"a.pt": 10}, (0,), conn=7)
    report(table, "s1", 0, {"a.pt": 10})
    busy = reserve(table, "s2", 0, {"a.pt": 10}, (0,), conn=7)
    assert isinstance(busy, Busy) and "waiting for its commit" in busy.reason
    assert table.abandon(Abandon("s1", "id-s1")) == Done()
    assert table.slots == []
    assert isinstance(reserve(table, "s2", 0, {"a.pt": 10}, (0,), conn=7), Reserved)


@pytest.mark.parametrize("rank, ranks, files, message", [
    (2, (0, 1), {"a.pt": 1}, "rank 2 is not among the node's ranks [0, 1]"),
    (0, (0,), {"a.pt": -1}, "capacities >= 0"),
])
def test_bad_reservations_are_refused(table, rank, ranks, files, message):
    reply = reserve(table, "s1", rank, files, ranks)
    assert isinstance(reply, Refused) and message in reply.reason
    assert table.address.segments_on_node() == []
