"""Which checkpoint a load takes from the tiers (rule 1 of :mod:`.restore`), chosen by global
rank 0, and the engine's record of the first tier's pointer that tells a pointer edited by hand
from the one the engine wrote.

- A tag asked for: that one, and no other.
- Else the first tier's pointer (``latest``, Megatron's tracker) as a user left it, where its
  text is not the one the engine last wrote there (:data:`RECORD_FILE`) and it names a
  checkpoint committed on the first tier or on a tier: a rollback by hand, followed even
  where a tier holds a newer one (one line says so).
- Else (no pointer, an empty one, one naming nothing committed, or the engine's own) the newest
  committed on any tier: the checkpoint the first tier's pointer names and each tier's
  pointer's, compared by their manifests' commit times (a tie goes to the faster tier). A
  first-tier checkpoint whose manifest is missing (a replaced node's empty disk) or damaged is
  not a candidate.
- Then, for when the first cannot be made whole, every older checkpoint committed on any tier
  (saved aside ones not), newest first.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Iterator, Sequence

from ..commit import MANIFEST, META_DIR, write_text_atomic
from ..commit.manifest import manifest_problem, read_manifest
from ..errors import IntegrityError
from ..storage import LocalStorage
from .mirror import read_tier_manifest, read_tier_pointer
from .remote import Remote

logger = logging.getLogger(__name__)

RECORD_FILE = ".async_ckpt.pointer.json"
"""The engine's record, beside the first tier's pointer, of the text it last wrote there:
``{"checkpoint": name, "pointer": [file name, text]}``. A pointer whose text differs was
edited by hand."""


def record_pointer(save_dir: str, name: str, pointer_name: str, text: str) -> None:
    """Note that the engine wrote ``text`` (naming checkpoint ``name``) to the pointer
    ``pointer_name`` of ``save_dir`` (node leaders: at each commit with tiers, and at a
    restore that moves the pointer). Not fsynced: a record a crash loses makes the pointer
    look edited, and it is then followed, which is what the engine wrote."""
    record = json.dumps({"checkpoint": name, "pointer": [pointer_name, text]}, sort_keys=True)
    write_text_atomic(LocalStorage(fsync=False, direct_io=False), os.path.join(save_dir, RECORD_FILE),
                      record, durable=False)


def _recorded_text(save_dir: str, pointer_name: str) -> str | None:
    """The text the engine last wrote to the pointer, or None where it has no record of it."""
    try:
        with open(os.path.join(save_dir, RECORD_FILE), encoding="utf-8") as f:
            pointer = json.load(f).get("pointer")
    except (OSError, ValueError, AttributeError):
        return None
    ok = isinstance(pointer, list) and len(pointer) == 2 and pointer[0] == pointer_name
    return pointer[1] if ok else None


def read_local_pointer(path: str) -> str | None:
    """The text of the first tier's pointer ``path``, stripped; None where it is missing or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def local_manifest(save_dir: str, name: str) -> dict | None:
    """The first tier's manifest of ``name``; None where it is missing or damaged (logged)."""
    try:
        return read_manifest(os.path.join(save_dir, name))
    except IntegrityError as exc:
        logger.warning("async checkpoint: restore: the first tier's copy is not a candidate: %s", exc)
        return None


def tier_manifest(remote: Remote, name: str) -> dict | None:
    """The tier's manifest of ``name``; None where it has none, or a damaged one (logged)."""
    try:
        manifest = read_tier_manifest(remote, name)
        problem = None if manifest is None else manifest_problem(manifest)
    except IntegrityError as exc:
        manifest, problem = None, str(exc)
    if problem is not None:
        logger.warning("async checkpoint: restore: %s is not a candidate: its manifest is damaged: %s",
                       remote.describe(name), problem)
        return None
    return manifest


def _at(manifest: dict) -> float:
    return float(manifest.get("committed_at", 0.0))


def choices(save_dir: str, remotes: Sequence[Remote], *, pointer_name: str, tag: str | None = None,
            name_of: Callable[[str], str] = str) -> Iterator[str]:
    """Rank 0: the checkpoints to try, in order (rule 1). Lazy: the older ones are listed only
    once the first could not be made whole."""
    if tag is not None:
        yield tag
        return
    first = _preferred(save_dir, remotes, pointer_name=pointer_name, name_of=name_of)
    if first is None:
        return
    yield first[1]
    for _, name in _older(save_dir, remotes, *first):
        yield name


def newest_committed(save_dir: str, remotes: Sequence[Remote], *, pointer_name: str,
                     name_of: Callable[[str], str] = str) -> tuple[float, str] | None:
    """Rank 0: (commit time, name) of the checkpoint a load without a tag takes from the first
    tier and the tiers (the first of :func:`choices`), or None where none is committed: what
    the memory tier's newest is compared with (:mod:`..memory.restore`)."""
    return _preferred(save_dir, remotes, pointer_name=pointer_name, name_of=name_of)


def _preferred(save_dir: str, remotes: Sequence[Remote], *, pointer_name: str,
               name_of: Callable[[str], str]) -> tuple[float, str] | None:
    """The first checkpoint to try, with its commit time: the pointer's as a user left it, else
    the newest any pointer names."""
    text = read_local_pointer(os.path.join(save_dir, pointer_name))
    named = None if text is None else name_of(text)
    local = None
    if named is not None and os.path.exists(os.path.join(save_dir, named, META_DIR, MANIFEST)):
        local = local_manifest(save_dir, named)
    pointers = [] if local is None else [(_at(local), 0, named, "the first tier")]
    for order, remote in enumerate(remotes, start=1):
        record = read_tier_pointer(remote)
        if record is None:
            continue
        manifest = tier_manifest(remote, record["checkpoint"])
        if manifest is None:  # the tier's commit order never leaves this: someone removed it
            logger.warning("async checkpoint: restore: %s names %s, of which it holds no valid manifest",
                           remote.url, record["checkpoint"])
            continue
        pointers.append((_at(manifest), order, record["checkpoint"], remote.url))
    if named is not None and text != _recorded_text(save_dir, pointer_name):  # edited by hand
        at = _at(local) if local is not None else _committed_at(remotes, named)
        pointer = os.path.join(save_dir, pointer_name)
        if at is not None:
            newer = sorted((p for p in pointers if p[0] > at), reverse=True)
            if newer:
                logger.warning("async checkpoint: restore: %s names %s, which the engine did not write "
                               "there (a rollback by hand): loading it, although %s holds the newer %s",
                               pointer, named, newer[0][3], newer[0][2])
            return at, named
        logger.warning("async checkpoint: restore: %s names %s, which no tier holds committed: loading "
                       "the newest committed on any tier", pointer, named)
    if not pointers:
        return None
    at, _, name, _ = max(pointers, key=lambda p: (p[0], -p[1]))
    return at, name


def _committed_at(remotes: Sequence[Remote], name: str) -> float | None:
    for remote in remotes:
        manifest = tier_manifest(remote, name)
        if manifest is not None:
            return _at(manifest)
    return None


def _older(save_dir: str, remotes: Sequence[Remote], before: float, first: str) -> list[tuple[float, str]]:
    """The checkpoints committed on any tier before ``before`` (a commit time), newest first;
    those saved aside (no pointer named them) are not."""
    at: dict[str, float] = {}
    try:
        local = sorted(os.listdir(save_dir))
    except FileNotFoundError:
        local = []
    for name in local:
        if not name.startswith(".") and os.path.exists(os.path.join(save_dir, name, META_DIR, MANIFEST)):
            manifest = local_manifest(save_dir, name)
            if manifest is not None and manifest.get("rotation") is not False:
                at[name] = _at(manifest)
    for remote in remotes:
        try:
            names = remote.list_names()
        except Exception:  # noqa: BLE001 - an unreachable tier holds nothing for this restore
            logger.warning("async checkpoint: restore: %s cannot be listed", remote.url, exc_info=True)
            continue
        for name in names:
            if name in at or name.startswith(META_DIR):
                continue
            manifest = tier_manifest(remote, name)
            if manifest is not None:
                at[name] = _at(manifest)
    return sorted(((t, n) for n, t in at.items() if t < before and n != first), reverse=True)
