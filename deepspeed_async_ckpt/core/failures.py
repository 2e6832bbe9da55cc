"""Failures of the background stages: recorded where they happen, raised at the next
``begin``, ``wait`` or ``close`` of the training thread, once.

A :class:`FailureLedger` is written by the committer thread (a save's failure) and read by the
training thread (``begin``, ``wait``, ``end`` of a sync save), or whichever thread closes the
checkpointer. Every rank keeps its own; ``begin`` and ``wait_all_ranks`` share them across ranks.

It also tracks outside work: writes an integration runs on the checkpointer's writer threads
(:meth:`AsyncCheckpointer.submit_write <.checkpointer.AsyncCheckpointer.submit_write>`). Such
a write's failure is a save's when the save depends on it (``begin``'s callbacks claim it);
otherwise the ledger reports it with the recorded errors.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Iterable

from ..commit import committed_checkpoints
from ..errors import AsyncCheckpointError, DurabilityError, PersistError, describe
from .saves import time_left

if TYPE_CHECKING:
    from .handle import CheckpointHandle


def what_stays(save_dir: str | None) -> str:
    """What a failed save left in ``save_dir``, for its error message: a failed save never
    touches a committed checkpoint, so "the last committed one is intact", unless the
    directory holds none, which that would wrongly promise (a disk full on the first save).
    None, or a directory that cannot be read: the first answer, as nothing tells otherwise."""
    if save_dir is not None:
        try:
            if not committed_checkpoints(save_dir):
                return f"nothing has been committed in {save_dir} yet"
        except OSError:
            pass
    return "the last committed one is intact"


def reraise(exc: BaseException, more: int = 0, save_dir: str | None = None) -> AsyncCheckpointError:
    """A background stage's error ``exc`` raised for the caller, with ``more`` failed saves
    after it reported together; ``save_dir``: the failed save's (see :func:`what_stays`)."""
    more_text = f" (and {more} more failed save(s))" if more else ""
    if isinstance(exc, DurabilityError):  # in place, not "not committed"
        err: AsyncCheckpointError = DurabilityError(f"a previous checkpoint's commit did not complete: "
                                                    f"{exc}{more_text}", pointer_moved=exc.pointer_moved)
        err.__cause__ = exc
        return err
    cls = exc.__class__ if isinstance(exc, AsyncCheckpointError) else PersistError
    err = cls(f"a previous checkpoint failed and was not committed ({what_stays(save_dir)}): "
              f"{exc}" + more_text)
    err.__cause__ = exc
    return err


def this_save_failed(handle: CheckpointHandle, exc: BaseException) -> BaseException:
    """A sync save's own failure, raised by its ``end``: as it is where it says what failed
    (a commit error; Ctrl-C), else named as this checkpoint's."""
    if isinstance(exc, (AsyncCheckpointError, KeyboardInterrupt, SystemExit)):
        return exc
    err = PersistError(f"checkpoint {handle.ckpt_dir!r} (tag {handle.tag}) not committed "
                       f"({what_stays(os.path.dirname(handle.ckpt_dir))}): {type(exc).__name__}: "
                       f"{describe(exc)}")
    err.__cause__ = exc
    return err


class _Tracked:
    """A write tracked until its outcome is taken: by a save that depends on it (``claimed``),
    or as a background error."""

    __slots__ = ("path", "future", "claimed")

    def __init__(self, path: str, future: Future) -> None:
        self.path, self.future, self.claimed = path, future, False


class FailureLedger:
    """The errors the background stages recorded and nobody raised yet, in order, and the
    outside writes whose outcome is not taken yet. Its own lock guards both lists; no lock
    of another object is held while it is taken."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        """Under ``lock``: recorded, not yet taken."""
        self._tracked: list[_Tracked] = []
        """Under ``lock``: outside writes, until :meth:`take` finds them done."""
        self._save_dirs: dict[BaseException, str] = {}
        """Under ``lock``: the save directory of each error recorded with one, until taken,
        and of the last error :meth:`take` returned (for its message)."""

    def track(self, path: str, future: Future) -> None:
        """Account for the write of ``path`` that ``future`` completes: :meth:`wait_tracked`
        waits for it, and :meth:`take` reports its failure unless a save claimed it
        (:meth:`claim`)."""
        with self.lock:
            self._tracked.append(_Tracked(path, future))

    def tracked(self) -> list[tuple[str, Future]]:
        """``(path, future)`` of the tracked writes not yet taken (running, or done since the
        last :meth:`take`), in the order they were tracked."""
        with self.lock:
            return [(t.path, t.future) for t in self._tracked]

    def claim(self, futures: Iterable[Future]) -> None:
        """``begin``: the tracked writes among ``futures`` are the save's now (it depends on
        them): their failure is its own, never reported here as well."""
        claimed = set(map(id, futures))
        with self.lock:
            for t in self._tracked:
                if id(t.future) in claimed:
                    t.claimed = True

    def wait_tracked(self, deadline: float | None, timeout: float | None) -> None:
        """Wait until every tracked write is done, until ``deadline`` (``time.monotonic``);
        past it, raise naming ``timeout`` (s)."""
        for path, future in self.tracked():
            try:
                future.exception(time_left(deadline))
            except FutureTimeout:
                raise AsyncCheckpointError(f"writing {path} did not finish within {timeout} s") from None

    def note(self, exc: BaseException, save_dir: str | None = None) -> None:
        """Record ``exc``, the failure of a save into ``save_dir`` (None: not a save's)."""
        with self.lock:
            self.errors.append(exc)
            if save_dir is not None:
                self._save_dirs[exc] = save_dir

    def save_dir_of(self, exc: BaseException) -> str | None:
        """The save directory ``exc`` was recorded with (taken by the last :meth:`take`, or not
        taken yet), else None."""
        with self.lock:
            return self._save_dirs.get(exc)

    def discard(self, exc: BaseException) -> None:
        """Forget ``exc``, raised by its own save (unless another thread took it meanwhile)."""
        with self.lock:
            if exc in self.errors:
                self.errors.remove(exc)
            self._save_dirs.pop(exc, None)

    def unreported(self) -> list[BaseException]:
        with self.lock:
            return list(self.errors)

    def take(self) -> tuple[BaseException | None, int]:
        """The first error the background stages recorded (None: none) and how many more; all
        of them are consumed, reported once together, so that a failure is not raised again
        at a later save, after its cause was fixed."""
        with self.lock:
            self.errors.extend(self._take_tracked())
            errors, self.errors = self.errors, []
            first = errors[0] if errors else None
            self._save_dirs = {e: d for e, d in self._save_dirs.items() if e is first}
        return (first, len(errors) - 1) if errors else (None, 0)

    def _take_tracked(self) -> list[BaseException]:
        """Under the lock: forget the tracked writes that are done; return the failures among
        them that no save claimed."""
        done = [t for t in self._tracked if t.future.done()]
        self._tracked = [t for t in self._tracked if t not in done]
        return [t.future.exception() for t in done
                if not t.claimed and t.future.exception() is not None]

    def raise_first(self) -> None:
        """Raise (once) the first error recorded, if any, with how many more there were
        (consumed too)."""
        exc, more = self.take()
        if exc is not None:
            raise reraise(exc, more, self.save_dir_of(exc))
