"""O_DIRECT file writing (``deepspeed_async_ckpt.storage.direct``): aligned and unaligned
pieces, short writes, fallbacks, descriptors never closed under a write."""

import errno
import os
import threading

import pytest

from deepspeed_async_ckpt.storage import LocalStorage


def test_direct_file_writes_aligned_and_unaligned_pieces_exactly(tmp_path):
    import mmap

    from deepspeed_async_ckpt.storage import DIRECT_ALIGN, DirectFile

    f = LocalStorage(fsync=True).open_write(str(tmp_path / "f"))
    if not isinstance(f, DirectFile):
        f.close()
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT; LocalStorage writes buffered there")
    aligned = mmap.mmap(-1, 3 * DirectFile._PART)  # page-aligned, spans several I/O parts
    aligned.write(os.urandom(len(aligned)))
    header, tail = os.urandom(DIRECT_ALIGN - 100), os.urandom(5000)
    expected = b"hdr" + header[3:] + b"x" * 100 + bytes(aligned) + tail + os.urandom(10 << 20)
    f.write(b"hdr")
    f.write(header[3:] + b"x" * 100)              # now at a page boundary
    f.write_stable(memoryview(aligned))           # written in place, asynchronously
    f.barrier().result(timeout=30)                # ... and done: the buffer may change again
    aligned[:] = bytes(len(aligned))
    f.write_stable(tail)                          # unaligned: staged, like write()
    f.write(expected[-(10 << 20):])               # more than one stage holds
    LocalStorage(fsync=True).sync_file(f)
    assert f.direct  # no fallback happened
    f.close()
    assert (tmp_path / "f").read_bytes() == expected


def _direct_file_or_skip(path):
    from deepspeed_async_ckpt.storage import DirectFile

    f = LocalStorage(fsync=True).open_write(str(path))
    if not isinstance(f, DirectFile):
        f.close()
        pytest.skip(f"{path.parent}'s filesystem refuses O_DIRECT; LocalStorage writes buffered there")
    return f


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_filesystem_refusing_o_direct_at_open_gets_buffered_writes(tmp_path, monkeypatch, code):
    """Some FUSE and network filesystems refuse ``O_DIRECT`` with EOPNOTSUPP, not EINVAL: that
    failed every save instead of falling back to buffered writes."""
    from deepspeed_async_ckpt import storage
    from deepspeed_async_ckpt.storage.direct import O_DIRECT

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & O_DIRECT:
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    if not O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    path = tmp_path / "f"
    with LocalStorage(fsync=True).open_write(str(path)) as f:
        assert not isinstance(f, storage.DirectFile)
        f.write(b"x" * 10000)
    assert path.read_bytes() == b"x" * 10000
    with LocalStorage(fsync=True).open_write_at(str(path), 4096) as f:
        assert not isinstance(f, storage.DirectFile)
        f.write(b"y" * 100)
    assert path.read_bytes() == b"x" * 4096 + b"y" * 100 + b"x" * (10000 - 4196)


@pytest.mark.parametrize("at", [None, 4096])
def test_a_direct_file_whose_stage_cannot_be_mapped_closes_its_descriptor(tmp_path, monkeypatch, at):
    """``open_write`` opened the file with O_DIRECT and then mapped the file's 8 MiB staging
    buffer; when that failed (ENOMEM) the descriptor was never closed, and the failed save's
    unlinked temporary kept its disk space and a descriptor until the process exited."""
    from deepspeed_async_ckpt.storage import direct

    _direct_file_or_skip(tmp_path / "probe").close()

    def no_memory(nbytes):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(direct, "host_buffer", no_memory)
    before = set(os.listdir("/proc/self/fd"))
    for i in range(3):
        path = str(tmp_path / f"f{i}.tmp")
        with pytest.raises(OSError, match="Cannot allocate memory"):
            LocalStorage(fsync=True).open_write(path) if at is None else \
                LocalStorage(fsync=True).open_write_at(path, at)
        os.unlink(path)
    leaked = [os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - before
              if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [p for p in leaked if str(tmp_path) in p], leaked


def test_ctrl_c_while_a_direct_file_closes_never_closes_the_fd_under_a_write(tmp_path, monkeypatch):
    """Closing a DirectFile joins its I/O thread, then closes the descriptor. Ctrl-C landing
    in the join (a sync save runs on the training thread) went straight to ``os.close`` while
    the I/O thread could still ``pwritev`` to that descriptor number, which another open may
    reuse at once: checkpoint bytes into an unrelated file."""
    import mmap

    f = _direct_file_or_skip(tmp_path / "f")
    events = []
    release = threading.Event()
    real_pwrite = f._pwrite

    def slow_pwrite(parts, offset):
        release.wait(10)
        real_pwrite(parts, offset)
        events.append("written")

    monkeypatch.setattr(f, "_pwrite", slow_pwrite)
    real_close = os.close
    monkeypatch.setattr(os, "close", lambda fd: (events.append("closed") if fd == f._fd else None, real_close(fd)))
    buf = mmap.mmap(-1, 2 * f._SMALL)
    f.write_stable(memoryview(buf))
    real_shutdown = f._io.shutdown
    calls = []

    def interrupted_shutdown(wait=True):
        calls.append(wait)
        if len(calls) == 1:  # Ctrl-C in the join; the write is still running
            threading.Timer(0.2, release.set).start()
            raise KeyboardInterrupt
        real_shutdown(wait=wait)

    monkeypatch.setattr(f._io, "shutdown", interrupted_shutdown)
    with pytest.raises(KeyboardInterrupt):
        f.close()
    assert events == ["written", "closed"], events


def _write_records_like_deepspeed(f, n_large=4):
    """Per large record, as in a DeepSpeed file: a page of zip header, two small page-aligned
    records (a bias and a norm), another header, the large record (its last page partial)."""
    import mmap

    from deepspeed_async_ckpt.storage import DIRECT_ALIGN, DirectFile

    expected = b""
    for i in range(n_large):
        small = mmap.mmap(-1, 2 * DIRECT_ALIGN)
        large = mmap.mmap(-1, 2 * DirectFile._SMALL + 3 * DIRECT_ALIGN + 100)
        small.write(os.urandom(len(small)))
        large.write(os.urandom(len(large)))
        for header, record in (((b"%d" % i) * DIRECT_ALIGN, small), (b"s" * DIRECT_ALIGN, small),
                               (b"L" * DIRECT_ALIGN, large)):
            header = header[:DIRECT_ALIGN]
            f.write(header)
            f.write_stable(memoryview(record))
            expected += header + bytes(record)
        if i == n_large - 1:
            break
        f.write(b"p" * (DIRECT_ALIGN - 100))  # back to a page boundary, as the zip writer pads
        expected += b"p" * (DIRECT_ALIGN - 100)
    LocalStorage(fsync=True).sync_file(f)
    f.close()
    return expected


def test_direct_file_stages_small_records_and_sends_them_with_the_next_large_one(tmp_path, monkeypatch):
    """Every direct write waits for the disk; small records are copied into the stage and go
    out with the next large record in one system call, instead of one write each."""
    f = _direct_file_or_skip(tmp_path / "f")
    calls, real = [], os.pwritev

    def pwritev(fd, bufs, offset):
        calls.append([len(b) for b in bufs])
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    expected = _write_records_like_deepspeed(f, n_large=4)
    assert (tmp_path / "f").read_bytes() == expected
    # one write per large record (the stage before it, then the record), one for the last tail
    assert [len(c) for c in calls] == [2, 2, 2, 2, 1], calls
    assert f.direct


def test_direct_file_resumes_short_writes_across_parts(tmp_path, monkeypatch):
    from deepspeed_async_ckpt.storage import DIRECT_ALIGN

    f = _direct_file_or_skip(tmp_path / "f")
    real, short = os.pwritev, []

    def pwritev(fd, bufs, offset):  # writes at most 3 pages per call (a legal short write)
        left, cut = 3 * DIRECT_ALIGN + DIRECT_ALIGN * (len(short) % 2), []
        for b in bufs:
            cut.append(b[:left])
            left -= len(cut[-1])
            if not left:
                break
        short.append(sum(map(len, cut)) < sum(map(len, bufs)))
        return real(fd, cut, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    expected = _write_records_like_deepspeed(f, n_large=2)
    assert (tmp_path / "f").read_bytes() == expected
    assert any(short)


def test_direct_file_write_copies_so_the_caller_may_reuse_its_buffer(tmp_path):
    import mmap

    from deepspeed_async_ckpt.storage import DirectFile

    f = LocalStorage(fsync=True).open_write(str(tmp_path / "f"))
    if not isinstance(f, DirectFile):
        f.close()
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT; LocalStorage writes buffered there")
    buf = mmap.mmap(-1, 3 * DirectFile._STAGE)  # aligned, but not declared stable
    expected = b""
    for i in range(6):  # more stages than the file keeps: write() must wait for a free one
        buf[:] = bytes([i]) * len(buf)
        f.write(buf)
        expected += bytes(buf)
    LocalStorage(fsync=True).sync_file(f)
    f.close()
    assert (tmp_path / "f").read_bytes() == expected
