"""This process's saves still in flight, as the Trainer wrappers ask about them: which
directories are being saved into, waiting for those saves, and raising a save's failure before
Trainer hands its directory on. Everything is read from the core's process-wide registry of
open checkpointers (:func:`_core`) and from the files written beside checkpoints
(:mod:`.beside`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from .beside import saving_dirs as dirs_written_beside
from .beside import unreported_failures, wait_beside

logger = logging.getLogger(__name__)


def _core() -> Any:
    """The core module that keeps this process's open checkpointers (``open_checkpointers``,
    ``saving_dirs``, ``saves_in_flight``). Imported on first use: Trainer's own process has
    imported torch by then."""
    from ... import core

    return core


def inside(path: str, real_root: str) -> bool:
    """Whether ``path`` is ``real_root`` (a real path) or lies under it."""
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)


def saving_dirs() -> set[str]:
    """Real paths of the directories this process is saving into now: checkpoints begun and
    not yet committed or failed, and directories that files beside them are written into."""
    return _core().saving_dirs() | dirs_written_beside()


def being_saved(path: str) -> bool:
    """Whether this process is saving into ``path`` (or under it) now."""
    real = os.path.realpath(path)
    return any(inside(d, real) for d in saving_dirs())


def async_checkpointer_of_process() -> Any:
    """This process's open async-mode checkpointer, if any."""
    return next((c for c in _core().open_checkpointers() if c.config.is_async), None)


def async_checkpointer(trainer: Any) -> Any:
    """The open async-mode checkpointer of the DeepSpeed engine ``trainer`` trains with, if any."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    engine = getattr(getattr(trainer, "deepspeed", None), "checkpoint_engine", None)
    checkpointer = getattr(engine, "checkpointer", None)
    if not isinstance(checkpointer, _core().AsyncCheckpointer) or checkpointer.closed \
            or not checkpointer.config.is_async:
        return None
    return checkpointer


def wait_for_saves_in(path: str, strict: bool = False, before: str = "going on") -> None:
    """Block until this process's saves into ``path`` (a ``checkpoint-N``, or the directory
    holding them) are committed or have failed. A failure is raised at the next save, as
    always; with ``strict``, also here (:func:`raise_failure`), for callers that do something
    next that cannot wait for that save (an upload, the end of training)."""
    wait_beside(path)  # the saves into path wait for them too; pushes of other kinds
    real = os.path.realpath(path)
    for handle in _core().saves_in_flight():
        if inside(handle.ckpt_dir, real):
            logger.info("async checkpoint: waiting for %s to commit before %s", handle.ckpt_dir, before)
            handle.wait_committed()
    if strict:
        raise_failure(path, before)


def raise_failure(path: str, before: str, exports_only: bool = False, directly_in: bool = False) -> None:
    """Raise a :class:`~deepspeed_async_ckpt.errors.PersistError` if this process's last save
    into ``path`` (or under it; ``directly_in``: its checkpoints directly in ``path``) failed,
    or the weights export into it (:func:`.beside.write_beside`), waiting for the exports;
    ``exports_only``: only those. Only failures the engine has not reported yet
    count (one it raised at a save or ``wait`` was dealt with). The error stays the engine's
    too (raised at its next save or ``close``). Raised here, a checkpoint whose save failed is
    neither uploaded to the Hub nor marked complete by the just-in-time checkpoint."""
    from ...errors import PersistError, describe

    real = os.path.realpath(path)

    def here(directory: str, is_file_dir: bool) -> bool:
        if not directly_in:
            return inside(directory, real)
        where = os.path.realpath(directory)  # a file beside: in path; a checkpoint: a child
        return (where if is_file_dir else os.path.dirname(where)) == real

    failures = [failure for checkpointer in _core().open_checkpointers()
                for failure in unreported_failures(checkpointer, here, exports_only=exports_only)]
    if failures:
        where, error = failures[0]
        raise PersistError(f"{where}: the save failed, so it is not ready for what comes next "
                           f"({before}): {type(error).__name__}: {describe(error)}") from error
