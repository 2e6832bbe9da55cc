""":class:`HostBufferPool`: the bounded host staging area that tensor copies go into, reused
across saves.

The snapshot stage's :class:`~.stager.Stager` acquires a buffer per tensor record; the persist
stage releases it once the record is written. The pool's memory is a few large
:class:`~.pinned.HostBlock` allocations, kept from one save to the next.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..errors import SnapshotError
from ..qos import lower_this_thread
from ..storage import DIRECT_ALIGN, aligned_size
from .pinned import HostBlock


class HostBufferPool:
    """A bounded host staging area, reused across saves.

    Memory is held in large blocks, allocated on demand, each as big as the bytes then queued
    for staging (a whole save is queued at once, so a save that fits the pool gets one block),
    and kept: from the second save of the same state on, nothing is allocated and no page is
    faulted in while training runs. :meth:`reserve` does the same for the first save, ahead of
    it, in a background thread. ``acquire`` blocks while the pool is full (backpressure).
    An idle block too small for a new buffer is freed and replaced. Pinned when ``pin`` is
    true (CUDA present), for copies from ``device`` (default: the current CUDA device), and
    pinned exactly: at most ``capacity_bytes`` are page-locked at any time (see :class:`HostBlock`).

    ``shared``: blocks in shared memory, which a persist worker process maps
    (:mod:`..persist.process`): it finds a buffer with :meth:`locate` and learns of a block
    the pool drops through :attr:`on_block_freed`.
    """

    def __init__(self, capacity_bytes: int, pin: bool, device: int | None = None, *,
                 shared: bool = False) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.pin = pin
        self.shared = shared
        self.on_block_freed: list[Callable[[int], None]] = []
        """Called with a block's id when the pool drops it (with the pool's lock held)."""
        # Blocks may be made on a background thread, whose CUDA device is not the trainer's.
        self._pin_device = (torch.cuda.current_device() if device is None else device) if pin else None
        self._cond = threading.Condition()
        self._blocks: list[HostBlock] = []
        self._live: dict[int, tuple[HostBlock, list]] = {}  # buffer data_ptr -> its block entry
        self.allocations = 0
        """Number of blocks ever allocated (stays flat once saves repeat)."""
        self.peak_bytes = 0
        """Largest number of bytes held in blocks at any time."""
        self._reserving = False  # a reserve() thread is allocating: acquire waits for its block
        self.reserve_error: BaseException | None = None
        """Why the last :meth:`reserve` failed, if it did (the first save then allocates)."""

    @property
    def held_bytes(self) -> int:
        return sum(b.size for b in self._blocks)

    def acquire(self, nbytes: int, what: str, expected_bytes: int = 0, *,
                wait: bool = True) -> torch.Tensor | None:
        """A uint8 tensor of exactly ``nbytes``; blocks until the pool has room, or returns
        None at once if it has none and ``wait`` is false.

        ``expected_bytes`` (the bytes queued for staging, this buffer included) sizes a new
        block when one is needed, so that the rest of the queue fits in it.
        """
        n = aligned_size(nbytes)
        if n > self.capacity_bytes:
            raise SnapshotError(
                f"{what} needs {n} bytes of host staging ({nbytes} rounded up to whole pages) but "
                f"host_buffer_gb allows only {self.capacity_bytes} bytes; raise "
                "async_checkpoint.host_buffer_gb")
        with self._cond:
            while True:
                while self._reserving:  # its block is about to arrive: allocate nothing twice
                    self._cond.wait()
                for block in self._blocks:
                    got = block.carve(n)
                    if got is not None:
                        start, entry = got
                        buf = block.memory[start:start + nbytes]
                        self._live[buf.data_ptr()] = (block, entry)
                        return buf
                self._drop_idle()  # an idle block that could not take the buffer is too small
                room = self.capacity_bytes - self.held_bytes
                if room >= n:
                    self._add_block(HostBlock(min(room, max(n, aligned_size(expected_bytes))),
                                              self._pin_device, shared=self.shared))
                    continue
                if not wait:
                    return None
                self._cond.wait()

    def reserve(self, nbytes: int) -> threading.Thread | None:
        """Allocate one block for a save of about ``nbytes`` (at most the capacity) and fault
        its pages in, in a background thread, so the first save finds its memory ready.

        A first save otherwise faults its staging memory in while the copier fills it, and
        the fence before the next optimizer step waits for that (0.4 s/GB here, up to 3.6 s/GB
        when the hypervisor has taken the free memory back). Does nothing, and returns None,
        if the pool already holds ``nbytes`` (or more), holds a buffer (a save is using it),
        is being reserved already, or ``nbytes`` is 0; otherwise returns the thread. Idle
        blocks smaller than that (an earlier reservation from a lower estimate) are freed
        first, so the pool stays within its capacity and the save gets one block.
        """
        n = min(aligned_size(nbytes), self.capacity_bytes // DIRECT_ALIGN * DIRECT_ALIGN)
        with self._cond:
            if n <= self.held_bytes or self._reserving or not all(b.idle for b in self._blocks):
                return None
            self._drop_idle()
            self._reserving = True
        thread = threading.Thread(target=self._fault_in, args=(n,), name="async-ckpt-reserve",
                                  daemon=True)
        try:
            thread.start()
        except BaseException as exc:  # "can't start new thread": no block will come
            with self._cond:
                self.reserve_error, self._reserving = exc, False
                self._cond.notify_all()
            raise
        return thread

    def _fault_in(self, nbytes: int) -> None:
        lower_this_thread()
        block = None
        try:
            block = HostBlock(nbytes, self._pin_device, shared=self.shared)  # pinning faults pages in
            block.fault_in()
        except BaseException as exc:  # e.g. out of memory: the first save then allocates
            self.reserve_error, block = exc, None
        with self._cond:
            if block is not None:
                self._add_block(block)
            self._reserving = False
            self._cond.notify_all()

    def _drop_idle(self) -> None:  # with self._cond held
        for block in self._blocks:
            if block.idle:
                block.free()
                for forget in self.on_block_freed:
                    forget(block.id)
        self._blocks = [b for b in self._blocks if not b.idle]

    def _add_block(self, block: HostBlock) -> None:  # with self._cond held
        self._blocks.append(block)
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def locate(self, buf: torch.Tensor) -> tuple[HostBlock, int] | None:
        """The block of a live buffer of this pool and the buffer's offset in it, in bytes;
        None for a buffer from elsewhere."""
        with self._cond:
            found = self._live.get(buf.data_ptr())
        if found is None:
            return None
        return found[0], buf.data_ptr() - found[0].memory.data_ptr()

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            block, entry = self._live.pop(buf.data_ptr())
            block.give_back(entry)
            self._cond.notify_all()
