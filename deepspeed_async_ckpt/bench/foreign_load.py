"""Other processes' CPU use while a benchmark runs, sampled from ``/proc``."""

from __future__ import annotations

import os
import threading
import time


class ForeignLoad:
    """Samples, every ``interval`` seconds, the CPU time of every process that is not this one
    or its descendants (other users of the machine), from /proc. ``cpu_between(t0, t1)`` gives
    their CPU-seconds in a window of ``time.perf_counter`` (CLOCK_MONOTONIC, shared with the
    workers). Kernel threads (writeback of our files, the VM's DAMON page-out daemon...) are
    summed apart: ``cpu_between(t0, t1, kernel=True)``."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.tick = os.sysconf("SC_CLK_TCK")
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, foreign CPU s, kernel CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-load", daemon=True)
        self.available = os.path.isdir("/proc/self")

    def start(self) -> "ForeignLoad":
        if self.available:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _table(self) -> dict[int, tuple[int, int]]:
        procs = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            fields = data[data.rindex(b")") + 2:].split()
            procs[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, ticks
        return procs

    def _run(self) -> None:
        me, last, total, kernel = os.getpid(), {}, 0.0, 0.0
        while True:
            procs = self._table()
            ours: dict[int, bool] = {me: True, 0: False, 1: False, 2: False}

            def is_ours(pid: int) -> bool:
                chain = []
                while pid not in ours:
                    chain.append(pid)
                    pid = procs.get(pid, (0, 0))[0]
                for p in chain:
                    ours[p] = ours[pid]
                return ours[pid]

            for pid, (ppid, ticks) in procs.items():
                delta = max(0, ticks - last.get(pid, 0)) / self.tick if last else 0.0
                if pid == 2 or ppid == 2:
                    kernel += delta
                elif not is_ours(pid):
                    total += delta
            last = {pid: t for pid, (_, t) in procs.items()}
            self.samples.append((time.perf_counter(), total, kernel))
            if self._stop.wait(self.interval):
                return

    def cpu_between(self, t0: float, t1: float, kernel: bool = False) -> float | None:
        """Foreign (or kernel-thread) CPU-seconds between two perf_counter times."""
        i = 2 if kernel else 1
        if len(self.samples) < 2 or t0 < self.samples[0][0] or t1 > self.samples[-1][0]:
            return None

        def at(t: float) -> float:
            for a, b in zip(self.samples, self.samples[1:]):
                if a[0] <= t <= b[0]:
                    return a[i] + (b[i] - a[i]) * (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else a[i]
            return self.samples[-1][i]

        return at(t1) - at(t0)
