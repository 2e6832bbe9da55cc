"""Kill a save at every filesystem operation it makes, one run per operation.

``python crash_points.py SCENARIO OUT_DIR`` first runs the scenario once to count the
operations that change the filesystem (opening a file for writing, before and after: created
or truncated, still empty; each unbuffered write, fsync, rename, link, unlink, mkdir, rmdir,
truncate, ``renameat2``), then once per operation ``n``: a fresh
copy of a save directory holding one committed checkpoint, the scenario run in a forked child
that dies with ``os._exit`` (as under SIGKILL: nothing after it runs, no exit handlers) right
before its ``n``-th operation, whichever thread makes it. Each run's directory is left under
``OUT_DIR/<n>``; ``OUT_DIR/report.json`` lists ``{"n", "exit"}`` per run (exit 0: the
scenario finished before operation ``n``). The test (``tests/integration/test_crash_points.py``) then
checks every directory: what loads, and that the next save cleans up.

Scenarios (the committed checkpoint is ``t1``, saved at step 1; the scenario saves step 2):
- ``new``: a save of tag ``t2`` with ``keep_last=1`` (its commit removes ``t1``);
- ``resave``: tag ``t1`` saved again (staged beside it, swapped in with ``renameat2``);
- ``resave-renames``: the same on a filesystem without ``renameat2`` (two renames).

``CRASH_POINTS_TRACE=1`` prints every operation counted (number, thread, call) to stderr.

The parent never starts an engine thread (each child makes its own checkpointer), so forking
it is safe; torch runs single-threaded for the same reason.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import sys
import threading
import traceback
from typing import Callable

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from deepspeed_async_ckpt.core import AsyncCheckpointer  # noqa: E402
from deepspeed_async_ckpt.commit import Pointer  # noqa: E402
from deepspeed_async_ckpt.config import AsyncCheckpointConfig  # noqa: E402
from deepspeed_async_ckpt.storage import local as storage_mod  # noqa: E402
from deepspeed_async_ckpt.storage import LocalStorage  # noqa: E402

SCENARIOS = ("new", "resave", "resave-renames")
CRASH_EXIT = 77


def state(step: int) -> dict:
    """Two files' worth of state for ``step``: a large record (written directly, in parts),
    small ones (staged and coalesced), shared storage and a non-tensor."""
    g = torch.Generator().manual_seed(step)
    flat = torch.randn(3 * 2**18, generator=g)  # 3 MiB: larger than the small-record stage
    return {"model": {"w": flat, "w_view": flat[:64].view(8, 8),
                      "b": torch.randn(33, generator=g).to(torch.bfloat16)},
            "optim": {"exp_avg": torch.randn(1000, generator=g), "step": torch.tensor(float(step))},
            "global_steps": step}


def save(ck: AsyncCheckpointer, root: str, tag: str, step: int) -> None:
    d = os.path.join(root, tag)
    ck.begin(d, tag=tag, pointer=Pointer(os.path.join(root, "latest"), tag))
    s = state(step)
    ck.save({"module": s["model"], "global_steps": s["global_steps"]}, os.path.join(d, "model.pt"))
    ck.save({"optimizer": s["optim"]}, os.path.join(d, "optim.pt"))
    ck.end()


class NoExchange(LocalStorage):
    def swap(self, a: str, b: str) -> bool:
        return False


def checkpointer(scenario: str, keep_last: int = 1) -> AsyncCheckpointer:
    config = AsyncCheckpointConfig(enabled=True, mode="async", host_buffer_gb=0.05,
                                   writer_threads=2, keep_last=keep_last)
    storage = NoExchange() if scenario == "resave-renames" else LocalStorage()
    return AsyncCheckpointer(config, storage=storage)


# ------------------------------------------------------------------ the operations counted

_lock = threading.Lock()
_count = 0
_crash_at = 0  # 0: count only


_trace = os.environ.get("CRASH_POINTS_TRACE") == "1"


def _tick(what: str, args: tuple = ()) -> None:
    global _count
    with _lock:
        _count += 1
        if _trace:
            shown = [a if isinstance(a, (str, int)) else type(a).__name__ for a in args]
            print(f"{_count:4d} {threading.current_thread().name:24s} {what} {shown}",
                  file=sys.stderr, flush=True)
        if _count == _crash_at:
            os._exit(CRASH_EXIT)


def _counted(fn, what: str):
    def wrapper(*args, **kwargs):
        _tick(what, args)
        return fn(*args, **kwargs)
    return wrapper


def _writes(flags: int) -> bool:
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))


def arm(crash_at: int) -> None:
    """Count (and, at ``crash_at``, die before) every filesystem change from here on."""
    global _crash_at
    _crash_at = crash_at
    for name in ("write", "pwrite", "pwritev", "fsync", "fdatasync", "replace", "rename", "link",
                 "symlink", "unlink", "remove", "rmdir", "mkdir", "ftruncate", "truncate"):
        setattr(os, name, _counted(getattr(os, name), name))
    real_open, real_builtin_open = os.open, builtins.open

    # An open for writing is two crash points: before it, and after it (the file created or
    # truncated, nothing written yet: what a crash while writing it leaves at the worst).
    def os_open(path, flags, *args, **kwargs):
        if not _writes(flags):
            return real_open(path, flags, *args, **kwargs)
        _tick("open", (path,))
        fd = real_open(path, flags, *args, **kwargs)
        _tick("opened", (path,))
        return fd

    def builtin_open(file, mode="r", *args, **kwargs):
        if not any(c in mode for c in "wax+") or isinstance(file, int):  # an fd: counted at os.open
            return real_builtin_open(file, mode, *args, **kwargs)
        _tick("open", (file,))
        f = real_builtin_open(file, mode, *args, **kwargs)
        _tick("opened", (file,))
        return f

    os.open, builtins.open = os_open, builtin_open
    if storage_mod._renameat2 is not None:
        storage_mod._renameat2 = _counted(storage_mod._renameat2, "renameat2")
    # Buffered file objects write through C, not os.write: their data reaches the file at close,
    # or at flush; a crash before that leaves the file empty: the crash point after the open.


def write_count(count_file: str) -> None:
    """Write the number of operations counted so far to ``count_file`` (after reading it: the
    writes are counted too)."""
    with _lock:
        n = _count
    with open(count_file, "w") as f:
        f.write(str(n))


LANES = 2
"""Runs at a time: the driver is one process, its runs each one thread's work (torch single
threaded), so two at a time keep two cores busy."""


def in_child(fn: Callable[[], None]) -> int:
    """Run ``fn()`` in a forked child; its exit code: 0 once ``fn`` returns, 1 if it raised
    (traceback on stderr), :data:`CRASH_EXIT` if a crash point ended it."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - any failure is this run's result
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def crash_every_operation(scenario: str, out: str, setup: Callable[[str], None],
                          run: Callable[[str, int, str | None], None],
                          check: Callable[[int, str], dict] | None = None) -> None:
    """The driver: ``setup(root)`` commits the first checkpoint into a template directory;
    ``run(root, crash_at, count_file)`` is the scenario (``crash_at`` 0 and a ``count_file``:
    count its operations; ``count_file`` None: die before operation ``crash_at``), each in a
    forked child, once per operation on a fresh copy of the template, ``OUT/<n>`` (:data:`LANES`
    at a time). ``check(n, root)``, if given, adds fields to run ``n``'s entry in
    ``OUT/report.json``; it runs in the process that ran ``n``."""
    os.makedirs(out, exist_ok=True)
    template = os.path.join(out, "template")
    if in_child(lambda: setup(template)) != 0:
        raise SystemExit("setting up the committed checkpoint failed")
    counted, count_file = os.path.join(out, "count"), os.path.join(out, "count.txt")
    shutil.copytree(template, counted)
    if in_child(lambda: run(counted, 0, count_file)) != 0:
        raise SystemExit("the scenario failed without a crash")
    with open(count_file) as f:
        total = int(f.read())
    # the runs are independent (each on its own copy): LANES forked processes take turns at
    # them, each writing its entries to a file of its own
    lanes = []
    for lane in range(LANES):
        lanes.append(os.fork())
        if lanes[-1] == 0:
            code = 1
            try:
                entries = []
                for n in range(1 + lane, total + 2, LANES):  # total + 1: the run that finishes
                    root = os.path.join(out, str(n))
                    shutil.copytree(template, root)
                    entry = {"n": n, "exit": in_child(lambda: run(root, n, None))}
                    if check is not None:
                        entry.update(check(n, root))
                    entries.append(entry)
                with open(os.path.join(out, f"lane{lane}.json"), "w") as f:
                    json.dump(entries, f)
                code = 0
            except BaseException:  # noqa: BLE001 - reported by the exit code
                traceback.print_exc()
                sys.stderr.flush()
            os._exit(code)
    if any(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in lanes):
        raise SystemExit("a lane of runs failed (its traceback is above)")
    runs = []
    for lane in range(LANES):
        with open(os.path.join(out, f"lane{lane}.json")) as f:
            runs += json.load(f)
    runs.sort(key=lambda entry: entry["n"])
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"scenario": scenario, "operations": total, "runs": runs}, f)


def setup(scenario: str, root: str) -> None:
    ck = checkpointer(scenario)
    save(ck, root, "t1", step=1)
    ck.wait()
    ck.close()


def run(scenario: str, root: str, crash_at: int, count_file: str | None) -> None:
    arm(crash_at)
    ck = checkpointer(scenario)
    save(ck, root, "t2" if scenario == "new" else "t1", step=2)
    ck.wait()
    ck.close()
    if count_file is not None:
        write_count(count_file)


def main() -> int:
    scenario, out = sys.argv[1], os.path.abspath(sys.argv[2])
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}")
    torch.set_num_threads(1)
    crash_every_operation(scenario, out, lambda root: setup(scenario, root),
                          lambda root, crash_at, count_file: run(scenario, root, crash_at, count_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
