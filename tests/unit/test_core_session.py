"""Beginning a save (``deepspeed_async_ckpt.core.session``): names and directories that
cannot be a checkpoint refused with nothing touched, refusals raised on every rank."""

import gc
import os
import threading
import weakref

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.core.session import REFUSED
from deepspeed_async_ckpt.errors import AsyncCheckpointError, CommitError, Failure, PersistError
from deepspeed_async_ckpt.storage import LocalStorage

from fakes import MakedirsRefused
from helpers import listing, make, sample_state, save_one


@pytest.mark.parametrize("with_pointer", [True, False])
@pytest.mark.parametrize("tag", ["", ".", "..", ".async_ckpt_staging.x", " ", "t2\n"])
def test_a_directory_whose_name_cannot_be_a_checkpoint_is_refused_and_nothing_is_touched(
        tmp_path, tag, with_pointer):
    """DeepSpeed takes ``save_checkpoint(save_dir, tag="")``: the checkpoint directory was then
    ``save_dir`` itself, swapped in over everything in it, and ``keep_last`` ran on the
    directory above and removed other runs' directories there."""
    runs = tmp_path / "runs"
    ck = make(keep_last=1)
    for run in ("a", "b"):
        save_one(ck, str(runs / run), sample_state(), tag="s1")
    ck.wait()

    def tree():
        return sorted((str(p.relative_to(tmp_path)), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))

    before = tree()
    save_dir = str(runs / "b")
    pointer = Pointer(os.path.join(save_dir, "latest"), tag) if with_pointer else None
    with pytest.raises(ValueError, match="checkpoint directory .*cannot name a checkpoint directory"):
        ck.begin(os.path.join(save_dir, tag), tag=tag, pointer=pointer)
    assert not ck.is_open and tree() == before
    save_one(ck, save_dir, sample_state(), tag="s2")  # the next save works, retention as before
    ck.wait()
    ck.close()
    assert listing(runs) == ["a", "b"] and listing(runs / "b") == ["latest", "s2"]
    assert listing(runs / "a") == ["latest", "s1"]


@pytest.mark.parametrize("text", ["../elsewhere", "s2\n", "", "sub/s2"])
def test_a_pointer_text_that_cannot_name_a_checkpoint_is_refused_at_begin(tmp_path, text):
    """The pointer's text was written as given: ``"../elsewhere"`` was committed as `latest`,
    and with ``keep_last=1`` retention then removed the one checkpoint it could have named."""
    ck = make(keep_last=1)
    save_one(ck, str(tmp_path), sample_state(), tag="s1")
    ck.wait()
    d = str(tmp_path / "s2")
    with pytest.raises(ValueError, match=r"Pointer\(.*latest', text\): .* cannot name a checkpoint"):
        ck.begin(d, tag="s2", pointer=Pointer(str(tmp_path / "latest"), text))
    assert not ck.is_open and listing(tmp_path) == ["latest", "s1"]
    assert (tmp_path / "latest").read_text() == "s1"
    ck.close()


def test_a_tag_too_long_for_the_names_derived_from_it_is_refused_at_begin(tmp_path):
    """A 230-character tag saved once, but its re-save failed with a bare "File name too long"
    (the staging and removal names add 37-38 bytes). The
    longest allowed saves twice, one byte more is refused before anything is written."""
    from deepspeed_async_ckpt.commit import MAX_NAME_BYTES

    ck = make()
    longest = "é" * (MAX_NAME_BYTES // 2) + "x" * (MAX_NAME_BYTES % 2)  # bytes, not characters
    assert len(os.fsencode(longest)) == MAX_NAME_BYTES
    for _ in range(2):  # the second a re-save: staged, swapped in, the old one removed
        handle = save_one(ck, str(tmp_path), sample_state(), tag=longest)
        ck.wait()
        assert handle.committed
    assert listing(tmp_path) == sorted(["latest", longest])
    with pytest.raises(ValueError, match=f"is {MAX_NAME_BYTES + 1} bytes long; .* at most {MAX_NAME_BYTES}"):
        save_one(ck, str(tmp_path), sample_state(), tag=longest + "x")
    assert not ck.is_open and listing(tmp_path) == sorted(["latest", longest])
    ck.close()


def test_a_relative_save_dir_commits_where_it_was_saved_after_a_chdir(tmp_path, monkeypatch, held_copier):
    """``save_checkpoint("ckpt")``, then ``os.chdir`` before the background commit: DeepSpeed's
    own engine writes ``latest`` inside the call. The pointer was kept relative and written by
    the committer relative to the new working directory: into another ``ckpt/`` there
    (a resume then loaded an older checkpoint), or, with none, the commit failed. The copier
    is held (``held_copier``), so nothing is committed before the chdir."""
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere" / "ckpt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "run")
    ck = make()
    ck.begin(os.path.join("ckpt", "t1"), tag="t1", pointer=Pointer(os.path.join("ckpt", "latest"), "t1"))
    ck.save(sample_state(), os.path.join("ckpt", "t1", "model.pt"))
    ck.end()
    os.chdir(tmp_path / "elsewhere")
    ck.fence()
    ck.wait()
    ck.close()
    assert (tmp_path / "run" / "ckpt" / "latest").read_text() == "t1"
    assert os.listdir(tmp_path / "elsewhere" / "ckpt") == []
    verify_checkpoint(str(tmp_path / "run" / "ckpt" / "t1"))


def test_an_exchange_of_the_signature_before_the_key_is_still_called(tmp_path):
    """``exchange=`` callables written for ``(value, error)``, without the ``key`` (the
    checkpoint directory) that ``begin`` passes, keep working."""
    calls = []
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01),
                           exchange=lambda value, error: calls.append(value) or (value, {}))
    save_one(ck, str(tmp_path), sample_state())
    ck.close()
    assert len(calls) == 1 and (tmp_path / "latest").read_text() == "t1"


def test_a_refused_save_leaves_what_was_there_and_removes_what_begin_made(tmp_path):
    """begin makes the directory before the ranks agree; if they then refuse the save (another
    rank's earlier save failed), what begin made goes again, and an empty directory the user
    made stays."""
    refuse = lambda value, error, key="": (value, {1: Failure("PersistError", "disk full")})  # noqa: E731
    (tmp_path / "mine").mkdir()
    for name in ("mine", "fresh"):
        ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01),
                               world_size=2, exchange=refuse)
        with pytest.raises(CommitError, match="disk full"):
            ck.begin(str(tmp_path / "run" / name if name == "fresh" else tmp_path / name), tag=name)
        ck.close()
    assert listing(tmp_path) == ["mine"] and os.listdir(tmp_path / "mine") == []


def test_rank_0_refusing_a_save_directory_is_raised_by_every_rank_in_its_words(tmp_path):
    """The other ranks learn of rank 0's refusal (another job's save directory) through
    begin's exchange, and raise it as rank 0's, not as 'a previous checkpoint failed'."""
    refusal = Failure(REFUSED, "save directory 'x' is being saved into by another process (host h, pid 7)")
    exchange = lambda value, error, key="": (value, {0: refusal})  # noqa: E731
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), rank=1,
                           world_size=2, exchange=exchange)
    with pytest.raises(AsyncCheckpointError, match=r"^rank 0: save directory 'x' is being saved "
                                                   r"into by another process \(host h, pid 7\)$"):
        ck.begin(str(tmp_path / "t1"), tag="t1")
    ck.close()
    assert listing(tmp_path) == []


def _object_store_checkpointer(failing: str):
    """Rank 0 of 2, whose ``Storage.<failing>`` raises a RuntimeError (an object store's
    client, say); and the list of errors its exchange was sent."""
    def fail(self, *args, **kwargs):
        raise RuntimeError("503 Slow Down")

    sent = []

    def exchange(value, error, key=""):
        sent.append(error)
        return value, {} if error is None else {0: error}

    storage = type("ObjectStore", (LocalStorage,), {failing: fail})()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), world_size=2,
                           storage=storage, exchange=exchange)
    return ck, sent


def test_a_storage_error_of_another_kind_before_the_exchange_reaches_every_rank(tmp_path):
    """Rank 0 makes the directory before begin's exchange: an error there that is not an
    OSError raised before the exchange, and the other ranks waited in it for good. It now
    travels in the exchange, and every rank raises."""
    ck, sent = _object_store_checkpointer("makedirs")
    with pytest.raises(AsyncCheckpointError, match="503 Slow Down") as info:
        ck.begin(str(tmp_path / "s1"), tag="s1")
    assert len(sent) == 1 and sent[0].kind == REFUSED and "503 Slow Down" in sent[0].message
    # this save's own preparation failed: not worded as an earlier save's failure (on any
    # rank), and the checkpoint it was for is named
    assert "previous checkpoint" not in str(info.value) and "s1" in str(info.value), info.value
    other = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), rank=1,
                              world_size=2, exchange=lambda value, error, key="": (value, {0: sent[0]}))
    with pytest.raises(AsyncCheckpointError) as info:
        other.begin(str(tmp_path / "s1"), tag="s1")
    assert str(info.value).startswith("rank 0: preparing checkpoint") and "503" in str(info.value), info.value
    other.close()
    ck.close()


def test_a_storage_error_before_the_exchange_does_not_hide_an_earlier_failure(tmp_path):
    """An earlier save's failure, found as the next begins, goes to every rank first; a
    storage error while preparing the new save (here listing the save directory, to clean
    up) is only logged then (it replaced the failure)."""
    ck, sent = _object_store_checkpointer("listdir")
    ck._failures.note(PersistError("disk full on rank 0"))
    with pytest.raises(AsyncCheckpointError, match="disk full"):
        ck.begin(str(tmp_path / "s1"), tag="s1")
    assert len(sent) == 1 and sent[0] == Failure("PersistError", "disk full on rank 0")
    ck.close()


def test_a_file_saved_outside_the_checkpoint_directory_is_refused_by_name(tmp_path):
    """A file saved beside the checkpoint directory is refused at ``save``, naming the path.
    Written and listed in the manifest as ``../outside.pt``, it would have every reader
    (``verify``, a load) refuse that manifest as damaged ("outside the checkpoint") once the
    commit moved ``latest`` to it: the checkpoint ``latest`` names could not be loaded."""
    ck = make()
    save_one(ck, str(tmp_path), {"w": torch.ones(4)}, tag="good", eager=())
    ck.wait()
    d = str(tmp_path / "t2")
    ck.begin(d, tag="t2", pointer=Pointer(str(tmp_path / "latest"), "t2"))
    ck.save({"w": torch.ones(4)}, os.path.join(d, "model.pt"))
    with pytest.raises(ValueError, match="outside.pt.*not a file inside the checkpoint directory"):
        ck.save({"w": torch.ones(4)}, str(tmp_path / "outside.pt"))
    ck.end(commit=False)  # as the adapters do when a save raised inside it
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "good"
    verify_checkpoint(str(tmp_path / "good"))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_file_saved_twice_in_one_checkpoint_is_refused_by_name(tmp_path, mode):
    """Async, two writers wrote the same temporary name and one's rename failed (ENOENT), so
    the checkpoint was never committed; sync, the second save silently won. Both now refuse the
    second ``save`` of a path, naming it, before writing anything of
    it; the checkpoint committed before stays ``latest``."""
    ck = make(mode=mode)
    save_one(ck, str(tmp_path), {"w": torch.ones(4)}, tag="good", eager=())
    ck.wait()
    d = str(tmp_path / "t2")
    ck.begin(d, tag="t2", pointer=Pointer(str(tmp_path / "latest"), "t2"))
    ck.save({"w": torch.ones(4)}, os.path.join(d, "model.pt"))
    ck.save({"w": torch.ones(4)}, os.path.join(d, "sub", "model.pt"))  # another file of that name
    with pytest.raises(ValueError, match=r"model.pt'\): this file was already saved in checkpoint 't2'"):
        ck.save({"w": torch.zeros(4)}, os.path.join(d, ".", "model.pt"))
    ck.end(commit=False)  # as the adapters do when a save raised inside it
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "good"
    verify_checkpoint(str(tmp_path / "good"))


def test_a_save_whose_directory_cannot_be_made_leaves_nothing_waiting_and_can_be_retried(tmp_path):
    """``save`` listed a file's items in the save before making its directory: when that
    failed, they were never issued and ``handle.wait_staged()`` never returned, and the path
    counted as saved, so a retry was refused."""
    storage = MakedirsRefused("sub")
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    d = str(tmp_path / "t1")
    handle = ck.begin(d, tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    ck.save({"a": torch.randn(16)}, os.path.join(d, "a.pt"))
    with pytest.raises(PermissionError):
        ck.save({"b": torch.randn(16)}, os.path.join(d, "sub", "b.pt"))
    storage.refuse = False
    ck.save({"b": torch.ones(16)}, os.path.join(d, "sub", "b.pt"))  # the retry
    ck.end()
    waiter = threading.Thread(target=handle.wait_staged, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive()
    ck.close()
    assert torch.equal(torch.load(os.path.join(d, "sub", "b.pt"))["b"], torch.ones(16))
    assert (tmp_path / "latest").read_text() == "t1"


def test_a_shared_file_whose_directory_cannot_be_made_stays_saved(tmp_path):
    """With replicas writing a file in shares, they met (a collective) before its directory
    is made: a retry on one rank would wait for the others there, so it is refused at once as
    "already saved"."""
    from deepspeed_async_ckpt.core import Replicas

    class TwoReplicas(Replicas):  # rank 0 of 2, the other agreeing
        def gather(self, digest):
            self.met = getattr(self, "met", 0) + 1
            return [digest, digest]

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01),
                           storage=MakedirsRefused("sub"))
    d = str(tmp_path / "t1")
    ck.begin(d, tag="t1")
    replicas = TwoReplicas(rank=0, size=2)
    path = os.path.join(d, "sub", "m.pt")
    with pytest.raises(PermissionError):
        ck.save({"w": torch.randn(4096)}, path, replicas=replicas)
    assert replicas.met == 1
    with pytest.raises(ValueError, match="already saved"):
        ck.save({"w": torch.randn(4096)}, path, replicas=replicas)
    assert replicas.met == 1
    ck.end(commit=False)
    ck.close()


def test_a_refused_saves_directories_are_removed_through_the_storage_and_a_refusal_stays_the_error(tmp_path):
    """What begin made for a save the ranks then refuse is removed through the storage; where
    the storage will not remove it, it stays, and begin raises the refusal, not the removal's
    error."""
    from fakes import RemovalsRefused

    storage = RemovalsRefused()
    refuse = lambda value, error, key="": (value, {1: Failure("PersistError", "disk full")})  # noqa: E731
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), world_size=2,
                           storage=storage, exchange=refuse)
    with pytest.raises(CommitError, match="disk full"):
        ck.begin(str(tmp_path / "t1"), tag="t1")
    assert storage.refused == [str(tmp_path / "t1" / ".async_ckpt")]
    assert listing(tmp_path / "t1") == [".async_ckpt"]
    storage.refuse = False
    with pytest.raises(CommitError, match="disk full"):
        ck.begin(str(tmp_path / "t2"), tag="t2")
    ck.close()
    assert listing(tmp_path) == ["t1"]


def test_the_handle_is_a_read_only_view_of_the_save_the_pipeline_fills_in(tmp_path):
    """A caller reads a save's files, items, bytes, timings and outcome on its handle and can
    set none of them: only the pipeline writes the save in flight."""
    ck = make()
    handle = save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    ck.close()
    assert handle.committed and handle.error is None and not handle.abandoned
    assert len(handle.files) == 1 and handle.nbytes == sum(i.nbytes for i in handle.items) > 0
    assert handle.commit_info is not None and handle.commit_info.tag == "t1"
    assert handle.times["begin"] <= handle.times["end"] <= handle.times["committed"]
    assert handle.write_dir == handle.ckpt_dir == str(tmp_path / "t1")
    for name, value in [("files", []), ("items", []), ("nbytes", 0), ("error", None),
                        ("abandoned", True), ("commit_info", None), ("retired", []),
                        ("finalize", ()), ("fence_wait_s", 0.0), ("eager_wait_s", 0.0),
                        ("write_dir", "elsewhere"), ("dependencies", [])]:
        with pytest.raises(AttributeError):
            setattr(handle, name, value)
    with pytest.raises(TypeError):
        handle.times["committed"] = 0.0
    with pytest.raises(AttributeError):
        handle.files.append(None)


def test_a_save_is_freed_once_its_caller_and_the_history_let_go(tmp_path):
    """A save's job and its handle hold each other, and the checkpointer finds the job of a
    handle handed back to it (``retire_older``): that lookup must hold neither, or a long run
    would keep every save it ever made, with its items and file futures."""
    ck = make()
    handle = save_one(ck, str(tmp_path), sample_state(), tag="t1")
    ck.wait()
    gone = weakref.ref(handle)
    save_one(ck, str(tmp_path), sample_state(), tag="t2")  # the last sealed save now
    ck.wait()
    ck.history.clear()  # (it keeps the last 64)
    del handle
    gc.collect()
    assert gone() is None
    ck.close()


def test_a_replica_whose_layout_fails_still_meets_the_others_and_every_replica_raises(tmp_path, monkeypatch):
    """A replica that cannot lay the shared file out (its digest raises) still takes part in
    the replicas' gather, so the others are not left waiting in it: it raises its own error,
    the others an error naming it."""
    from deepspeed_async_ckpt.core import Replicas, files

    seen = {}

    class Pair(Replicas):  # this replica and one other, whose digest is given
        other = None

        def gather(self, digest):
            seen["mine"] = digest
            return [digest, self.other] if self.rank == 0 else [self.other, digest]

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    d = str(tmp_path / "t1")
    ck.begin(d, tag="t1")
    state = {"w": torch.randn(4096)}
    real = files.layout_digest
    monkeypatch.setattr(files, "layout_digest", lambda plan: (_ for _ in ()).throw(RuntimeError("no layout")))
    ok = Pair(rank=0, size=2)
    ok.other = b"\x01" + bytes(24)
    with pytest.raises(RuntimeError, match="no layout"):  # its own error, after the gather
        ck.save(state, os.path.join(d, "a.pt"), replicas=ok)
    assert seen["mine"][:1] == b"\x00"
    monkeypatch.setattr(files, "layout_digest", real)
    failed_other = Pair(rank=0, size=2)
    failed_other.other = b"\x00" + bytes(24)
    with pytest.raises(AsyncCheckpointError, match=r"replica\(s\) \[1\] failed to lay the file out"):
        ck.save(state, os.path.join(d, "b.pt"), replicas=failed_other)
    ck.end(commit=False)
    ck.close()
