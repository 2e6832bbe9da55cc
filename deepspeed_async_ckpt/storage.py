"""The storage seam: the few filesystem operations the persist and commit stages use.

``LocalStorage`` is the default (a POSIX path, local or a shared mount). Tests inject faults by
subclassing it; a remote backend would implement the same ten methods.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import mmap
import os
import re
import shutil
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Protocol


#: The engine writes every file under a temporary name, ``<path>.tmp.<owner>`` (a save's id, or
#: the writing process's pid), and renames it to ``path`` once whole: what a crashed or failed
#: save leaves behind has such a name.
_TEMPORARY = re.compile(r"\.tmp\.[0-9a-f]+$")


def temporary_path(path: str, owner: str | int) -> str:
    """Where ``path`` is written before its rename (see ``_TEMPORARY``)."""
    return f"{path}.tmp.{owner}"


def is_temporary(name: str) -> bool:
    return _TEMPORARY.search(name) is not None


class Storage(Protocol):
    def open_write(self, path: str) -> BinaryIO:
        """A new unbuffered binary file at ``path`` (truncated if present), whose ``write``
        writes all it is given or raises."""

    def write_small(self, path: str, data: bytes, *, durable: bool = True) -> None:
        """A new small file at ``path`` (a record, the manifest, a pointer) holding ``data``,
        written whole and, unless ``durable=False`` (others need only see it once closed),
        made durable."""

    def open_write_at(self, path: str, offset: int) -> BinaryIO:
        """``path`` (created if absent, never truncated) for writing from ``offset`` on: one
        rank's share of a file that several ranks write at once, each its own byte range."""

    def sync_file(self, f: BinaryIO) -> None:
        """Make what was written to ``f`` durable."""

    def replace(self, src: str, dst: str, *, durable: bool = True) -> None:
        """Atomically rename ``src`` to ``dst`` and (unless ``durable=False``: others need only
        see it) make the rename durable."""

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap directories ``a`` and ``b`` and make it durable; False (nothing
        done) where the filesystem cannot (then two renames do it, see
        :func:`~.commit.replace_checkpoint`)."""

    def link(self, src: str, dst: str) -> None:
        """Make file ``src`` also appear at ``dst`` (a hard link, or a copy where links fail)."""

    def makedirs(self, path: str) -> None:
        ...

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (links, directories made in it) durable."""

    def listdir(self, path: str) -> list[str]:
        """Names in directory ``path`` (rank 0 polls the checkpoint's records with one call)."""

    def remove_tree(self, path: str) -> None:
        """Delete directory ``path`` and everything under it (retention); a symbolic link or
        a file at ``path`` is unlinked."""


def _direct_file(fd: int, path: str, start: int = 0) -> "DirectFile":
    """``DirectFile(fd, ...)``, closing ``fd`` if that fails (its staging buffer cannot be
    mapped: ENOMEM): the caller unlinks the file, and a leaked descriptor kept its disk space
    and one descriptor per failed save until the process exited (a review, session 30)."""
    try:
        return DirectFile(fd, path, start=start)
    except BaseException:
        os.close(fd)
        raise


_REFUSES_DIRECT = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})
"""What a filesystem that does not do direct I/O answers an ``O_DIRECT`` open or write with:
EINVAL (tmpfs, most), EOPNOTSUPP (some FUSE and network filesystems). Until session 30 only
EINVAL fell back to buffered writes; the others failed every save."""


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
        if self.fsync and self.direct_io and _O_DIRECT:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o666)
            except OSError as exc:  # e.g. tmpfs: no direct I/O; other errors show up just below
                if exc.errno not in _REFUSES_DIRECT:
                    raise
            else:
                return _direct_file(fd, path)
        f = open(path, "wb", buffering=0)
        return WriteBehindFile(f) if self.fsync and _sync_file_range is not None else WholeFile(f)

    def open_write_at(self, path: str, offset: int) -> BinaryIO:
        if offset % DIRECT_ALIGN:  # every share starts on a page (a record's data)
            raise ValueError(f"{path}: shares start on a page, got offset {offset}")
        flags = os.O_WRONLY | os.O_CREAT
        if self.fsync and self.direct_io and _O_DIRECT:
            try:
                fd = os.open(path, flags | _O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno not in _REFUSES_DIRECT:
                    raise
            else:
                return _direct_file(fd, path, start=offset)
        f = open(os.open(path, flags, 0o666), "wb", buffering=0, closefd=True)
        f.seek(offset)
        if self.fsync and _sync_file_range is not None:
            return WriteBehindFile(f, start=offset)
        return WholeFile(f, start=offset)

    def write_small(self, path: str, data: bytes, *, durable: bool = True) -> None:
        # Buffered, never direct: direct I/O would pad it to a page, then truncate it back
        # (a 2 kB manifest: 1.3 ms against 0.55 ms with its fsync on this VM's disk).
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

    def exchange(self, a: str, b: str) -> bool:
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* from <fcntl.h>


class WholeFile:
    """An unbuffered file whose ``write`` writes every byte it is given or raises, as a buffered
    file's does, without a buffer's copy. A raw file's ``write`` is one ``write(2)``, which may
    take less: Linux takes at most 2 GiB - 4 KiB per call, and a disk filling up takes what
    fits before the call that fails; a caller that trusted it (``safetensors``' layout in
    :func:`~.persist.write_safetensors`, a ``write_beside`` callback) left a short file that
    was then made durable and renamed into place as whole."""

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


_O_DIRECT = getattr(os, "O_DIRECT", 0)
DIRECT_ALIGN = 4096
"""Offsets, lengths and addresses of direct writes are multiples of this (the page size, and
a multiple of every common logical block size)."""


def aligned_size(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`DIRECT_ALIGN`."""
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def host_buffer(nbytes: int, kind: type[mmap.mmap] = mmap.mmap) -> mmap.mmap:
    """``nbytes`` of page-aligned, zero-filled host memory for direct writes: a private
    anonymous mapping (of ``kind``, ``mmap.mmap`` or a subclass), advised to use transparent
    huge pages and not to be inherited by ``fork``.

    Huge pages are for the disk, not the CPU: a direct write is one block request per run of
    physically contiguous memory, up to the device's segment limit (254 here, ``max_segments``),
    so from 4 KiB pages a request carries at most ~1 MiB, and from 2 MiB pages it carries the
    device's maximum (4 MiB here). On this machine's virtual disk that took 1 GiB ``O_DIRECT``
    writes from 2.2-2.6 GB/s to 2.8-3.9 GB/s, with a tenth of the system CPU (faulting in is
    also 500x fewer faults). The kernel falls back to small pages where it has no huge page
    free, or where transparent huge pages are off (``never``).

    Not inherited by ``fork``: a data-loader worker forked while the pool exists would
    otherwise share its pages copy-on-write, and every later copy into them would fault.
    (A shared mapping, ``mmap``'s default, has neither problem but is shmem, whose huge pages
    are off by default.)
    """
    buf = kind(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        if hasattr(mmap, advice):
            try:
                buf.madvise(getattr(mmap, advice))
            except OSError:  # a kernel without it: the advice is only advice
                pass
    return buf


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers included)."""
    import numpy as np  # a read-only buffer's address; numpy comes with torch and DeepSpeed

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class DirectFile:
    """A file written with ``O_DIRECT``: tensor bytes go from the host buffer to the disk,
    without a copy into the page cache and without the kernel's writeback work, which leaves
    the CPU to training.

    Direct writes need page-aligned memory, file offsets and lengths. Every write runs on one
    I/O thread, in order, so the caller never waits for the disk:

    - :meth:`write_stable` writes the caller's buffer in place, 8 MiB at a time, when it is
      page-aligned (the checkpoint's tensor records are: pool buffers are page-aligned and the
      zip writer pads record data to ``DIRECT_ALIGN``) and at least 1 MiB; what is staged
      before it goes out in the same ``pwritev``. The caller must keep the buffer unchanged
      until :meth:`barrier`'s future is done.
    - :meth:`write` copies the data into an aligned staging buffer (zip headers, the pickle,
      small records, record tails), so the caller may reuse it at once. A full stage is
      handed to the I/O thread and the next one is used (at most ``_MAX_STAGES`` exist).

    :meth:`finish` writes the last stage, its last page padded, waits for every write and cuts
    the file to its real size. If the filesystem refuses a direct write (EINVAL), the file falls
    back to ordinary writes.

    ``start`` (a page) is where the first byte goes: one rank's share of a file that several
    ranks write (:meth:`LocalStorage.open_write_at`). A share other than the last ends on a
    page, so it is never padded, and the file is never cut where another rank writes after it.
    """

    _STAGE = 8 << 20
    _PART = 8 << 20
    _SMALL = 1 << 20
    _MAX_STAGES = 4

    def __init__(self, fd: int, path: str, start: int = 0) -> None:
        self.name = path
        self._fd = fd
        self._size = start  # where the next byte goes: the end of what was written or staged
        self._stage = host_buffer(self._STAGE)
        self._staged = 0  # bytes in the stage; they belong at [_size - _staged, _size)
        self._stages = [self._stage]
        self._spare: list[mmap.mmap] = []  # stages whose write is done
        self._cond = threading.Condition()
        self._io: ThreadPoolExecutor | None = None
        self._pending: collections.deque[Future] = collections.deque()
        self._error: BaseException | None = None  # of a write no longer in _pending
        self.direct = True

    def write(self, data) -> int:
        """Copy ``data`` into the stage: the caller may reuse it as soon as this returns."""
        view = memoryview(data).cast("B")
        n = len(view)
        while len(view):
            m = min(len(view), self._STAGE - self._staged)
            self._stage[self._staged:self._staged + m] = view[:m]
            self._staged += m
            self._size += m
            view = view[m:]
            if self._staged == self._STAGE:
                self._submit_stage()
        return n

    def write_stable(self, data) -> int:
        """Write ``data`` in place where it is page-aligned (its last partial page is staged).
        ``data`` must stay unchanged until :meth:`barrier`'s future is done.

        Data under :attr:`_SMALL` bytes is staged instead: every write waits for the disk, and
        a small one costs as much as its round trip (a DeepSpeed file has two small records,
        biases and norms, per large one: 430 writes of 2.9 MB in all took 80-130 ms of a
        1 GB file's 0.5 s on this machine's disk, while training; staged, 64 writes, 20 ms).
        What is staged goes out in the same system call as the next in-place write."""
        view = memoryview(data).cast("B")
        n = len(view)
        if n < self._SMALL or self._size % DIRECT_ALIGN or buffer_address(view) % DIRECT_ALIGN:
            return self.write(view)
        k = n - n % DIRECT_ALIGN
        head = self._detach_stage()  # whole pages (the file is aligned): it leads the first part
        for off in range(0, k, self._PART):
            parts, offset = [view[off:min(k, off + self._PART)]], self._size + off
            if off == 0 and head is not None:
                stage, staged, offset = head
                parts.insert(0, memoryview(stage)[:staged])
                self._submit(parts, offset).add_done_callback(
                    lambda _fut, stage=stage: self._give_back(stage))
            else:
                self._submit(parts, offset)
        self._size += k
        self.write(view[k:])
        return n

    def barrier(self) -> Future:
        """A future that is done once every write issued so far is done (successfully or not;
        errors are raised by :meth:`flush`). Writes run in order on one thread."""
        if self._pending:
            return self._pending[-1]
        done: Future = Future()
        done.set_result(None)
        return done

    def flush(self) -> None:
        """Wait until every write issued so far is done; raise the first error, if any."""
        pending, self._pending = self._pending, collections.deque()
        errors = [fut.exception() for fut in pending]  # waits for all: buffers are then free
        first = self._error or next((e for e in errors if e is not None), None)
        self._error = None
        if first is not None:
            raise first

    def finish(self) -> None:
        """Write what is staged (its last page padded) and cut the padding off again."""
        padded = self._size % DIRECT_ALIGN
        self._submit_stage(pad=True)
        self.flush()
        if padded:
            os.ftruncate(self._fd, self._size)

    def _submit(self, parts: list[memoryview], offset: int) -> Future:
        """Queue one write of ``parts``, contiguous in the file from ``offset``."""
        if self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-io")
        while self._pending and self._pending[0].done():  # keep the queue short
            err = self._pending.popleft().exception()
            self._error = self._error or err
        fut = self._io.submit(self._pwrite, parts, offset)
        self._pending.append(fut)
        return fut

    def _submit_stage(self, pad: bool = False) -> None:
        head = self._detach_stage(pad)
        if head is not None:
            stage, n, offset = head
            fut = self._submit([memoryview(stage)[:n]], offset)
            fut.add_done_callback(lambda _fut: self._give_back(stage))

    def _detach_stage(self, pad: bool = False) -> tuple[mmap.mmap, int, int] | None:
        """Hand over the current stage, the number of its bytes to write (padded to whole
        pages if ``pad``) and their file offset, and continue with a spare stage. None if it
        is empty. The caller writes it and gives it back."""
        if not self._staged:
            return None
        stage, n, offset = self._stage, self._staged, self._size - self._staged
        if pad:
            n = aligned_size(n)
            stage[self._staged:n] = bytes(n - self._staged)
        self._staged = 0
        with self._cond:
            if not self._spare and len(self._stages) < self._MAX_STAGES:
                self._stages.append(host_buffer(self._STAGE))
                self._spare.append(self._stages[-1])
            while not self._spare:
                self._cond.wait()
            self._stage = self._spare.pop()
        return stage, n, offset

    def _give_back(self, stage: mmap.mmap) -> None:
        with self._cond:
            self._spare.append(stage)
            self._cond.notify()

    def _pwrite(self, parts: list[memoryview], offset: int) -> None:
        while parts:
            try:
                done = os.pwritev(self._fd, parts, offset)
            except OSError as exc:
                if exc.errno not in _REFUSES_DIRECT or not self.direct:
                    raise
                self._fall_back()
                continue
            if not done:
                raise OSError(errno.EIO, "short write", self.name)
            offset += done
            while parts and done >= len(parts[0]):
                done -= len(parts[0])
                parts = parts[1:]
            if done:
                parts[0] = parts[0][done:]

    def _fall_back(self) -> None:
        with self._cond:  # the filesystem takes O_DIRECT at open but not this write
            if self.direct:
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
                self.direct = False

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd < 0:
            return
        interrupted: BaseException | None = None
        while self._io is not None:  # every write, and its buffer's use, is over: only then
            try:                     # the descriptor goes (its number is reused at once)
                self._io.shutdown(wait=True)
                break
            except BaseException as exc:  # Ctrl-C in the join: join again, raise it after
                interrupted = interrupted or exc
                if isinstance(exc, Exception):  # not an interruption: joining again won't help
                    break
        try:
            if interrupted is not None:
                raise interrupted
        finally:
            os.close(self._fd)
            self._fd = -1
            self._pending.clear()
            for stage in self._stages:
                try:
                    stage.close()
                except BufferError:  # a view is still held (by a raised error's traceback)
                    pass

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
