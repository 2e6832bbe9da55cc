"""Host memory for staging: :class:`HostBlock`, one page-aligned allocation, page-locked for
CUDA copies where CUDA is present, and carved into buffers in ring order.

:class:`~.pool.HostBufferPool` holds a few of these. This module owns the CUDA host
registration behind them (``cudaHostRegister`` / ``cudaHostUnregister``), including clearing
the error a failed registration leaves behind.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import logging
import mmap
import os
from typing import Any

import torch

from ..storage import DIRECT_ALIGN, aligned_size, host_buffer, shared_host_buffer  # every buffer starts on a page
from ..storage.direct import populate

_block_ids = itertools.count()

log = logging.getLogger(__name__)


def _page_lock(address: int, nbytes: int, device: int) -> None:
    """Page-lock host memory for asynchronous copies from CUDA device ``device``
    (``cudaHostRegister``, portable to every context); raises ``RuntimeError`` on failure."""
    with torch.cuda.device(device):  # a thread without a device would make a context on GPU 0
        _checked(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))


def _page_unlock(address: int, device: int) -> None:
    with torch.cuda.device(device):
        _checked(torch.cuda.cudart().cudaHostUnregister(address))


def _checked(code: Any) -> None:
    """Raise for a failed CUDA runtime call, first clearing the error it left as this
    thread's last error: handled here (the pool falls back to torch's pinned allocator),
    it would otherwise be raised again by the next kernel launch on this thread, which
    torch checks with ``cudaGetLastError``."""
    if code != torch.cuda.cudart().cudaError.success:
        library = _cuda_runtime()
        if library is not None:
            library.cudaGetLastError()
        torch.cuda.check_error(code)


@functools.lru_cache(maxsize=None)
def _cuda_runtime() -> Any:
    """The CUDA runtime library torch loaded (``ctypes``), for ``cudaGetLastError``, which
    ``torch.cuda.cudart()`` does not offer; None where none is loaded as a shared library."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)  # already loaded: the same library, the same error state
        except OSError:
            continue
    return None


class _Mapping(mmap.mmap):
    """A :func:`~.storage.host_buffer` mapping that ends its CUDA registration, if it has one,
    before it is unmapped.

    Memory unmapped while still registered leaves the driver's record of the address range
    behind, and pageable memory mapped there later (a plain ``tensor.cpu()`` after a pool was
    dropped) then fails to copy with "CUDA error: invalid argument" (seen on an H100 with torch
    2.11). The mapping lives as long as any tensor viewing it, so this runs only once nothing
    can copy into it any more.
    """

    registration: tuple[int, int] | None = None
    """(address, CUDA device) while registered."""

    fd: int = -1
    """A shared mapping's memory file (:func:`~.storage.shared_host_buffer`), while open."""

    def unregister(self) -> None:
        """End the registration, if any (once; raises ``RuntimeError`` if CUDA refuses)."""
        if self.registration is not None:
            (address, device), self.registration = self.registration, None
            _page_unlock(address, device)

    def close_fd(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.unregister()
        except Exception:  # interpreter shutdown, or a driver already gone: nothing to keep
            pass
        try:
            self.close_fd()
        except Exception:
            pass


def _torch_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # starts on a page


class HostBlock:
    """One contiguous host allocation, carved into buffers in ring (FIFO) order.

    Records are staged in file order and written, then released, in the same order, so a ring
    reuses the block with no fragmentation: the oldest live buffer is the next to come back.
    Out-of-order releases (several writer threads) only delay the reuse of their space.

    The memory is always a :func:`~.storage.host_buffer` mapping (page-aligned, so O_DIRECT
    can write it; huge pages). With ``pin_device`` (a CUDA device index) it is page-locked in
    place with ``cudaHostRegister``, as torch's own DCP stager does, rather than taken from
    torch's pinned allocator, which rounds every block up to a power of two (a 5 GiB block
    would pin 8 GiB) and caches a freed block instead of unpinning it (so a replaced block
    would stay pinned beside its successor): the pool's bound would not bound pinned memory.

    ``shared``: the memory is a memory file's shared mapping instead
    (:func:`~.storage.shared_host_buffer`), which a persist worker process maps too
    (:attr:`fd`, :attr:`id`); should pinning fail, it stays shared and unpinned.
    """

    def __init__(self, nbytes: int, pin_device: int | None, *, shared: bool = False) -> None:
        self.id = next(_block_ids)
        """Names the block to a persist worker process (unique in this process)."""
        if shared:
            self._mapping, fd = shared_host_buffer(nbytes, _Mapping)
            self._mapping.fd = fd
        else:
            self._mapping = host_buffer(nbytes, _Mapping)
        self.memory = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._torch_pinned = False  # from torch's pinned allocator (faulted in by it)
        if pin_device is not None:
            try:
                _page_lock(self.memory.data_ptr(), nbytes, pin_device)
                self._mapping.registration = (self.memory.data_ptr(), pin_device)
            except RuntimeError as exc:
                self._pin_failed(nbytes, exc, shared)
        self.size = nbytes
        self._live: collections.deque[list] = collections.deque()  # [start, end, released]
        self._head = 0  # where the next buffer starts

    def _pin_failed(self, nbytes: int, exc: RuntimeError, shared: bool) -> None:
        if shared:  # torch's pinned memory is private: a worker process could not map it
            log.warning("cudaHostRegister of %d bytes failed (%s); the shared staging block "
                        "stays unpinned (copies into it wait for the device)", nbytes, exc)
            return
        # still pinned, only less exactly
        log.warning("cudaHostRegister of %d bytes failed (%s); the staging block comes "
                    "from torch's pinned allocator instead (rounded up to a power of two)",
                    nbytes, exc)
        self.memory = _torch_pinned(nbytes)
        self._torch_pinned = True
        try:  # unused now: give back its address space and whatever the attempt faulted in
            self._mapping.close()
        except BufferError:  # still viewed somewhere: it goes with its last view
            pass

    @property
    def fd(self) -> int:
        """The memory file of a shared block (-1 otherwise, or once freed)."""
        return self._mapping.fd

    @property
    def pinned_on(self) -> int | None:
        """The CUDA device the memory is registered with; None if not registered."""
        registration = self._mapping.registration
        return None if registration is None else registration[1]

    def free(self) -> None:
        """Unpin an idle block the pool drops at once (the mapping goes with its last
        reference; a block dropped otherwise, with its pool, is unpinned then), and close
        a shared block's memory file."""
        try:
            self._mapping.unregister()
        finally:
            self._mapping.close_fd()

    def fault_in(self) -> None:
        """Give every page of the block its memory now, rather than at the first copy into it
        (a save's, while training waits at the next fence). A page-locked block has it already
        (registration faults the pages in); otherwise one ``MADV_POPULATE_WRITE`` where the
        kernel has it, else a write to every page. Either way the GIL is free meanwhile."""
        if self.pinned_on is not None or self._torch_pinned:
            return
        if not populate(self.memory.data_ptr(), self.size):
            self.memory[::DIRECT_ALIGN].zero_()  # one write per page

    @property
    def idle(self) -> bool:
        return not self._live

    def carve(self, nbytes: int) -> tuple[int, list] | None:
        """Offset and bookkeeping entry of a free ``nbytes`` range, or None if none is free."""
        n = aligned_size(nbytes)
        if not self._live:
            start = 0 if n <= self.size else None
        else:
            tail = self._live[0][0]
            if self._head > tail:  # live range is [tail, head): free space on both sides
                start = self._head if self._head + n <= self.size else (0 if n <= tail else None)
            else:  # wrapped: free space is [head, tail)
                start = self._head if self._head + n <= tail else None
        if start is None:
            return None
        entry = [start, start + n, False]
        self._live.append(entry)
        self._head = start + n
        return start, entry

    def give_back(self, entry: list) -> None:
        entry[2] = True
        while self._live and self._live[0][2]:
            self._live.popleft()
