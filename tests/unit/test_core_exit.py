"""The exit flush (``deepspeed_async_ckpt.core.lifecycle``): a script that returns, or whose
training thread or pool worker still saves, commits its last checkpoint before the process
exits, and never hangs; a child forked during a save exits at once."""

import os

import pytest
import torch

from deepspeed_async_ckpt.commit import verify_checkpoint

from _compare import assert_same
from helpers import make, run_script, sample_state, save_one


EXIT_SCRIPT = """
import sys, time, torch
import deepspeed_async_ckpt.persist.writer as checkpointer
from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig

real_write_file = checkpointer.write_file
def slow_write_file(*args, **kwargs):  # still writing when the script returns
    time.sleep(0.5)
    return real_write_file(*args, **kwargs)
checkpointer.write_file = slow_write_file

root = sys.argv[1]
torch.manual_seed(0)
state = {"w": torch.randn(1 << 20), "b": torch.randn(1000).to(torch.bfloat16), "step": 7}
ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.05))
ck.begin(root + "/final", tag="final", pointer=Pointer(root + "/latest", "final"))
ck.save(state, root + "/final/model.pt")
ck.end()
ck.fence()  # as before an optimizer step: the lazy copies are done, training may go on
torch.save(state, root + "/expected.pt")
state["w"].zero_()
print("returning", flush=True)
"""


def test_script_that_returns_right_after_saving_commits_its_last_checkpoint(tmp_path, repo_env):
    # The usual end of a training script: save, then return. The interpreter's exit must let
    # the save finish (not refuse its writes as Python's thread pools shut down) and commit it.
    root = str(tmp_path)
    out = run_script(EXIT_SCRIPT, repo_env, root)
    assert out.returncode == 0, out.stderr
    assert "not committed" not in out.stderr, out.stderr
    assert "returning" in out.stdout
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "final"
    verify_checkpoint(os.path.join(root, "final"))
    assert_same(torch.load(os.path.join(root, "final", "model.pt"), weights_only=True),
                torch.load(os.path.join(root, "expected.pt"), weights_only=True), "at exit")


THREAD_EXIT_SCRIPT = """
import os, sys, threading, time, torch
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.commit import Pointer
root = sys.argv[1]
ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
entered = threading.Event()
def train():  # the training loop in a non-daemon thread; the main thread returns
    try:
        d = os.path.join(root, "t0")
        ck.begin(d, tag="t0", pointer=Pointer(os.path.join(root, "latest"), "t0"))
        ck.save({"w": torch.ones(1024)}, os.path.join(d, "model.pt"))
        entered.set()
        time.sleep(0.5)  # the framework's save goes on
        ck.end(); ck.fence(); ck.wait()
    except BaseException as exc:
        print(f"trainer: {type(exc).__name__}: {exc}", flush=True)
threading.Thread(target=train).start()
entered.wait()
"""


def test_the_exit_flush_waits_for_a_training_thread_still_saving(tmp_path, repo_env):
    """Training in a non-daemon thread, the main thread returning: Python runs the exit
    flush before it joins that thread, so the flush joins the thread that began the open save
    first. Closing the checkpointer under the save being made would fail it (``end() without
    begin()``) with nothing committed."""
    out = run_script(THREAD_EXIT_SCRIPT, repo_env, str(tmp_path))
    assert out.returncode == 0 and "trainer:" not in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "latest").read_text() == "t0"
    verify_checkpoint(str(tmp_path / "t0"))


THREAD_BETWEEN_SAVES_SCRIPT = """
import os, sys, threading, time, torch
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.commit import Pointer
root, slow_begin = sys.argv[1], sys.argv[2] == "slow_begin"
ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
if slow_begin:  # begin's collective waits for the slowest rank
    exchange = ck._session.exchange
    ck._session.exchange = lambda *a, **k: (time.sleep(1.0), exchange(*a, **k))[1]
first = threading.Event()
def save(tag):
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    ck.save({"w": torch.full((1024,), float(len(tag)))}, os.path.join(d, "model.pt"))
    ck.end(); ck.fence()
def train():  # a non-daemon training thread: one save, more steps, a last save
    try:
        if slow_begin:
            first.set()
        else:
            save("s1"); first.set(); time.sleep(1.0)
        save("s22")
    except BaseException as exc:
        print(f"trainer: {type(exc).__name__}: {exc}", flush=True)
threading.Thread(target=train).start()
first.wait()
"""


@pytest.mark.parametrize("when", ["between_saves", "slow_begin"])
def test_the_exit_flush_waits_for_a_training_thread_between_saves_or_in_begin(tmp_path, repo_env, when):
    """The flush waits for the training thread also when no save is open: between two saves,
    or inside ``begin``'s collective. It joins the thread, as Python does right after (a
    ``concurrent.futures`` worker, which stops only after the flush, only while its save is
    being made). Closing the checkpointer then would refuse the thread's last save ("the
    checkpointer is closed"), or fail it in ``end`` with a bare ``RuntimeError`` leaving a
    partial directory, while the process exits 0."""
    out = run_script(THREAD_BETWEEN_SAVES_SCRIPT, repo_env, str(tmp_path), when)
    assert out.returncode == 0 and "trainer:" not in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "latest").read_text() == "s22"
    verify_checkpoint(str(tmp_path / "s22"))
    assert torch.equal(torch.load(tmp_path / "s22" / "model.pt")["w"], torch.full((1024,), 3.0))


POOL_EXIT_SCRIPT = """
import sys, torch
from concurrent.futures import ThreadPoolExecutor
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.commit import Pointer
root = sys.argv[1]
ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
twice = sys.argv[2:] == ["twice"]  # the save raises between begin and end: saved twice
def save():
    ck.begin(root + "/t0", tag="t0", pointer=Pointer(root + "/latest", "t0"))
    ck.save({"w": torch.ones(16)}, root + "/t0/model.pt")
    if twice:
        ck.save({"w": torch.ones(16)}, root + "/t0/model.pt")
    ck.end()
pool = ThreadPoolExecutor(1)
try:
    pool.submit(save).result()  # the pool's worker stays, idle, until exit
except ValueError as exc:
    print("raised in the worker:", exc, flush=True)
print("returning", flush=True)
"""


def test_saves_from_an_idle_pool_worker_do_not_hold_up_the_exit(tmp_path, repo_env):
    """The exit flush waiting for the training thread must not wait for a pool worker that
    saved earlier and now idles: concurrent.futures stops it only after our hook."""
    out = run_script(POOL_EXIT_SCRIPT, repo_env, str(tmp_path), timeout=60)
    assert out.returncode == 0 and "returning" in out.stdout, out.stderr
    assert (tmp_path / "latest").read_text() == "t0"


def test_a_save_that_raised_in_a_pool_worker_does_not_hang_the_exit(tmp_path, repo_env):
    """A save that raised between begin and end in a ``concurrent.futures`` worker left the
    save open, the worker idle: the exit flush waited for it to end, for ever. It waits only
    while the worker runs a task; the save is abandoned."""
    out = run_script(POOL_EXIT_SCRIPT, repo_env, str(tmp_path), "twice", timeout=60)
    assert out.returncode == 0 and "returning" in out.stdout, (out.stdout, out.stderr[-3000:])
    assert "raised in the worker" in out.stdout
    assert not (tmp_path / "latest").exists()


def test_a_checkpointer_made_in_a_child_forked_after_cuda_init_does_without_cuda(tmp_path, monkeypatch):
    """In a child forked after its parent initialized CUDA every CUDA call raises ("Cannot
    re-initialize CUDA in forked subprocess"), yet ``torch.cuda.is_available()`` is still
    true: making a checkpointer there raised (seen on an H100, in the test above). It now
    stages without CUDA. Here the GPU and the bad fork are faked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    ck = make()
    assert not ck.pool.pin and not ck._files.stager.use_cuda
    save_one(ck, str(tmp_path), sample_state())
    ck.fence()
    ck.wait()
    ck.close()
    assert_same(torch.load(tmp_path / "t1" / "model.pt", weights_only=True), sample_state())


FORK_SCRIPT = """
import multiprocessing, os, sys, threading, time, torch
import deepspeed_async_ckpt.persist.writer as checkpointer
from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig

child_gone = threading.Event()
real_write_file = checkpointer.write_file
def held_write_file(*args, **kwargs):  # the save stays in flight until the child has exited:
    child_gone.wait(30)                # a child waiting for the commit never exits (no timing)
    return real_write_file(*args, **kwargs)
checkpointer.write_file = held_write_file

def child():  # a DataLoader worker's life: some work, then return
    pass

def main(root, how):
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.05))
    ck.begin(root + "/t1", tag="t1", pointer=Pointer(root + "/latest", "t1"))
    ck.save({"w": torch.randn(1 << 16)}, root + "/t1/model.pt")
    ck.end()
    t0 = time.perf_counter()
    if how == "multiprocessing":
        p = multiprocessing.get_context("fork").Process(target=child, daemon=True)  # as DataLoader's
        p.start()
        p.join(10)
        code = p.exitcode
    else:
        pid = os.fork()
        if pid == 0:  # a plain fork whose child exits through the interpreter
            try:
                ck.wait()
            except Exception as exc:
                print("child:", type(exc).__name__, exc, flush=True)
            sys.exit(0)
        for _ in range(100):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            code = None
    child_gone.set()
    print(f"child exit {code} after {time.perf_counter() - t0:.2f} s", flush=True)
    ck.wait()
    ck.close()

main(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("how", ["multiprocessing", "os.fork"])
def test_a_child_forked_during_a_save_exits_at_once_and_the_parent_commits(tmp_path, repo_env, how):
    """A DataLoader worker forked while a save was in flight inherited the exit flush: at its
    exit it waited for the parent's commit, which no thread of the child would ever make (a
    DataLoader waited 5 s per worker and killed it; a plain fork never exited). In the child
    the checkpointer is closed: using it raises, it never hangs."""
    import re
    root = str(tmp_path)
    out = run_script(FORK_SCRIPT, repo_env, root, how)
    assert out.returncode == 0, out.stderr
    found = re.search(r"child exit (\S+) after ([0-9.]+) s", out.stdout)
    assert found and found.group(1) == "0", out.stdout + out.stderr  # "None": killed after 10 s
    if how == "os.fork":
        assert "child: AsyncCheckpointError" in out.stdout and "fork" in out.stdout, out.stdout
    assert (tmp_path / "latest").read_text() == "t1"
    verify_checkpoint(os.path.join(root, "t1"))
