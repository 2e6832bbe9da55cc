"""The engine's threads and worker process kept below the training thread.

Linux keeps a nice value, an I/O priority and a CPU set per thread, and a new thread or process
inherits its creator's. The checkpointer is made on the training thread, so without this its
background threads (copier, writers, I/O, committer, reporter, retirer, reserve) and the
persist worker would compete with training as equals for a core and for the disk. Each of them
calls :func:`lower_this_thread` first thing (and the worker process :func:`lower_this_process`):

- **CPU priority**: the training thread's nice value + :data:`NICE` (10): on a core shared with
  training, the scheduler gives a nice-10 thread about a tenth of the time a nice-0 thread gets
  while both are runnable, and preempts it when training wakes; on an idle core it runs flat out.
- **I/O priority**: the best-effort class at its lowest level (7), where the kernel's I/O
  scheduler honours it (BFQ, and CFQ of old kernels): the data loader's reads go first. Not
  the idle class: a checkpoint must still be written while training reads.
- **Cores**: with ``ASYNC_CKPT_BACKGROUND_CPUS`` set (a list such as ``"8-15"`` or
  ``"3,7"``), the background threads and the worker run on those cores alone, away from the
  training thread's. Unset, they keep the cores they inherited: which cores training leaves
  idle is the launcher's knowledge (numactl, Slurm, DeepSpeed's ``--bind_cores_to_rank``).

``ASYNC_CKPT_BACKGROUND_NICE`` overrides :data:`NICE` (0 keeps the training thread's
priority). ``ASYNC_CKPT_BACKGROUND_POLICY=idle`` puts them in ``SCHED_IDLE`` as well: they
then run on a core only when nothing else wants it (a nice-10 thread still takes about a
tenth of a core it shares with training), at the risk of a checkpoint that persists slowly
while every core is busy. Everything here is best effort: where the system refuses (no Linux, a seccomp
profile, an unknown architecture for ``ioprio_set``), the thread runs as it was and the
checkpoint is unaffected.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

logger = logging.getLogger(__name__)

NICE = 10
"""Added to the creating (training) thread's nice value for every background thread."""

_IOPRIO_WHO_PROCESS = 1  # a thread id is a "process" to ioprio_set
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_LOWEST_BE = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "ppc64le": 274, "s390x": 283}


def nice_increment() -> int:
    """:data:`NICE`, or ``ASYNC_CKPT_BACKGROUND_NICE`` where set (0 to 19)."""
    raw = os.environ.get("ASYNC_CKPT_BACKGROUND_NICE")
    if raw is None:
        return NICE
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"ASYNC_CKPT_BACKGROUND_NICE={raw!r}: an integer from 0 to 19") from None
    if not 0 <= value <= 19:
        raise ValueError(f"ASYNC_CKPT_BACKGROUND_NICE={raw!r}: an integer from 0 to 19")
    return value


def idle_policy() -> bool:
    """Whether ``ASYNC_CKPT_BACKGROUND_POLICY`` asks for ``SCHED_IDLE`` ("idle"; default
    "nice")."""
    raw = os.environ.get("ASYNC_CKPT_BACKGROUND_POLICY", "nice").strip()
    if raw not in ("nice", "idle"):
        raise ValueError(f"ASYNC_CKPT_BACKGROUND_POLICY={raw!r}: 'nice' or 'idle'")
    return raw == "idle"


def background_cpus() -> set[int] | None:
    """The cores of ``ASYNC_CKPT_BACKGROUND_CPUS`` (``"0-3,8"`` form), None where unset."""
    raw = os.environ.get("ASYNC_CKPT_BACKGROUND_CPUS", "").strip()
    if not raw:
        return None
    cpus: set[int] = set()
    try:
        for part in raw.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"ASYNC_CKPT_BACKGROUND_CPUS={raw!r}: a list of cores such as '8-15' or '3,7'") from None
    if not cpus:
        raise ValueError(f"ASYNC_CKPT_BACKGROUND_CPUS={raw!r}: names no core")
    return cpus


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def io_priority(tid: int = 0) -> int | None:
    """The I/O priority of thread ``tid`` (0: this one) as ``ioprio_get`` gives it, None where
    it cannot be read."""
    nr, libc = _SYS_IOPRIO_GET.get(platform.machine()), _libc()
    if nr is None or libc is None:
        return None
    value = libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid)
    return None if value < 0 else value


def _set_io_priority(tid: int, value: int) -> bool:
    nr, libc = _SYS_IOPRIO_SET.get(platform.machine()), _libc()
    if nr is None or libc is None:
        return False
    return libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid, value) == 0


_lowered = threading.local()


def lower_this_thread() -> None:
    """Put the calling (background) thread below the training thread it was made by: nice +
    :func:`nice_increment`, the lowest best-effort I/O priority, the cores of
    :func:`background_cpus` where set. Once per thread; never raises."""
    if getattr(_lowered, "done", False) or not hasattr(os, "setpriority"):
        return
    _lowered.done = True
    tid = threading.get_native_id()
    try:
        step = nice_increment()
        cpus = background_cpus()
        idle = idle_policy()
    except ValueError as exc:
        logger.warning("async checkpoint: %s; background threads keep the training thread's priority", exc)
        return
    try:
        if step:
            now = os.getpriority(os.PRIO_PROCESS, tid)  # Linux: a thread's own nice value
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + step))
        if step:
            _set_io_priority(tid, _IOPRIO_LOWEST_BE)
        if cpus is not None:
            os.sched_setaffinity(tid, cpus)
        if idle and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # not allowed here: run as made
        logger.debug("async checkpoint: thread %d keeps its priority or cores: %s", tid, exc)


def lower_this_process() -> None:
    """The persist worker's start: every thread it makes after this inherits it."""
    lower_this_thread()
