"""Retiring: finding this engine's checkpoints in a save directory, and retiring old ones.

:func:`scan_checkpoints` sorts the directories of a save directory into committed checkpoints
and those that can never be loaded; the command line and the Hugging Face callback read it
too. :func:`retire_checkpoints` runs on rank 0 once a commit has moved the pointer: it asks a
:class:`.policy.RetentionPolicy` which checkpoints to keep and removes the others, each by an
atomic rename for deletion (:data:`.layout.REMOVING_PREFIX`) and then the deletion.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Callable

from ..errors import IntegrityError
from ..storage import Storage
from .layout import MANIFEST, META_DIR, REMOVING_PREFIX
from .manifest import is_finalized, read_manifest
from .policy import CheckpointInfo, KeepAny, KeepIf, KeepLast, RetentionPolicy
from .replace import delete_renamed, remove_trash

logger = logging.getLogger(__name__)

_TRAILING_STEP = re.compile(r"(\d+)$")


def step_in_name(name: str) -> int | None:
    """The step a checkpoint's name ends with (``global_step900``, ``iter_0000900``,
    ``checkpoint-900``: 900), or None."""
    match = _TRAILING_STEP.search(name)
    return None if match is None else int(match[1])


def _checkpoint_candidates(save_dir: str) -> list[os.DirEntry]:
    """The directories directly under ``save_dir`` that may be checkpoints: not links, not
    this engine's own (staging and removal directories start with :data:`META_DIR`, which
    :func:`.layout.check_name` refuses as a checkpoint's name). Other names starting with a
    dot are tags like any other (DeepSpeed takes ``tag=".last"``)."""
    try:
        entries = list(os.scandir(save_dir))
    except FileNotFoundError:
        return []
    return [e for e in entries if not e.name.startswith(META_DIR) and e.is_dir(follow_symlinks=False)]


def scan_checkpoints(save_dir: str, *, rotation_only: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """This engine's checkpoints directly under ``save_dir``, in one pass over their manifests:
    the committed ones (name -> commit time) and those that can never be loaded (name -> last
    change): partial ones (begun, never committed: a save a crash or a failure cut short;
    :data:`META_DIR` without a manifest; when a file or record was last written into it) and
    unfinalized ones (committed, their late files never recorded: a Megatron save whose
    markers a crash or failure cut off; its commit time). Other engines' directories are in
    neither, nor is one whose manifest is damaged: it may have been whole, and someone should
    look at it. ``rotation_only``: leave out the committed ones saved aside (``"rotation":
    false``: saved without moving a pointer)."""
    committed: dict[str, float] = {}
    abandoned: dict[str, float] = {}
    for entry in _checkpoint_candidates(save_dir):
        meta = os.path.join(entry.path, META_DIR)
        try:
            manifest = read_manifest(entry.path)
        except (IntegrityError, OSError):
            if os.path.lexists(os.path.join(meta, MANIFEST)) or not os.path.isdir(meta):
                continue  # damaged (left for a person), or not this engine's
            try:
                abandoned[entry.name] = max(os.stat(p).st_mtime for p in (entry.path, meta))
            except OSError:
                pass
            continue
        finalized = is_finalized(entry.path, manifest)
        if rotation_only and finalized and manifest.get("rotation") is False:
            continue
        (committed if finalized else abandoned)[entry.name] = float(manifest["committed_at"])
    return committed, abandoned


def committed_checkpoints(save_dir: str) -> list[str]:
    """Names of this engine's committed checkpoints directly under ``save_dir``, most recently
    committed first (by the manifest's ``committed_at``). Directories without a readable
    manifest (other engines' checkpoints, partial or in-progress saves) are not listed, nor
    are those whose late files were never recorded (unusable: a Megatron save whose markers a
    crash or failure cut off; retention would have kept one in place of a loadable one)."""
    return _newest_first(scan_checkpoints(save_dir)[0])


def _newest_first(committed: dict[str, float]) -> list[str]:
    return [name for _, name in sorted(((at, name) for name, at in committed.items()), reverse=True)]


def abandoned_checkpoints(save_dir: str, *, before: float) -> list[str]:
    """Names of this engine's checkpoints directly under ``save_dir`` that can never be loaded
    (partial or unfinalized, see :func:`scan_checkpoints`), last changed before ``before``
    (a ``time.time()``)."""
    return sorted(name for name, changed in scan_checkpoints(save_dir)[1].items() if changed < before)


def linked_checkpoints(save_dir: str) -> dict[str, list[str]]:
    """Entries of ``save_dir`` that symbolic links in it name (``best -> global_step900``):
    name -> the links' names. Retention keeps them: whoever made the link meant to keep what
    it names, and removing it would leave the link dangling."""
    real = os.path.realpath(save_dir)
    linked: dict[str, list[str]] = {}
    try:
        entries = list(os.scandir(save_dir))
    except OSError:
        return linked
    for entry in entries:
        if entry.is_symlink():
            target = os.path.realpath(entry.path)
            if os.path.dirname(target) == real and target != real:
                linked.setdefault(os.path.basename(target), []).append(entry.name)
    return linked


def _policy_of(policy: RetentionPolicy | None, keep_last: int | None,
               keep: Callable[[str], bool] | None) -> RetentionPolicy:
    """The policy :func:`retire_checkpoints` asks: ``policy``, or the one its keyword form
    (``keep_last``, ``keep``) describes."""
    if policy is not None:
        if keep_last is not None or keep is not None:
            raise ValueError("retire_checkpoints: policy is given, so keep_last and keep must not be")
        if not isinstance(policy, RetentionPolicy):
            raise ValueError(f"retire_checkpoints: policy must be a RetentionPolicy, got {policy!r}")
        return policy
    if keep_last is None:
        raise ValueError("retire_checkpoints: keep_last (or policy) is required")
    return KeepLast(keep_last) if keep is None else KeepAny(KeepLast(keep_last), KeepIf(keep))


def retire_checkpoints(storage: Storage, save_dir: str, *,
                       protected: Callable[[], set[str]], lock: threading.Lock,
                       policy: RetentionPolicy | None = None,
                       keep_last: int | None = None,
                       keep: Callable[[str], bool] | None = None,
                       committed_now: str | None = None,
                       step_of: Callable[[str], int | None] = step_in_name) -> list[str]:
    """Retention, on rank 0 once a commit has moved the pointer: remove the checkpoints of
    ``save_dir`` that ``policy`` does not keep. ``keep_last=N`` stands for ``KeepLast(N)``,
    with ``keep`` (a name predicate, e.g. every N-th iteration) for
    ``KeepAny(KeepLast(N), KeepIf(keep))``. The policy is asked about the committed
    checkpoints, newest first (by commit time), each with its step as ``step_of`` reads it
    from the name, and, with ``committed_now`` (the name of the checkpoint whose commit this
    follows), this engine's checkpoints that can never be loaded and were last changed before
    that commit (see :func:`scan_checkpoints`): a crash during a save otherwise leaves one
    behind for good, as large as a checkpoint. Whatever the policy answers, these stay: what
    a symbolic link in ``save_dir`` names (:func:`linked_checkpoints`), what ``protected()``
    names, and the checkpoints saved aside, without moving a pointer (a "best" model kept
    with DeepSpeed's ``save_latest=False``), which are not even offered. Returns the names
    removed.

    ``protected()`` gives the absolute paths that must stay (the pointer's target, and the
    directory of every save begun and not yet committed); it is called with ``lock`` held, and
    a save announces its directory under the same lock before any rank can write into it, so a
    directory is never taken away from under a save. Each removal is an atomic rename to
    :data:`REMOVING_PREFIX` + name (made durable), then the deletion; a deletion that a crash
    cut short is finished by the next call. ``ValueError`` for both ``policy`` and the keyword
    form, or neither.
    """
    policy = _policy_of(policy, keep_last, keep)
    save_dir = os.path.abspath(save_dir)
    remove_trash(storage, save_dir)  # removals a crash cut short
    removed = []
    committed, abandoned = scan_checkpoints(save_dir, rotation_only=True)
    before = None if committed_now is None else committed.get(committed_now)
    if committed_now is not None and before is None \
            and os.path.lexists(os.path.join(save_dir, committed_now)):  # gone: a previous pass's
        logger.warning("async checkpoint: %s is not a committed checkpoint of %s: checkpoints "
                       "that never committed are left there", committed_now, save_dir)
    unloadable = [] if before is None else sorted(n for n, changed in abandoned.items() if changed < before)
    candidates = [CheckpointInfo(name, step_of(name), True) for name in _newest_first(committed)] + \
                 [CheckpointInfo(name, step_of(name), False) for name in unloadable]
    kept = policy.should_keep(candidates)
    if len(kept) != len(candidates):
        raise ValueError(f"retire_checkpoints: {policy!r} answered {len(kept)} times for "
                         f"{len(candidates)} checkpoints")
    linked = linked_checkpoints(save_dir)
    for candidate, keep_it in zip(candidates, kept):
        name = candidate.name
        if keep_it or name in linked:
            continue
        path = os.path.join(save_dir, name)
        with lock:
            if path in protected():
                continue
            trash = os.path.join(save_dir, REMOVING_PREFIX + name)
            try:
                storage.replace(path, trash)
            except OSError as exc:  # this one stays; the others still go
                logger.warning("async checkpoint: retiring %s failed: %s", path, exc)
                continue
        removed.append(name)  # no longer a checkpoint, deleted or not
        delete_renamed(storage, trash)
    return removed
