"""Who runs beside the training thread: per-thread CPU, run-queue wait and wake-ups from /proc.

For every thread of this process (and of its child processes: the persist worker of
``persist_in: "process"``), from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on a CPU,
nanoseconds runnable but waiting for one, times scheduled in) and ``status`` (voluntary
context switches: each one a sleep, so the next scheduling is a wake-up). Threads are named by
their Python name where this interpreter knows the native id, else by the kernel's ``comm``
(a child's threads prefixed ``worker:``). Reading it costs tens of microseconds a thread
(docs/benchmarks.md), so the benchmarks read it between steps, never inside a timed one.

The training thread's own split of a step (:func:`own_times`): wall = on CPU + runnable but
waiting for a core + asleep. With a core to spare, asleep in a step that does no I/O is a wait
for a lock: the GIL, or the fence.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable

NS = 1e-9


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:  # the thread (or process) ended between the listing and the read
        return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        text = _read(f"/proc/{pid}/task/{tid}/children")
        if text:
            out += [int(c) for c in text.split()]
    return out


def _names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def sample(pid: int | None = None, children: bool = True) -> dict[str, dict]:
    """``{label: {"cpu_s", "wait_s", "slices", "wakeups"}}`` for every thread of ``pid`` (this
    process by default) and, with ``children``, of its children. Labels are unique (a numeric
    suffix for a repeated name, e.g. four ``async-ckpt-writer`` threads); ``(all threads)``
    (``worker:(all threads)``) is the whole process's CPU, threads that ended included (the
    I/O thread lives as long as its file), at the clock tick's resolution."""
    pid = os.getpid() if pid is None else pid
    names = _names() if pid == os.getpid() else {}
    out: dict[str, dict] = {}
    procs = [(pid, "")] + ([(c, "worker:") for c in _children(pid)] if children else [])
    tick = os.sysconf("SC_CLK_TCK")
    for p, prefix in procs:
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{p}/task"))
        except OSError:
            continue
        stat = _read(f"/proc/{p}/stat")
        if stat:  # the whole process, threads that have ended included (clock ticks)
            fields = stat.rsplit(")", 1)[1].split()
            out[prefix + "(all threads)"] = {"cpu_s": (int(fields[11]) + int(fields[12])) / tick, "wait_s": 0.0,
                                             "slices": 0, "wakeups": 0, "tid": p}
        for tid in tids:
            sched = _read(f"/proc/{p}/task/{tid}/schedstat")
            status = _read(f"/proc/{p}/task/{tid}/status")
            if sched is None or status is None:
                continue
            cpu, wait, slices = (int(v) for v in sched.split()[:3])
            vol = next((int(line.split()[1]) for line in status.splitlines()
                        if line.startswith("voluntary_ctxt_switches")), 0)
            name = names.get(tid) or (_read(f"/proc/{p}/task/{tid}/comm") or "?").strip()
            label = prefix + (name if p != pid or tid != pid else "MainThread")
            if label in out:
                label = f"{label}#{tid}"
            out[label] = {"cpu_s": cpu * NS, "wait_s": wait * NS, "slices": slices, "wakeups": vol,
                          "tid": tid}
    return out


def delta(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    """Per thread, what ``b`` adds to ``a`` (a thread new in ``b`` counts from zero; one gone
    from ``b`` is left out: its last interval is unknown)."""
    out = {}
    for label, vb in b.items():
        va = a.get(label)
        if va is not None and va["tid"] != vb["tid"]:
            va = None
        out[label] = {k: vb[k] - (va[k] if va else 0) for k in ("cpu_s", "wait_s", "slices", "wakeups")}
    return out


def own_times() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable waiting for one) so far: what the
    training thread reads before and after a step."""
    text = _read(f"/proc/self/task/{threading.get_native_id()}/schedstat")
    if text is None:
        return 0.0, 0.0
    cpu, wait = text.split()[:2]
    return int(cpu) * NS, int(wait) * NS


def total(deltas: Iterable[dict[str, dict]]) -> dict[str, dict]:
    """Sum of several :func:`delta` results, per thread."""
    out: dict[str, dict] = {}
    for d in deltas:
        for label, v in d.items():
            acc = out.setdefault(label, {"cpu_s": 0.0, "wait_s": 0.0, "slices": 0, "wakeups": 0})
            for k in acc:
                acc[k] += v[k]
    return out


def memory() -> dict:
    """This process's resident bytes and the machine's page cache and dirty bytes (from
    ``/proc``), to see host memory returned to the system or written back during training."""
    out = {}
    statm = _read("/proc/self/statm")
    if statm:
        out["rss_bytes"] = int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    info = _read("/proc/meminfo") or ""
    for line in info.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Cached", "Dirty", "Writeback", "MemFree"):
            out[key.lower() + "_bytes"] = int(rest.split()[0]) * 1024
    return out
