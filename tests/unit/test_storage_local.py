"""The local filesystem storage (``deepspeed_async_ckpt.storage.local``)."""

import os

import pytest

from deepspeed_async_ckpt.storage import LocalStorage


def test_write_behind_file_writes_every_byte(tmp_path):
    from deepspeed_async_ckpt.storage.buffered import WriteBehindFile, _sync_file_range

    if _sync_file_range is None:
        pytest.skip("sync_file_range is Linux-only; LocalStorage writes plainly elsewhere")
    data = os.urandom(5 << 20)
    with WriteBehindFile(open(tmp_path / "f", "wb", buffering=0), chunk_bytes=256 << 10,
                         window_bytes=1 << 20) as f:
        for i in range(0, len(data), 100_000):  # unaligned pieces
            f.write(data[i:i + 100_000])
        LocalStorage(fsync=True).sync_file(f)
    assert (tmp_path / "f").read_bytes() == data
    assert isinstance(LocalStorage(fsync=True, direct_io=False).open_write(str(tmp_path / "g")),
                      WriteBehindFile)
