"""Direct I/O: page-aligned host memory and :class:`DirectFile`, which writes it to disk with
``O_DIRECT``, bypassing the page cache.

Everything that must line up for a direct write lives here: the alignment
(:data:`DIRECT_ALIGN`, :func:`aligned_size`), the memory (:func:`host_buffer`, which the
snapshot stage's pool is also made of, so its buffers can be written in place), and the
file. :class:`~.local.LocalStorage` opens a file this way where the filesystem allows it.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

O_DIRECT = getattr(os, "O_DIRECT", 0)
"""``os.O_DIRECT``; 0 where the platform has none (files are then never opened for direct I/O)."""

REFUSES_DIRECT = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})
"""What a filesystem that does not do direct I/O answers an ``O_DIRECT`` open or write with:
EINVAL (tmpfs, most), EOPNOTSUPP (some FUSE and network filesystems). Each means "write
buffered instead", never a failed save."""

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
    _advise(buf)
    return buf


def shared_host_buffer(nbytes: int, kind: type[mmap.mmap] = mmap.mmap) -> tuple[mmap.mmap, int]:
    """``nbytes`` of page-aligned, zero-filled host memory that another process can map: a
    shared mapping of a new memory file (``memfd_create``), and that file's descriptor, which
    the caller closes once no other process needs to map it (:mod:`..persist.process` hands
    it to its worker). Advised as :func:`host_buffer`'s: huge pages (shared memory gets them
    only where ``shmem_enabled`` allows), and not inherited by ``fork``. The descriptor is
    closed on ``exec``; a forked child holds it but not the mapping, so it shares no page."""
    fd = os.memfd_create("async-ckpt-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        buf = kind(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    _advise(buf)
    return buf, fd


def _advise(buf: mmap.mmap) -> None:
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        if hasattr(mmap, advice):
            try:
                buf.madvise(getattr(mmap, advice))
            except OSError:  # a kernel without it: the advice is only advice
                pass


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+


def _load_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def populate(address: int, nbytes: int) -> bool:
    """Fault in ``nbytes`` of host memory from ``address`` (a page) for writing, in one
    ``madvise(MADV_POPULATE_WRITE)``; False, with nothing done, where the kernel (before
    5.14) or the platform has no such advice: the caller then writes to every page itself.

    One system call instead of one page-fault trap per page, made through ``ctypes``, which
    releases the GIL for it: several times faster than torch writing to every page where
    transparent huge pages are on; a shared mapping's small pages take about as long either
    way (docs/benchmarks.md, "Small choices")."""
    if _madvise is None or nbytes <= 0:
        return nbytes <= 0
    if _madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE) == 0:
        return True
    return False  # EINVAL: an older kernel; ENOMEM and the like: the page writes will say


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

    - :meth:`write_stable` writes the caller's buffer in place, 32 MiB at a time, when it is
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
    _PART = 32 << 20  # per write in place: each takes the GIL back once, on the I/O thread
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
        biases and norms, per large one: hundreds of small writes, a sizeable share of a
        file's write, where staged they are a few; docs/benchmarks.md, "Small choices").
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
                if exc.errno not in REFUSES_DIRECT or not self.direct:
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
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~O_DIRECT)
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
