"""A save directory as ``list`` and ``verify`` read it: the pointer that names its newest
checkpoint (DeepSpeed's ``latest`` or Megatron's tracker), which of its subdirectories this
engine wrote, and a checkpoint committed under a staging name. Reads only, never writes.
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import CliError


POINTERS = (("latest", "{}"), ("latest_checkpointed_iteration.txt", "iter_{:0>7}"))


def pointer_target(save_dir: str) -> str | None:
    """The checkpoint directory name ``save_dir``'s pointer (DeepSpeed's ``latest`` or
    Megatron's tracker) names, if it has one."""
    for pointer, fmt in POINTERS:
        path = os.path.join(save_dir, pointer)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read().strip()
            except (OSError, ValueError) as exc:
                raise CliError(f"cannot read the pointer {path!r}: {exc}") from None
            if not text:  # it would name save_dir itself: "not written by this engine" would
                # not say what is wrong
                raise CliError(f"the pointer {path!r} is empty: it names no checkpoint")
            return fmt.format(text)
    return None


def checkpoints_in(save_dir: str) -> list[str]:
    """The subdirectories of ``save_dir`` this engine wrote, by name."""
    from ..commit import META_DIR

    try:
        return sorted(e.name for e in os.scandir(save_dir)
                      if e.is_dir() and os.path.isdir(os.path.join(e.path, META_DIR)))
    except OSError:
        return []


def is_dir(path: str, checkpoint: str) -> bool:
    """Whether ``path`` is a directory; a failure other than its absence (permissions: another
    user's checkpoint) is an error about ``checkpoint``, not a "no"."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise CliError(f"cannot read checkpoint {checkpoint!r}: {exc.strerror or exc}") from None


def staged_replacement(path: str) -> str | None:
    """A committed staging directory meant to become ``path``, where ``path`` is missing."""
    from ..commit import META_DIR, MANIFEST, STAGING_PREFIX

    parent, name = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(parent)
    except OSError:  # missing, not a directory, not ours to list
        return None
    for n in names:
        if n.startswith(STAGING_PREFIX) and n[len(STAGING_PREFIX):].partition(".")[2] == name \
                and os.path.isfile(os.path.join(parent, n, META_DIR, MANIFEST)):
            return os.path.join(parent, n)
    return None
