"""A tensor record larger than the whole host staging pool (``host_buffer_gb``): refused by the
``save`` that adds it, before anything of the save is staged, naming the record and the
smallest ``host_buffer_gb`` that holds it; the last committed checkpoint stays as it was."""

import os

import pytest
import torch

from deepspeed_async_ckpt.commit import Pointer, verify_checkpoint
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.core.files import smallest_host_buffer_gb
from deepspeed_async_ckpt.errors import SnapshotError

POOL_GB = 64 * 1024 / 1024**3  # 64 KiB
BIG = 40 * 1024  # float32 elements: a 160 KiB record


def make(mode, gb=POOL_GB):
    return AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=gb))


def begin(ck, root, tag):
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    return d


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_record_larger_than_the_pool_is_refused_by_save_and_the_last_checkpoint_stays(tmp_path, mode):
    root = str(tmp_path)
    ck = make(mode)
    d = begin(ck, root, "t1")
    ck.save({"w": torch.ones(1024)}, os.path.join(d, "model.pt"), eager_keys=())
    ck.end()
    ck.wait()
    staged_before = ck._files.stager.staged_bytes

    d = begin(ck, root, "t2")
    ck.save({"small": torch.ones(16)}, os.path.join(d, "model.pt"), eager_keys=())
    with pytest.raises(SnapshotError) as raised:
        ck.save({"m": torch.zeros(8), "big": torch.zeros(BIG)}, os.path.join(d, "optim_states.pt"),
                eager_keys=())
    message = str(raised.value)
    # names the file and the record, its size, the pool's, and the smallest setting that works
    assert os.path.join("t2", "optim_states.pt") + ": tensor record 1 (40960,) torch.float32" in message
    assert f"needs {BIG * 4} bytes" in message and f"({ck.pool.capacity_bytes} bytes)" in message
    assert "Nothing of this save was staged" in message
    assert "set host_buffer_gb to at least 0.01" in message
    if mode == "async":  # refused before its copies were queued (sync mode stages as it writes)
        assert ck._files.stager.staged_bytes == staged_before
    ck.end(commit=False)  # what an adapter does when the framework's save raised
    ck.wait()  # nothing failed in the background: the refusal was the whole story
    assert (tmp_path / "latest").read_text() == "t1"
    verify_checkpoint(os.path.join(root, "t1"))
    # the pool is unchanged: a save that fits commits
    d = begin(ck, root, "t3")
    ck.save({"w": torch.full((1024,), 3.0)}, os.path.join(d, "model.pt"), eager_keys=())
    ck.end()
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "t3"
    verify_checkpoint(os.path.join(root, "t3"))


def test_the_host_buffer_gb_the_refusal_suggests_holds_the_record(tmp_path):
    state = {"big": torch.arange(BIG, dtype=torch.float32)}
    with pytest.raises(SnapshotError, match=r"at least ([0-9.]+)$") as raised:
        ck = make("async")
        d = begin(ck, str(tmp_path), "t1")
        try:
            ck.save(state, os.path.join(d, "model.pt"), eager_keys=())
        finally:
            ck.end(commit=False)
            ck.close()
    suggested = float(str(raised.value).rsplit(" ", 1)[1])
    ck = make("async", gb=suggested)
    d = begin(ck, str(tmp_path), "t2")
    ck.save(state, os.path.join(d, "model.pt"), eager_keys=())
    ck.end()
    ck.wait()
    ck.close()
    assert torch.equal(torch.load(os.path.join(d, "model.pt"))["big"], state["big"])


def test_eager_records_are_copied_outside_the_pool_in_async_mode_and_not_refused(tmp_path):
    ck = make("async")
    d = begin(ck, str(tmp_path), "t1")
    ck.save({"client": torch.ones(BIG)}, os.path.join(d, "model.pt"), eager_keys=("client",))
    ck.end()
    ck.wait()
    ck.close()
    assert (tmp_path / "latest").read_text() == "t1"


@pytest.mark.parametrize("nbytes", [1, 4096, 10_737_418, 10_737_419, 16_400_384, 75_161_928, 2**30, 2**30 + 1])
def test_smallest_host_buffer_gb_is_the_least_hundredth_whose_pool_holds_the_bytes(nbytes):
    gb = smallest_host_buffer_gb(nbytes)
    assert int(AsyncCheckpointConfig(enabled=True, host_buffer_gb=gb).host_buffer_bytes) >= nbytes
    assert gb <= 0.01 or int((gb - 0.01) * 2**30) < nbytes
