"""The storage seam: every change a save makes to the filesystem its checkpoints live on, and
the names of files not yet renamed into place.

:class:`Storage` is what the persist and commit stages, retention and the cleanup of failed
or refused saves are written against for every write, rename, link, removal and sync (the
save directory's lock file, :mod:`..commit.claims`, is a ``flock`` on a local file);
:class:`~.local.LocalStorage` is the default implementation. It is a POSIX filesystem's
(local, or a shared mount every rank sees): the commit's atomicity rests on its renames, the
swap of two directories, hard links and directory fsyncs, which an object store has
none of. Copies to object stores are the durable tiers' (:class:`~..tiers.remote.Remote`).
Reads (manifests, records, listings of a save directory, the files a load verifies) are plain
file reads, as ``torch.load`` and DeepSpeed's own loaders read the same files. Tests inject
faults by subclassing :class:`~.local.LocalStorage`: a fault reaches every change, the
cleanup's included.
"""

from __future__ import annotations

import re
from typing import BinaryIO, Protocol

#: The engine writes every file under a temporary name, ``<path>.tmp.<owner>`` (a save's id, or
#: the writing process's pid), and renames it to ``path`` once whole: what a crashed or failed
#: save leaves behind has such a name.
_TEMPORARY = re.compile(r"\.tmp\.[0-9a-f]+$")


def temporary_path(path: str, owner: str | int) -> str:
    """Where ``path`` is written before its rename (see ``_TEMPORARY``)."""
    return f"{path}.tmp.{owner}"


def is_temporary(name: str) -> bool:
    return _TEMPORARY.search(name) is not None


class Storage(Protocol):
    """The changes a save makes to the filesystem (see the module's description). Any thread
    of any rank calls it; calls on different paths may run at once."""

    def open_write(self, path: str) -> BinaryIO:
        """A new unbuffered binary file at ``path`` (truncated if present), whose ``write``
        writes all it is given or raises."""

    def write_small(self, path: str, data: bytes, *, durable: bool = True) -> None:
        """A new small file at ``path`` (a record, the manifest, a pointer) holding ``data``,
        written whole and, unless ``durable=False`` (others need only see it once closed),
        made durable."""

    def open_write_at(self, path: str, offset: int) -> BinaryIO:
        """``path`` (created if absent, never truncated) for writing from ``offset`` on: one
        rank's share of a file that several ranks write at once, each its own byte range."""

    def sync_file(self, f: BinaryIO) -> None:
        """Make what was written to ``f`` durable."""

    def replace(self, src: str, dst: str, *, durable: bool = True) -> None:
        """Atomically rename ``src`` to ``dst`` and (unless ``durable=False``: others need only
        see it) make the rename durable."""

    def swap(self, a: str, b: str) -> bool:
        """Atomically swap directories ``a`` and ``b`` and make it durable; False (nothing
        done) where the filesystem cannot (then two renames do it, see
        :func:`~.commit.replace_checkpoint`)."""

    def link(self, src: str, dst: str) -> None:
        """Make file ``src`` also appear at ``dst`` (a hard link, or a copy where links fail)."""

    def makedirs(self, path: str) -> None:
        """Make directory ``path`` and its missing parents; nothing if it exists."""

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (links, directories made in it) durable."""

    def listdir(self, path: str) -> list[str]:
        """Names in directory ``path`` (rank 0 polls the checkpoint's records with one call)."""

    def remove_tree(self, path: str) -> None:
        """Delete directory ``path`` and everything under it (retention); a symbolic link or
        a file at ``path`` is unlinked (a temporary file a failed write left)."""

    def remove_dir(self, path: str) -> None:
        """Delete the empty directory ``path``; ``OSError`` if it holds anything (a refused
        save's directories are removed only while nothing else is in them)."""
