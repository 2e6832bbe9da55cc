"""Persistence in a worker process (``persist_in: "process"``): the same bytes as the writer
threads, a worker killed mid-save, and how long background persistence keeps the training
thread from the GIL."""

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import AsyncCheckpointError
from deepspeed_async_ckpt.persist import process as process_module
from deepspeed_async_ckpt.persist import write_file
from deepspeed_async_ckpt.snapshot import plan_file
from deepspeed_async_ckpt.storage import LocalStorage


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"layers": [torch.randn(64, 1024, generator=g) for _ in range(6)],  # 256 KiB each
            "bias": torch.randn(1000, generator=g).to(torch.bfloat16), "empty": torch.empty(0),
            "step": 7, "rng": torch.arange(10)}


def _save(ck: AsyncCheckpointer, root: str, tag: str, seed: int = 0) -> str:
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    ck.save(_state(seed), os.path.join(d, "model.pt"), eager_keys=["rng"])
    ck.save_packed(os.path.join(d, "items.distcp"),
                   [("a", {"x": torch.full((3000,), 2.0)}), ("b", {"y": torch.zeros(5)})])
    ck.end()
    return d


def _digests(d: str) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(d, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(d)) if not name.startswith(".")}


def _checkpointer(**config) -> AsyncCheckpointer:
    # a pool smaller than model.pt (1.5 MiB): records stream through it as the worker frees them
    return AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=1 / 1024, **config))


def test_files_written_by_the_worker_process_equal_the_writer_threads_in_both_modes(tmp_path):
    """One state saved by the writer threads and by the worker process, asynchronously and
    synchronously, with a pool smaller than the file: byte for byte the same files."""
    seen = {}
    for persist_in in ("thread", "process"):
        for mode in ("async", "sync"):
            ck = _checkpointer(persist_in=persist_in, mode=mode)
            try:
                d = _save(ck, str(tmp_path / f"{persist_in}-{mode}"), "t")
                ck.wait()
                assert not ck.pool._live  # every buffer came back
            finally:
                ck.close()
            seen[persist_in, mode] = _digests(d)
    assert set(seen[("thread", "async")]) == {"model.pt", "items.distcp"}
    assert all(v == seen[("thread", "async")] for v in seen.values()), seen
    loaded = torch.load(str(tmp_path / "process-async" / "t" / "model.pt"))
    assert loaded["step"] == 7 and torch.equal(loaded["layers"][5], _state()["layers"][5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_staged_into_the_pinned_shared_pool_are_written_by_the_worker(tmp_path):
    """With CUDA the shared pool is page-locked in place (``cudaHostRegister`` of the shared
    mapping) and filled by the copy stream; the worker writes the thread mode's bytes."""
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(77, device="cuda").half()}
    seen = {}
    for persist_in in ("thread", "process"):
        ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, persist_in=persist_in))
        try:
            d = str(tmp_path / persist_in)
            ck.begin(d, tag="t", pointer=Pointer(str(tmp_path / f"latest-{persist_in}"), "t"))
            ck.save(state, os.path.join(d, "gpu.pt"))
            ck.end()
            ck.fence()
            ck.wait()
            assert all(b.pinned_on is not None for b in ck.pool._blocks)
        finally:
            ck.close()
        seen[persist_in] = _digests(d)
    assert seen["thread"] == seen["process"]


def test_a_killed_worker_fails_its_save_naming_the_signal_and_the_next_save_gets_a_new_worker(
        tmp_path, monkeypatch):
    root = str(tmp_path)
    ck = _checkpointer(persist_in="process")
    try:
        _save(ck, root, "t1")
        ck.wait()
        first = ck._files._persist._worker.process

        real_staged = process_module._WorkerProcess.staged
        killed = []

        def staged_after_a_kill(self, fid, k, host):  # the worker dies holding a file
            if not killed:
                killed.append(self.process.pid)
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
            return real_staged(self, fid, k, host)

        monkeypatch.setattr(process_module._WorkerProcess, "staged", staged_after_a_kill)
        _save(ck, root, "t2", seed=1)
        with pytest.raises(AsyncCheckpointError, match=r"killed by signal SIGKILL"):
            ck.wait()
        assert killed == [first.pid]
        assert open(os.path.join(root, "latest")).read().strip() == "t1"  # still committed
        assert not ck.pool._live  # the dead worker's buffers came back to the pool

        monkeypatch.setattr(process_module._WorkerProcess, "staged", real_staged)
        d = _save(ck, root, "t3", seed=1)
        ck.wait()
        assert ck._files._persist._worker.process.pid != first.pid
        assert torch.equal(torch.load(os.path.join(d, "model.pt"))["layers"][0], _state(1)["layers"][0])
    finally:
        ck.close()
    assert ck._files._persist._worker is None  # close stopped it


EXIT_SCRIPT = """
import os, sys, torch
from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer

root = sys.argv[1]
ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.05, persist_in="process"))
d = os.path.join(root, "t")
ck.begin(d, tag="t", pointer=Pointer(os.path.join(root, "latest"), "t"))
ck.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, os.path.join(d, "w.pt"))
ck.end()
print(ck._files._persist._worker.process.pid, flush=True)
"""  # returns with the save in the worker's hands: no wait(), no close()


def test_the_exit_flush_waits_for_the_worker_then_stops_it(tmp_path, repo_env):
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], env=repo_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert open(tmp_path / "latest").read().strip() == "t"
    assert torch.equal(torch.load(tmp_path / "t" / "w.pt")["w"], torch.arange(1 << 20, dtype=torch.float32))
    worker = int(out.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):  # stopped (and reaped) by the exit flush
        os.kill(worker, 0)


def _max_gap_while(work) -> tuple[float, float]:
    """The longest time (s) this thread went without the GIL while ``work`` ran on another
    thread, and how long ``work`` took."""
    gaps = [0.0]
    done = threading.Event()

    def run():
        start = time.perf_counter()
        work()
        gaps.append(time.perf_counter() - start)
        done.set()

    worker = threading.Thread(target=run)
    last = time.perf_counter()
    worker.start()
    longest = 0.0
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    return longest, gaps[-1]


def test_background_persistence_lets_the_training_thread_have_the_gil_in_short_slices(tmp_path):
    """A writer persisting 256 MB (checksummed, fsynced) holds the GIL only in short slices:
    the training thread's longest wait for it stays a small fraction of what one copy of the
    whole buffer made under the GIL costs it (measured here as the yardstick), in both
    persistence modes. Each is the better of two runs: a long hold shows in both, while a
    moment the busy machine's scheduler took the core away rarely does."""
    # one record of 256 MiB: a writer that copied or hashed a whole record under the GIL
    # would keep the training thread out about as long as the yardstick does
    state = {"w": torch.randn(64 << 20)}
    blob = bytearray(256 << 20)
    blob[::4096] = b"\1" * len(blob[::4096])  # faulted in: the yardstick is the copy alone
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        hold, _ = _max_gap_while(lambda: bytes(blob))

        def persist_in_thread():
            plan = plan_file(state, set(), what="gil.pt")
            for item, t in zip(plan.items, state.values()):
                item.host = t.view(-1).view(torch.uint8)
                item.mark_issued()
            write_file(LocalStorage(), str(tmp_path / "gil.pt"), [plan], "xxh128")

        thread_gap = min(_max_gap_while(persist_in_thread)[0] for _ in range(2))

        ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.5,
                                                     persist_in="process"))
        tags = iter(("warm", "measured", "again"))
        try:
            def persist_in_process():
                tag = next(tags)
                d = str(tmp_path / tag)
                ck.begin(d, tag=tag, pointer=Pointer(str(tmp_path / "latest"), tag))
                ck.save(state, os.path.join(d, "gil.pt"))
                ck.end()
                ck.wait()

            persist_in_process()  # the worker's start and the pool's first allocation: not measured
            process_gap = min(_max_gap_while(persist_in_process)[0] for _ in range(2))
        finally:
            ck.close()
    finally:
        sys.setswitchinterval(switch)
    assert hold > 0.02, f"the yardstick copy took only {hold * 1e3:.1f} ms"
    assert thread_gap < hold / 5, f"writer threads: {thread_gap * 1e3:.1f} ms, yardstick {hold * 1e3:.1f} ms"
    assert process_gap < hold / 5, f"worker process: {process_gap * 1e3:.1f} ms, yardstick {hold * 1e3:.1f} ms"


class _ScriptedConnection:
    """The worker's end of its socket, scripted: ``recv`` hands out ``script`` in order
    (``bytes`` are what ``recv_bytes`` returns after a message that says bytes follow), and
    ``sent`` keeps the worker's answers."""

    def __init__(self, script):
        self._script, self.sent = list(script), []

    def recv(self):
        return self._script.pop(0)

    def recv_bytes(self):
        return self._script.pop(0)

    def send(self, msg):
        self.sent.append(msg)


def test_the_worker_writes_a_file_from_typed_messages_and_answers_with_typed_messages(tmp_path):
    """What the worker is sent and answers is the frozen dataclasses of ``persist.messages``,
    dispatched on their type: a file described, its records' bytes, then Stop give the file
    loads as the state, one ``Released`` per record and the file's record; anything else is
    refused by name."""
    import dataclasses
    import pickle

    import xxhash

    from deepspeed_async_ckpt.persist import messages
    from deepspeed_async_ckpt.persist.worker import _WriteLoop

    state = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}
    plan = plan_file(state, set(), what="model.pt")
    archive = messages.Archive(plan.pickle_bytes, tuple((i.key, i.nbytes, i.what) for i in plan.items))
    path = str(tmp_path / "model.pt")
    script = [messages.UseStorage(pickle.dumps(LocalStorage(fsync=False))),
              messages.WriteFile(0, path, (archive,), "xxh128", None, False, None)]
    for k, tensor in enumerate(state.values()):
        script += [messages.RecordBytes(0, k), tensor.numpy().tobytes()]
    conn = _ScriptedConnection(script + [messages.Stop()])
    _WriteLoop(conn).run()
    loaded = torch.load(path)
    assert sorted(loaded) == ["a", "b"] and all(torch.equal(loaded[k], state[k]) for k in state)
    released = [m for m in conn.sent if isinstance(m, messages.Released)]
    assert sorted((m.file, m.record) for m in released) == [(0, 0), (0, 1)]
    done = conn.sent[-1]
    assert isinstance(done, messages.FileWritten) and done.error is None
    data = open(path, "rb").read()
    assert (done.entry.path, done.entry.nbytes, done.entry.checksum) == \
        (path, len(data), xxhash.xxh3_128_hexdigest(data))
    for cls in vars(messages).values():
        if isinstance(cls, type) and cls.__module__ == messages.__name__:
            assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    with pytest.raises(TypeError, match=r"was sent \('stop',\), not a message of"):
        _WriteLoop(_ScriptedConnection([("stop",)])).run()
