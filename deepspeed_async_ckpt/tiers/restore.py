"""Restore before load: bring the checkpoint to load into the first tier from the durable tiers.

Called by every rank before the framework reads the save directory (:func:`restore`): global
rank 0 chooses, and the ranks that restore (rank 0; each node's leader with a node-local first
tier) make that one checkpoint whole, every rank agreeing on each step through the
checkpointer's exchange, so that all of them load the same checkpoint. Rules:

1. Which checkpoint (rank 0, :func:`.choose.choices`): the tag asked for, and no other; else,
   following the pointer, the first tier's pointer where a user edited it (a rollback) and it
   names a committed checkpoint, else the newest committed on any tier. If that one cannot be
   made whole on every restoring rank (a file of it has no valid copy on any tier), the next
   older committed on any tier, newest first, until one can; rank 0 logs once which were
   skipped and why. A tag asked for is never replaced: its failure is raised.
2. Each of its files that is missing on the first tier or fails verification there is
   fetched from the fastest tier that holds the
   same save (same ``save_id``): downloaded to a temporary name, verified against the
   manifest, fsynced and renamed. A copy that fails verification is skipped for the next
   tier; if no tier holds a valid copy, :class:`IntegrityError` names the file and what is
   wrong with each copy (a corrupted object by its URL). With a node-local first tier
   (``node``), the files a node restores are those its directory held (its ranks read only
   them: DeepSpeed), or every file of the checkpoint (``every_file``: Megatron, whose ranks
   also read tensors written once, by a rank of another node).
3. Then the late files (every node's copy has them) and their record, the manifest, and the
   first tier's pointer last (only when following the pointer and it names another
   checkpoint), then the engine's record of it, so that the first tier's pointer, too, never
   names a partial copy.
4. An attempt that fails removes the directories it made: no empty checkpoint directory stays.

The framework then loads as usual, verifying what it reads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Callable, Sequence

from ..agreement import AgreementError, Exchange, alone, outcome
from ..commit import LATE_FILES, MANIFEST, META_DIR, write_text_atomic
from ..commit.verify import file_problem
from ..errors import IntegrityError
from ..progress import track
from ..storage import LocalStorage, temporary_path
from .choose import choices, local_manifest, read_local_pointer, record_pointer, tier_manifest
from .mirror import files_of_node, read_tier_manifest
from .keys import manifest_key
from .remote import Remote

logger = logging.getLogger(__name__)

_CANNOT = IntegrityError.__name__
"""The kind of a rank's failure when an attempt could not make a checkpoint whole."""


def restore(save_dir: str, remotes: Sequence[Remote], *, pointer_name: str, tag: str | None = None,
            name_of: Callable[[str], str] = str, node: int | None = None, every_file: bool = False,
            exchange: Exchange = alone, chooses: bool = True, restores: bool = True) -> str | None:
    """Make the first tier (``save_dir``) hold a verified copy of the checkpoint to load (see
    the module's rules). ``pointer_name``: the framework's pointer file in ``save_dir``;
    ``name_of``: the checkpoint directory its text names (Megatron's tracker holds the
    iteration). ``node``: the node whose directory ``save_dir`` is (a node-local first tier),
    which restores the files ``manifest["nodes"]`` places there, or with ``every_file`` every
    file of the checkpoint.

    Collective with a checkpointer's ``exchange`` (every rank calls it, each step agreed with
    :func:`~..agreement.outcome`): the rank that
    ``chooses`` (global rank 0) proposes each checkpoint in turn, those that ``restores`` try
    to make it whole, and every rank raises alike if one failed otherwise than for want of a
    valid copy. Without it, this process alone does both. Returns the checkpoint's name (a tag
    asked for even where no tier holds it: the framework's load says so), or None where no
    pointer names a committed one."""
    order = choices(save_dir, remotes, pointer_name=pointer_name, tag=tag, name_of=name_of) \
        if chooses else None
    skipped: list[str] = []
    cause: BaseException | None = None  # this rank's error of the last checkpoint passed over
    while True:
        proposal, own = None, None  # None: no checkpoint (left) to propose
        if order is not None:
            try:
                proposal = next(order, None)
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank alike
                own = exc
        name, failed = outcome("restore", proposal, own, exchange=exchange)
        if failed is not None:
            raise _raised(failed, own)
        if not name:
            if skipped:
                raise IntegrityError("no committed checkpoint can be made whole from any tier: "
                                     + "; ".join(skipped)) from cause
            return None
        own = None
        if restores:
            try:
                _make_whole(save_dir, remotes, name, pointer_name=pointer_name, follow=tag is None,
                            name_of=name_of, node=node, every_file=every_file)
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank alike
                own = exc
        _, failed = outcome(f"restore {name}", None, own, exchange=exchange)
        if failed is None:
            if skipped and chooses:
                logger.warning("async checkpoint: restore: loading %s; skipped the newer %s", name,
                               "; ".join(skipped))
            return name
        if tag is not None or not failed.only(_CANNOT):
            raise _raised(failed, own)
        why = "; ".join(f"rank {r}: {f.message}" for r, f in sorted(failed.failures.items()))
        skipped.append(f"{name} ({why})")
        cause = own


def _raised(failed: AgreementError, own: BaseException | None) -> BaseException:
    """What a rank raises when a step of the restore failed on some rank: its own exception,
    else one naming the lowest rank that failed."""
    if own is not None:
        return own
    rank = min(failed.failures)
    error = IntegrityError(f"restoring from the durable tiers failed on rank {rank}: "
                           f"{failed.failures[rank]}")
    error.__cause__ = failed
    return error


def _source(save_dir: str, remotes: Sequence[Remote], name: str) -> tuple[dict, Remote | None] | None:
    """The manifest of ``name`` to restore by, and the tier it comes from (None: the first
    tier's own); None where no tier holds one."""
    if os.path.exists(os.path.join(save_dir, name, META_DIR, MANIFEST)):
        manifest = local_manifest(save_dir, name)
        if manifest is not None:
            return manifest, None
    for remote in remotes:
        try:
            manifest = tier_manifest(remote, name)
        except Exception:  # noqa: BLE001 - an unreachable tier holds nothing for this restore
            logger.warning("async checkpoint: restore: %s cannot be read", remote.url, exc_info=True)
            continue
        if manifest is not None:
            return manifest, remote
    return None


def _pointer_text(manifest: dict, name: str, name_of: Callable[[str], str]) -> str:
    """The pointer's text that names ``name``: its tag, which both adapters write (Megatron's
    tracker: the iteration)."""
    tag = manifest.get("tag")
    return tag if isinstance(tag, str) and tag and name_of(tag) == name else name


def _make_whole(save_dir: str, remotes: Sequence[Remote], name: str, *, pointer_name: str, follow: bool,
                name_of: Callable[[str], str], node: int | None, every_file: bool) -> None:
    """One attempt: rules 2 and 3 for checkpoint ``name``; on failure, the directories it made
    removed (rule 4). ``follow``: the pointer is followed (it is moved to ``name``)."""
    source = _source(save_dir, remotes, name)
    if source is None:
        if follow:
            raise IntegrityError(f"checkpoint {name}: no tier holds its manifest")
        return  # a tag no tier holds: the framework's load says so
    ckpt_dir = os.path.join(save_dir, name)
    made = [d for d in (save_dir, ckpt_dir, os.path.join(ckpt_dir, META_DIR)) if not os.path.isdir(d)]
    try:
        fetched, holders = _fill(save_dir, remotes, name, *source, node=node, every_file=every_file)
    except BaseException:
        if made:
            shutil.rmtree(made[0] if made[0] != save_dir else ckpt_dir, ignore_errors=True)
            if made[0] == save_dir:
                try:
                    os.rmdir(save_dir)
                except OSError:
                    pass
        raise
    moved = False
    if follow:
        text = _pointer_text(source[0], name, name_of)
        if read_local_pointer(os.path.join(save_dir, pointer_name)) != text:
            storage = LocalStorage(fsync=True, direct_io=False)
            write_text_atomic(storage, os.path.join(save_dir, pointer_name), text)
            moved = True
            try:
                record_pointer(save_dir, name, pointer_name, text)
            except OSError as exc:  # the pointer then looks edited by hand: followed, as it should be
                logger.warning("async checkpoint: restore: cannot note the pointer of %s: %s", save_dir, exc)
    if fetched or source[1] is not None or moved:
        logger.info("async checkpoint: restored %s into %s: %d file(s) fetched from %s", name, save_dir,
                    fetched, ", ".join(r.url for r in holders) or "no tier")


def _fill(save_dir: str, remotes: Sequence[Remote], name: str, manifest: dict, remote: Remote | None, *,
          node: int | None, every_file: bool) -> tuple[int, list[Remote]]:
    """Rules 2 and 3 up to the manifest, by ``manifest`` (from ``remote``; None: the first
    tier's). Returns how many files were fetched, and from which tiers they could be."""
    ckpt_dir = os.path.join(save_dir, name)
    os.makedirs(os.path.join(ckpt_dir, META_DIR), exist_ok=True)
    algorithm = manifest["checksum"]
    holders = [r for r in remotes if (r is remote) or _holds(r, name, manifest["save_id"])]
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
    if remote is not None:
        local = local_manifest(save_dir, name) if os.path.exists(
            os.path.join(ckpt_dir, META_DIR, MANIFEST)) else None
        if local is None or local.get("save_id") != manifest["save_id"]:  # the tier's bytes, as they are
            write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, MANIFEST),
                              remote.get_bytes(manifest_key(name)))
    return fetched, holders


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
