"""Saving a tag again (``deepspeed_async_ckpt.commit.replace``): the old checkpoint stays
whole until the new one commits, with the exchange or with two renames, and what a
crash between them leaves is finished or swept."""

import errno
import os
import shutil
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import LOCK_FILE, META_DIR, Pointer, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import CommitError, IntegrityError, PersistError
from deepspeed_async_ckpt.storage import LocalStorage

from fakes import FailingStorage, NoExchangeStorage
from helpers import Crash, flip_byte, listing, make, sample_state, save_like_deepspeed, save_one, saved_steps


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("storage_cls", [FailingStorage, NoExchangeStorage], ids=["exchange", "renames"])
def test_resaving_the_pointers_checkpoint_keeps_it_whole_until_the_new_one_commits(tmp_path, mode, storage_cls):
    """The tag `latest` names, saved again: a failed save leaves it loadable (a re-save that
    removed its manifest first would leave nothing loadable); a good one replaces it
    whole, with what the new save did not write (a file of the user's) carried over."""
    root = str(tmp_path)
    storage = storage_cls(budget=10**9)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.01), storage=storage)
    save_one(ck, root, sample_state(), tag="t")
    ck.fence()
    ck.wait()
    (tmp_path / "t" / "notes.txt").write_text("the user's")
    state = sample_state()
    state["global_steps"] = 9
    storage.budget = 1000  # runs out of space mid-file
    with pytest.raises(PersistError, match="No space left"):
        handle = save_like_deepspeed(ck, root, state, tag="t")
        assert handle.write_dir == os.path.join(root, ".async_ckpt_staging." + handle.save_id + ".t")
        ck.fence()
        ck.wait()
    assert (tmp_path / "latest").read_text() == "t"
    verify_checkpoint(str(tmp_path / "t"))
    assert saved_steps(tmp_path / "t" / "model.pt") == 5
    storage.budget = 10**9
    handle = save_one(ck, root, state, tag="t")
    ck.fence()
    ck.wait()  # also the deletions: the old checkpoint, the failed save's staging directory
    assert handle.committed and handle.write_dir != handle.ckpt_dir
    assert listing(root) == ["latest", "t"]
    verify_checkpoint(str(tmp_path / "t"))
    assert saved_steps(tmp_path / "t" / "model.pt") == 9
    assert (tmp_path / "t" / "notes.txt").read_text() == "the user's"
    assert read_manifest(str(tmp_path / "t"))["save_id"] == handle.save_id
    ck.close()


def test_files_carried_over_into_a_resave_are_durable_before_the_swap(tmp_path):
    """What the re-save did not write (a file the training script put into the checkpoint's
    own directory, one in a subdirectory) is linked into the staged one, and those
    directories' entries are made durable before the exchange: once it is, the old directory
    is deleted, and a crash must not lose the files with it."""
    root = str(tmp_path)
    log = []

    class Recording(FailingStorage):
        def link(self, src, dst):
            log.append(("link", os.path.relpath(dst, root)))
            super().link(src, dst)

        def sync_dir(self, path):
            log.append(("sync_dir", os.path.relpath(path, root)))
            super().sync_dir(path)

        def swap(self, a, b):
            log.append(("swap",))
            return super().swap(a, b)

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01),
                           storage=Recording(budget=10**9))
    save_one(ck, root, sample_state(), tag="t")
    (tmp_path / "t" / "tokenizer.json").write_text("{}")
    (tmp_path / "t" / "extra").mkdir()
    (tmp_path / "t" / "extra" / "notes.txt").write_text("the user's")
    # what a crashed save left (its own temporary files) is not carried into the new one
    (tmp_path / "t" / "model.pt.tmp.4d2").write_bytes(b"x")
    (tmp_path / "t" / "extra" / "optim.pt.tmp.0123456789abcdef").write_bytes(b"x")
    log.clear()
    handle = save_one(ck, root, sample_state(), tag="t")
    staged = os.path.relpath(handle.write_dir, root)
    links = [e for e in log if e[0] == "link"]
    assert sorted(links) == [("link", os.path.join(staged, "extra", "notes.txt")),
                             ("link", os.path.join(staged, "tokenizer.json"))]
    swap = log.index(("swap",))
    synced = [e[1] for e in log[:swap] if e[0] == "sync_dir"]
    assert os.path.join(staged, "extra") in synced and staged in synced
    assert all(log.index(link) < swap for link in links)
    assert (tmp_path / "t" / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "t" / "extra" / "notes.txt").read_text() == "the user's"
    assert listing(tmp_path / "t" / "extra") == ["notes.txt"]
    ck.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_files_carried_over_into_a_resave_keep_their_checksums_and_are_verified(tmp_path, mode):
    """A re-save that writes fewer files (a run on fewer ranks, a smaller save) keeps the old
    checkpoint's other files, hard-linked: they were linked after the new manifest was written,
    so it did not list them, verify said OK with one of them corrupted, and a load after
    verify_all_ranks (DeepSpeed's and Megatron's path) read it unchecked. Their entries now
    come from the old manifest, and a file no manifest lists is
    refused by load, verified or not."""
    root, d = str(tmp_path), str(tmp_path / "t")
    ck = make(mode)
    ck.begin(d, tag="t", pointer=Pointer(os.path.join(root, "latest"), "t"))
    ck.save(sample_state(), os.path.join(d, "model.pt"))
    ck.save({"m": torch.randn(256, 256)}, os.path.join(d, "sub", "optim.pt"))
    ck.end()
    ck.wait()
    old = read_manifest(d)
    save_one(ck, root, sample_state(), tag="t")  # model.pt alone
    ck.fence()
    ck.wait()
    manifest = read_manifest(d)
    assert manifest["save_id"] != old["save_id"] and manifest["carried"] == ["sub/optim.pt"]
    assert manifest["files"]["sub/optim.pt"] == old["files"]["sub/optim.pt"]
    verify_checkpoint(d)
    ck.verify_all_ranks(d)
    ck.load(os.path.join(d, "sub", "optim.pt"))
    flip_byte(os.path.join(d, "sub", "optim.pt"))
    with pytest.raises(IntegrityError, match="optim.pt.*does not match"):
        verify_checkpoint(d)
    with pytest.raises(IntegrityError, match="refused on every rank.*optim.pt"):
        ck.verify_all_ranks(d)
    ck.verify_all_ranks(d, include=lambda rel: rel == "model.pt")  # a load of model.pt alone
    with pytest.raises(IntegrityError, match="optim.pt.*does not match"):
        ck.load(os.path.join(d, "sub", "optim.pt"))
    shutil.copy(os.path.join(d, "model.pt"), os.path.join(d, "stray.pt"))
    ck.verify_all_ranks(d, include=lambda rel: rel != "sub/optim.pt")
    with pytest.raises(IntegrityError, match="stray.pt is not listed in the manifest"):
        ck.load(os.path.join(d, "stray.pt"))
    ck.close()


def test_files_carried_over_under_another_checksum_stay_unlisted(tmp_path):
    """The old checkpoint's entries are kept only where its checksum is the new save's: a
    digest of another algorithm could not be checked against the new manifest's."""
    root, d = str(tmp_path), str(tmp_path / "t")
    ck = make("sync", checksum="crc32")
    ck.begin(d, tag="t", pointer=Pointer(os.path.join(root, "latest"), "t"))
    ck.save(sample_state(), os.path.join(d, "model.pt"))
    ck.save(sample_state(), os.path.join(d, "optim.pt"))
    ck.end()
    ck.close()
    ck = make("sync")
    save_one(ck, root, sample_state(), tag="t")
    assert sorted(read_manifest(d)["files"]) == ["model.pt"] and os.path.exists(os.path.join(d, "optim.pt"))
    with pytest.raises(IntegrityError, match="optim.pt is not listed"):
        ck.load(os.path.join(d, "optim.pt"))
    ck.close()


def test_a_crash_between_the_two_renames_is_finished_before_the_next_load_or_save(tmp_path, capsys):
    """Without an atomic exchange, the old checkpoint is renamed away, then the new one into
    place: a crash in between leaves the name missing and the new one committed beside it.
    The next process's rank 0 renames it into place before it loads or saves."""
    root = str(tmp_path)
    ck = make(mode="sync")
    save_one(ck, root, sample_state(), tag="t")
    ck.close()

    class CrashBeforeSecondRename(NoExchangeStorage):
        def replace(self, src, dst, *, durable=True):
            if os.path.basename(src).startswith(".async_ckpt_staging."):
                raise Crash()
            return super().replace(src, dst, durable=durable)

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01),
                           storage=CrashBeforeSecondRename(budget=10**9))
    state = sample_state()
    state["global_steps"] = 9
    with pytest.raises(PersistError) as e:  # in a real crash, nothing would be raised at all
        save_one(ck, root, state, tag="t")
    assert isinstance(e.value.__cause__, Crash)
    assert not (tmp_path / "t").exists()  # between the renames
    ck._saves.closed = True  # the process is gone: nothing of its own runs any more
    staged_name = next(n for n in os.listdir(root) if n.startswith(".async_ckpt_staging."))
    from deepspeed_async_ckpt.tools.cli import main
    assert main(["verify", root]) == 0  # the pointer's checkpoint, where it waits
    assert "stopped between its two renames" in capsys.readouterr().out
    shutil.copytree(tmp_path / staged_name, tmp_path / "staged")

    for way in ("load", "save"):
        if way == "save":  # the same state again, now found by the next save's begin
            shutil.rmtree(tmp_path / "t")
            shutil.copytree(tmp_path / "staged", tmp_path / staged_name)
        fresh = make()
        if way == "load":
            fresh.wait_all_ranks(action="load", recover=root)
        else:
            save_one(fresh, root, sample_state(), tag="u")
        fresh.wait()
        fresh.close()
        verify_checkpoint(str(tmp_path / "t"))
        assert saved_steps(tmp_path / "t" / "model.pt") == 9
        left = sorted(n for n in os.listdir(root) if n not in ("staged", LOCK_FILE))
        assert left == (["latest", "t"] if way == "load" else ["latest", "t", "u"])


def test_staging_left_by_a_crash_before_the_swap_is_removed_and_the_old_checkpoint_kept(tmp_path):
    root = str(tmp_path)
    ck = make()
    save_one(ck, root, sample_state(), tag="t")
    ck.wait()
    ck.close()
    # a re-save killed while writing, and one killed after its manifest but before the swap
    (tmp_path / ".async_ckpt_staging.0123456789abcdef.t" / META_DIR).mkdir(parents=True)
    (tmp_path / ".async_ckpt_staging.0123456789abcdef.t" / "model.pt").write_bytes(b"partial")
    shutil.copytree(tmp_path / "t", tmp_path / ".async_ckpt_staging.fedcba9876543210.t")
    before = listing(root)
    fresh = make()
    # a load leaves them: the directory may be another job's (a trainer re-saving the tag
    # while an evaluation job loads it), whose staging directory is not abandoned at all
    fresh.wait_all_ranks(action="load", recover=root)
    fresh.wait()
    assert listing(root) == before
    save_one(fresh, root, sample_state(), tag="u")
    fresh.wait()
    fresh.close()
    assert listing(root) == ["latest", "t", "u"]
    verify_checkpoint(str(tmp_path / "t"))


def test_replacing_a_directory_removed_meanwhile_renames_the_staged_one_into_place(tmp_path):
    """An exchange needs both names: with the target gone (removed by hand, or a staged save
    whose earlier save never made the directory), the staged checkpoint is renamed into place."""
    from deepspeed_async_ckpt.commit import replace_checkpoint

    staged = tmp_path / ".async_ckpt_staging.ab.t"
    staged.mkdir()
    (staged / "model.pt").write_bytes(b"new")
    replace_checkpoint(LocalStorage(fsync=True), str(staged), str(tmp_path / "t"), save_id="ab")
    assert listing(tmp_path) == ["t"] and (tmp_path / "t" / "model.pt").read_bytes() == b"new"


def test_a_file_whose_name_starts_with_two_dots_is_staged_like_any_other(tmp_path):
    """``..model.pt`` inside the checkpoint is not outside it: a re-save writes it into the
    staging directory, not into the checkpoint being replaced."""
    root = str(tmp_path)
    ck = make(mode="sync")
    for steps in (5, 9):
        d = os.path.join(root, "t")
        ck.begin(d, tag="t", pointer=Pointer(os.path.join(root, "latest"), "t"))
        state = sample_state()
        state["global_steps"] = steps
        ck.save(state, os.path.join(d, "..model.pt"))
        ck.end()
    ck.wait()
    ck.close()
    assert listing(root) == ["latest", "t"]
    verify_checkpoint(str(tmp_path / "t"))
    assert saved_steps(tmp_path / "t" / "..model.pt") == 9


def test_a_load_of_a_tag_saved_again_meanwhile_is_refused_not_mixed(tmp_path):
    """An evaluation job verifies tag "last" and reads its files one by one (DeepSpeed: model
    states, then optimizer states) while the trainer saves "last" again. The load raises,
    naming the checkpoint, and a new load gets step 200: reading on after the swap would
    return step 100's model with step 200's optimizer."""
    root = str(tmp_path)
    d = os.path.join(root, "last")

    def save_tag(ck, step):
        ck.begin(d, tag="last", pointer=Pointer(os.path.join(root, "latest"), "last"))
        ck.save({"step": step}, os.path.join(d, "model_states.pt"))
        ck.save({"step": step, "m": torch.full((8,), float(step))}, os.path.join(d, "optim_states.pt"))
        ck.end()
        ck.wait()

    trainer, loader = make("sync"), make("sync")
    save_tag(trainer, 100)
    loader.verify_all_ranks(d)
    assert loader.load(os.path.join(d, "model_states.pt"))["step"] == 100
    save_tag(trainer, 200)
    with pytest.raises(IntegrityError, match=r"last' was saved again while it was being loaded.*"
                                             r"optim_states\.pt"):
        loader.load(os.path.join(d, "optim_states.pt"))
    loader.verify_all_ranks(d)  # loading again
    assert [loader.load(os.path.join(d, f))["step"] for f in ("model_states.pt", "optim_states.pt")] == [200, 200]
    # Inside a framework's load (collective_load), the rank goes on (the others would wait for
    # it in the framework's collectives) and the end of the load raises, on every rank.
    save_tag(trainer, 300)
    with pytest.raises(IntegrityError, match=r"load_checkpoint refused on every rank: on rank\(s\) 0: "
                                             r"IntegrityError: checkpoint .*last' was saved again"):
        with loader.collective_load("load_checkpoint"):
            loaded = loader.load(os.path.join(d, "optim_states.pt"))
    assert loaded["step"] == 300
    trainer.close()
    loader.close()


def test_saving_again_a_directory_whose_save_is_in_flight_does_not_wait_for_it(tmp_path, monkeypatch):
    """The second save of one directory no longer waits in begin() for the first to commit:
    it is staged, and swapped in after the first commit, in order."""
    import deepspeed_async_ckpt.persist.writer as checkpointer

    real = checkpointer.write_file
    second_saved = threading.Event()

    def held_write_file(*args, **kwargs):  # the first save stays in flight until the second
        second_saved.wait(30)              # has begun (a begin waiting for it: 30 s)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "write_file", held_write_file)
    root = str(tmp_path)
    ck = make()
    first = save_one(ck, root, sample_state(), tag="t")
    ck.fence()
    state = sample_state()
    state["global_steps"] = 9
    t0 = time.perf_counter()
    second = save_one(ck, root, state, tag="t")
    begun_in = time.perf_counter() - t0
    second_saved.set()
    assert not first.committed and second.write_dir != second.ckpt_dir
    assert begun_in < 10, begun_in
    ck.fence()
    ck.wait()
    ck.close()
    assert first.committed and second.committed
    assert first.times["committed"] < second.times["committed"]
    assert listing(root) == ["latest", "t"]
    assert saved_steps(tmp_path / "t" / "model.pt") == 9
    verify_checkpoint(str(tmp_path / "t"))


def _resave(tmp_path, keep_last, step):
    """Checkpoint "t" saved, then saved again (step 9) with the finalize ``step``: staged
    beside it until that step is done."""
    root = str(tmp_path)
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=keep_last))
    save_one(ck, root, sample_state(), tag="t")
    ck.wait()
    state = sample_state()
    state["global_steps"] = 9
    d = os.path.join(root, "t")
    handle = ck.begin(d, tag="t", pointer=Pointer(os.path.join(root, "latest"), "t"), finalize=[step])
    ck.save(state, os.path.join(d, "model.pt"))
    ck.end()
    ck.fence()
    return ck, root, d, handle


def test_a_staged_save_whose_finalize_step_runs_is_neither_swept_nor_retired(tmp_path):
    """A re-saved checkpoint is swapped in after its finalize steps (the Megatron adapter's
    markers). While a step runs, the next save's clean-up must not take the committed staging
    directory for an abandoned one, nor retention the directory it replaces."""
    running, finish = threading.Event(), threading.Event()
    ck, root, d, handle = _resave(tmp_path, 2, lambda ctx: (running.set(), finish.wait(30)))
    assert running.wait(30)
    try:
        save_one(ck, root, sample_state(), tag="u")  # its begin() recovers and sweeps
        assert os.path.isdir(handle.write_dir) and os.path.isdir(d)
    finally:
        finish.set()
    ck.fence()
    ck.wait()
    ck.close()
    assert handle.committed
    assert listing(root) == ["latest", "t", "u"]
    verify_checkpoint(d)
    assert saved_steps(tmp_path / "t" / "model.pt") == 9


def test_a_staged_save_whose_finalize_step_fails_is_swept_and_the_old_one_stays(tmp_path):
    """A finalize step that fails after the commit's manifest (Megatron's markers) fails the
    save: the old checkpoint stays in place, ``latest`` still names it, and the next save
    sweeps the staging directory."""
    def fail(ctx):
        raise OSError(errno.ENOSPC, "No space left on device")

    ck, root, d, handle = _resave(tmp_path, 0, fail)
    with pytest.raises(CommitError, match="finalize step .*fail.* failed .*No space left"):
        ck.wait()
    assert not handle.committed and os.path.isdir(handle.write_dir)
    save_one(ck, root, sample_state(), tag="u")  # its begin() sweeps the staging directory
    ck.wait()
    ck.close()
    assert listing(root) == ["latest", "t", "u"]
    verify_checkpoint(d)
    assert saved_steps(tmp_path / "t" / "model.pt") == sample_state()["global_steps"] != 9
