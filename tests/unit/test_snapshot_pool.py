"""The host buffer pool (``deepspeed_async_ckpt.snapshot.pool`` and ``pinned``): its bound,
reuse, reservation, huge pages, pinning with ``cudaHostRegister`` faked."""

import os
import threading
import types
from types import SimpleNamespace

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import SnapshotError
from deepspeed_async_ckpt.snapshot import HostBufferPool

from _compare import assert_same

from fakes import SlowStorage
from helpers import make, save_one


def test_the_pool_estimate_counts_dense_tensors_and_passes_over_sparse_ones():
    """A sparse buffer in the module made the DeepSpeed plugin's estimate raise (a sparse
    tensor has no ``data_ptr``), and the pool was then not sized ahead of the first save.
    Its parts are copied at save time, outside the pool: it counts nothing."""
    from deepspeed_async_ckpt.integrations.deepspeed.engine import checkpoint_bytes_estimate
    from deepspeed_async_ckpt.storage import aligned_size

    module = torch.nn.Linear(100, 10)
    module.register_buffer("mask", torch.eye(10).to_sparse())
    engine = types.SimpleNamespace(module=module, optimizer=None, save_non_zero_checkpoint=True,
                                   zero_optimization=lambda: False)
    assert checkpoint_bytes_estimate(engine) == aligned_size(1000 * 4) + aligned_size(10 * 4)


def test_pool_smaller_than_state_streams_and_buffers_are_reused(tmp_path, caplog):
    big = {"module": {f"p{i}": torch.randn(64, 1024) for i in range(8)}}  # 8 x 256 KiB = 2 MiB
    cap_gb = 600 * 1024 / 1024**3  # 600 KiB: at most 2 records in flight
    ck = make(gb=cap_gb)
    with caplog.at_level("WARNING", logger="deepspeed_async_ckpt.core"):
        for step in range(3):
            save_one(ck, str(tmp_path), big, tag=f"s{step}")
            ck.fence()
            ck.wait()
            if step == 0:
                first_allocs = ck.pool.allocations
    # said once, with what to set: training waits for the writes the pool cannot hold
    said = [r.getMessage() for r in caplog.records if "host_buffer_gb" in r.getMessage()]
    assert len(said) == 1, said
    assert f"rank 0 stages 0.00195 GiB per save but async_checkpoint.host_buffer_gb is {cap_gb:g}" in said[0]
    assert "set host_buffer_gb to at least 0.01 " in said[0]
    assert ck.pool.peak_bytes <= ck.pool.capacity_bytes
    assert ck.pool.allocations == first_allocs  # allocated once, reused by later saves
    assert_same(torch.load(tmp_path / "s2" / "model.pt"), big)
    ck.close()


def test_tensor_larger_than_pool_is_a_clear_error(tmp_path):
    ck = make(gb=2**-18)  # one page, the least allowed
    # the message names the file, the record, its shape and dtype, and the key to raise;
    # the save that adds it refuses it (tests/test_pool_too_small.py)
    with pytest.raises(SnapshotError, match=r"model\.pt: tensor record 0 \(2048,\) torch\.float32 .*host_buffer_gb"):
        save_one(ck, str(tmp_path), {"module": {"w": torch.zeros(2048)}}, eager=())
    ck.end(commit=False)
    ck.close()


def test_pool_blocks_until_release():
    page = 4096
    pool = HostBufferPool(10 * page, pin=False)
    a = pool.acquire(6 * page - 5, "a")
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(6 * page - 5, "b")))
    t.start()
    t.join(0.2)
    assert not got  # backpressure: waits for room
    pool.release(a)
    t.join(5)
    assert got and got[0].numel() == 6 * page - 5
    assert got[0].data_ptr() % page == 0  # buffers start on a page (direct I/O)
    assert pool.allocations == 1  # the released buffer was reused


def test_pool_ring_never_hands_out_overlapping_buffers():
    import queue
    import random

    pool = HostBufferPool(40 * 4096, pin=False)
    handed: queue.SimpleQueue = queue.SimpleQueue()
    lock = threading.Lock()
    live: list[torch.Tensor] = []
    errors: list[str] = []

    def copier():  # acquires like the stager: blocking, any size up to the capacity
        rng = random.Random(1)
        for _ in range(1500):
            want = rng.randrange(1, 12 * 4096)
            buf = pool.acquire(want, "t", expected_bytes=rng.randrange(0, 24 * 4096))
            with lock:
                spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in live + [buf])
                if any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
                    errors.append(f"overlap handing out {want} bytes")
                buf.fill_(want % 251)
                live.append(buf)
            handed.put(buf)
        handed.put(None)

    t = threading.Thread(target=copier)
    t.start()
    rng = random.Random(2)
    mine: list[torch.Tensor] = []
    done = False
    while not (done and not mine):
        if not done:
            try:
                buf = handed.get(timeout=0.005)
                if buf is None:
                    done = True
                else:
                    mine.append(buf)
            except queue.Empty:
                pass
        if mine and (done or rng.random() < 0.4 or handed.empty()):
            # writers release mostly in order, sometimes out of order (several files)
            buf = mine.pop(0 if rng.random() < 0.8 else rng.randrange(len(mine)))
            with lock:
                if not torch.all(buf == buf.numel() % 251):
                    errors.append("a live buffer was overwritten")
                live[:] = [b for b in live if b is not buf]
            pool.release(buf)
    t.join(10)
    assert not t.is_alive() and not errors
    assert pool.peak_bytes <= pool.capacity_bytes


def test_second_save_allocates_nothing_one_block_per_file(tmp_path, caplog):
    model = {"module": {f"p{i}": torch.randn(64, 64 + i) for i in range(20)}}
    optim = {"optimizer": {f"m{i}": torch.randn(64, 64 + i) for i in range(20)}}
    ck = make(gb=0.1)
    caplog.set_level("WARNING", logger="deepspeed_async_ckpt.core")
    for step in range(3):
        d = tmp_path / f"s{step}"
        ck.begin(str(d), tag=f"s{step}")
        ck.save(model, str(d / "model.pt"))
        ck.save(optim, str(d / "optim.pt"))
        ck.end()
        ck.fence()
        ck.wait()
        if step == 0:
            assert ck.pool.allocations == 1  # one block for the whole save, not one per tensor
            first = ck.pool.allocations
    assert ck.pool.allocations == first  # later saves reuse the blocks
    assert_same(torch.load(tmp_path / "s2" / "optim.pt"), optim)
    assert "host_buffer_gb" not in caplog.text  # the saves fit the pool: nothing to say
    ck.close()


def test_reserve_faults_the_pool_in_ahead_of_the_first_save(tmp_path, monkeypatch):
    from deepspeed_async_ckpt.snapshot import pool as pool_module
    from deepspeed_async_ckpt.storage import aligned_size

    model = {"module": {f"p{i}": torch.randn(64, 64 + i) for i in range(20)}}
    need = sum(aligned_size(t.numel() * 4) for t in model["module"].values())
    ck = make(gb=0.1)
    # The first save starts while the reservation is still faulting its block in: the copier
    # waits for that block instead of allocating a second one.
    faulting, go_on = threading.Event(), threading.Event()
    real_block = pool_module.HostBlock

    def slow_block(nbytes, pin, **kwargs):
        faulting.set()
        assert go_on.wait(10)
        return real_block(nbytes, pin, **kwargs)

    monkeypatch.setattr(pool_module, "HostBlock", slow_block)
    thread = ck.reserve(need)
    assert faulting.wait(10)
    assert ck.reserve(need) is None  # one reservation at a time
    monkeypatch.setattr(pool_module, "HostBlock", real_block)
    save_one(ck, str(tmp_path), model, eager=())
    go_on.set()
    thread.join(10)
    ck.fence()
    ck.wait()
    assert ck.pool.allocations == 1 and ck.pool.held_bytes == need
    assert_same(torch.load(tmp_path / "t1" / "model.pt")["module"], model["module"])
    assert ck.reserve(need) is None  # the pool already holds memory
    ck.close()
    # capped at the pool's capacity; an allocation failure leaves the first save to allocate
    pool = HostBufferPool(10 * 4096 + 100, pin=False)
    pool.reserve(10**9).join()
    assert pool.held_bytes == 10 * 4096
    broken = HostBufferPool(10 * 4096, pin=False)
    monkeypatch.setattr(pool_module, "HostBlock", lambda n, pin, **kwargs: (_ for _ in ()).throw(MemoryError("no")))
    broken.reserve(4096).join()
    assert isinstance(broken.reserve_error, MemoryError) and broken.held_bytes == 0
    monkeypatch.setattr(pool_module, "HostBlock", real_block)
    buf = broken.acquire(4096, "x")  # allocates on demand as before
    assert broken.allocations == 1
    broken.release(buf)


def test_pinned_pool_pins_exactly_its_blocks_and_unpins_what_it_drops(monkeypatch, caplog):
    """With CUDA, the pool page-locks its own mappings (``cudaHostRegister``, faked here) instead
    of taking torch's pinned allocator's blocks, which are rounded up to a power of two and kept
    pinned after they are freed: the pinned bytes are the blocks' bytes exactly, on the pool's
    device, never more than the capacity, and a replaced block is unpinned before the next.
    A block dropped with its pool is unpinned too, before it is unmapped: memory unmapped while
    registered made a later plain ``tensor.cpu()`` into pageable memory at the same addresses
    fail with "CUDA error: invalid argument" on an H100."""
    import gc

    from deepspeed_async_ckpt.snapshot import pinned as pinned_memory
    from deepspeed_async_ckpt.storage import host_buffer

    page = 4096
    pinned: dict[int, tuple[int, int]] = {}  # address -> (bytes, device)
    most = [0]

    def lock(address, nbytes, device):
        assert address % page == 0 and address not in pinned
        pinned[address] = (nbytes, device)
        most[0] = max(most[0], sum(n for n, _ in pinned.values()))

    def unlock(address, device):
        assert pinned.pop(address)[1] == device  # once, on its device

    monkeypatch.setattr(pinned_memory, "_page_lock", lock)
    monkeypatch.setattr(pinned_memory, "_page_unlock", unlock)
    pool = HostBufferPool(100 * page, pin=True, device=3)
    a = pool.acquire(5 * page, "a", expected_bytes=31 * page)  # torch's allocator: 32 pages
    assert list(pinned.values()) == [(31 * page, 3)]
    pool.release(a)
    b = pool.acquire(60 * page, "b", expected_bytes=70 * page)  # the idle block is too small
    assert list(pinned.values()) == [(70 * page, 3)]  # torch's: 128 pages, and 32 still cached
    assert most[0] == 70 * page <= pool.capacity_bytes
    assert pool.allocations == 2 and pool.held_bytes == 70 * page
    pool.release(b)
    # the reservation pins on the pool's device too (it runs on its own thread)
    reserved = HostBufferPool(100 * page, pin=True, device=1)
    reserved.reserve(10 * page).join()
    assert reserved.reserve_error is None and sorted(pinned.values()) == [(10 * page, 1), (70 * page, 3)]
    # where registering fails, the block still comes pinned, from torch's allocator, said once
    monkeypatch.setattr(pinned_memory, "_page_lock", lambda address, nbytes, device: (_ for _ in ()).throw(
        RuntimeError("CUDA error: out of memory")))
    fallback = []
    monkeypatch.setattr(pinned_memory, "_torch_pinned", lambda n: fallback.append(n) or torch.frombuffer(
        host_buffer(n), dtype=torch.uint8))
    other = HostBufferPool(100 * page, pin=True, device=0)
    with caplog.at_level("WARNING", logger="deepspeed_async_ckpt.snapshot"):
        c = other.acquire(3 * page, "c")
    assert fallback == [3 * page] and c.numel() == 3 * page
    assert other._blocks[0]._mapping.closed  # the mapping it could not register is given back
    assert "cudaHostRegister of 12288 bytes failed (CUDA error: out of memory)" in caplog.text
    other.release(c)
    other.acquire(50 * page, "d")  # replacing a block that was never registered unpins nothing
    assert sorted(pinned.values()) == [(10 * page, 1), (70 * page, 3)]
    # pools dropped (a checkpointer closed and collected): their blocks are unpinned, once,
    # when the last view of their memory goes (``b`` still views the 70-page block)
    del pool, reserved, other, a, c
    gc.collect()
    assert list(pinned.values()) == [(70 * page, 3)]
    del b
    gc.collect()
    assert pinned == {}


def _mapping_of(address: int, smaps: str = "/proc/self/smaps") -> dict | None:
    """The ``smaps`` fields (kB) of the mapping that holds ``address``, or None."""
    import re

    found = None
    for line in open(smaps):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            found = {} if lo <= address < hi else None
        elif found is not None and line.startswith("VmFlags"):
            break  # the last field of a mapping
        elif found is not None and line.split()[-1] == "kB":
            found[line.split(":")[0]] = int(line.split()[1])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_host_pool_is_huge_pages_and_not_inherited_by_fork():
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip(f"transparent huge pages are off on this machine ({thp})")
    pool = HostBufferPool(64 << 20, pin=False)
    pool.reserve(64 << 20).join()  # faulted in by the reserve thread, as in training
    buf = pool.acquire(32 << 20, "x")
    address = buf.data_ptr()
    fields = _mapping_of(address)
    assert fields is not None and fields["Rss"] >= 32 << 10
    # most of the block in 2 MiB pages (an unaligned head or tail may not be)
    assert fields["AnonHugePages"] >= 60 << 10, fields
    pid = os.fork()
    if pid == 0:  # the child (a forked data-loader worker, say) does not map the pool
        os._exit(0 if _mapping_of(address) is None else 1)
    assert os.waitpid(pid, 0)[1] == 0, "the pool's mapping was inherited by a forked child"
    pool.release(buf)


def test_a_reservation_whose_thread_cannot_start_leaves_the_first_save_to_allocate(monkeypatch):
    """``reserve`` marked the pool as being reserved before it started its thread; a thread
    that could not start ("can't start new thread") left that mark, and every save then
    waited for a block that never came."""
    pool = HostBufferPool(1 << 20, pin=False)
    start = threading.Thread.start

    def cannot_start(self):
        if self.name == "async-ckpt-reserve":
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool.reserve(1 << 16)
    assert isinstance(pool.reserve_error, RuntimeError)
    done = threading.Event()
    threading.Thread(target=lambda: (pool.acquire(4096, "w"), done.set()), daemon=True).start()
    assert done.wait(10)


def test_eager_copies_of_saves_in_flight_are_bounded_by_the_pool_size(tmp_path):
    """Eager copies (``client_state``, module buffers) are made outside the pool, so a save
    whose eager copies would take the earlier saves' over ``host_buffer_gb`` waits in
    ``save`` for them to be written; every checkpoint still holds its own values. Unbounded,
    saves every step against a slow disk pile up one host copy per save (12 in flight,
    +231 MB)."""
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01),
                           storage=SlowStorage(0.1))
    per_save = 4 * 2**20  # two fit in the 10.7 MB bound, not three
    handles, in_flight = [], []
    for step in range(6):
        d = str(tmp_path / f"s{step}")
        ck.begin(d, tag=f"s{step}", pointer=Pointer(str(tmp_path / "latest"), f"s{step}"))
        ck.save({"client": torch.full((per_save // 4,), float(step))}, os.path.join(d, "m.pt"),
                eager_keys=("client",))
        handles.append(ck.end())
        in_flight.append(sum(not h.wait_persisted(0) for h in handles))
        ck.fence()
    ck.wait()
    # two saves' copies fit in the bound; one more save may be in flight whose copies were
    # released (its files written) and whose directories are being synced
    assert max(in_flight) <= ck.pool.capacity_bytes // per_save + 1, in_flight
    assert sum(h.eager_wait_s for h in handles) > 0.1
    for step, h in enumerate(handles):
        assert h.committed
        assert torch.load(os.path.join(h.ckpt_dir, "m.pt"))["client"].eq(step).all()
    ck.close()


def test_a_failed_registration_clears_the_error_it_leaves_before_raising(monkeypatch):
    """A failed ``cudaHostRegister`` (handled: the pool falls back to torch's pinned
    allocator) also sets the thread's CUDA last error, which torch's next kernel-launch check
    on that thread would raise as its own; it is read (cleared) before the failure is raised,
    and a successful call clears nothing. The CUDA calls are faked here; the GPU test below
    makes a registration fail for real."""
    from deepspeed_async_ckpt.snapshot import pinned

    cleared = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaError=SimpleNamespace(success=0)))
    monkeypatch.setattr(pinned, "_cuda_runtime", lambda: SimpleNamespace(cudaGetLastError=lambda: cleared.append(1)))

    def check_error(code):
        if code:
            raise RuntimeError(f"CUDA error {code} (cleared {len(cleared)})")

    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    pinned._checked(0)
    assert cleared == []
    with pytest.raises(RuntimeError, match=r"CUDA error 712 \(cleared 1\)"):
        pinned._checked(712)


def test_a_reservation_larger_than_the_idle_pool_replaces_its_block():
    """A reservation from a low estimate (before the optimizer's first step) is replaced by a
    larger one, within the capacity: the pool then holds one block of the larger size; a
    reservation the pool covers, or one while a buffer is out, does nothing."""
    page = 4096
    pool = HostBufferPool(100 * page, pin=False)
    pool.reserve(10 * page).join()
    assert (pool.allocations, pool.held_bytes) == (1, 10 * page)
    assert pool.reserve(8 * page) is None and pool.held_bytes == 10 * page
    pool.reserve(60 * page).join()
    assert (pool.allocations, pool.held_bytes, len(pool._blocks)) == (2, 60 * page, 1)
    buf = pool.acquire(page, "x")
    assert pool.reserve(80 * page) is None  # a save is using the block: left alone
    pool.release(buf)


def test_deepspeed_estimate_before_the_first_step_counts_the_optimizer_state_to_come():
    """At initialize the optimizer has no state yet; the estimate counts what its first step
    creates (Adam: two moments per parameter and a step tensor), so it equals the estimate
    made from the live state after that step: the pool reserved early needs no second block."""
    from types import SimpleNamespace

    from deepspeed_async_ckpt.integrations.deepspeed.engine import checkpoint_bytes_estimate

    for opt_cls, kwargs in ((torch.optim.Adam, {}), (torch.optim.AdamW, {"amsgrad": True}),
                            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
        opt = opt_cls(model.parameters(), **kwargs)
        ds = SimpleNamespace(module=model, optimizer=opt, save_non_zero_checkpoint=True,
                             zero_optimization=lambda: False)
        before = checkpoint_bytes_estimate(ds)
        model(torch.randn(4, 300)).sum().backward()
        opt.step()
        assert before == checkpoint_bytes_estimate(ds), opt_cls
        assert before > 2 * sum(p.numel() * 4 for p in model.parameters())


_FIRST_SAVE_SCRIPT = r"""
import json, os, sys
import torch, deepspeed
from deepspeed_async_ckpt.integrations.activation import install
install()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
       "async_checkpoint": {"enabled": True, "host_buffer_gb": 0.05}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
ours = engine.checkpoint_engine
out = {"started_at_initialize": ours.reservation is not None}
if ours.reservation is not None:
    ours.reservation.join()
pool = ours.checkpointer.pool
out["after_initialize"] = [pool.allocations, pool.held_bytes]
loss = engine(torch.randn(2, 256)).pow(2).mean()
engine.backward(loss)
engine.step()
if ours.reservation is not None:
    ours.reservation.join()
out["after_step"] = [pool.allocations, pool.held_bytes]
engine.save_checkpoint(sys.argv[1], tag="t1")
expect = {k: v.clone() for k, v in engine.module.state_dict().items()}
ours.checkpointer.wait()
out["after_save"] = [pool.allocations, pool.held_bytes, ours.checkpointer.pooled_bytes]
saved = torch.load(os.path.join(sys.argv[1], "t1", "mp_rank_00_model_states.pt"), weights_only=False)
out["same"] = all(torch.equal(saved["module"][k], v) for k, v in expect.items())
engine.destroy()
print("RESULT " + json.dumps(out))
"""


def test_deepspeed_reserves_the_pool_at_initialize_and_the_first_save_allocates_nothing(tmp_path, repo_env):
    """``deepspeed.initialize`` starts faulting the host pool in (before any step), from an
    estimate that covers the first save: the first optimizer step grows nothing, and the first
    save, right after it, takes its staging from that block (``pool.allocations`` stays 1),
    writing the model's weights as they were."""
    import json

    from helpers import run_script

    env = dict(repo_env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = run_script(_FIRST_SAVE_SCRIPT, env, str(tmp_path / "ckpt"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["started_at_initialize"], out
    allocations, held = out["after_initialize"]
    assert allocations == 1 and out["after_step"] == [1, held], out
    assert out["after_save"][:2] == [1, held] and out["after_save"][2] <= held, out
    assert out["same"], out
