"""The checkpointer's life (``deepspeed_async_ckpt.core.lifecycle``): background threads,
forks, the save directory's lock, close, Ctrl-C."""

import os
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import LOCK_FILE, Pointer, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import AsyncCheckpointError, PersistError

from helpers import (listing, lock_held, make, run_script, sample_state, save_one,
                     the_next_save_commits_and_closes)


def test_background_threads_start_only_when_the_save_is_sealed(tmp_path):
    """Inside the save, nothing runs beside the training thread: the writers (which open the
    file and write its headers) and the copier start at end(), so they do not compete with the
    rest of the framework's save for the GIL or a core."""
    import time

    state = sample_state()
    ck = make()
    d = tmp_path / "t1"
    ck.begin(str(d), tag="t1", pointer=Pointer(str(tmp_path / "latest"), "t1"))
    ck.save(state, str(d / "model.pt"), eager_keys=("client",))
    time.sleep(0.3)  # ample time for a writer thread to open its temporary file
    assert not [p.name for p in d.iterdir() if p.name.startswith("model.pt")]
    handle = ck._saves.current
    assert not any(i.issued for i in handle.items if not i.eager)  # no lazy copy yet
    ck.end()
    ck.wait()
    assert (d / "model.pt").exists() and (tmp_path / "latest").read_text() == "t1"
    ck.close()


def test_a_ctrl_c_while_end_hands_a_save_over_fails_it_and_nothing_waits_for_it(tmp_path, monkeypatch):
    """A Ctrl-C (or a SIGTERM handler's ``sys.exit``) landing in ``end`` after its writers are
    queued and before its copies are: the save fails (its writers on the copies that were
    never queued), the next save commits, and ``close`` returns. Otherwise the committer
    never gets the save and its writers wait for the copies: ``wait``, ``close`` and the exit
    flush hang for good."""
    from deepspeed_async_ckpt.snapshot import Stager

    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    submit, hits = Stager.submit, []

    def interrupted(self, items, **kwargs):
        if not hits:
            hits.append(1)
            raise KeyboardInterrupt
        return submit(self, items, **kwargs)

    monkeypatch.setattr(Stager, "submit", interrupted)
    root = str(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        save_one(ck, root, sample_state(), tag="t1")
    assert not ck.is_open
    with pytest.raises(PersistError, match="KeyboardInterrupt"):
        ck.wait(timeout=30)
    the_next_save_commits_and_closes(ck, tmp_path)
    assert not (tmp_path / "t1" / "model.pt").exists()


OTHER_JOB_SCRIPT = """
import os, sys, time, torch
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.commit import Pointer
root = sys.argv[1]
ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
ck.begin(root + "/a1", tag="a1", pointer=Pointer(root + "/latest", "a1"))
ck.save({"w": torch.ones(16)}, root + "/a1/model.pt")
ck.end()
print("saved", flush=True)
sys.stdin.readline()  # the job goes on until told to end
ck.close()
"""


def test_a_second_job_saving_into_the_same_directory_is_refused_naming_the_first(tmp_path, repo_env):
    """Two jobs given one save directory (a requeued job while the old one still runs) would
    sweep each other's staging directories and temporaries, and retention would remove the
    other's checkpoints: both fail with unrelated-looking errors, and one's ``latest`` ends up
    naming the other's model. Rank 0 holds an exclusive lock on the save directory from its
    first save until close(); another process's first save there is refused, naming the
    holder, with nothing touched. Checkpointers of one process share it; loads do not take
    it; it goes with the process."""
    import subprocess
    import sys

    root = str(tmp_path)
    first = subprocess.Popen([sys.executable, "-c", OTHER_JOB_SCRIPT, root], env=repo_env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "saved"
        ck = make("sync")
        with pytest.raises(AsyncCheckpointError, match=f"another process.*pid {first.pid}"):
            save_one(ck, root, sample_state(), tag="b1")
        assert listing(root) == ["a1", "latest"] and (tmp_path / LOCK_FILE).is_file()
        assert (tmp_path / "latest").read_text() == "a1"
        other = make("sync")  # within this process, saves elsewhere are not affected
        save_one(other, str(tmp_path / "mine"), sample_state(), tag="m1")
        other.close()
    finally:
        first.communicate("end\n", timeout=60)
    assert first.returncode == 0
    save_one(ck, root, sample_state(), tag="b1")  # the first job ended: the lock went with it
    again = make("sync")  # a second checkpointer of this process shares it
    save_one(again, root, sample_state(), tag="b2")
    again.close()
    ck.close()
    assert (tmp_path / "latest").read_text() == "b2"


def test_a_save_directory_is_unlocked_once_saves_go_elsewhere(tmp_path, held_copier):
    """Hugging Face Trainer saves into a new directory each time (``checkpoint-N``): the
    checkpointer kept each one's lock file open until close(), one descriptor per save, and a
    long run failed with "Too many open files". A directory is
    unlocked once a save begins elsewhere and none of its own is still in flight."""
    from deepspeed_async_ckpt.commit import claims as commit_module

    def fds():
        return len(os.listdir("/proc/self/fd"))

    ck = make("async")
    dirs = [str(tmp_path / f"checkpoint-{n}") for n in range(40)]
    held_copier.clear()  # the first save stays in flight until the next fence
    save_one(ck, dirs[0], sample_state(), tag="global_step0")
    save_one(ck, dirs[1], sample_state(), tag="global_step1")
    assert lock_held(dirs[0]) and lock_held(dirs[1])  # the first save is still in flight there
    ck.fence()
    ck.wait()
    before = fds()
    for n in range(2, len(dirs)):
        save_one(ck, dirs[n], sample_state(), tag=f"global_step{n}")
        ck.wait()
    assert fds() <= before
    assert [d for d in dirs if lock_held(d)] == [dirs[-1]]
    assert [k for k in commit_module._claims if k.startswith(str(tmp_path))] == [os.path.realpath(dirs[-1])]
    ck.close()
    assert not lock_held(dirs[-1])


def test_a_close_interrupted_while_a_commit_runs_keeps_the_save_directory_locked(tmp_path, monkeypatch):
    """Ctrl-C in ``close`` while rank 0's commit still runs (waiting for a slow rank, say): the
    save directory stays locked until the process ends. Released when the committer's join
    gives up, with the commit still to write its manifest and pointer, it would let another
    job start sweeping the directory under it."""
    from deepspeed_async_ckpt.commit import claims as commit_module
    from deepspeed_async_ckpt.core import checkpointer as checkpointer_module
    from deepspeed_async_ckpt.core import committer as committer_module

    root = str(tmp_path)
    release = threading.Event()
    real_commit = committer_module.commit
    monkeypatch.setattr(committer_module, "commit",
                        lambda *a, **k: (release.wait(30), real_commit(*a, **k))[1])
    monkeypatch.setattr(checkpointer_module, "_COMMITTER_JOIN_S", 0.2)
    ck = make("async")
    save_one(ck, root, sample_state(), tag="t1")
    key = os.path.realpath(root)
    assert key in commit_module._claims
    monkeypatch.setattr(ck, "wait", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        ck.close()
    assert key in commit_module._claims  # still locked: the commit has not run
    release.set()
    ck._committer.thread.join(30)
    assert (tmp_path / "latest").read_text() == "t1"
    verify_checkpoint(os.path.join(root, "t1"))
    commit_module.release_save_dir(key)  # what this process's end would do


FORK_LOCK_SCRIPT = """
import os, sys, time, torch
from deepspeed_async_ckpt.core import AsyncCheckpointer, fence_all
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.commit import Pointer
root = sys.argv[1]
def make():
    return AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
def save(ck, tag):
    ck.begin(root + "/" + tag, tag=tag, pointer=Pointer(root + "/latest", tag))
    ck.save({"w": torch.ones(16)}, root + "/" + tag + "/model.pt")
    ck.end()
ck = make()
save(ck, "a1")
r, w = os.pipe()  # the parent tells the child it saved again
tried_r, tried_w = os.pipe()  # the child tells the parent it tried to save
pid = os.fork()
if pid == 0:  # a long-lived child (a persistent DataLoader worker, an evaluation process)
    os.close(w)  # the parent's end only: a parent that dies ends the read below
    mine = make()
    fence_all()  # the parent's checkpointer is not the child's to fence
    try:
        save(mine, "child1")
        print("child saved into the parent's directory", flush=True)
    except Exception as exc:
        print("child refused:", "pid %d" % os.getppid() in str(exc), flush=True)
    os.write(tried_w, b"x")
    os.read(r, 1)
    os._exit(0)
os.read(tried_r, 1)  # not a sleep: a child slower than it claimed after the parent's close
ck.close()
again = make()  # the parent re-creates its checkpointer while the child lives
save(again, "a2")
again.close()
print("parent saved again", flush=True)
os.write(w, b"x")
os.waitpid(pid, 0)
"""


def test_a_forked_child_neither_holds_nor_shares_the_parents_save_directory_lock(tmp_path, repo_env):
    """flock belongs to the open file description, which a fork shares: the child held the
    parent's lock (the parent, re-creating its checkpointer, was refused naming itself) and
    saved into the parent's directory unrefused; fence_all() in the child raised on the
    parent's checkpointer."""
    out = run_script(FORK_LOCK_SCRIPT, repo_env, str(tmp_path), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "child refused: True" in out.stdout and "parent saved again" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "latest").read_text() == "a2"


def test_close_from_a_commit_callback_stops_everything(tmp_path):
    """close() called from inside a commit callback cannot wait for that callback's own thread
    (it raised ``cannot join current thread`` and left the copier running)."""
    errors, stopped = [], threading.Event()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))

    def stop(info):
        try:
            ck.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            stopped.set()

    ck.add_commit_callback(stop)
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    assert stopped.wait(30)  # the callback's close() has returned
    assert not errors and ck.closed and not ck._files.stager._thread.is_alive()


def test_a_report_after_close_runs_after_those_queued_before(tmp_path):
    """Once closed (here by a callback, whose thread could not wait for itself), a report runs
    where it is made, but only after the callbacks queued before it; and a later close()
    waits for them too."""
    order, closed = [], threading.Event()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))

    def first(info):
        ck.close()
        closed.set()
        time.sleep(0.3)
        order.append("first")

    ck.add_commit_callback(first)
    save_one(ck, str(tmp_path), sample_state())
    assert closed.wait(10)
    ck.report(order.append, "after close")
    assert order == ["first", "after close"]
    ck.close()


def test_a_save_directory_stays_locked_while_a_callback_or_a_finalize_step_still_uses_it(tmp_path):
    """The release above keeps the claim of a directory whose commit callback is still reading
    a checkpoint there (another job could otherwise retire it under the callback), and of one
    whose save's finalize steps (the Megatron adapter's markers) are still running."""
    release, reading = threading.Event(), threading.Event()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01, keep_last=1),
                           on_commit=lambda info: (reading.set(), release.wait(30)))
    d1, d2, d3, d4 = (str(tmp_path / f"d{n}") for n in range(1, 5))
    try:
        save_one(ck, d1, sample_state(), tag="a1")
        assert reading.wait(30)
        save_one(ck, d2, sample_state(), tag="b1")  # d1's callback is still reading a1
        assert lock_held(d1)
    finally:
        release.set()
    ck.wait()
    deadline = time.monotonic() + 30  # wait() does not wait for callbacks: until they are done
    while ck._reporter.queued and time.monotonic() < deadline:
        time.sleep(0.001)
    save_one(ck, d3, sample_state(), tag="c1")
    assert not lock_held(d1) and not lock_held(d2) and lock_held(d3)
    ck.close()

    ck = make()  # no callbacks, no retention
    finalizing, finish = threading.Event(), threading.Event()
    ck.begin(os.path.join(d4, "i1"), tag="i1", finalize=[lambda ctx: (finalizing.set(), finish.wait(30))])
    ck.save({"w": torch.ones(4)}, os.path.join(d4, "i1", "model.pt"))
    ck.end()
    assert finalizing.wait(30)
    try:
        save_one(ck, d1, sample_state(), tag="a2")
        assert lock_held(d4)  # its manifest written, its finalize step still running
    finally:
        finish.set()
    ck.wait()
    save_one(ck, d2, sample_state(), tag="b2")
    ck.wait()
    assert not lock_held(d4) and not lock_held(d1) and lock_held(d2)
    ck.close()
