"""Buffered-path file objects of :class:`~.local.LocalStorage`: files that write every byte they
are given (:class:`WholeFile`), and start writeback while they are written
(:class:`WriteBehindFile`). Files opened for direct I/O are :class:`~.direct.DirectFile`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import BinaryIO


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* from <fcntl.h>


def can_write_behind() -> bool:
    """Whether :class:`WriteBehindFile` works here (``sync_file_range``: Linux)."""
    return _sync_file_range is not None


class WholeFile:
    """An unbuffered file whose ``write`` writes every byte it is given or raises, as a buffered
    file's does, without a buffer's copy. A raw file's ``write`` is one ``write(2)``, which may
    take less: Linux takes at most 2 GiB - 4 KiB per call, and a disk filling up takes what
    fits before the call that fails; a caller that trusted it (``safetensors``' layout in
    :func:`~.persist.write_safetensors`, a ``write_beside`` callback) would leave a short file,
    made durable and renamed into place as whole."""

    def __init__(self, f: BinaryIO, start: int = 0) -> None:
        self._f = f
        self.name = f.name
        self._fd = f.fileno()
        self._offset = start  # where the next byte goes (``f`` is positioned there)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self._f.write(view[done:])
            if not n:  # 0 (or None): no progress, and no error from the kernel to raise
                raise OSError(errno.EIO, f"short write: {done} of {len(view)} bytes", self.name)
            done += n
            self._offset += n
            self._written()
        return done

    def _written(self) -> None:
        """Called after each ``write(2)`` that wrote something."""

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def __enter__(self) -> "WholeFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WriteBehindFile(WholeFile):
    """A :class:`WholeFile` that starts writeback while it is written, instead of at the fsync.

    Every ``chunk_bytes`` written are handed to the disk at once (``sync_file_range``); once
    more than ``window_bytes`` are in flight, the oldest range is waited for and dropped from
    the page cache. So the disk works while the CPU still checksums and writes, the final fsync
    finds almost nothing left to do, and a checkpoint does not fill the page cache (on the
    machine this was measured on, letting 2 GB of dirty pages pile up made the write itself
    2.5-4x slower). ``fsync`` still provides the durability guarantee.
    """

    def __init__(self, f: BinaryIO, chunk_bytes: int = 64 << 20, window_bytes: int = 256 << 20,
                 start: int = 0) -> None:
        super().__init__(f, start)
        self._chunk, self._window = chunk_bytes, window_bytes
        self._started = start  # writeback was started for [start, _started)
        self._inflight: list[tuple[int, int]] = []  # (offset, length) not yet waited for

    def _written(self) -> None:
        if self._offset - self._started >= self._chunk:
            self._write_behind()

    def _write_behind(self) -> None:
        start, length = self._started, self._offset - self._started
        self._call(start, length, _WRITE)
        self._inflight.append((start, length))
        self._started = self._offset
        while sum(n for _, n in self._inflight) > self._window:
            off, n = self._inflight.pop(0)
            self._call(off, n, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)

    def _call(self, offset: int, length: int, flags: int) -> None:
        if _sync_file_range(self._fd, offset, length, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}", self.name)
