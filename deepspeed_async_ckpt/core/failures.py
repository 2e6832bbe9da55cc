"""Failures of the background stages: recorded where they happen, raised at the next
``begin``, ``wait`` or ``close`` of the training thread, once.

A :class:`FailureLedger` is written by the committer thread (a save's failure) and read by the
training thread (``begin``, ``wait``, ``end`` of a sync save), or whichever thread closes the
checkpointer. Every rank keeps its own; ``begin`` and ``wait_all_ranks`` share them across ranks.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from ..errors import AsyncCheckpointError, DurabilityError, PersistError, describe

if TYPE_CHECKING:
    from .handle import CheckpointHandle


def reraise(exc: BaseException, more: int = 0) -> AsyncCheckpointError:
    """A background stage's error ``exc`` raised for the caller, with ``more`` failed saves
    after it reported together."""
    more_text = f" (and {more} more failed save(s))" if more else ""
    if isinstance(exc, DurabilityError):  # in place, not "not committed"
        err: AsyncCheckpointError = DurabilityError(f"a previous checkpoint's commit did not complete: "
                                                    f"{exc}{more_text}", pointer_moved=exc.pointer_moved)
        err.__cause__ = exc
        return err
    cls = exc.__class__ if isinstance(exc, AsyncCheckpointError) else PersistError
    err = cls(f"a previous checkpoint failed and was not committed (the last committed one is "
              f"intact): {exc}" + more_text)
    err.__cause__ = exc
    return err


def this_save_failed(handle: CheckpointHandle, exc: BaseException) -> BaseException:
    """A sync save's own failure, raised by its ``end``: as it is where it says what failed
    (a commit error; Ctrl-C), else named as this checkpoint's."""
    if isinstance(exc, (AsyncCheckpointError, KeyboardInterrupt, SystemExit)):
        return exc
    err = PersistError(f"checkpoint {handle.ckpt_dir!r} (tag {handle.tag}) not committed (the last "
                       f"committed one is intact): {type(exc).__name__}: {describe(exc)}")
    err.__cause__ = exc
    return err


class FailureLedger:
    """The errors the background stages recorded and nobody raised yet, in order.

    ``lock`` is the checkpointer's lock (:class:`~.saves.Saves`), shared with the files written
    beside: ``collect`` is called under it when the errors are taken, and returns the failures
    of those files that no save took as its own, which are reported with the rest."""

    def __init__(self, lock: threading.Lock, collect: Callable[[], list[BaseException]]) -> None:
        self.lock = lock
        self.errors: list[BaseException] = []
        """Under ``lock``: recorded, not yet taken."""
        self._collect = collect

    def record(self, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(exc)

    def discard(self, exc: BaseException) -> None:
        """Forget ``exc``, raised by its own save (unless another thread took it meanwhile)."""
        with self.lock:
            if exc in self.errors:
                self.errors.remove(exc)

    def unreported(self) -> list[BaseException]:
        with self.lock:
            return list(self.errors)

    def take(self) -> tuple[BaseException | None, int]:
        """The first error the background stages recorded (None: none) and how many more; all
        of them are consumed, reported once together, so that a failure is not raised again
        at a later save, after its cause was fixed."""
        with self.lock:
            self.errors.extend(self._collect())
            errors, self.errors = self.errors, []
        return (errors[0], len(errors) - 1) if errors else (None, 0)

    def raise_first(self) -> None:
        """Raise (once) the first error recorded, if any, with how many more there were
        (consumed too)."""
        exc, more = self.take()
        if exc is not None:
            raise reraise(exc, more)
