"""What the error of a failed save says about the save directory's committed checkpoints: "the
last committed one is intact" where one is, "nothing has been committed in <dir> yet" where
none is (a disk full on the first save), wherever the error is raised."""

import errno
import os

import pytest
import torch

from deepspeed_async_ckpt.commit import META_DIR, Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.errors import AsyncCheckpointError, CommitError, Failure, PersistError
from deepspeed_async_ckpt.storage import LocalStorage

INTACT = "the last committed one is intact"


class DiskFullStorage(LocalStorage):
    """While ``full`` is set, checkpoint files (``records``: this engine's records of them
    instead) fail with ENOSPC."""

    def __init__(self, records=False):
        super().__init__(fsync=True)
        self.full, self.records = False, records

    def _check(self, path, record):
        if self.full and record == self.records:
            raise OSError(errno.ENOSPC, "No space left on device", path)

    def open_write(self, path):
        self._check(path, f"{os.sep}{META_DIR}{os.sep}" in path)
        return super().open_write(path)

    def write_small(self, path, data, **kwargs):
        self._check(path, os.path.basename(path).startswith("rank_"))
        return super().write_small(path, data, **kwargs)


def make(mode="async", **kw):
    return AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, mode=mode, host_buffer_gb=0.01), **kw)


def save(ck, root, tag):
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    ck.save({"w": torch.ones(64)}, os.path.join(d, "model.pt"), eager_keys=())
    return ck.end()


def nothing_yet(root):
    return f"nothing has been committed in {root} yet"


@pytest.mark.parametrize("raised_by", ["close", "wait", "begin"])
def test_a_disk_full_on_the_first_save_says_nothing_was_committed(tmp_path, raised_by):
    root = str(tmp_path / "ckpt")
    storage = DiskFullStorage()
    ck = make(storage=storage)
    storage.full = True
    save(ck, root, "global_step1")
    ck.history[-1].wait_committed()
    with pytest.raises(PersistError) as raised:
        if raised_by == "begin":
            ck.begin(os.path.join(root, "global_step2"), tag="global_step2")
        else:
            getattr(ck, raised_by)()
    message = str(raised.value)
    assert f"a previous checkpoint failed and was not committed ({nothing_yet(root)})" in message
    assert "No space left on device" in message and INTACT not in message
    ck.close()


def test_a_disk_full_after_a_commit_says_the_last_committed_one_is_intact(tmp_path):
    root = str(tmp_path / "ckpt")
    storage = DiskFullStorage()
    ck = make(storage=storage)
    save(ck, root, "global_step1")
    ck.wait()
    storage.full = True
    save(ck, root, "global_step2")
    with pytest.raises(PersistError, match=rf"not committed \({INTACT}\): .*No space left on device"):
        ck.close()
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step1"


def test_a_sync_save_failing_first_says_nothing_was_committed(tmp_path):
    """Its files written, its record of them fails (a file failing is raised by ``save``)."""
    root = str(tmp_path / "ckpt")
    storage = DiskFullStorage(records=True)
    ck = make("sync", storage=storage)
    storage.full = True
    with pytest.raises(PersistError) as raised:
        save(ck, root, "global_step1")
    assert f"(tag global_step1) not committed ({nothing_yet(root)})" in str(raised.value)
    storage.full = False
    save(ck, root, "global_step2")
    storage.full = True
    with pytest.raises(PersistError, match=rf"\(tag global_step3\) not committed \({INTACT}\)"):
        save(ck, root, "global_step3")
    ck.close()


def test_another_ranks_failure_reported_by_begin_says_nothing_was_committed(tmp_path):
    """Rank 0 of 2: rank 1's previous save failed, as the exchange of ``begin`` reports."""
    def exchange(value, error, key=""):
        return value, {1: Failure("PersistError", "No space left on device")}

    ck = make(rank=0, world_size=2, exchange=exchange)
    root = str(tmp_path / "ckpt")
    with pytest.raises(CommitError, match=rf"not committed \({nothing_yet(root)}\) on rank\(s\) 1"):
        ck.begin(os.path.join(root, "global_step2"), tag="global_step2")
    ck.close()


def test_a_storage_failing_to_prepare_the_first_save_says_nothing_was_committed(tmp_path):
    class Unpreparable(LocalStorage):
        def makedirs(self, path):
            raise RuntimeError("bucket gone")

    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    ck = make(storage=Unpreparable(fsync=True))
    with pytest.raises(AsyncCheckpointError, match=rf"nothing was written \({nothing_yet(root)}\): "
                                                   "RuntimeError: bucket gone"):
        ck.begin(os.path.join(root, "global_step1"), tag="global_step1")
    ck.close()


def test_a_sync_deepspeed_save_failing_on_another_rank_says_nothing_was_committed(tmp_path, monkeypatch):
    import types

    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from deepspeed_async_ckpt.integrations.deepspeed import engine as deepspeed_engine

    engine = deepspeed_engine.AsyncCheckpointEngine(
        None, AsyncCheckpointConfig(enabled=True, mode="sync", host_buffer_gb=0.01))
    engine.begin_save(types.SimpleNamespace(zero_optimization_partition_weights=lambda: True), None)
    engine.create(CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path), save_latest=True))
    engine.save({"w": torch.ones(4)}, str(tmp_path / "global_step1" / "model.pt"))
    end = engine.checkpointer.end
    # this rank's part ends well; rank 1's write failed, so rank 0 never commits the save
    monkeypatch.setattr(engine.checkpointer, "end", lambda commit=True: end(commit=False))
    monkeypatch.setattr(deepspeed_engine, "exchange_across_ranks",
                        lambda value, error, key="": (None, {1: Failure("PersistError",
                                                                        "No space left on device")}))
    with pytest.raises(CommitError, match=rf"global_step1 was not committed \({nothing_yet(tmp_path)}\), "
                                          r"because of rank\(s\) 1"):
        engine.end_save(True)
    monkeypatch.undo()
    engine.cleanup()
