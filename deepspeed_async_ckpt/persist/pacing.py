""":class:`WritePacer`: spreads a save's background writes over the time until the next save
(config ``pace_writes``), instead of letting them run flat out in the steps right after it.

On a host whose spare cores are few, a save's persist work (the checksum, the copies into the
direct-I/O stage, the kernel's block-layer work for the writes and the fsync) runs beside
training; flat out, it lands in the first steps after the save and slows exactly those. Paced,
the same work is spread thin over a fraction of the save interval, where a spare core can
absorb it.

Each save gets a :class:`Schedule`, a token bucket whose rate follows the save cadence: the
bytes it lets through by time ``t`` grow linearly from the save's ``begin`` to ``begin +
fraction x interval`` (``interval``: the time between the last two saves' begins), plus a
burst. A writer asks :meth:`Schedule.take` before each write and sleeps while it is ahead
of that line. Pacing never delays a write past that deadline, so a save whose disk keeps up
is written by then, before the next save is due; a write already behind the line is never
held. The first save, and one whose cadence is unknown, are not paced; a new save, or a
wait for the saves to be durable (:meth:`WritePacer.hurry`), ends the pacing of the one
before. A writer's :meth:`~.writer.FileWriter.pace` and ``hurry`` are :class:`PacedWrites`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

PACE_FRACTION = 0.5
"""Share of the save interval a paced save's writes are spread over: the other half is
margin for a next save that comes early (a cadence of steps whose time varies) and for a
disk slower than the pace."""

_BURST = 16 << 20
"""Bytes a schedule lets through ahead of its line: the first records and every file's
headers go at once, and small writes never wait."""

_RECHECK_S = 0.1
"""Longest sleep between looks at the schedule (its total grows as the save's files are
handed over)."""


class Schedule:
    """The pace of one save's writes, shared by every writer thread of it: ``total`` bytes
    (grown with :meth:`add`) spread from ``start`` over ``span`` seconds, on ``clock``."""

    def __init__(self, start: float, span: float, total: int, *, clock: Callable[[], float],
                 sleep: Callable[[float], Any] | None = None, burst: int = _BURST) -> None:
        self.start, self.span, self.total, self.burst = start, span, total, burst
        self._clock = clock
        self._hurried = threading.Event()
        self._sleep = sleep or self._hurried.wait
        self._lock = threading.Lock()
        self.taken = 0
        """Bytes let through so far."""
        self.waited_s = 0.0
        """Seconds writers slept in :meth:`take`, all threads together."""

    @property
    def deadline(self) -> float:
        """When pacing lets every byte through (``clock`` seconds)."""
        return self.start + self.span

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes

    def hurry(self) -> None:
        """Stop pacing: every write from now on goes at once (sleeping ones wake up)."""
        self._hurried.set()

    def take(self, nbytes: int) -> None:
        """Let ``nbytes`` through once the schedule allows them: sleeps while the writes are
        ahead of the line, never past :attr:`deadline`, and not at all once hurried."""
        with self._lock:
            self.taken += nbytes
            upto = self.taken - self.burst  # this write's end, less the burst
        while not self._hurried.is_set():
            now = self._clock()
            with self._lock:
                total = self.total
            due = self.start + self.span * min(1.0, upto / total) if total > 0 and upto > 0 else now
            if due <= now:
                return
            self._sleep(min(due - now, _RECHECK_S))
            with self._lock:
                self.waited_s += self._clock() - now


class WritePacer:
    """Gives each save a :class:`Schedule` from the save cadence (one per checkpointer, any
    thread). ``fraction``: see :data:`PACE_FRACTION`; ``clock`` (seconds) must be the clock
    of the ``begun_at`` times given to :meth:`start`; ``sleep``: for tests with a fake clock
    (default: a wait that :meth:`hurry` ends)."""

    def __init__(self, fraction: float = PACE_FRACTION, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Any] | None = None, burst: int = _BURST) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"WritePacer(fraction={fraction!r}): a number in (0, 1]")
        self.fraction, self._clock, self._sleep, self._burst = fraction, clock, sleep, burst
        self._lock = threading.Lock()
        self._key: Any = None
        self._begun_at: float | None = None
        self.interval: float | None = None
        """Seconds between the begins of the last two saves (None before the second)."""
        self.current: Schedule | None = None
        """The schedule of the latest save; None where it is not paced."""

    def start(self, key: Any, begun_at: float, nbytes: int) -> Schedule | None:
        """The save ``key`` (the same object at every call for one save), begun at
        ``begun_at``, hands ``nbytes`` more bytes to the writers: its schedule, or None if it
        is not paced (the first save). A new save ends the pacing of the one before."""
        with self._lock:
            if key is self._key:
                if self.current is not None:
                    self.current.add(nbytes)
                return self.current
            if self.current is not None:
                self.current.hurry()
            if self._begun_at is not None and begun_at > self._begun_at:
                self.interval = begun_at - self._begun_at
            self._key, self._begun_at = key, begun_at
            self.current = None if self.interval is None else Schedule(
                begun_at, self.fraction * self.interval, nbytes, clock=self._clock,
                sleep=self._sleep, burst=self._burst)
            return self.current

    def hurry(self) -> None:
        """Someone waits for the saves to be durable: the latest save's writes go at once."""
        with self._lock:
            if self.current is not None:
                self.current.hurry()


class PacedWrites:
    """The pacing of a :class:`~.writer.FileWriter`: its ``pace`` and ``hurry``, and the
    :meth:`take` its background writes call; ``pacer``: the checkpointer's
    :class:`WritePacer` (config ``pace_writes``), or None (writes go flat out)."""

    def __init__(self, pacer: WritePacer | None) -> None:
        self.pacer = pacer

    def pace(self, save: Any, begun_at: float, nbytes: int) -> None:
        """The files handed to the writer next are the save ``save``'s (begun at ``begun_at``,
        ``time.perf_counter`` seconds), ``nbytes`` more of its bytes."""
        if self.pacer is not None:
            self.pacer.start(save, begun_at, nbytes)

    def hurry(self) -> None:
        """Someone waits for the saves: stop pacing their writes."""
        if self.pacer is not None:
            self.pacer.hurry()

    def take(self) -> Callable[[int], None] | None:
        """What a file submitted now calls before each write (:meth:`Schedule.take` of the
        latest save), or None where it is not paced."""
        schedule = None if self.pacer is None else self.pacer.current
        return None if schedule is None else schedule.take
