"""Start N local ranks of a Python script (torchrun-style environment, no extra launcher).

    python scripts/launch.py --nproc 2 scripts/ds_train.py --config ... 

Exits with a failing rank's exit code, preferring a rank that failed on its own over peers killed
afterwards; a rank killed by a signal counts as 128 + signal.
A deadline (``--timeout``) kills every rank, so a hung collective never hangs CI.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import time

from deepspeed_async_ckpt.tools import warm_start


SCRATCH_MARK = ".scratch-of-async-ckpt-scripts"
"""The file :func:`scratch_dir` leaves in a directory it made, so a later run may empty it."""


def scratch_dir(path: str) -> str:
    """Empty ``path`` (made if missing) for a script's scratch work and mark it as the scripts'.

    Refuses, naming it, a path that is not a directory or a non-empty directory no script of
    this repository made: a mistyped ``--workdir`` must not delete someone's checkpoints.
    """
    path = os.path.abspath(path)
    mark = os.path.join(path, SCRATCH_MARK)
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        raise SystemExit(f"{path}: not a directory; give a new or empty directory for scratch work")
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.isfile(mark):
            raise SystemExit(f"{path} is not empty and was not made by these scripts (no {SCRATCH_MARK} "
                             f"in it); refusing to delete it: give a new or empty directory")
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    open(mark, "w", encoding="ascii").close()
    return path


def count(least: int):
    """An argparse ``type``: an integer of at least ``least``, refused by argparse naming the flag."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise ValueError(text)
        return value
    parse.__name__ = "positive int" if least == 1 else f"int >= {least}"
    return parse


POSITIVE, NON_NEGATIVE = count(1), count(0)


def free_port() -> int:
    """A port for rank 0's store, free now and below the kernel's ephemeral range.

    The port is released before rank 0 binds it. A port the kernel hands out itself (bind to
    0) can be handed out again in that gap, to any socket on the machine: every outgoing TCP
    connection (gloo opens several per rank pair) draws from the same range. A port below it is
    taken only by a process that asks for it by number.
    """
    high = _ephemeral_low()
    low = max(1024, high - 12000)  # above the privileged ports
    rng = random.SystemRandom()
    for _ in range(64 if low < high else 0):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def spawn(script: str, script_args: list[str], nproc: int, env: dict | None = None, *,
          log_prefix: str | None = None, cwd: str | None = None,
          per_node: int | None = None) -> list[subprocess.Popen]:
    """Start ``nproc`` ranks and return them at once (see :func:`launch`, which waits). With
    ``ASYNC_CKPT_LAUNCH_PRELOAD`` in the environment, forked from a warm interpreter
    (:mod:`warm_start`), not started fresh. ``per_node``: ranks per node as a launcher says it
    (``LOCAL_WORLD_SIZE``; default ``nproc``, one node), to run several nodes on this host."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        e = dict(os.environ if env is None else env)
        local = per_node or nproc
        e.update(RANK=str(rank), LOCAL_RANK=str(rank % local), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(local),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        e.setdefault("DS_ACCELERATOR", "cpu")
        e.setdefault("OMP_NUM_THREADS", "1")
        if log_prefix is None:
            procs.append(warm_start.popen(script, script_args, e, cwd=cwd))
        else:  # the rank keeps its own descriptor of the log file
            with open(f"{log_prefix}.rank{rank}.log", "w", encoding="utf-8") as log:
                procs.append(warm_start.popen(script, script_args, e, cwd=cwd, stdout=log.fileno(),
                                              stderr=log.fileno()))
    return procs


def launch(script: str, script_args: list[str], nproc: int, timeout: float = 600,
           env: dict | None = None, *, log_prefix: str | None = None,
           cwd: str | None = None, per_node: int | None = None) -> list[int]:
    """Run ``nproc`` ranks; returns their exit codes (negative: killed by that signal).

    Raises ``TimeoutError`` (after killing every rank) past ``timeout`` seconds. With
    ``log_prefix``, rank N's stdout and stderr go to ``<log_prefix>.rankN.log`` instead of
    this process's; ``cwd`` is the ranks' working directory; ``per_node`` as :func:`spawn`.
    """
    procs = spawn(script, script_args, nproc, env, log_prefix=log_prefix, cwd=cwd, per_node=per_node)
    deadline = time.monotonic() + timeout
    try:
        while None in [p.poll() for p in procs]:  # polls every rank, so a failure is seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"{script}: ranks still running after {timeout:.0f} s")
            # One rank dying (a crash, or a deliberate SIGKILL) must not leave the others
            # blocked forever in a collective.
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(2)
                break
            time.sleep(0.1)
    finally:
        stop(procs)
    return [p.returncode for p in procs]


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the ranks still running, then reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise ValueError(text)
    return value


_seconds.__name__ = "seconds > 0"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=POSITIVE, default=2)
    p.add_argument("--timeout", type=_seconds, default=600)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    codes = launch(a.script, a.args, a.nproc, a.timeout)
    # A rank that failed on its own (code > 0) explains the run better than the peers this
    # launcher then killed (code < 0).
    bad = sorted((c for c in codes if c != 0), key=lambda c: c < 0)
    return (bad[0] if bad[0] > 0 else 128 - bad[0]) if bad else 0


if __name__ == "__main__":
    sys.exit(main())
