"""Files written beside a checkpoint (the Hugging Face integration's write_beside, on the core's
submit_write and begin callbacks): Trainer's model.safetensors in checkpoint-N, written in the
background. Whole or absent under its name, durable before a save into its directory
persists, failures reported once."""

import os
import threading

import pytest
import torch

from deepspeed_async_ckpt.core import AsyncCheckpointer
from deepspeed_async_ckpt.commit import Pointer
from deepspeed_async_ckpt.config import AsyncCheckpointConfig
from deepspeed_async_ckpt.errors import PersistError
from deepspeed_async_ckpt.integrations.hf_trainer.beside import wait_beside, write_beside
from deepspeed_async_ckpt.integrations.hf_trainer.in_flight import saving_dirs


@pytest.fixture
def ck():
    checkpointer = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    yield checkpointer
    checkpointer.close()


def writer(data: bytes, gate: threading.Event | None = None, error: Exception | None = None):
    """A ``write(f)`` for write_beside: waits for ``gate``, writes half of ``data``, then
    raises ``error`` or writes the rest."""
    def write(f):
        if gate is not None:
            assert gate.wait(60)
        f.write(data[:len(data) // 2])
        if error is not None:
            raise error
        f.write(data[len(data) // 2:])
    return write


def begin_save(ck, save_dir, step=2):
    tag = f"global_step{step}"
    ck.begin(os.path.join(save_dir, tag), tag=tag, pointer=Pointer(os.path.join(save_dir, "latest"), tag))
    ck.save({"w": torch.full((64,), float(step))}, os.path.join(save_dir, tag, "model_states.pt"))
    return ck.end()


def test_a_file_beside_is_whole_or_absent_and_the_save_beside_it_persists_after_it(tmp_path, ck):
    save_dir = str(tmp_path / "checkpoint-2")
    os.makedirs(save_dir)
    path = os.path.join(save_dir, "model.safetensors")
    gate, data = threading.Event(), os.urandom(1 << 20)
    future = write_beside(ck, path, writer(data, gate))
    assert os.path.realpath(save_dir) in saving_dirs()  # Trainer's rotation leaves it alone
    handle = begin_save(ck, save_dir)
    for fut in handle.files:
        fut.result()
    # this rank's files are durable, the file beside is not: the save is not persisted yet
    assert not handle.wait_persisted(1.0)
    assert not os.path.exists(path) and not os.path.exists(os.path.join(save_dir, "latest"))
    gate.set()
    assert handle.wait_committed(60) and handle.committed and future.done()
    with open(path, "rb") as f:
        assert f.read() == data
    assert sorted(os.listdir(save_dir)) == [".async_ckpt.lock", "global_step2", "latest",
                                            "model.safetensors"]  # no temporary left
    assert os.path.realpath(save_dir) not in saving_dirs()


def test_a_failed_write_beside_fails_the_save_beside_it(tmp_path, ck):
    save_dir = str(tmp_path / "checkpoint-2")
    os.makedirs(save_dir)
    path = os.path.join(save_dir, "model.safetensors")
    gate = threading.Event()
    write_beside(ck, path, writer(b"x" * 4096, gate, OSError(28, "No space left on device")))
    handle = begin_save(ck, save_dir)
    gate.set()
    with pytest.raises(PersistError, match="model.safetensors: writing it in the background failed: "
                                           "OSError: .*No space left on device"):
        ck.wait()
    assert handle.wait_committed(0) and not handle.committed
    assert sorted(os.listdir(save_dir)) == [".async_ckpt.lock", "global_step2"]  # no latest, no file
    ck.wait()  # reported once: the save's failure


def test_a_failed_write_beside_with_no_save_beside_it_is_raised_once_at_the_next_save(tmp_path, ck):
    out = str(tmp_path)
    path = os.path.join(out, "checkpoint-2", "model.safetensors")
    os.makedirs(os.path.dirname(path))

    def failing():
        write_beside(ck, path, writer(b"x" * 4096, error=OSError(5, "Input/output error")))
        wait_beside(os.path.join(out, "checkpoint-4"))  # another directory: returns at once
        wait_beside(os.path.dirname(path))  # done: no later save can take it as its own

    failing()
    with pytest.raises(PersistError, match="a previous checkpoint failed .*checkpoint-2/model.safetensors: "
                                           "writing it in the background failed: OSError: .*Input/output error"):
        begin_save(ck, os.path.join(out, "checkpoint-4"), 4)
    assert not os.path.exists(os.path.join(out, "checkpoint-4", "global_step4"))  # refused: nothing written
    begin_save(ck, os.path.join(out, "checkpoint-4"), 4)  # once
    ck.wait()
    failing()
    with pytest.raises(PersistError, match="a previous checkpoint failed .*Input/output error"):
        ck.wait()
    ck.wait()
    assert os.listdir(os.path.dirname(path)) == []  # no temporary left, no partial file


def test_closing_waits_for_the_files_beside(tmp_path):
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01))
    path, gate = str(tmp_path / "model.safetensors"), threading.Event()
    write_beside(ck, path, writer(b"y" * 8192, gate))
    threading.Timer(0.2, gate.set).start()
    ck.close()  # what the exit flush does
    with open(path, "rb") as f:
        assert f.read() == b"y" * 8192


def test_a_safetensors_file_written_by_the_engine_is_byte_for_byte_the_librarys(tmp_path, ck):
    """write_safetensors (Trainer's model.safetensors, written with direct I/O from the tensors'
    memory) writes the bytes safetensors.torch.save_file writes: its layout (by dtype, then by
    name), header and padding; every dtype it takes, empty and 0-d tensors, non-ASCII names."""
    from safetensors.torch import load_file, save_file

    from deepspeed_async_ckpt.persist import SAFETENSORS_DTYPES, safetensors_writable, write_safetensors

    torch.manual_seed(0)
    tensors = {f"layer.{i}.{str(dtype)[6:]}": (torch.randn(257, 3) * 100).to(dtype)
               for i, dtype in enumerate(SAFETENSORS_DTYPES)}
    tensors.update({"empty": torch.zeros(0, 4), "scalar": torch.tensor(7, dtype=torch.int64),
                    "größe": torch.ones(5, dtype=torch.bfloat16), "big": torch.randn(1 << 20)})
    for metadata in ({"format": "pt"}, None):
        ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
        assert safetensors_writable(tensors)
        write_beside(ck, ours, lambda f: write_safetensors(f, tensors, metadata)).result()
        save_file(tensors, theirs, metadata=metadata)
        with open(ours, "rb") as a, open(theirs, "rb") as b:
            assert a.read() == b.read()
    loaded = load_file(ours)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name

    flat = torch.randn(8)
    for refused in ({"t": torch.randn(4, 3).t()}, {"a": flat[:4], "b": flat[4:]},
                    {"c": torch.ones(2, dtype=torch.complex64)}, {"s": torch.eye(3).to_sparse()}):
        assert not safetensors_writable(refused)  # left to the library: its error, or its file


@pytest.mark.parametrize("tensors, metadata, error", [
    ({"w": torch.ones(4)}, {"format": "pt", "total_size": 16}, "not an instance of 'str'"),
    ({"w": torch.ones(4)}, ["format"], None),
    ({1: torch.ones(4)}, None, None),
])
def test_safetensors_the_library_refuses_get_its_error_not_an_unreadable_file(tmp_path, ck, monkeypatch,
                                                                                tensors, metadata, error):
    """Metadata or names that ``safetensors`` refuses (an integer in the metadata, which
    ``safe_open`` would not read back; an integer name) are not written by the engine: such
    calls go to the library, through Trainer's path, and raise its error at the call, with no
    file left under the name."""
    from deepspeed_async_ckpt.integrations.hf_trainer import trainer_methods
    from deepspeed_async_ckpt.persist import safetensors_writable

    assert not safetensors_writable(tensors, metadata)
    assert safetensors_writable({"w": torch.ones(4)}, {"format": "pt"})
    monkeypatch.setattr(trainer_methods._exporting, "checkpointer", ck, raising=False)
    monkeypatch.setattr(trainer_methods._exporting, "model", None, raising=False)
    from safetensors.torch import save_file

    monkeypatch.setitem(trainer_methods._ORIGINALS, "safe_save_file", save_file)  # what install() keeps
    path = str(tmp_path / "model.safetensors")
    with pytest.raises((TypeError, ValueError), match=error):
        trainer_methods.safe_save_file(tensors, path, metadata)
    assert not os.path.exists(path)


class _ShortWrites:
    """A raw file whose ``write`` takes at most ``limit`` bytes a call (0: none), as one
    ``write(2)`` may: Linux takes at most 2 GiB - 4 KiB, a filling disk what fits."""

    def __init__(self, f, limit):
        self._f, self._limit = f, limit

    def write(self, data):
        return self._f.write(memoryview(data).cast("B")[:self._limit]) if self._limit else 0

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("storage", [dict(fsync=False), dict(fsync=True, direct_io=False)])
def test_a_file_beside_is_written_whole_by_a_raw_file_that_writes_short(tmp_path, monkeypatch, storage):
    """Without direct I/O the engine's files are raw ones, whose ``write`` may take less than it
    is given: write_safetensors (one ``write`` per tensor) still writes every byte, or the write
    fails and nothing is left under the name."""
    import builtins

    from safetensors.torch import load_file

    from deepspeed_async_ckpt.storage import local as storage_module
    from deepspeed_async_ckpt.persist import write_safetensors

    limit = {"bytes": 1000}
    monkeypatch.setattr(storage_module, "open",
                        lambda *a, **k: _ShortWrites(builtins.open(*a, **k), limit["bytes"]), raising=False)
    tensors = {"w": torch.randn(3000), "b": torch.arange(10, dtype=torch.int64)}
    ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=0.01, **storage))
    try:
        path = str(tmp_path / "model.safetensors")
        write_beside(ck, path, lambda f: write_safetensors(f, tensors)).result()
        loaded = load_file(path)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
        # a call that writes nothing: an error naming the file, no file under its name
        limit["bytes"] = 0
        path = str(tmp_path / "other.safetensors")
        with pytest.raises(PersistError, match=r"other.safetensors: writing it in the background failed: "
                                               r"OSError: .*short write: 0 of \d+ bytes"):
            write_beside(ck, path, lambda f: write_safetensors(f, tensors)).result()
        assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
        with pytest.raises(PersistError):  # reported again by the next wait (no save took it)
            ck.wait()
    finally:
        ck.close()
