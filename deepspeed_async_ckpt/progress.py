"""Progress of one long operation (a restore from a tier, a drain, ``verify``): bytes done of a
known total, reported at a bounded rate.

An operation that ends within ``FIRST_AFTER_S`` says nothing; a longer one reports then, and
again at most every ``EVERY_S``: bytes done of the total, the rate so far and the time left at
that rate; and once more when it ends. In a training job the reports are log lines (INFO, this
module's logger); on the command line (``stream``: standard error) a tqdm bar when the stream is
a terminal, else the same lines, written to it. Nothing ever goes to standard output.

    for rel in track(files, lambda rel: sizes[rel], "restore of global_step100"):
        fetch(rel)          # each item's bytes count once the loop asks for the next

One thread per :class:`Progress`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds an operation runs before its first report.
FIRST_AFTER_S = 5.0
#: Seconds at least between two reports (a terminal's bar redraws on its own, faster).
EVERY_S = 30.0


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"  # (unreached)


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """Bytes done of ``total`` for the operation ``what`` (e.g. ``"restore of global_step100
    from s3://bucket/run"``). :meth:`add` as bytes are done, :meth:`done` at the end.
    ``stream``: report there (the command line's standard error) instead of the log."""

    def __init__(self, what: str, total: int, *, stream: TextIO | None = None,
                 first_after_s: float | None = None, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.done_bytes = what, max(0, int(total)), 0
        self._stream, self._clock = stream, clock
        self._first = FIRST_AFTER_S if first_after_s is None else first_after_s
        self._every = EVERY_S if every_s is None else every_s
        self._start = clock()
        self._last: float | None = None  # when the last report was made (None: none yet)
        self._bar = None
        self._finished = False
        if stream is not None and _isatty(stream):
            try:
                from tqdm import tqdm
            except ImportError:  # plain lines, then
                pass
            else:
                self._bar = tqdm(total=self.total, desc=what, unit="B", unit_scale=True,
                                 file=stream, leave=True, dynamic_ncols=True)

    def add(self, nbytes: int) -> None:
        """``nbytes`` more are done."""
        self.done_bytes += int(nbytes)
        if self._bar is not None:
            self._bar.update(int(nbytes))
            return
        now = self._clock()
        if now - self._start >= self._first and (self._last is None or now - self._last >= self._every):
            self._report(self.line(now))
            self._last = now

    def stop(self) -> None:
        """The operation failed: a bar is closed, no last report (its error says the rest)."""
        if not self._finished:
            self._finished = True
            if self._bar is not None:
                self._bar.close()

    def done(self) -> None:
        """The operation ended: a last report if any was made (a bar is closed). Once."""
        if self._finished:
            return
        self._finished = True
        if self._bar is not None:
            self._bar.close()
        elif self._last is not None:
            elapsed = self._clock() - self._start
            rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
            self._report(f"{self.what}: done, {_bytes(self.done_bytes)} in {_duration(elapsed)} "
                         f"({_bytes(rate)}/s)")

    def line(self, now: float | None = None) -> str:
        """``"<what>: 1.2 GB of 4 GB (30%), 410 MB/s, 7s left"``."""
        elapsed = (self._clock() if now is None else now) - self._start
        rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
        share = f" ({100 * self.done_bytes / self.total:.0f}%)" if self.total else ""
        left = f", {_duration((self.total - self.done_bytes) / rate)} left" if rate > 0 else ""
        return (f"{self.what}: {_bytes(self.done_bytes)} of {_bytes(self.total)}{share}, "
                f"{_bytes(rate)}/s{left}")

    def _report(self, text: str) -> None:
        if self._stream is None:
            logger.info("async checkpoint: %s", text)
        else:
            print(text, file=self._stream, flush=True)


def track(items: Iterable[T], size: Callable[[T], int], what: str, **kwargs) -> Iterator[T]:
    """Yield ``items``, reporting the bytes of those done (``size(item)``, counted once the
    loop asks for the next) as a :class:`Progress` of ``what``; ``kwargs`` go to it."""
    items = list(items)
    progress = Progress(what, sum(size(item) for item in items), **kwargs)
    for item in items:
        yield item
        progress.add(size(item))
    progress.done()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a file
        return False
