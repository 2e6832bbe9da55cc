"""CUDA-only tests: the pinned pool, the copy stream, fences. Marked ``gpu``; each skips
with its reason where no GPU is visible."""

import os
import threading

import pytest
import torch

from deepspeed_async_ckpt.errors import PersistError, SnapshotError
from deepspeed_async_ckpt.snapshot import HostBufferPool

from helpers import make, save_one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned pool and copy stream")
def test_cuda_pinned_pool_and_copy_stream_overlap(tmp_path):
    dev = torch.device("cuda")
    state = {"module": {f"p{i}": torch.randn(1024, 1024, device=dev) for i in range(16)}}  # 64 MiB
    expected = {k: v.cpu() for k, v in state["module"].items()}
    ck = make(gb=1)
    save_one(ck, str(tmp_path), state, eager=())
    assert ck.pool.pin
    # the trainer keeps computing on the default stream while copies run on the copy stream
    x = torch.randn(4096, 4096, device=dev)
    for _ in range(10):
        x = x @ x
        x = x / x.norm()
    ck.fence()  # the default stream now waits on the copy events; the host is not blocked
    for v in state["module"].values():
        v.add_(1.0)  # the optimizer step, ordered after the copies
    ck.wait()
    loaded = torch.load(tmp_path / "t1" / "model.pt", map_location="cpu")
    for k, v in expected.items():
        assert torch.equal(loaded["module"][k], v)
    assert loaded["module"]["p0"].device.type == "cpu"
    block = ck.pool._blocks[0]  # our own mapping, page-locked in place on this device
    assert block.pinned_on == torch.cuda.current_device() and block.memory.is_pinned()
    ck.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: copy stream")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_copies_see_kernels_queued_before_the_save(tmp_path, mode):
    """The copy stream waits for what the training stream queued before the save: here a
    long chain of matmuls and then the write of the saved tensor. The sync mode copied
    without that wait (its items were staged with no ready event)."""
    dev = torch.device("cuda")
    saved = torch.zeros(16 << 20, device=dev)  # 64 MiB
    x = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    for _ in range(30):  # about 100 ms of queued work on an H100
        x = x @ x
        x = x / x.norm()
    saved.add_(1.0 + 0.0 * x[0, 0])  # runs after all of them
    ck = make(mode, gb=1)
    save_one(ck, str(tmp_path), {"module": {"w": saved}}, eager=())
    ck.fence()
    ck.wait()
    ck.close()
    loaded = torch.load(tmp_path / "t1" / "model.pt", map_location="cpu")
    assert torch.equal(loaded["module"]["w"], torch.ones(16 << 20))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: copy stream")
@pytest.mark.parametrize("change,error", [
    (lambda w: w.add_(1), "changed in place after the save"),  # no fence_all() first
    # the storage check: resize_(0) of a device storage (the process lives)
    (lambda w: w.untyped_storage().resize_(0), "storage was freed, resized or replaced after the save"),
], ids=["in_place", "storage_freed"])
def test_cuda_a_tensor_changed_before_its_copy_is_issued_fails_the_save(tmp_path, held_copier, change, error):
    """With CUDA the copy is only issued (checked then, not after): a kernel that changes the
    tensor, queued after the save and before the copier issues its copy, fails the save
    instead of reaching the file; so does its device storage freed then."""
    weight = torch.zeros(1 << 20, device="cuda")
    ck = make(gb=1)
    save_one(ck, str(tmp_path), {"w": weight}, eager=())
    change(weight)
    with pytest.raises(SnapshotError, match=error):
        ck.fence()
    with pytest.raises(PersistError):
        ck.wait()
    ck.close()
    assert not (tmp_path / "latest").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: copy stream")
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_cuda_strided_tensors_keep_their_layout_through_the_copy_stream(tmp_path, mode):
    """The CPU test of strided records above, with CUDA tensors copied by the copy stream into
    the pinned pool: a record is the storage span seen through ``as_strided``, which the copy
    reads from device memory, which only a GPU run exercises."""
    dev = torch.device("cuda")
    base = torch.arange(24, dtype=torch.float32, device=dev)
    state = {
        "mask": torch.ones(1, device=dev).expand(4_000_000),
        "t": torch.randn(512, 256, device=dev).t(),
        "cl": torch.randn(8, 16, 4, 5, device=dev).to(memory_format=torch.channels_last),
        "overlap": base.as_strided((4, 3), (2, 1), 1),
        "gaps": base[::2],
        "bf16": torch.randn(256, 128, device=dev, dtype=torch.bfloat16).t(),
    }
    expected = {k: v.cpu() for k, v in state.items()}
    ck = make(mode, gb=2**-6)  # 16 MiB: the expanded tensor's 16 MB would not have fit
    d = str(tmp_path / "t")
    ck.begin(d, tag="t")
    ck.save(state, os.path.join(d, "m.pt"), eager_keys=())
    ck.end()
    ck.fence()
    ck.wait()
    ck.close()
    ours = torch.load(os.path.join(d, "m.pt"), map_location="cpu")
    for key, value in expected.items():
        assert torch.equal(ours[key], value), key
        assert ours[key].stride() == state[key].stride() or key == "gaps", key
    assert ours["mask"].untyped_storage().nbytes() == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cudaHostRegister")
def test_cuda_a_failed_registration_leaves_no_error_for_the_next_kernel():
    """Registering memory twice fails (already registered); the next kernel launched on this
    thread, whose launch torch checks with ``cudaGetLastError``, must not raise that error."""
    from deepspeed_async_ckpt.snapshot import pinned
    from deepspeed_async_ckpt.storage import host_buffer

    mapping = host_buffer(1 << 20)
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    device = torch.cuda.current_device()
    pinned._page_lock(memory.data_ptr(), 1 << 20, device)
    try:
        with pytest.raises(RuntimeError):
            pinned._page_lock(memory.data_ptr(), 1 << 20, device)
        assert pinned._cuda_runtime() is not None  # torch's runtime, found as a shared library
        x = torch.ones(64, 32, device="cuda").t().contiguous()  # kernel launches, checked
        torch.cuda.synchronize()
        assert float(x.sum()) == 64 * 32
    finally:
        pinned._page_unlock(memory.data_ptr(), device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cudaHostRegister")
def test_cuda_pool_pins_blocks_exactly_and_unpins_dropped_ones():
    pool = HostBufferPool(64 << 20, pin=True)
    a = pool.acquire(4 << 20, "a", expected_bytes=5 << 20)
    first = pool._blocks[0]
    assert first.memory.numel() == 5 << 20 and first.memory.is_pinned()
    src = torch.randn(1 << 20, device="cuda")
    a.view(torch.float32).copy_(src, non_blocking=True)  # asynchronous into registered memory
    torch.cuda.synchronize()
    assert torch.equal(a.view(torch.float32), src.cpu())
    pool.release(a)
    b = pool.acquire(20 << 20, "b")  # the idle block is too small: unpinned and replaced
    assert not first.memory.is_pinned() and pool._blocks[0].memory.is_pinned()
    pool.release(b)
    reserved = HostBufferPool(8 << 20, pin=True)
    reserved.reserve(8 << 20).join()  # registered on the reserve thread, on this device
    assert reserved.reserve_error is None and reserved._blocks[0].memory.is_pinned()
    # pools dropped with their views: their blocks are unregistered before they are unmapped.
    # Unmapped while registered, the addresses stayed registered with the driver, and a plain
    # ``.cpu()`` into pageable memory mapped there later failed ("invalid argument", H100)
    import gc

    from deepspeed_async_ckpt.storage import host_buffer

    addresses = [blk.memory.data_ptr() for blk in pool._blocks + reserved._blocks]
    del pool, reserved, first, a, b
    gc.collect()
    cudart, codes = torch.cuda.cudart(), []
    # asked on a thread of its own: a failed call leaves that thread's last CUDA error set
    asker = threading.Thread(target=lambda: codes.extend(cudart.cudaHostUnregister(x) for x in addresses))
    asker.start()
    asker.join()
    assert codes and all(c != cudart.cudaError.success for c in codes), codes  # none still registered
    for n in (20 << 20, 8 << 20):  # pageable memory, likely at the same addresses, copies again
        page = torch.frombuffer(host_buffer(n), dtype=torch.uint8)
        page.copy_(torch.ones(n, dtype=torch.uint8, device="cuda"))
        assert bool(page.all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: copy stream")
def test_cuda_fence_does_not_block_the_host(tmp_path):
    """The fence only orders the compute stream after the copies: measured against a blocking
    copy of the same bytes in the same run."""
    import time

    dev = torch.device("cuda")
    state = {"module": {f"p{i}": torch.randn(4096, 4096, device=dev) for i in range(8)}}  # 512 MiB
    ck = make(gb=1)
    for _ in range(2):  # the first save allocates the pinned pool; time the second
        save_one(ck, str(tmp_path), state, tag="warm", eager=())
        ck.fence()
        ck.wait()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for v in state["module"].values():
        v.cpu()
    blocking_copy_s = time.perf_counter() - t0
    save_one(ck, str(tmp_path), state, tag="t2", eager=())
    time.sleep(0.001)
    t0 = time.perf_counter()
    ck.fence()
    fence_s = time.perf_counter() - t0
    ck.wait()
    assert fence_s < 0.5 * blocking_copy_s, (fence_s, blocking_copy_s)
    ck.close()
