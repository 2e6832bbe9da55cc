"""Files written beside a checkpoint: Trainer's ``model.safetensors`` in ``checkpoint-N``,
written on the engine's writer threads and made durable before the DeepSpeed save into that
directory commits.

Built on three seams of the core's :class:`~deepspeed_async_ckpt.core.AsyncCheckpointer`:

- ``submit_write``: the file is written on a writer thread, queued with the engine's own
  writes; ``wait``, ``close`` and the exit flush wait for it, and a failure no save took as
  its own is raised at the next ``begin`` or ``wait``;
- ``add_begin_callback`` and ``CheckpointHandle.depends_on``: a save into a directory
  (``begin(<directory>/<tag>)``) depends on the files being written into that directory, so
  this rank's part of it is persisted only once they are durable, and their failure is that
  save's (raised at the next ``begin`` or ``wait``, on every rank at a ``begin``);
- ``submitted_writes``, ``unreported_errors`` and ``history``: what :func:`saving_dirs`,
  :func:`wait_beside` and :func:`unreported_failures` read.

Called on Trainer's thread (:mod:`.trainer_methods`, :mod:`.in_flight`); the writes run on the
writer threads. The core is imported on first use (see :func:`.in_flight._core`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import weakref
from concurrent.futures import Future
from typing import Any, BinaryIO, Callable

_hooked: weakref.WeakSet = weakref.WeakSet()
"""The checkpointers whose saves depend on the files written beside them (one callback each)."""
_hook_lock = threading.Lock()


def write_beside(checkpointer: Any, path: str, write: Callable[[BinaryIO], Any]) -> Future:
    """Write ``path``, a file of no checkpoint of this engine in a save directory, on a writer
    thread of ``checkpointer``: ``write(f)`` writes it whole into ``f``, a temporary file opened
    as the engine opens its own (``Storage.open_write``: direct I/O where it can), which is then
    made durable (``fsync``) and renamed to ``path``, so ``path`` is whole or absent. ``write``
    must own what it writes: no fence covers it.

    Until it is durable, its directory counts as being saved into (:func:`saving_dirs`), and a
    save into that directory waits for it and fails with it (see the module docstring).
    ``close`` (and so the exit flush) waits for it."""
    path = os.path.abspath(path)
    _depend_on_files_beside(checkpointer)
    return checkpointer.submit_write(path, _write_whole, checkpointer.storage, path, write,
                                     checkpointer.config.fsync)


def _write_whole(storage: Any, path: str, write: Callable[[BinaryIO], Any], durable: bool) -> None:
    from ...errors import PersistError, describe
    from ...storage import temporary_path

    tmp = temporary_path(path, uuid.uuid4().hex[:12])
    try:
        with storage.open_write(tmp) as f:
            write(f)
            storage.sync_file(f)
        storage.replace(tmp, path, durable=durable)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PersistError(f"{path}: writing it in the background failed: "
                           f"{type(exc).__name__}: {describe(exc)}") from exc


def _depend_on_files_beside(checkpointer: Any) -> None:
    """Make every save of ``checkpointer`` depend on the files written into its save directory
    (once per checkpointer)."""
    with _hook_lock:
        if checkpointer in _hooked:
            return
        _hooked.add(checkpointer)
    ref = weakref.ref(checkpointer)  # the checkpointer holds the callback: no cycle

    def depend(handle: Any) -> None:
        owner = ref()
        if owner is not None:
            for future in _files_in(owner, os.path.dirname(handle.ckpt_dir)):
                handle.depends_on(future)

    checkpointer.add_begin_callback(depend)


def _files_in(checkpointer: Any, directory: str | None) -> list[Future]:
    """The writes of ``checkpointer`` not yet taken (see ``submitted_writes``) into
    ``directory`` (None: all)."""
    real = None if directory is None else os.path.realpath(directory)
    return [future for path, future in checkpointer.submitted_writes()
            if real is None or os.path.realpath(os.path.dirname(path)) == real]


def _open_checkpointers() -> list[Any]:
    from ... import core

    return core.open_checkpointers()


def saving_dirs() -> set[str]:
    """Real paths of the directories that this process's open checkpointers are still writing
    files beside checkpoints into."""
    return {os.path.realpath(os.path.dirname(path)) for checkpointer in _open_checkpointers()
            for path, future in checkpointer.submitted_writes() if not future.done()}


def wait_beside(directory: str | None = None, checkpointer: Any = None) -> None:
    """Wait until the files being written beside checkpoints into ``directory`` (None: all), by
    ``checkpointer`` (None: every open one of this process), are written or have failed (a
    failure is raised as always: by the save beside it, or at the next ``begin`` or ``wait``)."""
    for owner in _open_checkpointers() if checkpointer is None else [checkpointer]:
        for future in _files_in(owner, directory):
            future.exception()  # waits


def unreported_failures(checkpointer: Any, where: Callable[[str, bool], bool],
                        exports_only: bool = False) -> list[tuple[str, BaseException]]:
    """``(path, error)`` of the failures ``checkpointer`` recorded and has not reported yet
    (raised at a ``begin``, ``wait`` or ``close``): of the last save into each checkpoint
    directory that ``where(ckpt_dir, False)`` accepts, with the files written beside it, and of
    the files written beside checkpoints into directories that ``where(directory, True)``
    accepts (waiting for those); ``exports_only``: of the files beside alone. A save ended with
    ``commit=False`` counts as failed. They stay recorded: reported here, they are raised again
    at the next ``begin``, ``wait`` or ``close``."""
    from ...errors import PersistError

    failures: list[tuple[str, BaseException]] = []
    for path, future in checkpointer.submitted_writes():  # not taken yet: not reported
        if where(os.path.dirname(path), True) and future.exception() is not None:
            failures.append((path, future.exception()))
    errors = checkpointer.unreported_errors()  # read once the files above are written
    last: dict[str, Any] = {}  # a checkpoint directory -> its last save
    for handle in list(checkpointer.history):
        if where(handle.ckpt_dir, False):
            last[handle.ckpt_dir] = handle
    for handle in last.values():
        if handle.error is not None and not any(e is handle.error for e in errors):
            continue  # raised already
        failures += [(handle.ckpt_dir, f.exception()) for f in handle.dependencies
                     if f.exception() is not None]
        if exports_only:
            continue
        if handle.error is not None:
            failures.append((handle.ckpt_dir, handle.error))
        elif handle.abandoned:
            failures.append((handle.ckpt_dir, PersistError("its save was abandoned (end(commit=False))")))
    return failures
