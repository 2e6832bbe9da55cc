"""The storage seam: the few filesystem operations the persist and commit stages use.

``LocalStorage`` is the default (a POSIX path, local or a shared mount). Tests inject faults by
subclassing it; a remote backend would implement the same five methods.
"""

from __future__ import annotations

import os
from typing import BinaryIO, Protocol


class Storage(Protocol):
    def open_write(self, path: str) -> BinaryIO:
        """A new unbuffered binary file at ``path`` (truncated if present)."""

    def sync_file(self, f: BinaryIO) -> None:
        """Make what was written to ``f`` durable."""

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` to ``dst`` and make the rename durable."""

    def makedirs(self, path: str) -> None:
        ...

    def exists(self, path: str) -> bool:
        ...


class LocalStorage:
    """POSIX files. ``fsync=False`` skips every fsync (faster, not crash-safe)."""

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    def open_write(self, path: str) -> BinaryIO:
        return open(path, "wb", buffering=0)

    def sync_file(self, f: BinaryIO) -> None:
        if self.fsync:
            os.fsync(f.fileno())

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        if self.fsync:
            _fsync_dir(os.path.dirname(os.path.abspath(dst)))

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
