"""Remotes: where a durable tier keeps its copy, behind one small protocol.

A remote mirrors a save directory: ``<name>/<file>`` for each checkpoint file,
``<name>/.async_ckpt/manifest.json`` (its commit on this tier), and the tier's pointer
``.async_ckpt/pointer.json`` (which checkpoint the tier holds whole), followed by a copy of the
framework's own pointer file (``latest``, Megatron's tracker) so that a path tier reads as an
ordinary save directory. Keys are ``/``-separated and relative to the tier's root.

:class:`PathRemote` is a directory (a shared filesystem); :class:`~.s3.S3Remote` an S3 bucket
and prefix. Both write each object whole or not at all (temp name and rename; S3 objects
appear only when their upload completes), so a reader never sees a part of one.
"""

from __future__ import annotations

import os
import shutil
from typing import Protocol, runtime_checkable

from ..errors import ConfigError
from .config import TierConfig
from .keys import manifest_key


@runtime_checkable
class Remote(Protocol):
    """What a drain and a restore need of a tier. Methods may raise ``OSError`` (or the
    client's own errors) on failure; ``FileNotFoundError`` for a missing key."""

    url: str
    """Where it is, as logs and errors show it (no secrets)."""

    def check(self) -> None:
        """Raise unless the tier can be reached and written (called at engine build)."""

    def put_file(self, local_path: str, key: str) -> None:
        """Upload a local file whole to ``key``."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object whole."""

    def get_file(self, key: str, local_path: str) -> None:
        """Download ``key`` to ``local_path`` (overwritten)."""

    def get_bytes(self, key: str) -> bytes:
        """Read a small object."""

    def list_names(self) -> list[str]:
        """The top-level names under the root (checkpoint directories and the rest)."""

    def delete_tree(self, name: str) -> None:
        """Remove the checkpoint ``name``: its manifest first (it no longer counts), then the rest."""

    def last_modified(self, name: str) -> float | None:
        """When the newest object under ``name/`` was written (seconds since the epoch, by the
        store's own clock), or None where nothing is under it (``name`` a plain object, or
        absent)."""

    def describe(self, key: str) -> str:
        """The URL of ``key``, for messages."""


class PathRemote:
    """A tier in a directory, e.g. on a shared filesystem: files copied to a temporary name,
    fsynced, renamed, and the directory fsynced."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def check(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise PermissionError(f"{self.root} is not writable")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _replace(self, path: str, write) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put_file(self, local_path: str, key: str) -> None:
        def copy(f) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, f, 16 * 1024 * 1024)
        self._replace(self._path(key), copy)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._replace(self._path(key), lambda f: f.write(data))

    def get_file(self, key: str, local_path: str) -> None:
        shutil.copyfile(self._path(key), local_path)

    def get_bytes(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except NotADirectoryError:  # a file where the key has a directory: no such key
            raise FileNotFoundError(f"{self.describe(key)} does not exist") from None

    def list_names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def delete_tree(self, name: str) -> None:
        path = self._path(name)
        try:
            os.unlink(self._path(manifest_key(name)))
        except FileNotFoundError:
            pass
        shutil.rmtree(path, ignore_errors=True)

    def last_modified(self, name: str) -> float | None:
        newest = None
        for parent, _, files in os.walk(self._path(name)):  # nothing for a file or nothing
            for f in files:
                try:  # a temporary file being written counts: its time moves as it grows
                    at = os.stat(os.path.join(parent, f)).st_mtime
                except FileNotFoundError:
                    continue
                newest = at if newest is None else max(newest, at)
        return newest

    def describe(self, key: str) -> str:
        return self._path(key)


def open_remote(tier: TierConfig, *, index: int = 0, check: bool = True) -> Remote:
    """The remote a tier's config names; with ``check``, reached once now (a short connect
    timeout), so that a wrong URL, endpoint or credentials fail at engine build with a
    :class:`ConfigError` naming the tier, not at the first drain."""
    if tier.is_s3:
        from .s3 import S3Remote  # boto3 only where an s3:// tier is configured
        remote: Remote = S3Remote(tier)
    else:
        remote = PathRemote(tier.url)
    if check:
        try:
            remote.check()
        except Exception as exc:  # noqa: BLE001 - any client error: the tier is unusable
            where = f" (endpoint {tier.safe_endpoint})" if tier.safe_endpoint else ""
            raise ConfigError(f"async_checkpoint.tiers[{index}] {tier.url}{where} cannot be used: "
                              f"{type(exc).__name__}: {exc}") from exc
    return remote
