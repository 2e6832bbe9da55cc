""":class:`TensorItem`: one tensor record of a file on its way from its source tensor to a
host buffer, and on to the writer.

The planner makes one per record (:func:`~.planner.plan_file`), the stager copies it
(:class:`~.stager.Stager`, through the item's methods: :meth:`TensorItem.queue_with`,
:meth:`~TensorItem.claim`, :meth:`~TensorItem.take_buffer`, :meth:`~TensorItem.record_event`,
:meth:`~TensorItem.mark_issued`, :meth:`~TensorItem.fail`), the persist stage waits for its
host copy and releases it to the pool.
An item refuses to copy a source that was changed, freed or resized after the save planned it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SnapshotError, describe

if TYPE_CHECKING:
    from .pool import HostBufferPool


def _version_of(t: torch.Tensor | None) -> int | None:
    """``t``'s version counter, which every in-place change moves; None where it has none (an
    inference-mode tensor)."""
    try:
        return None if t is None else t._version
    except RuntimeError:
        return None


def _storage_of(t: torch.Tensor | None) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of ``t``'s storage; None where it has none to ask."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class TensorItem:
    """One storage record of a file: a source tensor and, once staged, its host copy.

    A save plans one per tensor on the training thread (hundreds per file), so it is kept
    light: slots, a lock as its "issued" latch rather than a ``threading.Event`` (a condition
    and a lock each), and its description formatted only when a message needs it.
    """

    __slots__ = ("key", "src", "nbytes", "eager", "_label", "host", "error", "_pool",
                 "_cuda_event", "_issued", "_latch", "_claimed", "_version", "_job", "_storage")

    def __init__(self, key: str, src: torch.Tensor | None, nbytes: int, eager: bool,
                 what: str | tuple = "") -> None:
        self.key, self.src, self.nbytes, self.eager = key, src, nbytes, eager
        self._version = _version_of(src)  # in-place changes before the copy are refused
        self._storage = _storage_of(src) if nbytes else None  # and a storage freed or resized
        self._label = what  # a string, or (file, shape, dtype) formatted by ``what``
        self.host: torch.Tensor | None = None
        self.error: BaseException | None = None
        self._pool: HostBufferPool | None = None
        self._cuda_event: Any = None
        self._issued = False
        self._latch = threading.Lock()  # held until the copy is issued; waiters pass through
        self._latch.acquire()
        self._claimed = False  # a thread took it to copy (the copier, or the fence helping)
        self._job: object = None  # the save's items submitted together (Stager.submit)

    @property
    def what(self) -> str:
        if isinstance(self._label, tuple):
            file, shape, dtype = self._label
            return f"{file}: tensor record {self.key} {tuple(shape)} {dtype}"
        return self._label

    def check_unchanged(self, src: torch.Tensor) -> None:
        """Raise if ``src`` was changed in place since the save planned it (its version
        counter moved): its copy would hold values of after the save, or a mix. Changes
        through ``.data``, which has a counter of its own, are not seen."""
        now = _version_of(src)
        if self._storage is not None and _storage_of(src) != self._storage:
            # resize_(0) (FSDP-style freeing) moves no version counter, and copying from the
            # freed memory would crash the process
            where = _storage_of(src)
            raise SnapshotError(
                f"its storage was freed, resized or replaced after the save and before its copy "
                f"(then {self._storage[1]} bytes, now {where[1] if where else 'none'}): the "
                "checkpoint would hold other memory. Code that frees or swaps storages outside "
                "the optimizer step must call deepspeed_async_ckpt.fence_all() first")
        if now != self._version:
            raise SnapshotError(
                f"changed in place after the save and before its copy (its version went from "
                f"{self._version} to {now}): the checkpoint would hold values "
                "of after the save. Code that changes weights or optimizer state outside the "
                "optimizer step must call deepspeed_async_ckpt.fence_all() first")

    @property
    def issued(self) -> bool:
        """Whether the copy was issued (or failed, or will never happen)."""
        return self._issued

    @property
    def job(self) -> object:
        """What the item was queued with (:meth:`queue_with`): its save's items."""
        return self._job

    @property
    def storage(self) -> tuple[int, int] | None:
        """``(data_ptr, nbytes)`` of the source's storage when the save planned it."""
        return self._storage

    @property
    def cuda_event(self) -> Any:
        """The CUDA event that completes the copy on the copy stream; None without one."""
        return self._cuda_event

    def queue_with(self, job: object) -> None:
        """The item is queued for the background copier as part of ``job``."""
        self._job = job

    def claim(self) -> bool:
        """Take the item to copy it (the copier, or a fence helping); False if another thread
        took it first. Called under the stager's lock, which makes the test and set one step."""
        if self._claimed:
            return False
        self._claimed = True
        return True

    def take_buffer(self, host: torch.Tensor, pool: HostBufferPool | None) -> None:
        """The item's host buffer, from ``pool`` (None: a buffer of its own), which
        :meth:`release` gives back."""
        self.host, self._pool = host, pool

    def record_event(self, event: Any) -> None:
        """The copy was issued on a CUDA stream; ``event`` completes it."""
        self._cuda_event = event

    def mark_issued(self) -> None:
        """The copy was issued (or failed, or will never happen)."""
        if not self._issued:
            self._issued = True
            self._latch.release()

    def fail(self, exc: BaseException) -> None:
        """The item will not be copied: record ``exc`` (unless an error is recorded already),
        drop the source and count it as issued. No effect once it was issued."""
        if not self._issued:
            self.error = self.error or exc
            self.src = None
            self.mark_issued()

    def wait_issued(self) -> None:
        """Block until the copy was issued (not until it has finished: :meth:`wait_copied`)."""
        if not self._issued:
            with self._latch:
                pass

    def wait_copied(self) -> None:
        """Block until the host copy has finished or failed (never raises)."""
        self.wait_issued()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()

    def wait_staged(self) -> torch.Tensor:
        """Block until the host copy is complete; returns it (flat uint8)."""
        self.wait_copied()
        if self.error is not None:
            raise SnapshotError(f"staging {self.what} failed: {describe(self.error)}") from self.error
        return self.host

    def cancel(self) -> None:
        """Mark an item that no copier will ever stage (the synchronous mode, after a failure)
        as done, so :meth:`release` does not wait for it. No effect once it was staged."""
        if not self._issued:
            self.src = None
            self.mark_issued()

    def release(self) -> None:
        """Return the host buffer to the pool (after it was written, or on failure)."""
        self.wait_copied()
        if self._pool is not None and self.host is not None:
            self._pool.release(self.host)
        self.host = None
        self.src = None
