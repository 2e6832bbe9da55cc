"""The drainer: one background thread per durable tier that copies committed checkpoints
there, one at a time, never holding up training.

Backlog rule. When the tier is slower than checkpoints are committed, at most one drain runs
and at most one waits; a newer commit replaces the waiting one (logged), so the tier catches
up with the newest checkpoint and skips those in between. A failed drain (the tier went away,
a timeout) leaves the tier's pointer where it was and is retried with a doubling delay
(``retry_delay_s``, at most 60 s), unless a newer commit is waiting by then, which is
drained instead.

While a checkpoint waits or is drained, the first tier's retention leaves its directory
(``hold``); it is released when the drain is done, replaced or given up.

Close. Once close began (:meth:`Drainer.stop`), nothing is retried: the drain running
finishes or fails, the one waiting (a failed one waiting for its retry included) gets one
try at once, and close waits for them ``close_timeout_s`` in all, counted from
:meth:`~Drainer.stop` (every tier's clock starts together). A tier that does not answer
therefore holds the exit that long at most; a drain still running then is abandoned on its
daemon thread. What stays undrained is logged by name and tier (:attr:`Drainer.undrained`);
the next start queues the newest committed checkpoint the tier lacks before anything else
(:meth:`Drainer.submit` with ``if_behind``, from :meth:`.durable.DurableTiers.catch_up`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..commit import Pointer
from ..errors import describe
from .config import TierConfig, without_userinfo
from .mirror import drain_checkpoint, retire_on_tier, tier_lacks
from .remote import Remote

logger = logging.getLogger(__name__)

_MAX_RETRY_DELAY_S = 60.0


@dataclass
class DrainJob:
    """One committed checkpoint to copy to the tier."""

    ckpt_dir: str
    pointer: Pointer | None
    release: Callable[[], None]
    """Lets the first tier's retention remove it again (called once)."""
    attempts: int = 0
    not_before: float = 0.0
    if_behind: bool = False
    """Drained only if the tier lacks it (:func:`.mirror.tier_lacks`), checked on the drain
    thread: the catch-up at start."""
    released: bool = field(default=False, repr=False)

    def done(self) -> None:
        if not self.released:
            self.released = True
            self.release()


class Drainer:
    """The drains of one tier on one node. ``coordinator``: global rank 0, which commits the
    tier (manifest, pointer) and runs its retention; the others only upload their node's files."""

    def __init__(self, remote: Remote, tier: TierConfig, *, node: int, coordinator: bool) -> None:
        self.remote, self.tier, self.node, self.coordinator = remote, tier, node, coordinator
        self._cond = threading.Condition()
        self._pending: DrainJob | None = None
        self._running: DrainJob | None = None
        self._closing = False
        self._deadline: float | None = None
        """When close stops waiting (monotonic seconds), set by :meth:`stop`; from then on a
        failed drain is not retried."""
        self._tried: list[str] = []
        self.drained: list[str] = []
        """Names of the checkpoints drained so far, in order."""
        self.replaced: list[str] = []
        """Names of waiting checkpoints a newer commit replaced (never drained)."""
        self.failures: list[str] = []
        """One message per failed drain attempt."""
        self.seconds: list[float] = []
        """Seconds each successful drain took (upload to the tier's pointer)."""
        self.on_drained: list[Callable[[str], None]] = []
        """Called on this drainer's thread with the checkpoint directory of each drain that
        committed on the tier (a monitor's figures); an exception is logged."""
        self.undrained: list[str] = []
        """Names of the checkpoints close left undrained (given up, or still running)."""
        self._thread = threading.Thread(target=self._loop, name=f"async-ckpt-drain-{tier.url}",
                                        daemon=True)
        self._thread.start()

    def submit(self, ckpt_dir: str, pointer: Pointer | None, release: Callable[[], None], *,
               if_behind: bool = False) -> None:
        """Queue a committed checkpoint (any thread); replaces the one waiting, if any.
        ``if_behind``: drained only if the tier lacks it, and only while no drain runs or
        waits (one queued by a commit of this process is newer)."""
        job = DrainJob(ckpt_dir, pointer, release, if_behind=if_behind)
        with self._cond:
            old, self._pending = self._pending, job
            if self._closing or (if_behind and (old is not None or self._running is not None)):
                self._pending = old  # not drained
                job.done()
                return
            self._cond.notify_all()
        if old is not None:
            self.replaced.append(os.path.basename(old.ckpt_dir))
            logger.warning("async checkpoint: tier %s is behind: %s waiting to drain is replaced by "
                           "the newer %s (at most one drain runs and one waits)", self.tier.url,
                           os.path.basename(old.ckpt_dir), os.path.basename(ckpt_dir))
            old.done()

    @property
    def backlog(self) -> int:
        """Drains running or waiting (0, 1 or 2)."""
        with self._cond:
            return (self._running is not None) + (self._pending is not None)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no drain runs or waits (a failed one waiting for its retry counts);
        returns whether that happened within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._running is not None or self._pending is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        """Close begins (called by :meth:`close`, or first for every tier at once): from now on
        a failed drain is not retried, the one waiting for its retry goes at once, and
        ``close_timeout_s`` starts counting."""
        with self._cond:
            if self._deadline is None:
                self._deadline = time.monotonic() + self.tier.close_timeout_s
            if self._pending is not None:
                self._pending.not_before = 0.0
            self._cond.notify_all()

    def close(self) -> None:
        """Wait for the drain running and the one waiting, each given its last try, until
        ``close_timeout_s`` after :meth:`stop`; then give up what is left. What stays undrained
        is logged by name (:attr:`undrained`): it is on the first tier only until the next
        start drains it."""
        self.stop()
        finished = self.wait_idle(max(0.0, self._deadline - time.monotonic()))
        with self._cond:
            self._closing = True
            running, (pending, self._pending) = self._running, (self._pending, None)
            left = [os.path.basename(j.ckpt_dir) for j in (running, pending) if j is not None]
            self.undrained += [n for n in left if n not in self.undrained]
            self._cond.notify_all()
        if pending is not None:
            pending.done()
        if self.undrained:
            where = f" (endpoint {self.tier.safe_endpoint})" if self.tier.safe_endpoint else ""
            logger.warning("async checkpoint: tier %s%s: %s not drained at close (%s); %s on the first "
                           "tier only, and the next start drains the newest committed checkpoint "
                           "the tier lacks", without_userinfo(self.tier.url), where,
                           ", ".join(self.undrained),
                           "its last try failed" if finished else
                           f"close_timeout_s={self.tier.close_timeout_s:g} s passed",
                           "it stays" if len(self.undrained) == 1 else "they stay")
        if running is None:  # else it is abandoned: a daemon, it holds no exit
            self._thread.join(timeout=1.0)

    def _next(self) -> DrainJob | None:
        with self._cond:
            while True:
                if self._closing:
                    return None
                job = self._pending
                if job is not None:
                    wait = job.not_before - time.monotonic()
                    if wait <= 0:
                        self._pending, self._running = None, job
                        return job
                    self._cond.wait(wait)
                else:
                    self._cond.wait()

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            name = os.path.basename(job.ckpt_dir)
            t0 = time.monotonic()
            try:
                if job.if_behind and not tier_lacks(self.remote, job.ckpt_dir):
                    logger.info("async checkpoint: tier %s holds %s or a newer checkpoint: not "
                                "drained again", self.tier.url, name)
                    self._finished(job)
                    continue
                if name not in self._tried:
                    self._tried = (self._tried + [name])[-64:]
                drain_checkpoint(self.remote, job.ckpt_dir, job.pointer, node=self.node,
                                 coordinator=self.coordinator,
                                 marker_timeout_s=self.tier.marker_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the tier's failure, never training's
                self._failed(job, exc)
                continue
            self.seconds.append(time.monotonic() - t0)
            self.drained.append(name)
            logger.info("async checkpoint: %s drained to %s in %.2f s", name, self.tier.url,
                        time.monotonic() - t0)
            for fn in list(self.on_drained):
                try:
                    fn(job.ckpt_dir)
                except Exception as exc:  # noqa: BLE001 - a report, never the drain's failure
                    logger.warning("async checkpoint: a drain callback failed: %s", describe(exc))
            if self.coordinator:
                try:
                    removed = retire_on_tier(self.remote, self.tier.keep_last, name, self._tried)
                    if removed:
                        logger.info("async checkpoint: tier %s: removed %s", self.tier.url,
                                    ", ".join(removed))
                except Exception as exc:  # noqa: BLE001 - retried after the next drain
                    logger.warning("async checkpoint: tier %s: retention failed: %s", self.tier.url,
                                   describe(exc))
            self._finished(job)

    def _finished(self, job: DrainJob) -> None:
        with self._cond:
            self._running = None
            self._cond.notify_all()
        job.done()

    def _failed(self, job: DrainJob, exc: BaseException) -> None:
        name = os.path.basename(job.ckpt_dir)
        job.attempts += 1
        delay = min(_MAX_RETRY_DELAY_S, self.tier.retry_delay_s * 2 ** (job.attempts - 1))
        message = f"{name} to {self.tier.url}: {type(exc).__name__}: {describe(exc)}"
        self.failures.append(message)
        with self._cond:
            self._running = None
            stopping = self._deadline is not None
            retry = self._pending is None and not stopping
            if retry:
                job.not_before = time.monotonic() + delay
                self._pending = job
            elif stopping and self._pending is None and name not in self.undrained:
                self.undrained.append(name)
            self._cond.notify_all()
        if retry:
            logger.warning("async checkpoint: drain of %s failed (attempt %d; the tier's pointer is "
                           "unchanged); retrying in %.0f s", message, job.attempts, delay)
        else:
            logger.warning("async checkpoint: drain of %s failed; %s", message,
                           "not retried: closing" if stopping else "a newer checkpoint is drained instead")
            job.done()
