"""The saves of one checkpointer and the lock that guards them: the one open and those in
flight, each as its :class:`~.job.SaveJob` (which holds its handle).

One :class:`Saves` is shared by the checkpointer's collaborators: the training thread opens
and seals saves here, the committer thread settles them, retention and the process registry
read which directories are in use. Lock order: ``dirs_lock`` before ``lock``; neither is held
while waiting for a save.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

from ..errors import CommitError
from .handle import CheckpointHandle
from .job import SaveJob


def time_left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic``; None: no limit), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Saves:
    """What is being saved, as every thread of one checkpointer sees it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Guards ``inflight`` and ``reporting`` here, and the lists of the collaborators
        built with it (reports, retention futures)."""
        self.dirs_lock = threading.Lock()
        """Retention against saves announcing their directories (``beginning``, the pointer
        each save directory names)."""
        self.current: SaveJob | None = None
        """The open save (between ``begin`` and ``end``), on the training thread."""
        self.beginning: str | None = None
        """Under ``dirs_lock``: the directory of a ``begin`` still agreeing its save id."""
        self.inflight: collections.deque[SaveJob] = collections.deque()
        """Under ``lock``: sealed saves the committer has not settled yet, oldest first."""
        self.reporting: collections.Counter[str] = collections.Counter()
        """Under ``lock``: checkpoint directories whose commit callbacks are queued or running:
        retention leaves them (a callback may be uploading the checkpoint)."""
        self.closed = False
        self.history: collections.deque[CheckpointHandle] = collections.deque(maxlen=64)
        """The last 64 sealed checkpoints of this process, oldest first (timings, bytes, errors)."""
        self.last: SaveJob | None = None
        """The last sealed save (``history[-1]``'s): a fence's wait is counted there."""
        self._begun: weakref.WeakKeyDictionary[CheckpointHandle, weakref.ref[SaveJob]] = \
            weakref.WeakKeyDictionary()
        """Under ``lock``: each save's job by its handle, for a caller that hands a handle
        back (:meth:`job_of`); weakly held both ways, as each holds the other."""

    def open(self, job: SaveJob) -> None:
        """``job`` is the open save (``begin``)."""
        with self.lock:
            self._begun[job.handle] = weakref.ref(job)
        self.current = job

    def job_of(self, handle: CheckpointHandle) -> SaveJob | None:
        """The job of ``handle`` if this checkpointer began it (None for another's): for the
        calls that take a handle from the caller, never for the pipeline's own."""
        with self.lock:
            ref = self._begun.get(handle)
        return None if ref is None else ref()

    def pending(self) -> list[CheckpointHandle]:
        """Saves whose directories are in use: those in flight (until their commit, finalize
        steps, swap and pointer included, is done)."""
        with self.lock:
            return [job.handle for job in self.inflight]

    def dirs_in_use(self) -> set[str]:
        """The checkpoint directories of the open save and of those in flight. The open save
        is read first, as retention's ``protected`` does: one sealed meanwhile is in flight."""
        current = self.current
        dirs = {h.ckpt_dir for h in self.pending()}
        if current is not None:
            dirs.add(current.handle.ckpt_dir)
        return dirs

    def busy(self, ckpt_dir: str) -> bool:
        return any(h.ckpt_dir == ckpt_dir for h in self.pending())

    def wait_committed(self, deadline: float | None, timeout: float | None) -> None:
        """Wait until every sealed save is settled by the committer, until ``deadline``
        (``time.monotonic``); past it, raise naming ``timeout`` (s)."""
        while True:
            with self.lock:
                job = self.inflight[0] if self.inflight else None
            if job is None:
                return
            if not job.handle.wait_committed(time_left(deadline)):
                raise CommitError(f"checkpoint {job.handle.tag!r} not committed within {timeout} s")

    def settle(self, job: SaveJob) -> None:
        """The committer is done with ``job``: no longer in flight (failed or abandoned,
        its staging directory, if any, is left for the next save to sweep)."""
        with self.lock:
            if job in self.inflight:
                self.inflight.remove(job)
