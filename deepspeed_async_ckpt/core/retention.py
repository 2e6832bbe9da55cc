"""Retention and deletion: older checkpoints removed once a newer one commits (the
checkpointer's :class:`~..commit.RetentionPolicy`), the old copies of re-saved checkpoints
deleted, and what a crash left half-replaced finished.

Rank 0 only. Deletions run on the retention thread (``async-ckpt-retirer``), one at a time and
in order, queued by the committer thread (after a commit moved the pointer, and after a swap),
by the commit callbacks' thread (once a callback lets go of a checkpoint), by the training
thread (``begin``'s recovery) and by integrations; once the checkpointer is closed they run on
the caller's thread.
"""

from __future__ import annotations

import collections
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from ..commit import (REMOVING_PREFIX, KeepLast, RetentionPolicy, finish_replacements, remove_trash,
                      retire_checkpoints)
from ..commit.retire import step_in_name
from ..errors import AsyncCheckpointError
from ..qos import lower_this_thread
from ..storage import Storage
from .handle import CheckpointHandle
from .job import SaveJob
from .saves import Saves, time_left

logger = logging.getLogger(__name__)


def policy_of(keep_last: int, policy: RetentionPolicy | None) -> RetentionPolicy | None:
    """The retention policy of a checkpointer: ``policy`` if given, else the config's
    ``keep_last`` as :class:`~..commit.KeepLast` (0: None, every checkpoint kept)."""
    if policy is not None:
        if not isinstance(policy, RetentionPolicy):
            raise ValueError(f"retention must be a RetentionPolicy (KeepLast, KeepEvery, KeepIf, "
                             f"KeepAny, or one of your own), got {policy!r}")
        return policy
    return KeepLast(keep_last) if keep_last else None


class Retention:
    """Rank 0's retention for one checkpointer. ``policy``: which committed checkpoints to keep
    (None: all); ``step_of``: the step a checkpoint's name holds, for the policy (the number
    it ends with, by default)."""

    def __init__(self, saves: Saves, storage: Storage, policy: RetentionPolicy | None,
                 step_of: Callable[[str], int | None] = step_in_name) -> None:
        self._saves, self._storage = saves, storage
        self.policy, self._step_of = policy, step_of
        self.pointed: dict[str, str] = {}
        """Under ``saves.dirs_lock``: save directory -> the checkpoint its pointer names, as this
        checkpointer last moved it (:meth:`pointer_moved`); retention never removes it."""
        self._retirer: ThreadPoolExecutor | None = None  # started on first use
        self.retiring: collections.deque[Future] = collections.deque()
        """Under ``saves.lock``: what was queued on the retention thread and not yet waited for."""
        self._last: SaveJob | None = None

    def retire_older(self, handle: CheckpointHandle, job: SaveJob | None = None) -> list[str]:
        """Retention (rank 0, once ``handle`` is committed and the pointer names it): remove
        this engine's committed checkpoints in the same save directory that the policy does
        not keep, never ``handle``'s nor that of a save begun and not yet committed; also its
        checkpoints there that can never be loaded (partial, or committed and never finalized)
        last changed before ``handle`` committed, unless the policy keeps them. Returns the
        names removed, and records them in ``job`` (``handle``'s save: its ``retired``); does
        nothing without a policy. The committer queues it (:meth:`retire_older_later`) once a
        commit moved the pointer.

        A failure to remove an old checkpoint does not undo the commit: it is logged, and the
        next commit tries again.
        """
        policy = self.policy
        if policy is None:
            return []
        saves = self._saves

        def protected() -> set[str]:  # called with saves.dirs_lock held
            # current first: end() queues the save in flight, then clears current (outside
            # this lock), so reading them the other way round could miss a save in between
            current = saves.current
            busy = {h.ckpt_dir for h in saves.pending()}
            with saves.lock:
                reporting = set(saves.reporting)  # its commit callbacks may still read it
            return busy | reporting | set(self.pointed.values()) | \
                {d for d in (saves.beginning, current and current.handle.ckpt_dir, handle.ckpt_dir) if d}

        retired: list[str] = []
        try:
            retired = retire_checkpoints(
                self._storage, os.path.dirname(handle.ckpt_dir), policy=policy,
                protected=protected, lock=saves.dirs_lock, step_of=self._step_of,
                committed_now=os.path.basename(handle.ckpt_dir))
            if job is not None:
                job.retired = retired
            if retired:
                logger.info("async checkpoint: %s committed; removed older checkpoint(s) %s",
                            handle.ckpt_dir, ", ".join(retired))
        except OSError as exc:
            logger.warning("async checkpoint: %s is committed, but removing older checkpoints "
                           "(%r) failed: %s", handle.ckpt_dir, policy, exc)
        return list(job.retired) if job is not None else retired

    def pointer_moved(self, handle: CheckpointHandle) -> None:
        """Rank 0: the pointer of ``handle``'s save directory now names it. Retention never
        removes that checkpoint, whatever the commit times say: it orders checkpoints by the
        manifest's ``committed_at``, and after rank 0's clock stepped back (an NTP step, a
        restart on a node whose clock is behind) a pass that ran behind the commits would remove
        the checkpoint ``latest`` had just moved to. The committer calls it for the pointer it
        moves (also where the move's fsync failed, the rename done)."""
        with self._saves.dirs_lock:
            self.pointed[os.path.dirname(handle.ckpt_dir)] = handle.ckpt_dir

    def retire_older_later(self, job: SaveJob) -> Future:
        """:meth:`retire_older` of the save ``job`` on this checkpointer's retention thread, one
        call at a time: removing a checkpoint can take as long as saving it (on ext4 mounted
        with online discard, say), and neither the next commit nor a sync
        save should wait for that. :meth:`wait` and :meth:`close` wait for it. Once closed, it
        runs here."""
        self._last = job  # run again when callbacks let go
        return self.later(self.retire_older, job.handle, job)

    def later(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` on the retention thread, after what was queued there before
        (every deletion runs there, one at a time); here once closed."""
        with self._saves.lock:  # close() sets closed before it takes the lock to stop the thread
            if not self._saves.closed:
                if self._retirer is None:
                    self._retirer = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-retirer",
                                                       initializer=lower_this_thread)
                self._prune()  # nobody called wait() meanwhile
                future = self._retirer.submit(fn, *args, **kwargs)
                self.retiring.append(future)
                return future
        done: Future = Future()  # closed: here, outside the lock (fn may take it)
        done.set_result(fn(*args, **kwargs))
        return done

    def _prune(self) -> None:
        """Under ``saves.lock``: drop the retention futures that are done, except the first that
        failed (for :meth:`wait` to raise once); a loop that never waits keeps no others."""
        kept: collections.deque[Future] = collections.deque()
        failed = False
        for future in self.retiring:
            if future.done():
                if future.exception() is None:
                    continue
                if failed:  # the first is raised by wait(); this one is only logged
                    logger.warning("async checkpoint: retention failed again: %r", future.exception())
                    continue
                failed = True
            kept.append(future)
        self.retiring = kept

    def recover(self, save_dir: str, *, sweep: bool = True) -> list[str]:
        """Rank 0, before saving into or loading from ``save_dir`` (``begin`` calls it): finish
        a replacement of a checkpoint that a crash cut short, and, with ``sweep`` (saves only:
        a load may read another job's directory while that job saves), queue the removal of
        staging directories that never committed (see :func:`~.commit.finish_replacements`).
        Returns the names of the checkpoints it put back in place."""
        save_dir = os.path.abspath(save_dir)
        busy = {h.write_dir for h in self._saves.pending()}
        rolled, trash = finish_replacements(self._storage, save_dir, busy, sweep=sweep)
        if rolled:
            logger.warning("async checkpoint: finished replacing %s in %s (the process saving it "
                           "stopped between its two renames)", ", ".join(rolled), save_dir)
        if trash:
            self.later(self.remove_trash, save_dir)
        return rolled

    def remove_later(self, path: str) -> bool:
        """Rename the directory ``path`` out of sight now (as retention does) and delete it on
        the retention thread. False, nothing done, if it is a link, no directory, or cannot be
        renamed. Any thread."""
        parent, name = os.path.split(os.path.abspath(path))
        if os.path.islink(path) or not os.path.isdir(path):
            return False
        try:
            self._storage.replace(path, os.path.join(parent, f"{REMOVING_PREFIX}{name}.{os.urandom(6).hex()}"),
                                  durable=False)
        except OSError:
            return False
        self.later(self.remove_trash, parent)
        return True

    def remove_trash(self, save_dir: str) -> None:
        try:
            remove_trash(self._storage, save_dir)
        except OSError as exc:
            logger.warning("async checkpoint: removing replaced or abandoned checkpoints in %s "
                           "failed (tried again after the next commit): %s", save_dir, exc)

    def released(self, ckpt_dir: str) -> None:
        """The commit callbacks on ``ckpt_dir`` are done: the last retention, which left it
        for them, runs again if it was for that save directory."""
        last = self._last
        if last is not None and ckpt_dir != last.handle.ckpt_dir and \
                os.path.dirname(last.handle.ckpt_dir) == os.path.dirname(ckpt_dir):
            self.retire_older_later(last)

    def running(self) -> bool:
        """Under ``saves.lock``: whether a deletion is queued or running."""
        return any(not f.done() for f in self.retiring)

    def wait(self, deadline: float | None, timeout: float | None) -> BaseException | None:
        """Wait until what is queued has run, until ``deadline`` (``time.monotonic``; past it,
        raise naming ``timeout``, in s). Returns the exception of the first task that raised
        (a bug: :meth:`retire_older` logs its OSErrors), once; None if none did."""
        while True:
            with self._saves.lock:
                retiring = self.retiring[0] if self.retiring else None
            if retiring is None:
                return None
            try:
                retiring.exception(time_left(deadline))  # waits
            except FutureTimeout:
                raise AsyncCheckpointError(f"removing older checkpoints (retention) did not "
                                           f"finish within {timeout} s") from None
            with self._saves.lock:
                if self.retiring and self.retiring[0] is retiring:
                    self.retiring.popleft()
            if retiring.exception() is not None:
                return retiring.exception()

    def shutdown(self) -> None:
        """Run what is queued to the end and stop the thread (``close``, once closed)."""
        with self._saves.lock:
            retirer = self._retirer
        if retirer is not None:
            retirer.shutdown(wait=True)
