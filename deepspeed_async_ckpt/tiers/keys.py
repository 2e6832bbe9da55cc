"""The names of a checkpoint's objects on a tier: ``/``-separated keys relative to the tier's
root, the same for every kind of remote (:mod:`.remote`, :mod:`.s3`)."""

from __future__ import annotations

from ..commit import MANIFEST, META_DIR

POINTER_KEY = f"{META_DIR}/pointer.json"
"""The tier's pointer: ``{"checkpoint": name, "save_id": ..., "pointer": [file name, text]}``."""


def manifest_key(name: str) -> str:
    """The manifest of checkpoint ``name`` on the tier: its commit there."""
    return f"{name}/{META_DIR}/{MANIFEST}"


def marker_key(name: str, node: int) -> str:
    """Written by each node once its files of checkpoint ``name`` are uploaded."""
    return f"{name}/{META_DIR}/drained.{node}.json"
