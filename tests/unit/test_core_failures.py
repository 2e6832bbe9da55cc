"""Failures (``deepspeed_async_ckpt.core.failures``): disk full and other errors surface
at the next save or wait, once, on every rank, and never hide one another."""

import contextlib
import io
import json
import logging
import os
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import KeepIf
from deepspeed_async_ckpt.commit import META_DIR, Pointer, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import (AsyncCheckpointError, CommitError, Failure, IntegrityError,
                                         PersistError)

from fakes import FailingAfter, FailingStorage, FullDisk, HeldWrites, RecordFailing, SmallFileFull
from helpers import listing, make, sample_state, save_one, save_small


@pytest.mark.parametrize("victim", ["manifest.json", "latest", "rank_00000"])
def test_disk_full_on_a_small_commit_file_names_it_and_leaves_no_temporary(tmp_path, victim):
    """A full disk when the rank record, the manifest or ``latest`` was written gave an
    error naming no file ("[Errno 28] No space left on device") and left its 0-byte
    temporary behind."""
    root = str(tmp_path)
    ck = make("sync")
    save_one(ck, root, sample_state(), tag="t1")
    ck.close()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01,
                                                 commit_timeout_s=2), storage=SmallFileFull(victim))
    with pytest.raises(AsyncCheckpointError) as info:
        save_one(ck, root, sample_state(), tag="t2")
        ck.wait()
    assert victim in str(info.value) and "No space left" in str(info.value), info.value
    if ck.is_open:
        ck.end(commit=False)
    ck.close()
    left = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if ".tmp." in n]
    assert left == [], left
    assert (tmp_path / "latest").read_text() == "t1"


def test_disk_full_surfaces_at_next_save_and_previous_checkpoint_survives(tmp_path):
    state = sample_state()
    storage = FailingStorage(budget=10**9)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    save_one(ck, str(tmp_path), state, tag="good")
    ck.fence()
    ck.wait()
    storage.budget = 1000  # the next save runs out of space mid-file
    bad = save_one(ck, str(tmp_path), state, tag="bad")
    ck.fence()
    bad.wait_committed()  # the background write has failed by now
    assert bad.error is not None and not bad.committed
    with pytest.raises(PersistError, match="No space left") as e:
        save_one(ck, str(tmp_path), state, tag="next")
    assert "bad/model.pt" in str(e.value)
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad" / "model.pt").exists()
    assert not list((tmp_path / "bad").glob("*.tmp.*"))  # the partial file was removed
    assert not (tmp_path / "bad" / META_DIR / "manifest.json").exists()
    verify_checkpoint(str(tmp_path / "good"))
    # the error was reported once; with space back, saving works again
    storage.budget = 10**9
    save_one(ck, str(tmp_path), state, tag="again")
    ck.wait()
    assert (tmp_path / "latest").read_text() == "again"
    ck.close()


def test_two_failed_saves_in_flight_are_reported_once_together(tmp_path):
    """Two async saves in flight both fail (disk full): the next save raises the first error
    and how many more there were, and the one after it works. One error per save would have
    the second save, with the disk freed meanwhile, still raise the older failure."""
    storage = HeldWrites()  # every checkpoint file waits until released
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    state = sample_state()
    bad = []
    for tag in ("bad1", "bad2"):
        bad.append(save_one(ck, str(tmp_path), state, tag=tag))
        ck.fence()
    storage.budget = 0  # both run out of space
    storage.released.set()
    for handle in bad:
        handle.wait_committed(30)
        assert handle.error is not None
    with pytest.raises(PersistError, match=r"No space left.*\(and 1 more failed save\(s\)\)"):
        save_one(ck, str(tmp_path), state, tag="next")
    storage.budget = 10**9
    save_one(ck, str(tmp_path), state, tag="again")
    ck.wait()
    assert (tmp_path / "latest").read_text() == "again"
    ck.close()


def test_a_save_cut_short_is_partial_refused_by_loads_and_removed_by_retention_after_a_commit(tmp_path):
    """A save that never commits (a disk full here; a crash alike) leaves its directory, as large
    as a checkpoint: marked this engine's from its start, `list` shows it partial and a load
    refuses it by name. Unmarked, it would be a stranger's directory (listed as "other",
    loaded unchecked) that nothing removes: a run that crashes every few hours would grow its
    save directory by one such directory each time. With ``keep_last``, the next commit
    removes those last changed before it, and not one a save still writes into (changed
    after it)."""
    from deepspeed_async_ckpt.tools.cli import main as cli_main

    state = sample_state()
    storage = FailingStorage(budget=1000)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=1),
                           storage=storage)
    bad = save_one(ck, str(tmp_path), state, tag="bad")
    ck.fence()
    bad.wait_committed()
    assert bad.error is not None
    assert os.listdir(tmp_path / "bad") == [META_DIR]  # the failed file's temporary is gone
    with pytest.raises(IntegrityError, match="never committed"):
        ck.load(str(tmp_path / "bad" / "model.pt"))
    (tmp_path / "writing" / META_DIR).mkdir(parents=True)  # another save, still writing
    future = time.time() + 3600
    for p in (tmp_path / "writing", tmp_path / "writing" / META_DIR):
        os.utime(p, (future, future))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert cli_main(["list", "--json", str(tmp_path)]) == 0
    rows = {r["name"]: r["state"] for r in json.loads(out.getvalue())}
    assert rows == {"bad": "partial", "writing": "partial"}
    storage.budget = 10**9
    with pytest.raises(PersistError, match="No space left"):  # reported once, at the next save
        save_one(ck, str(tmp_path), state, tag="good")
    good = save_one(ck, str(tmp_path), state, tag="good")
    ck.fence()
    ck.wait()
    assert good.retired == ["bad"]
    assert listing(tmp_path) == ["good", "latest", "writing"]
    ck.close()


def test_a_durability_error_survives_the_ways_errors_travel(tmp_path):
    """Rebuilt by ``wait_all_ranks`` (DeepSpeed's ``load_checkpoint``) as ``type(e)(message)``,
    copied, pickled: with its field required, each raised ``TypeError``."""
    import copy
    import pickle

    from deepspeed_async_ckpt.errors import DurabilityError

    e = DurabilityError("in place", pointer_moved=True)
    for twin in (copy.copy(e), pickle.loads(pickle.dumps(e))):
        assert type(twin) is DurabilityError and str(twin) == "in place" and twin.pointer_moved
    storage = FailingAfter()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    save_one(ck, str(tmp_path), sample_state(), tag="t1")
    ck.wait()
    storage.where = "pointer_fsync"
    save_one(ck, str(tmp_path), sample_state(), tag="t2")
    with pytest.raises(DurabilityError, match="load_checkpoint refused on every rank: .*latest names it"):
        ck.wait_all_ranks(action="load_checkpoint")
    storage.where = None
    ck.close()


def test_error_on_one_rank_is_raised_on_every_rank_without_a_hang(tmp_path):
    """begin() shares pending errors through its one collective; a peer's failure raises here."""
    peer_error = {1: Failure("PersistError", "writing x failed: [Errno 28] No space left on device")}
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True), rank=0, world_size=2,
                           exchange=lambda value, err, key="": (value, dict(peer_error)))
    with pytest.raises(CommitError, match=r"rank\(s\) 1: PersistError.*No space"):
        ck.begin(str(tmp_path / "t2"), tag="t2")
    assert not ck.is_open
    ck.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_failed_rank_writes_a_failure_record_so_rank0_aborts_at_once(tmp_path, mode):
    """Rank 1's write fails: in the background (async), or inside its save, which the framework
    then ends uncommitted (sync: ``end(commit=False)``, as the DeepSpeed plugin and the
    Megatron adapter do). Either way rank 0's commit fails at once, quoting rank 1's error.
    A sync rank that wrote nothing would leave rank 0 waiting ``commit_timeout_s`` for its
    record (a 4-rank Megatron save with one disk full would hang for 600 s)."""
    r1 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode), rank=1, world_size=2,
                           storage=FailingStorage(budget=1000),
                           exchange=lambda v, e, key="": (("same-id", False), {}))
    r0 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, commit_timeout_s=300), rank=0, world_size=2,
                           exchange=lambda v, e, key="": (("same-id", False), {}))
    d = str(tmp_path / "t1")
    h0 = r0.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    r0.save({"module": {"w": torch.ones(10)}}, os.path.join(d, "rank0.pt"))
    r0.end()
    r1.begin(d, tag="t1")
    if mode == "async":
        r1.save(sample_state(), os.path.join(d, "rank1.pt"))
        r1.end()
    else:
        with pytest.raises(PersistError, match="No space left"):
            r1.save(sample_state(), os.path.join(d, "rank1.pt"))
        r1.end(commit=False)
    t0 = time.monotonic()
    assert h0.wait_committed(60)
    assert time.monotonic() - t0 < 30  # not the 300 s commit timeout
    assert isinstance(h0.error, CommitError) and "rank(s) 1 failed to persist" in str(h0.error)
    assert "No space left" in str(h0.error)
    assert not (tmp_path / "latest").exists()
    for ck in (r0, r1) if mode == "async" else (r0,):  # sync: rank 1 raised it already
        with pytest.raises((CommitError, PersistError)):
            ck.wait()
    r0.close()
    r1.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_rank_whose_record_fails_writes_a_failure_record_so_rank0_aborts_at_once(tmp_path, mode):
    """Rank 1's files are durable, then writing its record fails. It still writes a failure
    record: counted as persisted and silent, it would leave rank 0 waiting ``commit_timeout_s``
    and then blaming rank 1 for not finishing, without its error."""
    same = lambda v, e, key="": (("same-id", False), {})  # noqa: E731
    r0 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, commit_timeout_s=300), rank=0,
                           world_size=2, exchange=same)
    r1 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode), rank=1, world_size=2,
                           storage=RecordFailing(), exchange=same)
    d = str(tmp_path / "t1")
    h1 = r1.begin(d, tag="t1")
    r1.save({"w": torch.ones(10)}, os.path.join(d, "rank1.pt"))
    try:
        r1.end()
    except PersistError as exc:  # sync: raised by the save itself
        assert mode == "sync" and "Input/output error" in str(exc)
    assert h1.wait_committed(60) and isinstance(h1.error, OSError)
    t0 = time.monotonic()
    h0 = r0.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    r0.save({"w": torch.ones(10)}, os.path.join(d, "rank0.pt"))
    with contextlib.suppress(CommitError):  # sync: rank 0's end commits, and fails
        r0.end()
    assert h0.wait_committed(60) and time.monotonic() - t0 < 30  # not the 300 s commit timeout
    assert isinstance(h0.error, CommitError), h0.error
    assert "rank(s) 1 failed to persist their part (OSError: [Errno 5] Input/output error" in str(h0.error)
    assert not (tmp_path / "latest").exists()
    for ck in (r0, r1):
        with contextlib.suppress(CommitError, PersistError, OSError):
            ck.wait()
        ck.close()


def test_a_sync_end_raises_its_own_saves_failure_not_a_previous_ones(tmp_path):
    """A sync save's ``end`` raises that save's failure as it is (rank 1's part failed: rank
    0's commit error naming it), not wrapped as "a previous checkpoint failed", which the
    next save's ``begin`` says of an async one. Sync DeepSpeed saves raise it from
    ``save_checkpoint`` on every rank (tests/integration/test_deepspeed_multiproc.py)."""
    same = lambda v, e, key="": (("same-id", False), {})  # noqa: E731
    r0 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync"), rank=0, world_size=2,
                           exchange=same)
    r1 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync"), rank=1, world_size=2,
                           storage=FailingStorage(budget=1000), exchange=same)
    d = str(tmp_path / "t1")
    r0.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    r1.begin(d, tag="t1")
    with pytest.raises(PersistError, match="No space left"):
        r1.save(sample_state(), os.path.join(d, "rank1.pt"))
    r1.end(commit=False)
    r0.save({"module": {"w": torch.ones(10)}}, os.path.join(d, "rank0.pt"))
    with pytest.raises(CommitError) as info:
        r0.end()
    assert str(info.value).startswith(f"checkpoint {d!r} (tag t1) not committed: rank(s) 1 failed"), info.value
    assert "No space left" in str(info.value)
    assert not (tmp_path / "latest").exists()
    r0.wait()  # raised once: nothing left to report
    r0.close()
    r1.close()


def test_a_sync_end_raises_its_failure_even_when_another_threads_wait_took_it(tmp_path, monkeypatch):
    """Sync ``end`` on a training thread while another thread waits (the exit flush's close,
    say) and takes the background errors first: ``end`` raised ``ValueError: list.remove(x)``
    in place of its save's error. Both now report it."""
    from deepspeed_async_ckpt.core import committer as checkpointer_module

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointer_module, "commit", disk_full)
    root = str(tmp_path)
    ck = make("sync")
    result = {}
    taken = threading.Event()

    def wait_for_it():
        try:
            ck.wait()
        except AsyncCheckpointError as exc:
            result["wait"] = exc
        taken.set()

    handle = ck.begin(os.path.join(root, "t1"), tag="t1", pointer=Pointer(os.path.join(root, "latest"), "t1"))
    ck.save(sample_state(), os.path.join(root, "t1", "model.pt"))
    real_settle = handle.mark_settled

    def committed_then_the_other_thread_waits():  # it takes the error before end() looks
        real_settle()
        threading.Thread(target=wait_for_it).start()
        taken.wait(10)

    handle.mark_settled = committed_then_the_other_thread_waits
    with pytest.raises(PersistError, match="No space left") as info:
        ck.end()
    assert "t1" in str(info.value)
    assert "No space left" in str(result.get("wait")), result
    ck.close()


def test_a_begin_refused_for_its_directory_still_raises_an_earlier_saves_failure(tmp_path, monkeypatch):
    """``begin`` takes the failures of earlier saves first; refused because another job holds
    the save directory, it raised the refusal and dropped them: the failed save was never
    reported, and the next saves, ``wait`` and ``close`` were silent."""
    from deepspeed_async_ckpt.errors import AsyncCheckpointError

    storage = FullDisk()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    mine, other = str(tmp_path / "mine"), str(tmp_path / "other")
    os.makedirs(other)
    real_claim = ck._claims.claim

    def claim(save_dir):
        if save_dir.startswith(other):
            raise AsyncCheckpointError(f"save directory {save_dir!r} is being saved into by another process")
        return real_claim(save_dir)

    monkeypatch.setattr(ck._claims, "claim", claim)
    save_small(ck, mine, "t1")
    ck.wait()
    storage.full = True
    save_small(ck, mine, "t2").wait_committed()
    storage.full = False
    with pytest.raises(PersistError, match="No space left"):
        save_small(ck, other, "x1")  # t2's failure, not the refusal
    with pytest.raises(AsyncCheckpointError, match="another process"):
        save_small(ck, other, "x1")  # then the refusal
    save_small(ck, mine, "t3")
    ck.close()
    assert (tmp_path / "mine" / "latest").read_text() == "t3"


def test_close_raises_a_failed_save_though_retention_failed_too(tmp_path, caplog):
    """A retention bug (a policy that raised) and a failed save: ``close`` raises the failed
    save (else it would close for good with it never raised) and logs the retention bug."""
    def keep(name):
        raise ValueError("a retention bug")

    storage = FullDisk()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage,
                           retention=KeepIf(keep))
    root = str(tmp_path)
    save_small(ck, root, "t0").wait_committed()
    handle = save_small(ck, root, "t1")
    handle.wait_committed()
    with ck._saves.lock:
        first = ck._retention.retiring[0]
    assert isinstance(first.exception(30), ValueError)
    storage.full = True
    save_small(ck, root, "t2").wait_committed()
    with caplog.at_level(logging.ERROR), pytest.raises(PersistError, match="No space left"):
        ck.close()
    assert "removing older checkpoints failed" in caplog.text and "a retention bug" in caplog.text
    assert not ck._failures.errors
