"""Retention (``keep_last``) as the checkpointer runs it: what is removed, what never is,
on its own thread, retried after a failure."""

import errno
import json
import os
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import KeepAny, KeepIf, KeepLast, RetentionPolicy
from deepspeed_async_ckpt.commit import META_DIR, REMOVING_PREFIX, Pointer, read_manifest, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import CommitError, IntegrityError
from deepspeed_async_ckpt.storage import LocalStorage

from helpers import cli_main, listing, make, sample_state, save_one, saved_steps


def test_retention_futures_do_not_pile_up_after_one_retention_bug(tmp_path):
    """After one retention raised (a user's policy, say), the later retention futures are
    dropped once done, not kept until someone calls wait(): a loop that never waits holds at
    most the failed one and the one running. The one error is still raised once."""
    boom = {"on": True}

    def keep(name):
        if boom.pop("on", False):
            raise ValueError("a retention bug")
        return False

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01),
                           retention=KeepAny(KeepLast(1), KeepIf(keep)))
    for step in range(12):
        handle = save_one(ck, str(tmp_path), {"w": torch.randn(16)}, tag=f"t{step}", eager=())
        ck.fence()
        handle.wait_committed()  # its retention is queued by then
        with ck._saves.lock:
            queued = ck._retention.retiring[-1]
        queued.exception()
    held = len(ck._retention.retiring)
    with pytest.raises(ValueError, match="a retention bug"):
        ck.close()
    assert held <= 2, held


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_keep_last_removes_older_committed_checkpoints_and_nothing_else(tmp_path, mode, caplog):
    caplog.set_level("INFO", logger="deepspeed_async_ckpt.core")
    root = str(tmp_path)
    # What retention must leave alone: another engine's checkpoint, a checkpoint of ours whose
    # manifest is damaged (someone should look at it), a plain file; what it must finish: a
    # removal that a crash cut short; and what it removes at the first commit: a partial save
    # of ours from before it (a crash cut it short: it can never be loaded).
    (tmp_path / "torch_engine" / "global_step1").mkdir(parents=True)
    (tmp_path / "torch_engine" / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "partial" / META_DIR).mkdir(parents=True)
    (tmp_path / "partial" / META_DIR / "rank_00000.abc.json").write_text("{}")
    (tmp_path / "partial" / "model.pt").write_bytes(b"z" * 100)
    (tmp_path / "damaged" / META_DIR).mkdir(parents=True)
    (tmp_path / "damaged" / META_DIR / "manifest.json").write_text('{"format": ')
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / ".async_ckpt_removing.old" / "sub").mkdir(parents=True)
    (tmp_path / ".async_ckpt_removing.old" / "sub" / "model.pt").write_bytes(b"y" * 100)
    ck = make(mode, keep_last=2)
    state, retired = sample_state(), []
    for i in range(5):
        state["global_steps"] = i
        handle = save_one(ck, root, state, tag=f"s{i}")
        ck.fence()
        ck.wait()
        retired.append(handle.retired)
        assert sorted(n for n in os.listdir(root) if n.startswith("s")) == [f"s{j}" for j in range(max(0, i - 1), i + 1)]
    ck.close()
    assert retired == [["partial"], [], ["s0"], ["s1"], ["s2"]]
    assert "s4 committed; removed older checkpoint(s) s2" in caplog.text  # said in the log
    assert listing(root) == ["damaged", "latest", "notes.txt", "s3", "s4", "torch_engine"]
    assert (tmp_path / "torch_engine" / "global_step1" / "mp_rank_00_model_states.pt").read_bytes() == b"x"
    assert os.listdir(tmp_path / "damaged" / META_DIR) == ["manifest.json"]
    assert (tmp_path / "latest").read_text() == "s4"
    for i in (3, 4):  # the kept ones are whole: every byte verifies, and they hold their step
        verify_checkpoint(str(tmp_path / f"s{i}"))
        assert torch.load(tmp_path / f"s{i}" / "model.pt", weights_only=False)["global_steps"] == i


def test_keep_last_never_removes_the_checkpoint_the_pointer_names_after_the_clock_stepped_back(
        tmp_path, monkeypatch):
    """Retention orders checkpoints by the manifest's ``committed_at`` (rank 0's wall clock).
    After the clock stepped back, a pass that ran behind the commits (its thread busy with a
    slow deletion) must not remove the checkpoint ``latest`` has just moved to and keep a
    stale one."""
    import types

    import deepspeed_async_ckpt.commit as commit_mod

    clock = {"t": 1_000_000.0}
    monkeypatch.setattr(commit_mod.sequence, "time", types.SimpleNamespace(
        time=lambda: clock["t"], monotonic=time.monotonic, sleep=time.sleep, perf_counter=time.perf_counter))
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=1))
    root = str(tmp_path)

    def save(tag, at):
        clock["t"] = at
        d = os.path.join(root, tag)
        ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
        ck.save({"w": torch.arange(100.0)}, os.path.join(d, "model.pt"))
        ck.end()
        ck.fence()
        assert ck.history[-1].wait_committed(60) and ck.history[-1].committed

    save("s1", 1_000_000)
    save("s2", 1_000_100)
    ck.wait()
    gate = threading.Event()
    ck._later(gate.wait)  # the retention thread is busy until s4 has committed
    save("s3", 999_500)  # ten minutes back
    save("s4", 999_600)
    gate.set()
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "s4"
    assert (tmp_path / "s4" / "model.pt").exists()
    assert torch.equal(torch.load(tmp_path / "s4" / "model.pt")["w"], torch.arange(100.0))


def test_keep_last_counts_tags_that_start_with_a_dot(tmp_path, caplog):
    """DeepSpeed takes ``tag=".last"`` and so does :func:`check_name` (only this engine's own
    names, starting with ``.async_ckpt``, are refused), but retention skipped every name
    starting with a dot: such checkpoints were never removed, and each commit warned that it
    was "not a committed checkpoint". Hidden directories that
    are not checkpoints of this engine are still left alone."""
    (tmp_path / ".git" / "objects").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "x").write_text("y")
    ck = make("sync", keep_last=1)
    for tag in (".a", ".b", ".c"):
        save_one(ck, str(tmp_path), sample_state(), tag=tag)
    ck.close()
    assert "is not a committed checkpoint" not in caplog.text
    assert listing(tmp_path) == [".c", ".git", "latest"]
    assert (tmp_path / "latest").read_text() == ".c"
    assert (tmp_path / ".git" / "objects" / "x").read_text() == "y"


def test_retention_for_a_checkpoint_an_earlier_pass_removed_says_nothing(tmp_path, caplog):
    """Saves committing faster than retention runs: a queued pass for a checkpoint that an
    earlier pass already removed warned that it "is not a committed checkpoint" (136 times in
    150 saves). A directory there that never committed still
    warns."""
    import logging
    import threading as _threading

    from deepspeed_async_ckpt.commit import retire_checkpoints

    root = str(tmp_path)
    ck = make("sync")
    save_one(ck, root, sample_state(), tag="t1")
    ck.close()
    args = dict(keep_last=1, protected=set, lock=_threading.Lock())
    with caplog.at_level(logging.WARNING):
        retire_checkpoints(LocalStorage(), root, committed_now="t0", **args)
    assert "not a committed checkpoint" not in caplog.text
    (tmp_path / "t9").mkdir()
    with caplog.at_level(logging.WARNING):
        retire_checkpoints(LocalStorage(), root, committed_now="t9", **args)
    assert "t9 is not a committed checkpoint" in caplog.text


def test_keep_last_leaves_a_checkpoint_saved_without_moving_the_pointer(tmp_path, capsys):
    """DeepSpeed's ``save_checkpoint(d, tag="best", save_latest=False)``, the usual way to keep
    the best model aside: with ``keep_last``, the next saves' retention removed it like any
    older checkpoint. Such a save is begun with
    ``rotation=False`` (the DeepSpeed plugin passes ``save_latest``): never counted, never
    removed; saved again in the rotation, it joins it."""
    root = str(tmp_path)

    def aside(tag):
        d = os.path.join(root, tag)
        ck.begin(d, tag=tag, pointer=None, rotation=False)
        ck.save(sample_state(), os.path.join(d, "model.pt"))
        return ck.end()

    ck = make("sync", keep_last=1)
    aside("best")
    for tag in ("s1", "s2", "s3"):
        save_one(ck, root, sample_state(), tag=tag)
    aside("best")  # saved again aside: still aside
    save_one(ck, root, sample_state(), tag="s4")
    ck.wait()
    assert listing(tmp_path) == ["best", "latest", "s4"]
    assert "rotation" not in read_manifest(os.path.join(root, "s4"))  # manifests as before
    verify_checkpoint(os.path.join(root, "best"))
    assert cli_main(["list", "--json", root]) == 0  # list says which are kept aside
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["best"].get("rotation") is False and "rotation" not in rows["s4"], rows
    assert cli_main(["list", root]) == 0
    assert "kept aside" in next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best"))
    save_one(ck, root, sample_state(), tag="best")  # with the pointer: in the rotation
    save_one(ck, root, sample_state(), tag="s5")
    ck.close()
    assert listing(tmp_path) == ["latest", "s5"]


def test_keep_last_does_not_count_a_checkpoint_never_finalized_and_removes_it_once_older(tmp_path):
    """A checkpoint whose late files (Megatron's markers) were never recorded cannot be loaded:
    counted among the ``keep_last`` newest, it kept the place of a loadable one; never removed,
    every crash between a commit and its markers left one behind for good. It goes once a
    checkpoint committed after it is the newest; one committed after that one stays (on a
    Megatron rank 0, the next save can be committed and not yet finalized while retention runs
    for the one before)."""
    root = str(tmp_path)
    ck = make("sync", keep_last=2)

    def save(tag, late=(), record=True):
        def markers(ctx):
            if not record:
                raise OSError(errno.EIO, "Input/output error")
            for name in late:
                ctx.write_file(name, tag)
        markers.files = late

        d = os.path.join(root, tag)
        handle = ck.begin(d, tag=tag, finalize=[markers] if late else [])
        ck.save(sample_state(), os.path.join(d, "model.pt"))
        if record:
            ck.end()
        else:
            with pytest.raises(CommitError, match="finalize step"):
                ck.end()
        return handle

    save("a")
    save("b", late=("markers.json",), record=False)  # its finalize step failed
    save("c", late=("markers.json",))
    verify_checkpoint(os.path.join(root, "c"))
    with pytest.raises(IntegrityError, match="never finalized"):
        verify_checkpoint(os.path.join(root, "b"))
    handle = save("d")
    save("e", late=("markers.json",), record=False)  # committed after "d", not finalized yet
    assert ck.retire_older(handle) == ["a", "b"]
    assert handle.retired == ["a", "b"]  # recorded on the handle the caller passed
    ck.close()
    assert listing(root) == ["c", "d", "e"]


def test_keep_last_never_takes_a_directory_from_under_a_save_being_begun(tmp_path):
    """A save announces its directory before begin()'s exchange, that is before any rank can
    write into it: retention running meanwhile (the commit of the previous save, on rank 0's
    committer thread) must skip it, even when it is an old committed checkpoint re-saved."""
    from deepspeed_async_ckpt.core import CheckpointHandle

    root = str(tmp_path)
    plain = make()
    for tag in ("a", "b"):
        save_one(plain, root, sample_state(), tag=tag)
        plain.wait()
    plain.close()
    seen = {}

    def exchange(value, error, key=""):  # rank 0's part of begin()'s collective, for re-saving "a"
        b = CheckpointHandle(str(tmp_path / "b"), "b", "id-b", None)
        seen["retired"] = ck.retire_older(b)  # "a" is committed and beyond keep_last=1
        seen["a_exists"] = os.path.isdir(tmp_path / "a" / META_DIR)
        return value, {}

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, keep_last=1, host_buffer_gb=0.01),
                           exchange=exchange)
    state = sample_state()
    state["global_steps"] = 7
    handle = save_one(ck, root, state, tag="a")
    ck.fence()
    ck.wait()
    ck.close()
    assert seen == {"retired": [], "a_exists": True}
    assert handle.retired == ["b"]  # the re-saved "a" is now the newest; "b" goes
    assert listing(root) == ["a", "latest"]
    verify_checkpoint(str(tmp_path / "a"))
    assert torch.load(tmp_path / "a" / "model.pt", weights_only=False)["global_steps"] == 7


def test_a_retention_bug_is_raised_by_one_wait_not_every_later_one(tmp_path):
    """A retention that raises something other than an OSError (a bug; a custom Storage's
    own exception) is raised by the next ``wait()`` and then dropped: kept, it would be raised
    by every later ``wait()``, and so refuse every later load."""
    class Broken(LocalStorage):
        broken = True

        def replace(self, src, dst, durable=True):
            if Broken.broken and REMOVING_PREFIX in dst:
                raise RuntimeError(f"cannot move {src}")
            return super().replace(src, dst, durable=durable)

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, keep_last=1, host_buffer_gb=0.01),
                           storage=Broken())
    for tag in ("s0", "s1"):
        save_one(ck, str(tmp_path), sample_state(), tag=tag)
        ck.fence()
    with pytest.raises(RuntimeError, match="cannot move"):
        ck.wait()
    ck.wait()  # reported once
    Broken.broken = False
    save_one(ck, str(tmp_path), sample_state(), tag="s2")
    ck.wait()
    ck.close()
    assert listing(tmp_path) == ["latest", "s2"]


def test_keep_last_failure_to_remove_keeps_the_commit_and_retries_next_time(tmp_path, caplog):
    """One entry that cannot be deleted is logged, naming it, and does not hold up the
    others: it stopped every later retention before (``remove_trash`` raised on it first)."""
    class Undeletable(LocalStorage):
        fail = {"s0"}

        def remove_tree(self, path):
            if any(path.endswith(REMOVING_PREFIX + name) for name in Undeletable.fail):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            super().remove_tree(path)

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, keep_last=1, host_buffer_gb=0.01),
                           storage=Undeletable())
    root = str(tmp_path)
    for tag in ("s0", "s1", "s2"):
        save_one(ck, root, sample_state(), tag=tag)
        ck.wait()  # raises nothing: the commits stand
    assert (tmp_path / "latest").read_text() == "s2"
    assert f"deleting {os.path.join(root, REMOVING_PREFIX + 's0')} failed" in caplog.text
    assert "Permission denied" in caplog.text
    # s0 was renamed away (it is no longer a checkpoint) but could not be deleted; s1 went
    assert listing(root) == [REMOVING_PREFIX + "s0", "latest", "s2"]
    Undeletable.fail = set()
    handle = save_one(ck, root, sample_state(), tag="s3")
    ck.wait()
    ck.close()
    assert handle.retired == ["s2"]
    assert listing(root) == ["latest", "s3"]
    verify_checkpoint(str(tmp_path / "s3"))


def test_a_tag_that_was_a_symbolic_link_is_replaced_and_retention_goes_on(tmp_path):
    """``best -> global_step2``, saved again: the new checkpoint replaces the link (the one it
    pointed at is untouched), and the link, moved away, is unlinked: ``rmtree`` refused it,
    and that one entry stopped all later retention."""
    root = str(tmp_path)
    ck = make(keep_last=2)
    for i in range(3):
        save_one(ck, root, sample_state(), tag=f"global_step{i}")
        ck.wait()
    os.symlink("global_step2", os.path.join(root, "best"))
    state = sample_state()
    state["global_steps"] = 99
    save_one(ck, root, state, tag="best")
    ck.wait()
    assert not os.path.islink(os.path.join(root, "best"))
    assert saved_steps(tmp_path / "best" / "model.pt") == 99
    assert saved_steps(tmp_path / "global_step2" / "model.pt") == 5
    for i in range(3, 6):
        save_one(ck, root, sample_state(), tag=f"global_step{i}")
        ck.wait()
    ck.close()
    assert listing(root) == ["global_step4", "global_step5", "latest"]


def test_keep_last_keeps_a_checkpoint_a_symbolic_link_names(tmp_path, capsys):
    """``ln -s global_step1 best`` in the save directory: a checkpoint a link in the save
    directory names stays while the link does (removing it like any older checkpoint would
    leave ``best`` dangling); ``list`` shows the link and what it keeps. Links elsewhere, or
    dangling, change nothing."""
    root = str(tmp_path)
    ck = make("sync", keep_last=1)
    save_one(ck, root, sample_state(), tag="global_step1")
    ck.wait()  # linked before the next commit's retention pass (on its own thread) can run
    os.symlink("global_step1", os.path.join(root, "best"))
    os.symlink(str(tmp_path.parent), os.path.join(root, "up"))  # outside: ignored
    os.symlink("gone", os.path.join(root, "dangling"))
    for tag in ("global_step2", "global_step3", "global_step4"):
        save_one(ck, root, sample_state(), tag=tag)
    ck.wait()
    assert listing(root) == ["best", "dangling", "global_step1", "global_step4", "latest", "up"]
    verify_checkpoint(os.path.join(root, "best"))
    assert cli_main(["list", "--json", root]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["best"]["state"] == "link" and rows["best"]["target"] == "global_step1", rows
    assert rows["global_step1"]["state"] == "committed" and rows["global_step1"]["linked_from"] == ["best"]
    assert "linked_from" not in rows["global_step4"] and "dangling" not in rows, rows
    assert cli_main(["list", root]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "linked from best: keep_last keeps it" in next(line for line in out if line.startswith("global_step1"))
    assert "-> global_step1" in next(line for line in out if line.startswith("best"))
    os.unlink(os.path.join(root, "best"))  # unlinked: it ages out with the next commit
    save_one(ck, root, sample_state(), tag="global_step5")
    ck.close()
    assert listing(root) == ["dangling", "global_step5", "latest", "up"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_keep_last_removes_on_its_own_thread_so_saves_and_commits_do_not_wait(tmp_path, mode):
    """Deleting a checkpoint can take as long as saving it (0.2 s per GiB on this VM's ext4,
    mounted with online discard). Retention runs on its own thread: with the deletion of s0
    held, the sync save of s1 returns and the next checkpoint, s2, commits; ``wait()`` then
    waits for the deletions, in order (s0, then s1 once s2 is committed)."""
    entered, release = threading.Event(), threading.Event()

    class HeldDeletion(LocalStorage):
        def remove_tree(self, path):
            entered.set()
            release.wait(10)  # a save or commit waiting here would take these 10 s
            super().remove_tree(path)

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, keep_last=1, host_buffer_gb=0.01),
                           storage=HeldDeletion())
    root = str(tmp_path)
    save_one(ck, root, sample_state(), tag="s0")
    ck.fence()
    ck.wait()
    handles = []
    for tag in ("s1", "s2"):
        handles.append(save_one(ck, root, sample_state(), tag=tag))
        ck.fence()
        assert handles[-1].wait_committed(5), f"{tag} not committed while s0 was being deleted"
        assert (tmp_path / "latest").read_text() == tag
        assert entered.wait(5) and (tmp_path / ".async_ckpt_removing.s0").is_dir()  # still held
    assert not release.is_set()
    release.set()
    ck.wait()
    ck.close()
    assert [h.retired for h in handles] == [["s0"], ["s1"]]
    assert listing(root) == ["latest", "s2"]
    verify_checkpoint(str(tmp_path / "s2"))


def test_retention_queued_after_close_runs_in_the_caller(tmp_path):
    """Retention or a deletion queued after the engine closed (an integration's, or a
    callback's release) runs at once, in the calling thread (no thread to hand it to, and no
    deadlock on the engine's lock)."""
    class KeepAllUntilClosed(RetentionPolicy):
        closed = False

        def should_keep(self, checkpoints):
            return [not self.closed or i == 0 for i in range(len(checkpoints))]

    policy = KeepAllUntilClosed()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), retention=policy)
    handles = []
    for tag in ("a", "b"):
        handles.append(save_one(ck, str(tmp_path), sample_state(), tag=tag))
        ck.wait()
    ck.close()
    policy.closed = True
    result = {}
    job = ck._saves.job_of(handles[1])
    thread = threading.Thread(target=lambda: result.update(f=ck._retention.retire_older_later(job)))
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "retire_older_later deadlocked on a closed checkpointer"
    assert result["f"].result(0) == ["a"] and listing(tmp_path) == ["b", "latest"]


def test_retention_leaves_a_checkpoint_whose_commit_callback_still_runs(tmp_path):
    """An upload in a commit callback reads the checkpoint after its commit; with keep_last=1
    the next commit's retention would remove it meanwhile (callbacks run on their own thread):
    it is left until the callback is done, and removed by the retention after that."""
    release, read = threading.Event(), []

    def upload(info):
        if info.tag == "t1":
            assert release.wait(10)
        read.append((info.tag, len((tmp_path / info.tag / "model.pt").read_bytes())))

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=1),
                           on_commit=upload)
    save_one(ck, str(tmp_path), sample_state(), tag="t1")
    save_one(ck, str(tmp_path), sample_state(), tag="t2")
    ck.wait()  # t2 committed and its retention done: t1 is still being uploaded
    assert listing(tmp_path) == ["latest", "t1", "t2"]
    release.set()
    save_one(ck, str(tmp_path), sample_state(), tag="t3")
    ck.close()
    assert [tag for tag, n in read] == ["t1", "t2", "t3"] and all(n > 0 for _, n in read)
    assert listing(tmp_path) == ["latest", "t3"]


def test_retention_sees_a_save_that_is_ending_while_it_looks(tmp_path):
    """end() moves a save from ``_current`` to the in-flight queue outside retention's lock:
    retention read the queue, then ``_current``, and a save ended in between was protected by
    neither, so a keep_last retention removed it under the save (then ``latest`` named a
    missing checkpoint). Here the retention thread pauses right after reading the queue."""
    ck = make(keep_last=5)
    save_one(ck, str(tmp_path), sample_state(), tag="t1")
    ck.wait()
    in_window = threading.Event()
    real_pending = ck._saves.pending

    def pending():
        got = real_pending()
        if threading.current_thread().name.startswith("async-ckpt-retirer"):
            in_window.set()
            time.sleep(0.3)  # a thread switch right here
        return got

    ck._saves.pending = pending
    save_one(ck, str(tmp_path), sample_state(), tag="t2")  # committed in the background...
    d = tmp_path / "t3"  # ...with t3 begun before: t3's directory is older than t2's commit
    ck.begin(str(d), tag="t3", pointer=Pointer(str(tmp_path / "latest"), "t3"))
    ck.save(sample_state(), str(d / "model.pt"))
    assert in_window.wait(10)
    ck.end()
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "t3"
    verify_checkpoint(str(d))


def test_a_checkpoint_left_for_its_callback_goes_once_the_callback_is_done(tmp_path):
    """Retention leaves a checkpoint while its commit callback runs; with uploads slower than
    the saves, keep_last=1 left every checkpoint behind at the end of the run. Retention runs
    again when a checkpoint's last callback is done."""
    def upload(info):
        time.sleep(0.2)
        assert (tmp_path / info.tag / "model.pt").exists()

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=1),
                           on_commit=upload)
    for tag in ("t1", "t2", "t3"):
        save_one(ck, str(tmp_path), sample_state(), tag=tag)
        ck.wait()
    ck.close()
    assert listing(tmp_path) == ["latest", "t3"]


def test_a_commit_callback_that_blocks_holds_up_neither_retention_nor_wait(tmp_path):
    """Retention runs on a thread apart from the commit callbacks: an upload stuck in a callback
    (a dead store) neither stops the removal of older checkpoints (the disk would fill) nor
    makes ``wait()``, which waits for retention, wait for the upload; the callbacks still run
    one at a time in commit order, and one that raises stops neither them nor retention."""
    earlier = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    for tag in ("t0", "t1"):  # an earlier run's, without callbacks
        save_one(earlier, str(tmp_path), sample_state(), tag=tag)
    earlier.close()
    release, order = threading.Event(), []

    def upload(info):
        order.append(info.tag)
        if info.tag == "t2":
            assert release.wait(30)

    def broken(info):
        raise RuntimeError("the dashboard is down")

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, keep_last=1),
                           on_commit=upload)
    ck.add_commit_callback(broken)
    try:
        for tag in ("t2", "t3"):
            save_one(ck, str(tmp_path), sample_state(), tag=tag)
            ck.wait()  # returns with t2's upload still held, its retention done
            # the earlier run's checkpoints are gone; those whose callbacks are queued or
            # running are left until they are done
            assert listing(tmp_path) == ["latest", "t2", "t3"][:2 if tag == "t2" else 3], tag
        assert order == ["t2"]
    finally:
        release.set()
    ck.close()  # waits for the callbacks, and for the retention t2's release runs again
    assert order == ["t2", "t3"]
    assert listing(tmp_path) == ["latest", "t3"]


def test_a_directory_the_storage_will_not_rename_for_deletion_stays_and_remove_later_says_so(tmp_path):
    """``remove_later`` renames through the storage, so a refused rename is the storage's to
    report: False, nothing renamed or queued; once allowed, the directory goes."""
    from fakes import RemovalsRefused

    storage = RemovalsRefused()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    old = tmp_path / "checkpoint-1"
    old.mkdir()
    (old / "model.pt").write_bytes(b"x")
    assert ck.remove_later(str(old)) is False
    assert storage.refused == [str(old)] and listing(tmp_path) == ["checkpoint-1"]
    assert not ck._retention.retiring
    storage.refuse = False
    assert ck.remove_later(str(old)) is True
    ck.wait()
    assert listing(tmp_path) == []
    ck.close()
