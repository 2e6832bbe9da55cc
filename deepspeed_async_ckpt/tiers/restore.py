"""Restore before load: bring the checkpoint to load into the first tier from the durable tiers.

Called before the framework reads the save directory (rank 0; each node's leader with a
node-local first tier). Rules:

1. Which checkpoint: the one named (``tag``), else the newest committed on any tier: the
   first tier's pointer and each durable tier's pointer are compared by their manifests'
   commit times (a tie goes to the faster tier). A first-tier checkpoint whose manifest is
   missing (a replaced node's empty disk) or damaged is not a candidate.
2. Each of its files that is missing on the first tier or fails verification there is
   fetched from the fastest tier that holds the
   same save (same ``save_id``): downloaded to a temporary name, verified against the
   manifest, fsynced and renamed. A copy that fails verification is skipped for the next
   tier; if no tier holds a valid copy, :class:`IntegrityError` names the file and what is
   wrong with each copy (a corrupted object by its URL). With a node-local first tier
   (``node``), the files a node restores are those its directory held (its ranks read only
   them: DeepSpeed), or every file of the checkpoint (``every_file``: Megatron, whose ranks
   also read tensors written once, by a rank of another node).
3. Then the late files (every node's copy has them) and their record, the manifest, and the first tier's pointer last (only
   when following the pointer and it named an older checkpoint), so that the first tier's
   pointer, too, never names a partial copy.

The framework then loads as usual, verifying what it reads.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Sequence

from ..commit import LATE_FILES, MANIFEST, META_DIR, write_text_atomic
from ..commit.manifest import manifest_problem, read_manifest
from ..commit.verify import file_problem
from ..errors import IntegrityError
from ..progress import track
from ..storage import LocalStorage, temporary_path
from .mirror import files_of_node, read_tier_manifest, read_tier_pointer
from .remote import Remote, manifest_key

logger = logging.getLogger(__name__)


class _Source:
    """Where the checkpoint to load was found: the first tier (``remote`` None) or a tier."""

    def __init__(self, name: str, manifest: dict, remote: Remote | None, pointer_text: str | None):
        self.name, self.manifest, self.remote, self.pointer_text = name, manifest, remote, pointer_text


def _read_local_pointer(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _local_manifest(save_dir: str, name: str) -> dict | None:
    try:
        return read_manifest(os.path.join(save_dir, name))
    except IntegrityError as exc:
        logger.warning("async checkpoint: restore: the first tier's copy is not a candidate: %s", exc)
        return None


def _tier_manifest(remote: Remote, name: str) -> dict | None:
    manifest = read_tier_manifest(remote, name)
    if manifest is not None and manifest_problem(manifest):
        raise IntegrityError(f"{remote.describe(name)}: its manifest is damaged: {manifest_problem(manifest)}")
    return manifest


def choose(save_dir: str, remotes: Sequence[Remote], *, pointer_name: str, tag: str | None,
           name_of: Callable[[str], str]) -> _Source | None:
    """The checkpoint to load and where its manifest comes from (rule 1), or None if no tier
    holds one."""
    candidates: list[tuple[float, int, _Source]] = []
    if tag is not None:
        manifest = _local_manifest(save_dir, tag)
        if manifest is not None:
            return _Source(tag, manifest, None, None)
        for remote in remotes:
            manifest = _tier_manifest(remote, tag)
            if manifest is not None:
                return _Source(tag, manifest, remote, None)
        return None
    text = _read_local_pointer(os.path.join(save_dir, pointer_name))
    if text is not None:
        manifest = _local_manifest(save_dir, name_of(text))
        if manifest is not None:
            candidates.append((manifest["committed_at"], 0, _Source(name_of(text), manifest, None, None)))
    for order, remote in enumerate(remotes, start=1):
        record = read_tier_pointer(remote)
        if record is None:
            continue
        manifest = _tier_manifest(remote, record["checkpoint"])
        if manifest is None:  # the tier's commit order never leaves this: someone removed it
            logger.warning("async checkpoint: restore: %s names %s, which has no manifest there",
                           remote.url, record["checkpoint"])
            continue
        pointer = record.get("pointer")
        text = pointer[1] if isinstance(pointer, list) and pointer[0] == pointer_name else record["checkpoint"]
        candidates.append((manifest["committed_at"], order, _Source(record["checkpoint"], manifest, remote, text)))
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c[0], -c[1]))[2]


def _fetch(path: str, key: str, entry: dict, algorithm: str, holders: Sequence[Remote],
           problems: list[str]) -> bool:
    """Download ``key`` from the first of ``holders`` whose copy verifies into ``path``."""
    tmp = temporary_path(path, os.getpid())
    for remote in holders:
        try:
            remote.get_file(key, tmp)
            problem = file_problem(tmp, entry, algorithm)
        except Exception as exc:  # noqa: BLE001 - that tier's copy is unusable: the next one
            problem = f"cannot be fetched: {type(exc).__name__}: {exc}"
        if problem is None:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        problems.append(f"{remote.describe(key)}: {problem}")
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return False


def restore(save_dir: str, remotes: Sequence[Remote], *, pointer_name: str, tag: str | None = None,
            name_of: Callable[[str], str] = str, node: int | None = None,
            every_file: bool = False) -> str | None:
    """Make the first tier (``save_dir``) hold a verified copy of the checkpoint to load (see
    the module's rules). ``pointer_name``: the framework's pointer file in ``save_dir``;
    ``name_of``: the checkpoint directory its text names (Megatron's tracker holds the
    iteration). ``node``: the node whose directory ``save_dir`` is (a node-local first tier),
    which restores the files ``manifest["nodes"]`` places there, or with ``every_file`` every
    file of the checkpoint. Returns the checkpoint's name, or None where no tier holds one."""
    source = choose(save_dir, remotes, pointer_name=pointer_name, tag=tag, name_of=name_of)
    if source is None:
        return None
    name, manifest = source.name, source.manifest
    ckpt_dir = os.path.join(save_dir, name)
    os.makedirs(os.path.join(ckpt_dir, META_DIR), exist_ok=True)
    algorithm = manifest["checksum"]
    holders = [r for r in remotes if (r is source.remote) or _holds(r, name, manifest["save_id"])]
    storage = LocalStorage(fsync=True, direct_io=False)
    fetched = 0
    rels = sorted(manifest["files"]) if node is None or every_file else files_of_node(manifest, node)
    for rel in track(rels, lambda rel: manifest["files"][rel]["bytes"], f"restore of {name} into {save_dir}"):
        fetched += _ensure(ckpt_dir, name, rel, manifest["files"][rel], algorithm, holders)
    late = manifest.get("late_files") or []
    if late:  # Megatron's marker files: rank 0 writes them, and sends each node's leader a copy
        record, raw = _late_record(ckpt_dir, name, holders)
        for rel in late:
            fetched += _ensure(ckpt_dir, name, rel, record[rel], algorithm, holders)
        if raw is not None:
            write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, LATE_FILES), raw)
    if source.remote is not None:
        local = _local_manifest(save_dir, name) if os.path.exists(
            os.path.join(ckpt_dir, META_DIR, MANIFEST)) else None
        if local is None or local.get("save_id") != manifest["save_id"]:  # the tier's bytes, as they are
            write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, MANIFEST),
                              source.remote.get_bytes(manifest_key(name)))
        if tag is None and source.pointer_text is not None:
            write_text_atomic(storage, os.path.join(save_dir, pointer_name), source.pointer_text)
    if fetched or source.remote is not None:
        logger.info("async checkpoint: restored %s into %s: %d file(s) fetched from %s", name, save_dir,
                    fetched, ", ".join(r.url for r in holders) or "no tier")
    return name


def _holds(remote: Remote, name: str, save_id: str) -> bool:
    try:
        manifest = read_tier_manifest(remote, name)
    except (IntegrityError, OSError):
        return False
    except Exception:  # noqa: BLE001 - an unreachable tier holds nothing for this restore
        logger.warning("async checkpoint: restore: %s cannot be read", remote.url, exc_info=True)
        return False
    return manifest is not None and manifest.get("save_id") == save_id


def _ensure(ckpt_dir: str, name: str, rel: str, entry: dict, algorithm: str,
            holders: Sequence[Remote]) -> int:
    """1 if the file was fetched, 0 if the first tier's copy verifies."""
    path = os.path.join(ckpt_dir, rel)
    try:
        local = file_problem(path, entry, algorithm)
    except OSError as exc:  # missing on the first tier: what a replaced node's disk is
        local = f"cannot be read: {exc}"
    if local is None:
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    problems = [f"{path}: {local}"]
    if _fetch(path, f"{name}/{rel}", entry, algorithm, holders, problems):
        return 1
    if not holders:
        problems.append("no durable tier holds this save of the checkpoint")
    raise IntegrityError(f"checkpoint {name}: no tier holds a valid copy of {rel}: " + "; ".join(problems))


def _late_record(ckpt_dir: str, name: str, holders: Sequence[Remote]) -> tuple[dict, bytes | None]:
    """The record of the late files: the first tier's (bytes None: nothing to write), else the
    first durable tier's, with its bytes."""
    path = os.path.join(ckpt_dir, META_DIR, LATE_FILES)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), None
    except (OSError, ValueError):
        pass
    for remote in holders:
        try:
            raw = remote.get_bytes(f"{name}/{META_DIR}/{LATE_FILES}")
            return json.loads(raw), raw
        except (OSError, ValueError):
            continue
    raise IntegrityError(f"checkpoint {name}: no tier holds the record of its late files ({LATE_FILES})")
