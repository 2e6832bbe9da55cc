"""Save-directory claims: one process saves into a save directory at a time.

Two jobs saving into one directory would sweep each other's staging directories and
temporaries, and retention would remove the other's checkpoints. Rank 0 claims the directory
at a save's begin with an exclusive ``flock`` on its :data:`.layout.LOCK_FILE` and releases it
at close; a forked child forgets its parent's claims. Other ranks never call these.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading

from ..errors import AsyncCheckpointError
from .layout import LOCK_FILE

logger = logging.getLogger(__name__)

_claims: dict[str, list] = {}  # real path of a save directory -> [lock file's fd, claims]
_claims_lock = threading.Lock()
_unlockable_warned: set[str] = set()


def claim_save_dir(save_dir: str) -> str | None:
    """Rank 0, at a save's begin: claim ``save_dir`` for this process, with an exclusive
    ``flock`` on its :data:`LOCK_FILE` (host and pid written in it), held until
    :func:`release_save_dir` (the checkpointer's close) or the process's end. Checkpointers of
    one process share the claim. Returns the key to release; None where the filesystem has no
    such locks (logged once). Raises ``AsyncCheckpointError`` naming the holder if another
    process has it."""
    key = os.path.realpath(save_dir)
    with _claims_lock:
        if key in _claims:
            _claims[key][1] += 1
            return key
        path = os.path.join(key, LOCK_FILE)
        try:  # the save directory exists: begin claims it once it does
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # not ours to open (another user's?): saves go on unlocked
            logger.warning("async checkpoint: cannot open %s (%s): two jobs saving into %s "
                           "would not be told apart", path, exc, save_dir)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                host, _, pid = holder.partition(" ")
                raise AsyncCheckpointError(
                    f"save directory {save_dir!r} is being saved into by another process "
                    f"(host {host or '?'}, pid {pid or '?'}, per {path}): two jobs must not share a "
                    "save directory (each would remove the other's checkpoints); give this one "
                    "its own, or end the other (nothing was written)") from None
            if key not in _unlockable_warned:
                _unlockable_warned.add(key)
                logger.warning("async checkpoint: %s cannot be locked (%s): two jobs saving into "
                               "it would not be told apart", path, exc)
            return None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        _claims[key] = [fd, 1]
        return key


def forget_claims_in_child() -> None:
    """In a forked child: the parent's claims are not the child's. Its copies of the lock
    files' descriptors are closed (the parent's own still hold the locks), so the parent can
    claim again after its checkpointer closes, and a checkpointer made in the child must
    claim for itself (and is refused where the parent saves)."""
    global _claims_lock
    _claims_lock = threading.Lock()  # the parent may have held it at the fork
    for fd, _ in _claims.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _claims.clear()


def release_save_dir(key: str, *, remove: bool = False) -> None:
    """Give back one claim of :func:`claim_save_dir`; the last one unlocks. The file stays
    (removing it would race with another process opening it to lock), unless ``remove``: a
    save directory that the refused save had just made, to be removed with it."""
    with _claims_lock:
        claim = _claims.get(key)
        if claim is None:
            return
        claim[1] -= 1
        if claim[1] == 0:
            del _claims[key]
            if remove:
                try:
                    os.unlink(os.path.join(key, LOCK_FILE))
                except OSError:
                    pass
            os.close(claim[0])
