""":class:`Stager`: copies the planned tensor items to host.

*Eager* items are copied before ``save`` returns (state the training loop may mutate at any
time: client state, scalar step counters, scheduler tensors). *Lazy* items (model and optimizer
tensors, which only the optimizer step mutates) are copied by a background copier into buffers
from :class:`~.pool.HostBufferPool` while the next forward/backward runs. With CUDA the copies
run on a dedicated copy stream into pinned buffers and complete through CUDA events. The
training loop calls :meth:`Stager.fence` before the optimizer step; it blocks only while copies
are outstanding, and copies tensors in host memory (all of them without CUDA) alongside the
copier meanwhile.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from typing import Any, Callable, Iterable

import torch

from ..errors import SnapshotError, describe
from ..qos import lower_this_thread
from ..storage import aligned_size
from .item import TensorItem, _storage_of
from .pool import HostBufferPool


class _Job:
    """What a submit's items share when the caller names no save (weakly referenced)."""

    __slots__ = ("__weakref__",)


def _on_host(item: TensorItem) -> bool:
    """Whether ``item`` is still to be copied from host memory (a CPU copy, which the fence
    can help with), not from a CUDA device."""
    return item.src is not None and not item.src.is_cuda


class Stager:
    """Copies tensor items to host. One background copier thread serves lazy items in FIFO
    order; eager items and the synchronous mode call :meth:`stage` inline; a fence that would
    block copies items in host memory from the back of the queue (:meth:`fence`)."""

    def __init__(self, pool: HostBufferPool, use_cuda: bool) -> None:
        self.pool = pool
        self.use_cuda = use_cuda
        self._copy_stream = torch.cuda.Stream() if use_cuda else None
        self._queue: queue.SimpleQueue[tuple[list[TensorItem], Any] | None] = queue.SimpleQueue()
        self._pending: collections.deque[TensorItem] = collections.deque()
        self._failed_jobs: weakref.WeakSet = weakref.WeakSet()
        """Jobs (saves) whose staging error a fence raised: raised once, the rest dropped."""
        self._lock = threading.Lock()
        self._queued_bytes = 0  # pool bytes submitted and not yet acquired: sizes new blocks
        self.staged_bytes = 0
        """Bytes copied to host by this rank since start (pool and eager)."""
        self.pooled_bytes = 0
        """Pool bytes those copies took (whole pages per record), since start: what a save
        needs from the pool, for sizing ``host_buffer_gb`` and :meth:`HostBufferPool.reserve`."""
        self.fence_copied_bytes = 0
        """Bytes the training thread copied itself while blocked at the fence, since start."""
        self._helpable: collections.deque[TensorItem] = collections.deque()
        """Items of the copier's current job that have their buffers: the fence takes from
        the back."""
        self._jobs = [0, 0]  # jobs submitted, and jobs whose buffers the copier has taken
        self._prepared = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="async-ckpt-copier", daemon=True)
        self._thread.start()

    def ready_event(self) -> Any:
        """With CUDA, an event recorded on the current (training) stream: copies on the copy
        stream wait for it, so they see the values as of now, with every kernel queued before
        it done, not as of when the copy stream gets to them. None without CUDA."""
        if not self.use_cuda:
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def submit(self, items: Iterable[TensorItem], job: Any = None) -> None:
        """Queue lazy items for the background copier (called on the training thread).
        ``job``: what they belong to (a save, which may submit several times; its own by
        default): once a fence raised a staging error of a job, its other items are dropped,
        and those submitted later fail at once, uncopied (the save is failed already)."""
        ready = self.ready_event()
        items, job = list(items), _Job() if job is None else job
        with self._lock:
            failed = job in self._failed_jobs
        if failed:
            for item in items:
                item.fail(SnapshotError("not copied: an earlier record of its save failed to stage"))
            return
        for item in items:
            item.queue_with(job)
        with self._lock:
            self._pending.extend(items)
            self._queued_bytes += sum(aligned_size(item.nbytes) for item in items)
            self._jobs[0] += 1
        self._queue.put((items, ready))  # one wake-up of the copier, after the lock is free

    def stage_eager(self, items: Iterable[TensorItem]) -> None:
        """Copy items now, outside the pool (small state the loop may mutate at any time)."""
        for item in items:
            src = item.src
            try:
                item.host = src.detach().to("cpu", copy=True).contiguous().view(-1).view(torch.uint8) \
                    if item.nbytes else torch.empty(0, dtype=torch.uint8)
            except Exception as exc:  # named as the copier's failures are
                raise SnapshotError(f"staging {item.what} failed: {describe(exc)}") from exc
            item.src = None
            self._count(item.nbytes)
            item.mark_issued()

    def stage(self, item: TensorItem, ready: Any = None, expected_bytes: int = 0) -> None:
        """Copy one item into a pool buffer; with CUDA the copy is only issued here.

        ``expected_bytes`` sizes a new pool block when one is needed (the synchronous mode
        passes its largest record); queued background items are counted automatically.
        """
        if self._acquire(item, expected_bytes, wait=True):
            self._copy(item, ready)

    def _acquire(self, item: TensorItem, expected_bytes: int = 0, *, wait: bool) -> bool:
        """Give ``item`` its pool buffer, unless it has one. Returns False, having taken
        nothing, if ``wait`` is false and the pool has no room now. A failure (a tensor larger
        than the pool) is recorded on the item, which then counts as issued."""
        if item.host is not None or item.issued:
            return True
        try:
            if item.nbytes:
                with self._lock:
                    expected = max(expected_bytes, self._queued_bytes)
                buf = self.pool.acquire(item.nbytes, item.what, expected, wait=wait)
                if buf is None:
                    return False
                item.take_buffer(buf, self.pool)
            else:
                item.take_buffer(torch.empty(0, dtype=torch.uint8), None)
        except BaseException as exc:  # surfaced by wait_staged / fence
            item.fail(exc)
            if not isinstance(exc, Exception):  # Ctrl-C on the training thread: still Ctrl-C
                raise
        return True

    def _copy(self, item: TensorItem, ready: Any = None) -> None:
        """Copy ``item``'s source into its buffer (with CUDA: issue the copy on the copy
        stream), then mark it issued."""
        try:
            if item.issued:  # its buffer could not be had: the error is on the item
                return
            src = item.src
            if item.nbytes:
                item.check_unchanged(src)
                dst = item.host.view(src.dtype).view(src.shape)
                if src.is_cuda and self._copy_stream is not None:
                    with torch.cuda.stream(self._copy_stream):
                        if ready is not None:
                            self._copy_stream.wait_event(ready)
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(self._copy_stream)
                        event = torch.cuda.Event()
                        event.record(self._copy_stream)
                    item.record_event(event)
                else:
                    dst.copy_(src)
                    item.check_unchanged(src)  # not even while it was being copied
            self._count(item.nbytes, pooled=aligned_size(item.nbytes))
        except BaseException as exc:  # surfaced by wait_staged / fence
            item.error = exc
            if not isinstance(exc, Exception):  # Ctrl-C on the training thread: still Ctrl-C
                raise
        finally:
            item.src = None
            item.mark_issued()

    def fence(self, unchanged: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        """Block until every queued copy is issued; with CUDA, make the current stream wait for
        the copies instead of blocking the host. Called before the optimizer step.

        ``unchanged``: what the caller knows the coming change leaves alone (the optimizer
        step: frozen parameters), called only when copies are queued. A copy whose source
        shares a storage with one of them is not waited for (nor helped with): the copier
        gets to it while training goes on, and a change before it is copied still fails the
        save, as for any tensor (the version and storage checks). A later fence without
        ``unchanged`` waits for it.

        Where sources are in host memory (no CUDA, or ZeRO-Offload's optimizer state beside
        CUDA weights), a training thread that would block here copies too: it takes such
        items from the back of the queue that already have their buffers (the copier takes a
        buffer for every item it can when such a save arrives) while the copier works from
        the front, so a copy that outlasts forward and backward finishes with two threads
        copying."""
        with self._lock:
            if not self._pending:
                return
        skip = {_storage_of(t) for t in unchanged()} - {None} if unchanged is not None else set()
        at = 0  # items before it in the queue are left to the copier (their sources unchanged)
        while True:
            with self._lock:
                while at < len(self._pending) and skip and not self._pending[at].issued \
                        and self._pending[at].storage in skip:
                    at += 1
                if at >= len(self._pending):
                    return
                item = self._pending[at]
            if not item.issued and self._copy_one_from_the_back(skip):
                continue
            item.wait_issued()
            with self._lock:  # done with it, failed or not: an error is raised once
                if at < len(self._pending) and self._pending[at] is item:
                    del self._pending[at]
                if item.error is not None:  # and once per save: the rest of it failed with it
                    self._pending = collections.deque(i for i in self._pending if i.job is not item.job)
                    self._failed_jobs.add(item.job)
                at = 0  # another thread's fence may have taken items meanwhile: look again
            if item.error is not None:
                raise SnapshotError(f"staging {item.what} failed: {describe(item.error)}") from item.error
            if item.cuda_event is not None:
                torch.cuda.current_stream().wait_event(item.cuda_event)

    def forget_issued(self) -> None:
        """Drop the queued items already copied or failed, once their saves are over (the
        checkpointer's ``wait``): a loop that never fences does not keep them for good, and a
        later fence does not raise again a staging error the save's failure reported."""
        with self._lock:
            self._pending = collections.deque(item for item in self._pending if not item.issued)

    def _copy_one_from_the_back(self, skip: set = frozenset()) -> bool:
        """Copy the last queued item from host memory that has its buffer and that no thread
        has taken, unless its storage is in ``skip``; False if there is none (a save of CUDA
        tensors has none: the fence does not block the host there)."""
        claimed = None
        try:
            with self._lock:
                while self._jobs[1] < self._jobs[0]:  # the copier is taking buffers: in a moment
                    self._prepared.wait()
                while self._helpable:
                    item = self._helpable.pop()
                    if not item.issued and item.storage not in skip and item.claim():
                        claimed = item
                        break
                else:
                    return False
            self._copy(claimed)
        except BaseException as exc:
            # Cut short (Ctrl-C) between the claim and _copy's own handling: the copier skips a
            # claimed item, so it must end issued here, failed, or its writer and the next
            # fence wait for it for good.
            if claimed is not None:
                claimed.fail(exc)
            raise
        self.fence_copied_bytes += claimed.nbytes
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _count(self, n: int, pooled: int = 0) -> None:
        with self._lock:
            self.staged_bytes += n
            self.pooled_bytes += pooled

    def _run(self) -> None:
        lower_this_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            items, ready = job
            if any(_on_host(item) for item in items):  # every buffer now: the fence can copy too
                for item in items:
                    if not self._acquire(item, wait=False):
                        break
                    if _on_host(item):  # (a CUDA source's copy is the copy stream's DMA)
                        with self._lock:
                            self._helpable.append(item)
            with self._lock:
                self._jobs[1] += 1
                self._prepared.notify_all()
            for item in items:
                with self._lock:
                    mine = item.claim()
                if mine:
                    self.stage(item, ready)
                with self._lock:
                    self._queued_bytes -= aligned_size(item.nbytes)
            with self._lock:
                self._helpable.clear()  # all taken by now
