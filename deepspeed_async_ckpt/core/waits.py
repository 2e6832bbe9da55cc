"""The waits of one checkpointer: :meth:`Waits.wait`, until this rank's saves are committed,
raising its background errors, and :meth:`Waits.all_ranks`, the same on every rank with one
outcome for all.

``wait`` may be called from any thread (the training loop's, an integration's own, the exit
flush through ``close``); ``all_ranks`` is collective: the training thread of every rank,
before a step that must start on all ranks or on none (a framework's load).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from ..agreement import Exchange, by_rank, outcome
from ..errors import AsyncCheckpointError, CommitError, DurabilityError, Failure
from .failures import FailureLedger, reraise
from .files import SaveFiles
from .retention import Retention
from .saves import Saves

logger = logging.getLogger(__name__)


def _seconds(timeout: float | None) -> float | None:
    """``wait``'s ``timeout`` checked: a number of seconds >= 0 (infinity: None, no limit)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) \
            or timeout < 0:
        raise ValueError(f"wait(timeout={timeout!r}): a number of seconds >= 0, or None")
    return None if math.isinf(timeout) else timeout


class Waits:
    """The waits of one checkpointer (rank ``rank``). ``check``: called first by every wait
    (the checkpointer's own refusal in a forked child); ``exchange``: the transport of
    ``all_ranks``'s agreement (the one ``begin`` makes)."""

    def __init__(self, saves: Saves, files: SaveFiles, failures: FailureLedger, retention: Retention, *,
                 rank: int, exchange: Exchange, check: Callable[[], None]) -> None:
        self._saves, self._files, self._failures, self._retention = saves, files, failures, retention
        self._rank, self._exchange, self._check = rank, exchange, check

    def wait(self, timeout: float | None = None) -> None:
        """Block until every write of ``submit_write`` is done, every sealed checkpoint is
        committed and the retention its commit started (``keep_last``) is done; raise a
        background error if any. Past ``timeout`` (s), raise naming it."""
        self._check()
        timeout = _seconds(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._files.hurry()  # paced writes (pace_writes) go at once for a waiter
        self._failures.wait_tracked(deadline, timeout)  # outcome taken below, as a background error
        self._saves.wait_committed(deadline, timeout)
        self._files.stager.forget_issued()  # those saves are over: their items need no fence
        bug = self._retention.wait(deadline, timeout)
        if bug is not None:  # anything but an OSError is a bug: raised once, here
            exc, more = self._failures.take()
            if exc is None:
                raise bug
            # a failed save goes first (close() raises once, and it would be lost behind
            # this); the retention bug is logged with its traceback
            logger.error("async checkpoint: removing older checkpoints failed", exc_info=bug)
            raise reraise(exc, more, self._failures.save_dir_of(exc))
        self._failures.raise_first()

    def all_ranks(self, timeout: float | None = None, *, action: str = "wait_all_ranks()",
                  recover: str | None = None, error: Exception | None = None) -> None:
        """Collective :meth:`wait` (every rank): call it before a step that must start on all
        ranks or on none, e.g. a framework's ``load_checkpoint``, whose collectives would hang
        if a background error stopped only the rank that has it.

        Each rank waits until its own sealed checkpoints are committed, then all ranks share the
        outcome in one call of the exchange (the one ``begin`` makes). If a save failed, or the
        wait timed out, on any rank, every rank raises, naming ``action`` as refused: the
        failing rank its own error, the others a :class:`CommitError` naming the failing
        rank(s) and their messages. A failed save is never committed, so the last committed
        checkpoint (the one ``latest`` names) is intact. Every background error recorded so far
        is consumed, so calling again proceeds. Without a process group (a single process) the
        exchange is a no-op: this is :meth:`wait`, raising with the same message.

        ``recover``: a save directory about to be loaded from; rank 0 first finishes there what
        a crash cut short (:meth:`.retention.Retention.recover`), so every rank then finds the
        checkpoint in place. ``error``: this rank failed already (the caller's step before this
        call): it is shared without waiting, and raised here as it is, after the exchange.
        """
        local: Exception | None = error
        try:
            if error is None:
                self.wait(timeout)  # raises (and consumes) the background errors
                if recover is not None and self._rank == 0:
                    self._retention.recover(recover, sweep=False)
        except Exception as exc:  # any kind: a rank that skipped the exchange would hang the rest
            local = exc
        # raised by wait's own steps (a timeout), the background errors are still there
        first, more = self._failures.take()
        detail = None
        if local is not None:
            count = 0 if first is None else 1 + more
            detail = f"{local}" + (f" (and {count} more failed save(s))" if count else "")
        _, failed = outcome(action, action, local, exchange=self._exchange,
                            failure=None if local is None else Failure(type(local).__name__, detail))
        retry = f". The errors reported here are cleared: calling {action} again retries."
        if error is not None:
            raise error
        if local is not None:
            cls = type(local) if isinstance(local, AsyncCheckpointError) else CommitError
            raise cls(f"{action} refused on every rank: {detail}{retry}") from local
        if failed is None:
            return
        cls = DurabilityError if failed.only_durability else CommitError
        raise cls(f"{action} refused on every rank, because of rank(s) {by_rank(failed.failures)}{retry}") \
            from failed
