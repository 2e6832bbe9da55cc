"""The commit sequence (``deepspeed_async_ckpt.commit.sequence``): rank records, the
manifest, the pointer, in durable order; waiting for every rank; failures after the
manifest named for what they leave."""

import errno
import json
import os
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import META_DIR, Pointer, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import AsyncCheckpointError, CommitError, IntegrityError
from deepspeed_async_ckpt.storage import LocalStorage

from fakes import CountingListings, FailingAfter, ListingFailing, NoExchangeFailingRename, RecordingStorage
from helpers import listing, make, sample_state, save_one, saved_steps


@pytest.mark.parametrize("tag, where, in_place", [
    ("t2", "pointer", False),  # a new tag, `latest` never renamed: nothing a load sees changed
    ("t2", "pointer_fsync", True),  # `latest` renamed to it, its fsync failed
    ("t1", "pointer", True),  # a re-save: swapped in, then `latest` (naming it already) failed
])
def test_a_failure_after_the_checkpoint_is_in_place_says_so(tmp_path, tag, where, in_place):
    """After the manifest, a failure raised "failed and was not committed (the last committed
    one is intact)" even where the new checkpoint was already where loads look: `latest`
    renamed to it (its fsync failed), or a re-save swapped in (the old one on its way to
    deletion). It says now that the checkpoint is in place and may not survive a crash, and
    retention keeps what `latest` names."""
    from deepspeed_async_ckpt.errors import DurabilityError

    storage = FailingAfter()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=1),
                           storage=storage)
    save_one(ck, str(tmp_path), sample_state(), tag="t1")
    ck.wait()
    storage.where = where
    state = sample_state()
    state["global_steps"] = 9
    handle = save_one(ck, str(tmp_path), state, tag=tag)
    with pytest.raises(AsyncCheckpointError) as raised:
        ck.wait()
    storage.where = None
    message = str(raised.value)
    assert isinstance(raised.value, DurabilityError) is in_place, message
    assert not handle.committed
    if in_place:
        assert "did not complete" in message and "is committed and in place, and" in message, message
        assert "a crash may undo it" in message and "not committed" not in message, message
        assert (tmp_path / "latest").read_text() == tag
        assert saved_steps(tmp_path / tag / "model.pt") == 9
        assert ck._retention.pointed[str(tmp_path)] == str(tmp_path / tag)  # retention keeps it
    else:
        assert "was not committed (the last committed one is intact)" in message, message
        assert (tmp_path / "latest").read_text() == "t1" and saved_steps(tmp_path / "t1" / "model.pt") == 5
    save_one(ck, str(tmp_path), sample_state(), tag="t3")  # the next save commits, retention runs
    ck.wait()
    assert (tmp_path / "latest").read_text() == "t3"
    verify_checkpoint(str(tmp_path / "t3"))
    ck.close()


def test_failures_after_the_manifest_that_leave_the_checkpoint_unfinished_or_beside(tmp_path):
    """A re-save without an exchange whose second rename failed is committed, beside its
    place, and the next load or save renames it in (the old one is in the trash): a
    DurabilityError says so, not "the last committed one is intact". A re-save whose finalize
    step fails (Megatron's markers) is not in place, and the error says it was not committed;
    the checkpoint it would have replaced still verifies."""
    from deepspeed_async_ckpt.errors import DurabilityError

    storage = NoExchangeFailingRename()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    save_one(ck, str(tmp_path), sample_state(), tag="t")
    ck.wait()
    state = sample_state()
    state["global_steps"] = 9
    storage.fail = True
    save_one(ck, str(tmp_path), state, tag="t")
    with pytest.raises(DurabilityError, match="is committed, at .*staging.* renaming it into place failed"):
        ck.wait()
    storage.fail = False
    ck.recover(str(tmp_path))
    assert saved_steps(tmp_path / "t" / "model.pt") == 9
    # finished by a finalize step that fails: the re-saved checkpoint is not in place
    ck2 = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=LocalStorage())
    root = str(tmp_path / "mg")
    d = os.path.join(root, "iter_0000010")

    def markers(ctx):
        if ctx.write_dir != ctx.ckpt_dir:  # the re-save, staged beside the first
            raise OSError(errno.EIO, "Input/output error")
        ctx.write_file(".metadata", "m")
    markers.files = (".metadata",)

    for steps in (5, 9):
        ck2.begin(d, tag="10", pointer=Pointer(os.path.join(root, "tracker.txt"), "10"), finalize=[markers])
        st = sample_state()
        st["global_steps"] = steps
        ck2.save(st, os.path.join(d, "model.pt"))
        handle = ck2.end()
        if steps == 5:
            ck2.wait()
    with pytest.raises(AsyncCheckpointError) as raised:
        ck2.wait()
    assert not isinstance(raised.value, DurabilityError), raised.value
    assert "not committed" in str(raised.value)
    assert saved_steps(os.path.join(d, "model.pt")) == 5 and not handle.committed
    verify_checkpoint(d)
    ck2.close()
    ck.close()


def test_a_failed_commit_removes_the_shares_temporaries_in_subdirectories_too(tmp_path):
    """A file the replicas write in shares lives under a temporary name until the commit joins
    it; a failed commit removes those, but only looked at the checkpoint's top directory: a
    share of ``sub/deep.pt`` (possibly gigabytes) stayed for good."""
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, commit_timeout_s=30),
                           rank=0, world_size=2, exchange=lambda v, e, key="": (v, {}))
    d = str(tmp_path / "t")
    handle = ck.begin(d, tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save({"w": torch.randn(64)}, os.path.join(d, "model.pt"))
    ck.end()
    from deepspeed_async_ckpt.storage import temporary_path

    os.makedirs(os.path.join(d, "sub"), exist_ok=True)
    leftovers = [temporary_path(os.path.join(d, "sub", "deep.pt"), handle.save_id),
                 temporary_path(os.path.join(d, "top.pt"), handle.save_id)]
    for path in leftovers:  # what the other replica's share left before it failed
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    os.makedirs(os.path.join(d, META_DIR), exist_ok=True)
    with open(os.path.join(d, META_DIR, f"rank_00001.{handle.save_id}.failed"), "w") as f:
        f.write("OSError: [Errno 5] Input/output error")
    with pytest.raises(CommitError, match="rank\\(s\\) 1 failed to persist"):
        ck.wait()
    assert not any(os.path.exists(p) for p in leftovers), leftovers
    ck.close()


def test_a_commit_failing_with_an_os_error_removes_the_shares_temporaries_too(tmp_path):
    """The sweep ran for a ``CommitError`` only: an ``OSError`` inside the commit (a share's
    rename, the listing of the records) left the shares' temporaries."""
    from deepspeed_async_ckpt.storage import temporary_path

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=ListingFailing())
    d = str(tmp_path / "t")
    handle = ck.begin(d, tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save({"w": torch.randn(64)}, os.path.join(d, "model.pt"))
    os.makedirs(os.path.join(d, "sub"))
    leftover = temporary_path(os.path.join(d, "sub", "big.pt"), handle.save_id)
    with open(leftover, "wb") as f:
        f.write(b"x" * 4096)
    ck.end()
    with pytest.raises(AsyncCheckpointError, match="Input/output error"):
        ck.wait()
    assert not os.path.exists(leftover) and not (tmp_path / "latest").exists()
    ck.close()


@pytest.mark.parametrize("body, problem", [
    ("", "JSONDecodeError"),
    ("[]", "no 'files' object"),
    ('{"rank": 1, "save_id": "{id}", "checksum": "xxh128", "files": null}', "no 'files' object"),
    ('{"rank": 1, "save_id": "{id}", "checksum": "xxh128", "files": {"r1.pt": {}}}', "'r1.pt' has no size"),
    ('{"rank": 1, "save_id": "{id}", "checksum": "xxh128", "files": {"../t0/model.pt": {"bytes": 5, '
     '"xxh128": "00"}}}', "outside the checkpoint"),
    ('{"rank": 1, "save_id": "{id}", "checksum": "xxh128", "files": {"r1.pt": {"bytes": 5}}}',
     "'r1.pt' has no xxh128 checksum"),
    ('{"rank": 1, "save_id": "{id}", "checksum": "xxh128", "files": {"r1.pt": {"bytes": 5, "segments": '
     '[[0, 5]], "tmp": "r1.pt.tmp"}}}', "'r1.pt' has malformed segments"),
    ('{"rank": 0, "save_id": "{id}", "checksum": "xxh128", "files": {}}', "rank 0, expected 1"),
    ('{"rank": 1, "save_id": "other", "checksum": "xxh128", "files": {}}', "save_id 'other'"),
])
def test_a_damaged_rank_record_is_refused_naming_it_and_the_pointer_stays(tmp_path, body, problem):
    """Rank 0 copied every rank's record into the manifest unchecked: a record an entry of
    which had no size, or a path outside the checkpoint, was committed and `latest` moved onto
    a checkpoint every reader refuses; a record that was not JSON failed the save with a bare
    parser message naming neither the record nor the rank."""
    root = str(tmp_path)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, commit_timeout_s=30),
                           rank=0, world_size=2, exchange=lambda v, e, key="": (v, {}))
    for tag in ("t0", "t1"):
        d = os.path.join(root, tag)
        handle = ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
        ck.save({"w": torch.randn(64, 64)}, os.path.join(d, "model.pt"))
        ck.end()
        meta = os.path.join(handle.write_dir, META_DIR)
        os.makedirs(meta, exist_ok=True)
        record = os.path.join(meta, f"rank_00001.{handle.save_id}.json")
        text = (json.dumps({"rank": 1, "save_id": handle.save_id, "checksum": "xxh128", "files": {}})
                if tag == "t0" else body.replace("{id}", handle.save_id))
        with open(record + ".part", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(record + ".part", record)
        if tag == "t0":
            ck.wait()
    with pytest.raises(CommitError) as raised:
        ck.wait()
    message = str(raised.value)
    assert "rank 1's record" in message and f"rank_00001.{handle.save_id}.json" in message, message
    assert problem in message, message
    assert (tmp_path / "latest").read_text() == "t0"
    verify_checkpoint(str(tmp_path / "t0"))
    with pytest.raises(IntegrityError, match="never committed"):
        read_manifest(str(tmp_path / "t1"))
    ck.close()


@pytest.mark.parametrize("pointer", ["none", "elsewhere", "beside"])
def test_a_committed_checkpoints_own_entry_is_durable_without_a_pointer_beside_it(tmp_path, pointer):
    """The checkpoint directory is renamed into the save directory without fsync, counting on
    the pointer's update (in the same directory) to sync it. With no pointer (DeepSpeed's
    ``save_latest=False``) or one elsewhere, nothing did: a power loss after the commit could
    lose the directory a caller was told is committed."""
    root = str(tmp_path / "save")
    storage = RecordingStorage()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01),
                           storage=storage)
    d = os.path.join(root, "t1")
    where = {"none": None, "elsewhere": Pointer(str(tmp_path / "latest"), "t1"),
             "beside": Pointer(os.path.join(root, "latest"), "t1")}[pointer]
    ck.begin(d, tag="t1", pointer=where)
    ck.save(sample_state(), os.path.join(d, "model.pt"))
    assert ck.end().committed
    ck.close()
    synced = [path for kind, path in storage.events if kind == "sync"]
    assert os.path.abspath(root) in synced, synced  # "beside": by the pointer's replace
    if pointer == "beside":
        assert (tmp_path / "save" / "latest").read_text() == "t1"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("save_dir_made_by_caller", [False, True])
def test_every_directory_made_for_a_save_is_durable_in_its_parent_before_the_pointer_moves(
        tmp_path, mode, save_dir_made_by_caller):
    """A file is synced in its own directory as it is renamed into place, but a new
    directory's entry lies in its parent, so the parents of the directories made for a save
    are synced too (a first save's save directory and those above it, Trainer's
    ``checkpoint-N`` at every save, which Trainer makes itself, subdirectories of files, and
    the checkpoint directory itself when all its files were in subdirectories): a power loss
    after the commit could take back a checkpoint reported committed, while rotation had
    removed the older ones."""
    out = tmp_path / "out"
    out.mkdir()
    save_dir = out / "runs" / "checkpoint-10"
    if save_dir_made_by_caller:
        os.makedirs(save_dir)
    d = save_dir / "global_step10"
    storage = RecordingStorage()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.01),
                           storage=storage)
    ck.begin(str(d), tag="global_step10", pointer=Pointer(str(save_dir / "latest"), "global_step10"))
    ck.save(sample_state(), str(d / "sub" / "deeper" / "model.pt"))  # no file in d itself
    ck.end()
    ck.wait()
    ck.close()
    events = storage.events
    pointer_moved = events.index(("rename", str(save_dir / "latest")))
    synced = {path for kind, path in events[:pointer_moved] if kind == "sync"}
    made = [d, d / META_DIR, d / "sub", d / "sub" / "deeper", save_dir]
    if not save_dir_made_by_caller:
        made.append(out / "runs")
    for directory in made:
        assert str(directory.parent) in synced, (directory, sorted(synced))


def test_uncommitted_checkpoint_is_refused(tmp_path):
    ck = make()
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    os.unlink(tmp_path / "t1" / META_DIR / "manifest.json")
    with pytest.raises(IntegrityError, match="never committed"):
        ck.load(str(tmp_path / "t1" / "model.pt"))
    ck.close()


def test_commit_waits_for_every_rank_and_times_out_naming_missing_ranks(tmp_path):
    cfg = AsyncCheckpointConfig(enabled=True, commit_timeout_s=0.5)
    ck = AsyncCheckpointer(cfg, rank=0, world_size=3)
    save_one(ck, str(tmp_path), sample_state())
    with pytest.raises(CommitError, match=r"rank\(s\) 1, 2 did not finish"):
        ck.wait()
    assert not (tmp_path / "latest").exists()
    ck.close()


def test_commit_follows_the_last_rank_closely_with_one_listing_per_poll(tmp_path):
    """Rank 0 commits within a short poll of the last rank's record (backing off to 0.5 s
    between polls, a rank finishing 1.2 s after rank 0 would be seen 0.43 s late), and a poll
    costs one directory listing, not a lookup per rank (metadata load at scale)."""
    import time

    from deepspeed_async_ckpt.commit import commit, write_rank_record

    storage, d, world = CountingListings(fsync=False), str(tmp_path / "t1"), 64
    for r in range(world - 1):
        write_rank_record(storage, d, rank=r, save_id="s", checksum="xxh128", files=[])
    written = {}

    def last_rank():
        time.sleep(1.2)
        write_rank_record(storage, d, rank=world - 1, save_id="s", checksum="xxh128", files=[])
        written["at"] = time.monotonic()

    thread = threading.Thread(target=last_rank)
    thread.start()
    commit(storage, d, tag="t1", save_id="s", world_size=world, checksum="xxh128", timeout_s=60,
           pointer=Pointer(str(tmp_path / "latest"), "t1"))
    late = time.monotonic() - written["at"]
    thread.join()
    assert (tmp_path / "latest").read_text() == "t1"
    assert late < 0.2, f"committed {late:.3f} s after the last rank's record"
    # one per poll (at most 108 polls in 1.2 s: see the virtual-clock test below), not one
    # per rank per poll (64 each)
    assert 2 <= storage.listings <= 108, storage.listings


@pytest.mark.parametrize("last_at", [0.004, 0.05, 0.2, 0.6, 3.0])
def test_commit_comes_within_a_sixteenth_of_the_wait_after_the_last_record(tmp_path, monkeypatch, last_at):
    """Rank 0 looks for the ranks' records again after 1/16 of the time it has waited so far
    (1 ms at least, 50 ms at most), so the commit follows a rank that finished shortly after
    it closely, without polling faster once the wait is long. On a virtual clock, so the
    bound is exact: with the backoff before (5 ms doubling to 50 ms), the record of a rank
    finishing 0.2 s after rank 0 was seen 25 ms late (12 ms allowed here)."""
    from deepspeed_async_ckpt import commit as commit_mod

    class Clock:  # commit's time module: sleeping advances it
        now = 0.0

        def monotonic(self):
            return self.now

        def sleep(self, seconds):
            self.now += seconds

        time = staticmethod(time.time)

    clock, d = Clock(), str(tmp_path / "t1")
    monkeypatch.setattr(commit_mod.sequence, "time", clock)
    seen = {}

    class LateRank(LocalStorage):
        def listdir(self, path):
            seen["listings"] = seen.get("listings", 0) + 1
            if clock.now >= last_at and "at" not in seen:
                commit_mod.write_rank_record(self, d, rank=1, save_id="s", checksum="xxh128", files=[])
                seen["at"] = clock.now
            return super().listdir(path)

    storage = LateRank(fsync=False)
    commit_mod.write_rank_record(storage, d, rank=0, save_id="s", checksum="xxh128", files=[])
    commit_mod.commit(storage, d, tag="t1", save_id="s", world_size=2, checksum="xxh128",
                      timeout_s=60, pointer=Pointer(str(tmp_path / "latest"), "t1"))
    assert (tmp_path / "latest").read_text() == "t1"
    late = seen["at"] - last_at
    assert late <= min(0.05, max(0.001, last_at / 16)) + 1e-9, f"seen {late * 1e3:.1f} ms late"
    # 16 polls of 1 ms, about 16 per doubling of the wait up to 0.8 s, then 20 a second
    assert seen["listings"] <= 100 + 20 * max(0.0, last_at - 0.8), seen["listings"]


def test_commit_order_data_then_record_then_manifest_then_pointer(tmp_path):
    """What the pointer's atomicity rests on, in the order the disk sees it: the checkpoint's
    directory renamed into place with its marker inside (not synced: the pointer's directory
    fsync covers it), every data file fsynced and renamed durably, then the rank's record published (renamed, not synced: a
    record a crash loses belongs to a save never committed), then the manifest fsynced and
    renamed durably, and only then the pointer (fsynced, renamed durably)."""
    events = []

    class Spy(LocalStorage):
        def sync_file(self, f):
            events.append(("sync", os.path.basename(getattr(f, "name", None) or getattr(f, "path", ""))))
            super().sync_file(f)

        def write_small(self, path, data, *, durable=True):  # records, manifest, pointer
            if durable:
                events.append(("sync", os.path.basename(path)))
            super().write_small(path, data, durable=durable)

        def replace(self, src, dst, *, durable=True):
            events.append(("replace", os.path.basename(dst), durable))
            super().replace(src, dst, durable=durable)

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=Spy())
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    ck.close()
    replaced = [e[1] for e in events if e[0] == "replace"]
    record = next(n for n in replaced if n.startswith("rank_00000."))
    assert replaced == ["t1", "model.pt", record, "manifest.json", "latest"], events
    assert ("replace", "t1", False) in events
    assert ("replace", "model.pt", True) in events and ("replace", record, False) in events
    assert ("replace", "manifest.json", True) in events and ("replace", "latest", True) in events
    synced = [e[1] for e in events if e[0] == "sync"]
    assert len(synced) == 3 and not any(n.startswith("rank_") for n in synced), events
    # each durable file synced before its rename
    for name in ("model.pt", "manifest.json", "latest"):
        sync_at = next(i for i, e in enumerate(events) if e[0] == "sync" and e[1].startswith(name))
        assert sync_at < events.index(("replace", name, True)), events


def test_the_checkpoint_directory_appears_with_its_marker_over_an_empty_one_or_beside_files(tmp_path):
    """``make_checkpoint_dir`` renames a directory holding the marker into place, so no crash
    leaves the checkpoint's directory without it (``tests/integration/test_crash_points.py``). An empty
    directory already there (made by hand, or by a crash before) is replaced; one that holds
    a file meanwhile (another rank's) gets the marker in place, the file kept; nothing
    under the staging name is left either way."""
    from deepspeed_async_ckpt.commit import make_checkpoint_dir

    storage = LocalStorage(fsync=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "zero_pp_rank_1.pt.tmp.ab").write_bytes(b"x")
    for name in ("new", "empty", "busy"):
        make_checkpoint_dir(storage, str(tmp_path / name), "0123")
        assert (tmp_path / name / META_DIR).is_dir(), name
    assert (tmp_path / "busy" / "zero_pp_rank_1.pt.tmp.ab").read_bytes() == b"x"
    assert listing(tmp_path) == ["busy", "empty", "new"]
    make_checkpoint_dir(storage, str(tmp_path / "new"), "4567")  # already marked: unchanged
    assert listing(tmp_path) == ["busy", "empty", "new"]


def test_stale_pointer_temporaries_of_other_processes_are_removed_by_the_next_save(tmp_path):
    """A process killed between writing ``latest.tmp.<pid>`` and renaming it left the file
    forever; rank 0 removes other pids' pointer temporaries as a save begins (its own may be
    its committer's, being written), and nothing else with such a name."""
    (tmp_path / "latest.tmp.123456789").write_text("t0")
    (tmp_path / f"latest.tmp.{os.getpid()}").write_text("t0")
    (tmp_path / "notes.tmp.1").write_text("the user's")
    ck = make()
    save_one(ck, str(tmp_path), sample_state(), tag="latest.tmp.1")  # a checkpoint so named
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    ck.close()
    assert listing(tmp_path) == ["latest", "latest.tmp.1", "notes.tmp.1", "t1"]
    verify_checkpoint(str(tmp_path / "latest.tmp.1"))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_rank_0_reports_each_commit_with_what_it_wrote(tmp_path, caplog, mode):
    """Once the pointer moved, rank 0 logs the commit (INFO) and calls each commit callback
    with its figures: files and bytes as on disk, ranks, time since the save began. Callbacks
    run on a thread of their own: one that blocks holds up neither ``wait()`` nor the next
    commit, one may call ``wait()`` itself, and one that raises is logged (the checkpoint
    stays committed); ``close()`` waits for them."""
    import logging

    from deepspeed_async_ckpt import CommitInfo

    seen, release, waited = [], threading.Event(), threading.Event()

    def slow(info):  # an upload, say; then the engine's own wait() from inside a callback
        seen.append(info)
        assert release.wait(10)
        ck.wait()
        waited.set()

    def broken(info):
        raise RuntimeError("the dashboard is down")

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.01),
                           on_commit=slow)
    ck.add_commit_callback(broken)
    with caplog.at_level(logging.INFO, logger="deepspeed_async_ckpt"):
        handle = save_one(ck, str(tmp_path), sample_state())
        ck.wait()
        save_one(ck, str(tmp_path), sample_state(), tag="t2")  # with the first callback held
        ck.wait()
        assert (tmp_path / "latest").read_text() == "t2" and not waited.is_set()
        release.set()
        assert waited.wait(10)
        ck.close()  # waits for the callbacks still queued (the second commit's)
    assert [i.tag for i in seen] == ["t1", "t2"] and all(isinstance(i, CommitInfo) for i in seen)
    info = seen[0]
    assert (info.tag, info.ckpt_dir, info.files, info.world_size) == ("t1", str(tmp_path / "t1"), 1, 1)
    assert info.bytes == os.path.getsize(tmp_path / "t1" / "model.pt")
    assert 0 < info.seconds <= handle.times["committed"] - handle.times["begin"] + 1e-6
    assert handle.commit_info == info
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert any(level == logging.INFO and "checkpoint t1 committed: " in m and "1 file(s)" in m
               for level, m in messages)
    assert sum(level == logging.WARNING and "the dashboard is down" in m for level, m in messages) == 2


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_save_ended_uncommitted_does_not_say_it_committed(tmp_path, mode):
    """``end(commit=False)`` (the framework's save raised inside it): nothing is committed and
    the pointer does not move, yet the handle said ``committed`` (set, no error)."""
    ck = make(mode)
    d = str(tmp_path / "t1")
    ck.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    ck.save({"w": torch.ones(10)}, os.path.join(d, "model.pt"))
    handle = ck.end(commit=False)
    ck.wait()
    ck.close()
    assert not (tmp_path / "latest").exists()
    assert not handle.committed and handle.commit_info is None



def test_both_record_exchanges_and_the_memory_fake_take_the_calls_the_protocol_declares():
    """The commit is written against ``RecordExchange``; each exchange takes every declared
    call with the declared parameters (names and kinds: a keyword the commit passes is one
    the exchange takes)."""
    from deepspeed_async_ckpt.commit import RecordExchange
    from deepspeed_async_ckpt.commit.exchange import StoreExchange
    from deepspeed_async_ckpt.commit.records import DirectoryExchange
    from fakes import MemoryExchange
    from helpers import declared_calls, takes_declared_calls

    assert declared_calls(RecordExchange) == ["discard", "fail", "look", "missing", "publish", "read",
                                              "reason", "tell_nodes", "tell_nodes_failed"]
    for cls in (DirectoryExchange, StoreExchange, MemoryExchange):
        assert isinstance(cls.node_local, bool), cls
        assert takes_declared_calls(cls, RecordExchange) == []
    assert isinstance(DirectoryExchange(LocalStorage()), RecordExchange)


def test_the_commit_runs_on_any_record_exchange_and_tells_it_the_outcome(tmp_path):
    """``commit`` needs nothing of an exchange but the declared calls: records held in memory
    commit a checkpoint, and the exchange hears the outcome (committed, or why not)."""
    from deepspeed_async_ckpt.commit import commit
    from deepspeed_async_ckpt.commit.records import rank_record
    from deepspeed_async_ckpt.persist import FileEntry
    from fakes import MemoryExchange

    d = str(tmp_path / "t")
    os.makedirs(os.path.join(d, META_DIR))  # as begin makes it
    exchange = MemoryExchange()
    for r in range(2):
        with open(os.path.join(d, f"r{r}.pt"), "wb") as f:
            f.write(b"x" * (r + 1))
        exchange.publish(d, rank_record(d, rank=r, save_id="s1", checksum="xxh128", files=[
            FileEntry(path=os.path.join(d, f"r{r}.pt"), nbytes=r + 1, checksum=f"{r:032x}")]))
    manifest, late = commit(LocalStorage(), d, tag="t", save_id="s1", world_size=2, checksum="xxh128",
                            timeout_s=5, pointer=Pointer(str(tmp_path / "latest"), "t"), exchange=exchange)
    assert late == {}  # no finalize step
    assert sorted(manifest["files"]) == ["r0.pt", "r1.pt"] and (tmp_path / "latest").read_text() == "t"
    assert read_manifest(d)["files"]["r1.pt"] == {"bytes": 2, "xxh128": f"{1:032x}"}
    assert exchange.told == [("committed", "s1", [0])]

    exchange = MemoryExchange()
    exchange.fail(d, rank=1, save_id="s2", message="OSError: disk gone")
    with pytest.raises(CommitError, match=r"rank\(s\) 1 failed to persist their part \(OSError: disk gone\)"):
        commit(LocalStorage(), d, tag="t", save_id="s2", world_size=2, checksum="xxh128",
               timeout_s=5, pointer=Pointer(str(tmp_path / "latest"), "t2"), exchange=exchange)
    assert exchange.told[0][:2] == ("failed", "s2") and "disk gone" in exchange.told[0][2]
    assert (tmp_path / "latest").read_text() == "t"


def test_a_shares_temporary_the_storage_will_not_remove_leaves_the_commits_own_error(tmp_path):
    """A failed commit removes the shares' temporaries through the storage; one it refuses to
    remove stays (nothing else can be done), the others go, and what is raised is why the
    commit failed, not the removal's error."""
    from deepspeed_async_ckpt.storage import temporary_path
    from fakes import RemovalsRefused

    storage = RemovalsRefused()
    storage.refuse = False
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, commit_timeout_s=30),
                           rank=0, world_size=2, exchange=lambda v, e, key="": (v, {}), storage=storage)
    d = str(tmp_path / "t")
    handle = ck.begin(d, tag="t", pointer=Pointer(str(tmp_path / "latest"), "t"))
    ck.save({"w": torch.randn(64)}, os.path.join(d, "model.pt"))
    ck.end()
    kept, removed = (temporary_path(os.path.join(d, name), handle.save_id) for name in ("a.pt", "b.pt"))
    for path in (kept, removed):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    storage.refuse = {kept}
    with open(os.path.join(d, META_DIR, f"rank_00001.{handle.save_id}.failed"), "w") as f:
        f.write("OSError: [Errno 5] Input/output error")
    with pytest.raises(CommitError, match=r"rank\(s\) 1 failed to persist their part \(OSError"):
        ck.wait()
    assert storage.refused == [kept] and os.path.exists(kept) and not os.path.exists(removed)
    assert not (tmp_path / "latest").exists()
    ck.close()
