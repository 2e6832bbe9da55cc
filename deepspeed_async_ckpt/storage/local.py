""":class:`LocalStorage`, the default :class:`~.protocol.Storage`: POSIX files on a local disk or
a shared mount, made durable with fsync, directories swapped atomically with ``renameat2``.

It picks each file's writer: :class:`~.direct.DirectFile` where the filesystem does direct I/O,
else :class:`~.files.WriteBehindFile` (Linux) or :class:`~.files.WholeFile`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from typing import BinaryIO

from .direct import DIRECT_ALIGN, O_DIRECT, REFUSES_DIRECT, DirectFile
from .buffered import WholeFile, WriteBehindFile, can_write_behind


def _direct_file(fd: int, path: str, start: int = 0) -> DirectFile:
    """``DirectFile(fd, ...)``, closing ``fd`` if that fails (its staging buffer cannot be
    mapped: ENOMEM): the caller unlinks the file, and a leaked descriptor would keep its disk
    space, and one descriptor per failed save, until the process exits."""
    try:
        return DirectFile(fd, path, start=start)
    except BaseException:
        os.close(fd)
        raise


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # from <fcntl.h> and <linux/fs.h>


class LocalStorage:
    """POSIX files. ``fsync=False`` skips every fsync (faster, not crash-safe).

    With fsync, files are opened for direct I/O where the filesystem allows it
    (:class:`DirectFile`, ``direct_io=True``), else written behind on Linux
    (:class:`WriteBehindFile`), else written plainly; every file's ``write`` writes all it is
    given or raises (:class:`WholeFile`).
    """

    def __init__(self, fsync: bool = True, direct_io: bool = True) -> None:
        self.fsync = fsync
        self.direct_io = direct_io

    def open_write(self, path: str) -> BinaryIO:
        if self.fsync and self.direct_io and O_DIRECT:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o666)
            except OSError as exc:  # e.g. tmpfs: no direct I/O; other errors show up just below
                if exc.errno not in REFUSES_DIRECT:
                    raise
            else:
                return _direct_file(fd, path)
        f = open(path, "wb", buffering=0)
        return WriteBehindFile(f) if self.fsync and can_write_behind() else WholeFile(f)

    def open_write_at(self, path: str, offset: int) -> BinaryIO:
        if offset % DIRECT_ALIGN:  # every share starts on a page (a record's data)
            raise ValueError(f"{path}: shares start on a page, got offset {offset}")
        flags = os.O_WRONLY | os.O_CREAT
        if self.fsync and self.direct_io and O_DIRECT:
            try:
                fd = os.open(path, flags | O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno not in REFUSES_DIRECT:
                    raise
            else:
                return _direct_file(fd, path, start=offset)
        f = open(os.open(path, flags, 0o666), "wb", buffering=0, closefd=True)
        f.seek(offset)
        if self.fsync and can_write_behind():
            return WriteBehindFile(f, start=offset)
        return WholeFile(f, start=offset)

    def write_small(self, path: str, data: bytes, *, durable: bool = True) -> None:
        # Buffered, never direct: direct I/O would pad it to a page, then truncate it back
        # (a 2 kB manifest: twice as long; docs/benchmarks.md, "Small choices").
        with open(path, "wb") as f:
            f.write(data)
            if self.fsync and durable:
                f.flush()
                os.fsync(f.fileno())

    def sync_file(self, f: BinaryIO) -> None:
        finish = getattr(f, "finish", None)  # DirectFile: its staged tail is not written yet
        if finish is not None:
            finish()
        if self.fsync:
            os.fsync(f.fileno())
            if isinstance(f, WriteBehindFile):  # clean now: drop the rest from the page cache
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def replace(self, src: str, dst: str, *, durable: bool = True) -> None:
        os.replace(src, dst)
        if self.fsync and durable:
            _fsync_dir(os.path.dirname(os.path.abspath(dst)))

    def swap(self, a: str, b: str) -> bool:
        if _renameat2 is None:
            return False
        if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE):
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
                return False  # e.g. NFS, or a kernel before 3.15
            raise OSError(err, f"renameat2(RENAME_EXCHANGE): {os.strerror(err)}", a, None, b)
        if self.fsync:
            _fsync_dir(os.path.dirname(os.path.abspath(b)))
        return True

    def link(self, src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError as exc:  # a filesystem without hard links: copy (and flush) instead
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                raise
            shutil.copy2(src, dst)
            if self.fsync:
                with open(dst, "rb+") as f:
                    os.fsync(f.fileno())

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def sync_dir(self, path: str) -> None:
        if self.fsync:
            _fsync_dir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def remove_tree(self, path: str) -> None:
        if os.path.islink(path) or not os.path.isdir(path):  # a tag that was a symlink, say
            os.unlink(path)
        else:
            shutil.rmtree(path)

    def remove_dir(self, path: str) -> None:
        os.rmdir(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
