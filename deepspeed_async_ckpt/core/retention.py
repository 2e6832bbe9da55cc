"""Retention and deletion: older checkpoints removed once a newer one commits (``keep_last``),
checkpoints that a re-save replaced swapped in and their old copies deleted, and what a crash
left half-replaced finished.

Rank 0 only. Deletions run on the retention thread (``async-ckpt-retirer``), one at a time and
in order, queued by the committer thread (after a commit), by the commit callbacks' thread
(once a callback lets go of a checkpoint), by the training thread (``begin``'s recovery,
``swap_in``) and by adapters; once the checkpointer is closed they run on the caller's thread.
"""

from __future__ import annotations

import collections
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from ..commit import finish_replacements, remove_trash, replace_checkpoint, retire_checkpoints
from ..errors import AsyncCheckpointError
from ..storage import Storage
from .handle import CheckpointHandle
from .saves import Saves, time_left

logger = logging.getLogger(__name__)


class Retention:
    """Rank 0's retention for one checkpointer. ``keep_last``: the config's default."""

    def __init__(self, saves: Saves, storage: Storage, keep_last: int) -> None:
        self._saves, self._storage, self._keep_last = saves, storage, keep_last
        self.pointed: dict[str, str] = {}
        """Under ``saves.dirs_lock``: save directory -> the checkpoint its pointer names, as this
        checkpointer last moved it (:meth:`pointer_moved`); retention never removes it."""
        self._retirer: ThreadPoolExecutor | None = None  # started on first use
        self.retiring: collections.deque[Future] = collections.deque()
        """Under ``saves.lock``: what was queued on the retention thread and not yet waited for."""
        self._last: tuple[CheckpointHandle, int | None, Callable[[str], bool] | None] | None = None

    def retire_older(self, handle: CheckpointHandle, *, keep_last: int | None = None,
                     keep: Callable[[str], bool] | None = None) -> list[str]:
        """Retention (rank 0, once ``handle`` is committed and the pointer names it): remove
        this engine's committed checkpoints in the same save directory beyond the
        ``keep_last`` (default: the config's) most recently committed, except those whose
        name ``keep`` accepts, never ``handle``'s nor that of a save begun and not yet
        committed; also its checkpoints there that can never be loaded (partial, or committed
        and never finalized) last changed before ``handle`` committed. Records and returns the
        names removed; does nothing when ``keep_last`` is 0. The commit stage calls it when it
        moved the pointer (DeepSpeed's ``latest``); an adapter that moves its own pointer
        (Megatron's tracker) calls it after.

        A failure to remove an old checkpoint does not undo the commit: it is logged, and the
        next commit tries again.
        """
        keep_last = self._keep_last if keep_last is None else keep_last
        if not keep_last:
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
                {d for d in (saves.beginning, current and current.ckpt_dir, handle.ckpt_dir) if d}

        try:
            handle.retired = retire_checkpoints(
                self._storage, os.path.dirname(handle.ckpt_dir), keep_last=keep_last,
                protected=protected, lock=saves.dirs_lock, keep=keep,
                committed_now=os.path.basename(handle.ckpt_dir))
            if handle.retired:
                logger.info("async checkpoint: %s committed; removed older checkpoint(s) %s",
                            handle.ckpt_dir, ", ".join(handle.retired))
        except OSError as exc:
            logger.warning("async checkpoint: %s is committed, but removing older checkpoints "
                           "(keep_last=%d) failed: %s", handle.ckpt_dir, keep_last, exc)
        return handle.retired

    def pointer_moved(self, handle: CheckpointHandle) -> None:
        """Rank 0: the pointer of ``handle``'s save directory now names it. Retention never
        removes that checkpoint, whatever the commit times say: it orders checkpoints by the
        manifest's ``committed_at``, and after rank 0's clock stepped back (an NTP step, a
        restart on a node whose clock is behind) a pass that ran behind the commits would remove
        the checkpoint ``latest`` had just moved to. The commit stage calls it for the pointer it
        moves; an adapter that moves its own (Megatron's tracker) calls it after."""
        with self._saves.dirs_lock:
            self.pointed[os.path.dirname(handle.ckpt_dir)] = handle.ckpt_dir

    def retire_older_later(self, handle: CheckpointHandle, *, keep_last: int | None = None,
                           keep: Callable[[str], bool] | None = None) -> Future:
        """:meth:`retire_older` on this checkpointer's retention thread, one call at a time:
        removing a checkpoint can take as long as saving it (about 0.2 s per GiB on this VM's
        ext4, mounted with online discard), and neither the next commit nor a sync save should
        wait for that. :meth:`wait` and :meth:`close` wait for it. Once closed, it runs here."""
        self._last = (handle, keep_last, keep)  # run again when callbacks let go
        return self.later(self.retire_older, handle, keep_last=keep_last, keep=keep)

    def later(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` on the retention thread, after what was queued there before
        (every deletion runs there, one at a time); here once closed."""
        with self._saves.lock:  # close() sets closed before it takes the lock to stop the thread
            if not self._saves.closed:
                if self._retirer is None:
                    self._retirer = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-retirer")
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

    def swap_in(self, handle: CheckpointHandle) -> None:
        """Rank 0, for a save begun with ``swap_at_commit=False``, once it is committed and
        the caller's own files are in ``handle.write_dir``: replace ``handle.ckpt_dir`` with
        it (nothing to do when the save was not staged)."""
        try:
            if handle.write_dir == handle.ckpt_dir:
                return
            replace_checkpoint(self._storage, handle.write_dir, handle.ckpt_dir, save_id=handle.save_id)
            self.later(self.remove_trash, os.path.dirname(handle.ckpt_dir))
        finally:
            with self._saves.lock:
                self._saves.unswapped.discard(handle)

    def abandon_swap(self, handle: CheckpointHandle) -> None:
        """Rank 0, for a save begun with ``swap_at_commit=False`` that the caller will not
        :meth:`swap_in` (its own files failed): the checkpoint it would have replaced stays,
        and the next save sweeps its staging directory."""
        with self._saves.lock:
            self._saves.unswapped.discard(handle)

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
        if last is not None and ckpt_dir != last[0].ckpt_dir and \
                os.path.dirname(last[0].ckpt_dir) == os.path.dirname(ckpt_dir):
            self.retire_older_later(last[0], keep_last=last[1], keep=last[2])

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
                raise AsyncCheckpointError(f"removing older checkpoints (keep_last) did not "
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
