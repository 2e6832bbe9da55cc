"""The engine's threads and worker process run below the training thread
(``deepspeed_async_ckpt.qos``): a higher nice value, the lowest best-effort I/O priority, and
the cores of ``ASYNC_CKPT_BACKGROUND_CPUS`` where set; the training thread is left as it was."""

import os
import threading

import pytest

from deepspeed_async_ckpt import qos

from helpers import make, sample_state, save_one

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def _nice(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def _threads() -> dict[str, int]:
    return {t.name: t.native_id for t in threading.enumerate()}


def _saved(tmp_path, **kw):
    ck = make(**kw)
    save_one(ck, str(tmp_path), sample_state())
    ck.wait()
    return ck


def test_background_threads_run_ten_nice_levels_below_the_training_thread(tmp_path):
    mine = _nice(threading.get_native_id())
    ck = _saved(tmp_path)
    try:
        threads = _threads()
        background = {n: tid for n, tid in threads.items() if n.startswith("async-ckpt-")}
        assert {"async-ckpt-copier", "async-ckpt-committer"} <= set(background)
        assert any(n.startswith("async-ckpt-writer") for n in background)
        assert {n: _nice(tid) for n, tid in background.items()} == {n: min(19, mine + 10) for n in background}
        assert _nice(threading.get_native_id()) == mine  # training: untouched
        prio = qos.io_priority(background["async-ckpt-copier"])
        if prio is not None:  # best-effort class (2), level 7
            assert (prio >> 13, prio & 0xff) == (2, 7)
            assert qos.io_priority() != prio
    finally:
        ck.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # ended meanwhile
        return b""


def test_the_persist_worker_process_runs_below_the_training_process(tmp_path):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    ck = _saved(tmp_path, persist_in="process")
    try:
        children = {int(c) for t in os.listdir("/proc/self/task")
                    for c in open(f"/proc/self/task/{t}/children").read().split()}
        # this checkpointer's worker only: the suite's other children (a test's S3 server,
        # the warm fork server) keep their own priority
        pids = {pid for pid in children if b"deepspeed_async_ckpt.persist.worker" in _cmdline(pid)}
        assert pids, "no worker process"
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {min(19, mine + 10)}
    finally:
        ck.close()


def test_background_nice_zero_keeps_the_training_threads_priority(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_CKPT_BACKGROUND_NICE", "0")
    mine = _nice(threading.get_native_id())
    ck = _saved(tmp_path)
    try:
        assert _nice(_threads()["async-ckpt-copier"]) == mine
    finally:
        ck.close()


def test_background_cpus_put_the_engines_threads_on_those_cores(tmp_path, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("ASYNC_CKPT_BACKGROUND_CPUS", str(allowed[-1]))
    ck = _saved(tmp_path)
    try:
        assert os.sched_getaffinity(_threads()["async-ckpt-copier"]) == {allowed[-1]}
        assert os.sched_getaffinity(0) == set(allowed)  # training: untouched
    finally:
        ck.close()


def test_the_idle_policy_puts_the_engines_threads_in_sched_idle(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_CKPT_BACKGROUND_POLICY", "idle")
    ck = _saved(tmp_path)
    try:
        assert os.sched_getscheduler(_threads()["async-ckpt-copier"]) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # training: untouched
    finally:
        ck.close()


@pytest.mark.parametrize("name, value, message", [
    ("ASYNC_CKPT_BACKGROUND_NICE", "20", "an integer from 0 to 19"),
    ("ASYNC_CKPT_BACKGROUND_NICE", "low", "an integer from 0 to 19"),
    ("ASYNC_CKPT_BACKGROUND_CPUS", "a-b", "a list of cores such as '8-15' or '3,7'"),
    ("ASYNC_CKPT_BACKGROUND_POLICY", "fifo", "'nice' or 'idle'"),
])
def test_a_bad_setting_is_refused_naming_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    read = {"NICE": qos.nice_increment, "CPUS": qos.background_cpus, "POLICY": qos.idle_policy}
    with pytest.raises(ValueError, match=f"{name}={value!r}: {message}"):
        read[name.rsplit("_", 1)[1]]()


def test_cpu_lists_are_read_as_taskset_writes_them(monkeypatch):
    monkeypatch.setenv("ASYNC_CKPT_BACKGROUND_CPUS", "0-2, 5")
    assert qos.background_cpus() == {0, 1, 2, 5}
    monkeypatch.delenv("ASYNC_CKPT_BACKGROUND_CPUS")
    assert qos.background_cpus() is None


def _wakeups() -> dict[str, int]:
    out = {}
    for name, tid in _threads().items():
        if name.startswith("async-ckpt-"):
            try:
                with open(f"/proc/self/task/{tid}/status") as f:
                    out[name] = next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt_switches"))
            except OSError:  # ended meanwhile
                pass
    return out


def test_no_engine_thread_polls_while_a_save_waits_or_after_its_commit(tmp_path):
    """Every thread of the engine sleeps until there is work: while a save's file waits for
    the disk (here: its open held) and after the commit, none wakes more than twice in half
    a second (a thread polling every 50 ms would wake ten times)."""
    import time

    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.core import AsyncCheckpointer
    from fakes import HeldWrites

    storage = HeldWrites()
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01), storage=storage)
    try:
        handle = save_one(ck, str(tmp_path), sample_state())
        ck.fence()
        time.sleep(0.2)  # the copier and the writers reach their waits
        before = _wakeups()
        time.sleep(0.5)
        during = {n: v - before.get(n, v) for n, v in _wakeups().items()}
        assert during and max(during.values()) <= 2, during
        storage.released.set()
        handle.wait_committed(30)
        ck.wait()
        time.sleep(0.2)
        before = _wakeups()
        time.sleep(0.5)
        after = {n: v - before.get(n, v) for n, v in _wakeups().items()}
        assert max(after.values(), default=0) <= 2, after
    finally:
        storage.released.set()
        ck.close()
