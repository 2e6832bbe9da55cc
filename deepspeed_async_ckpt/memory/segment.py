"""Shared memory segments: files in ``/dev/shm`` that the keeper creates, sizes and unlinks,
and ranks map to write or read a checkpoint's bytes in place.

Not :class:`multiprocessing.shared_memory.SharedMemory`: before Python 3.13 it registers every
segment it opens, created or attached, with multiprocessing's resource tracker, which unlinks
them when the opening process exits, and these must outlive the ranks. The keeper creates
every segment and is the only one that unlinks (:func:`unlink`); ranks only map them.
"""

from __future__ import annotations

import errno
import mmap
import os

from .address import SHM_DIR

PAGE = mmap.PAGESIZE


def size_for(nbytes: int) -> int:
    """The size of a segment made for ``nbytes``: whole pages, at least one."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def path_of(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create(name: str, nbytes: int) -> int:
    """Make segment ``name`` of ``nbytes`` (rounded up to a page), its pages allocated now
    (``posix_fallocate``), so a rank writing into it later can never fault on a full
    ``/dev/shm`` (a ``SIGBUS`` that would kill the training process). Returns its size.
    ``OSError(ENOSPC)`` when ``/dev/shm`` has no room; nothing is left behind then."""
    size = size_for(nbytes)
    fd = os.open(path_of(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    return size


def resize(name: str, nbytes: int) -> int:
    """Give segment ``name`` (a spare) ``nbytes`` (rounded up to a page), its pages allocated:
    the pages it already has are kept, the rest made or freed. Returns its size."""
    size = size_for(nbytes)
    os.chmod(path_of(name), 0o600)
    fd = os.open(path_of(name), os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return size


def cut(name: str, size: int) -> int:
    """Cut segment ``name`` to ``size`` bytes, a file's exact size (its pages beyond are
    freed), and make it read-only (0400: a load's hard link to it cannot be opened for
    writing); the bytes it holds now, whole pages."""
    os.truncate(path_of(name), size)
    os.chmod(path_of(name), 0o400)
    return -(-size // PAGE) * PAGE


def unlink(name: str) -> bool:
    """Remove segment ``name`` (its memory goes once no process maps it); False if it was gone."""
    try:
        os.unlink(path_of(name))
        return True
    except FileNotFoundError:
        return False


def free_bytes() -> int:
    """Bytes ``/dev/shm`` can still allocate."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class Mapping:
    """A segment mapped into this process, whole; ``view`` is its bytes."""

    def __init__(self, name: str, *, writable: bool) -> None:
        self.name = name
        try:
            fd = os.open(path_of(name), os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError as exc:
            raise FileNotFoundError(errno.ENOENT, f"shared memory segment {path_of(name)} is gone") from exc
        try:
            size = os.fstat(fd).st_size
            if size == 0:  # a file of no bytes: nothing to map
                self._map, self.view = None, memoryview(b"")
                return
            # Populated at map time: one call maps every page instead of a fault per 4 KiB page
            # during the copy (docs/benchmarks.md, "Small choices").
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def close(self) -> None:
        """Unmap it. Views handed out must be released first (else ``BufferError``)."""
        self.view.release()
        if self._map is not None:
            self._map.close()
            self._map = None
