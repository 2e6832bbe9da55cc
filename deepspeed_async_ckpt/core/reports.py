"""Commit reports: the log line and the ``on_commit`` callbacks of each committed checkpoint,
and the adapters' own reports, run in commit order on a thread of their own.

Rank 0 only. The committer thread queues them (:meth:`Reporter.announce`), adapters queue
their own (:meth:`Reporter.report`); they run on the reporter thread
(``async-ckpt-reporter``), or, once the checkpointer is closed, on the caller's thread. That
thread is not retention's (:mod:`.retention`), though both run in commit order: ``wait()``
waits for retention and never for a callback, so a callback stuck in an upload holds up
neither ``wait()`` nor the removal of older checkpoints.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..commit.records import TIMINGS
from ..qos import lower_this_thread
from .handle import CommitInfo
from .job import SaveJob
from .memory_saves import memory_committed_s
from .saves import Saves

logger = logging.getLogger(__name__)


class Reporter:
    """The commit callbacks of one checkpointer and the thread they run on.

    While a report about a checkpoint directory is queued or running, the directory is listed
    in ``saves.reporting`` (retention leaves it); ``released(ckpt_dir)`` is called once the
    last of them is done."""

    def __init__(self, saves: Saves, *, world_size: int, released: Callable[[str], None],
                 callbacks: list[Callable[[CommitInfo], None]]) -> None:
        self._saves, self._world_size, self._released = saves, world_size, released
        self.callbacks = callbacks
        self._executor: ThreadPoolExecutor | None = None  # started on first use
        self._thread: threading.Thread | None = None
        self.queued = 0
        """Under ``saves.lock``: reports (commit callbacks included) queued or running."""

    def report(self, fn: Callable[..., Any], *args: Any, about: str | None = None) -> None:
        """Run ``fn(*args)`` on the commit callbacks' thread, after those queued before (once
        closed: here, after those). Its exception is logged. ``about``: the checkpoint
        directory it reads, which retention leaves until it has run."""
        saves = self._saves

        def call() -> None:
            self._thread = threading.current_thread()
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - a report, never the save's failure
                logger.warning("async checkpoint: a commit callback failed: %s: %s",
                               type(exc).__name__, exc)
            finally:
                try:
                    if release is not None:
                        release()
                finally:
                    with saves.lock:  # only now: that retention is queued (idle claims)
                        self.queued -= 1
        release = None if about is None else self.hold(about)
        with saves.lock:
            self.queued += 1
            if not saves.closed:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-reporter",
                                                        initializer=lower_this_thread)
                self._executor.submit(call)
                return
        self.drain()  # in order: after what was queued before the close
        call()

    def hold(self, about: str) -> Callable[[], None]:
        """Keep retention off the checkpoint directory ``about`` until the function returned
        is called (once): a report reading it, or a drain to a durable tier copying it."""
        saves = self._saves
        with saves.lock:
            saves.reporting[about] += 1

        def release() -> None:
            with saves.lock:
                saves.reporting[about] -= 1
                released = not saves.reporting[about]
                if released:
                    del saves.reporting[about]
            if released:  # the retention that left it for this hold: again
                self._released(about)
        return release

    def drain(self) -> None:
        """Once closed: run the commit callbacks queued so far to the end and stop their
        thread; from that thread itself (close() in a callback), stop it without waiting."""
        with self._saves.lock:
            executor = self._executor
        if executor is not None:
            executor.shutdown(wait=threading.current_thread() is not self._thread)

    def announce(self, job: SaveJob, manifest: dict) -> None:
        """Rank 0, once ``job``'s checkpoint is committed: log it (INFO), record it
        (``commit_info``) and queue the commit callbacks. A failure here is logged, never the
        save's: the pointer has moved already."""
        handle = job.handle
        try:
            slowest = {key: float(t["max"]) for key, t in manifest.get("timings", {}).items()
                       if key in TIMINGS and isinstance(t, dict) and type(t.get("max")) in (int, float)}
            info = CommitInfo(tag=handle.tag, ckpt_dir=handle.ckpt_dir, files=len(manifest["files"]),
                              bytes=sum(e["bytes"] for e in manifest["files"].values()),
                              world_size=self._world_size,
                              seconds=job.times["committed"] - job.times["begin"],
                              save_id=handle.save_id, **slowest, **memory_figures(job))
            job.commit_info = info
            logger.info("async checkpoint: %s", info)
            for fn in list(self.callbacks):
                self.report(fn, info, about=handle.ckpt_dir)
        except Exception as exc:  # noqa: BLE001 - a report, not part of the commit
            logger.warning("async checkpoint: reporting the commit of %s failed (it is committed): "
                           "%s", handle.tag, exc)


def memory_figures(job: SaveJob) -> dict[str, Any]:
    """A save's memory tier figures for its :class:`CommitInfo` (none without the tier)."""
    seconds = memory_committed_s(job.times)
    return {} if seconds is None else {"memory_committed_s": seconds, "memory_only": job.memory_only}
