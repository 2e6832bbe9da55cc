"""Files written beside a checkpoint: a file of no checkpoint of this engine, in a save
directory (Hugging Face Trainer's ``model.safetensors`` in ``checkpoint-N``), written on a
writer thread and made durable before the save into that directory commits.

Only the Hugging Face integration writes such files (through
:meth:`AsyncCheckpointer.write_beside <.checkpointer.AsyncCheckpointer.write_beside>`). The
rest of the core sees :class:`BesideFiles` through four calls: ``claim`` (``begin``: their
outcome is now the save's), ``take_failures`` (the failure ledger), ``entries`` (waits, the
process registry) and ``unreported_failures`` (the integration's scan).
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, BinaryIO, Callable, Iterable

from ..errors import AsyncCheckpointError, PersistError, describe
from ..storage import Storage, temporary_path
from .handle import CheckpointHandle
from .saves import time_left


class _Beside:
    """A file written beside the checkpoints, until its write is done and its outcome taken:
    by the save beside it, or as a background error."""

    __slots__ = ("path", "future", "by_save")

    def __init__(self, path: str, future: Future) -> None:
        self.path, self.future = path, future
        self.by_save = False  # its failure is the failure of the save beside it

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path)


class BesideFiles:
    """The files one checkpointer writes beside its checkpoints, until their outcome is taken.

    ``writers``: the checkpointer's writer threads; ``lock``: its lock (see :mod:`.saves`),
    which guards the list here; ``durable``: rename with ``fsync`` (the config's)."""

    def __init__(self, storage: Storage, writers: Executor, lock: threading.Lock, *,
                 durable: bool) -> None:
        self._storage, self._writers, self._lock, self._durable = storage, writers, lock, durable
        self._entries: list[_Beside] = []

    def write(self, path: str, write: Callable[[BinaryIO], Any]) -> Future:
        """Write ``path``, a file of no checkpoint of this engine that sits in a save directory
        (Hugging Face Trainer's ``model.safetensors`` in ``checkpoint-N``, see
        :mod:`..hf_trainer`), on a writer thread: ``write(f)`` writes it whole into ``f``, a
        temporary file opened as this engine opens its own (``Storage.open_write``: direct I/O
        where it can), which is then made durable (with ``fsync``) and renamed to ``path``, so
        ``path`` is whole or absent. ``write`` must own what it writes: no fence covers it.

        Until it is durable, its directory counts as being saved into
        (:func:`~.lifecycle.saving_dirs`), and a save into that directory
        (``begin(<that directory>/<tag>)``) is not persisted on this rank before it is: its
        failure is then that save's (raised at the next ``begin`` or ``wait``, on every rank at
        a ``begin``); otherwise it is raised there itself.
        ``close`` (and so the exit flush) waits for it."""
        path = os.path.abspath(path)
        entry = _Beside(path, self._writers.submit(self._write, path, write))
        with self._lock:
            self._entries.append(entry)
        return entry.future

    def _write(self, path: str, write: Callable[[BinaryIO], Any]) -> None:
        tmp = temporary_path(path, uuid.uuid4().hex[:12])
        try:
            with self._storage.open_write(tmp) as f:
                write(f)
                self._storage.sync_file(f)
            self._storage.replace(tmp, path, durable=self._durable)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise PersistError(f"{path}: writing it in the background failed: "
                               f"{type(exc).__name__}: {describe(exc)}") from exc

    def entries(self, directory: str | None = None) -> list[_Beside]:
        """The files beside not yet taken, in ``directory`` (a real path; None: all)."""
        with self._lock:
            entries = list(self._entries)
        return [e for e in entries
                if directory is None or os.path.realpath(e.directory) == directory]

    def claim(self, save_dir: str) -> list[Future]:
        """``begin``: the files beside in its save directory, whose outcome is now the save's."""
        entries = self.entries(os.path.realpath(save_dir))
        with self._lock:
            for entry in entries:
                entry.by_save = True
        return [e.future for e in entries]

    def take_failures(self) -> list[BaseException]:
        """Under the lock (the failure ledger's ``take``): forget the files whose write is
        done; return the failures among them that no save took as its own."""
        failures = []
        for entry in [e for e in self._entries if e.future.done()]:
            self._entries.remove(entry)
            if not entry.by_save and entry.future.exception() is not None:
                failures.append(entry.future.exception())
        return failures

    def wait(self, directory: str | None = None) -> None:
        """Wait until the files being written into ``directory`` (None: all) are written or
        have failed."""
        for entry in self.entries(None if directory is None else os.path.realpath(directory)):
            entry.future.exception()  # waits

    def wait_all(self, deadline: float | None, timeout: float | None) -> None:
        """Wait until every file beside is written or has failed, until ``deadline``
        (``time.monotonic``); past it, raise naming ``timeout`` (s)."""
        for entry in self.entries():
            try:
                entry.future.exception(time_left(deadline))
            except FutureTimeout:
                raise AsyncCheckpointError(f"writing {entry.path} did not finish within {timeout} s") \
                    from None

    def unreported_failures(self, where: Callable[[str, bool], bool], exports_only: bool,
                            unreported: Callable[[], list[BaseException]],
                            history: Iterable[CheckpointHandle]
                            ) -> list[tuple[str, BaseException]]:
        """``(path, error)`` of the failures recorded and not yet reported (raised at a
        ``begin``, ``wait`` or ``close``) of the last save into each checkpoint directory that
        ``where(ckpt_dir, False)`` accepts, with the files written beside it, and of the files
        written beside into directories that ``where(directory, True)`` accepts (waiting for
        those); ``exports_only``: of the files beside alone. A save ended with
        ``commit=False`` counts as failed. They stay recorded: reported here, they are raised
        again at the next ``begin``, ``wait`` or ``close`` (see :mod:`..hf_trainer`).

        ``unreported``: the errors the ledger holds (read after the files beside are waited
        for); ``history``: the checkpointer's last sealed saves."""
        failures: list[tuple[str, BaseException]] = []
        for entry in self.entries():  # not taken yet: not reported
            if where(entry.directory, True) and entry.future.exception() is not None:
                failures.append((entry.path, entry.future.exception()))
        errors = unreported()
        last: dict[str, CheckpointHandle] = {}  # a checkpoint directory -> its last save
        for handle in list(history):
            if where(handle.ckpt_dir, False):
                last[handle.ckpt_dir] = handle
        for handle in last.values():
            if handle.error is not None and not any(e is handle.error for e in errors):
                continue  # raised already
            failures += [(handle.ckpt_dir, f.exception()) for f in handle.beside if f.exception() is not None]
            if exports_only:
                continue
            if handle.error is not None:
                failures.append((handle.ckpt_dir, handle.error))
            elif handle.abandoned:
                failures.append((handle.ckpt_dir, PersistError("its save was abandoned (end(commit=False))")))
        return failures
