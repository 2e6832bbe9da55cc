"""Re-saving a checkpoint in place: the swap, the files carried over, crash recovery, trash.

A save into a directory that already holds files (the tag or iteration the pointer names, saved
again) is written beside it, into :func:`.layout.staging_dir`, and the commit swaps it in
(:func:`replace_checkpoint`): ``renameat2(RENAME_EXCHANGE)`` where the filesystem has it, else
two renames that :func:`finish_replacements` completes after a crash between them. Until that
swap the old checkpoint is untouched, so a crash or a failed save leaves it loadable. What is
replaced or retired is renamed to :data:`.layout.REMOVING_PREFIX` + name, then deleted
(:func:`remove_trash` finishes a deletion a crash cut short).

Rank 0 makes every call here: the commit, and the checkpointer before a save or a load.
"""

from __future__ import annotations

import logging
import os

from ..errors import IntegrityError
from ..storage import Storage, is_temporary, temporary_path
from .layout import META_DIR, REMOVING_PREFIX, STAGING_PREFIX, replaced_trash
from .manifest import is_committed, read_manifest

logger = logging.getLogger(__name__)


def replace_checkpoint(storage: Storage, staged: str, target: str, *, save_id: str) -> None:
    """Rank 0, once the manifest in ``staged`` is durable: make it ``target``, atomically.

    First, whatever ``target`` holds that the new save did not write (a file some other code
    put there, another rank count's files) is linked into ``staged``, so the result is what
    writing over ``target`` in place would have left, as DeepSpeed's own engine does. Then one
    ``renameat2(RENAME_EXCHANGE)`` swaps the two (fsynced) and the old one is renamed to
    :func:`.layout.replaced_trash`. Where the filesystem cannot swap (NFS, say), ``target``
    is renamed to the trash and ``staged`` to ``target``: a crash between the two leaves
    ``target`` missing and ``staged`` committed, which :func:`finish_replacements` renames
    into place (before a load, and before the next save)."""
    if not os.path.lexists(target):  # removed meanwhile: nothing to swap with (an exchange
        storage.replace(staged, target)  # needs both names, and would fail with ENOENT)
        return
    if os.path.isdir(target):
        _carry_over(storage, target, staged, top=True)
    trash = replaced_trash(target, save_id)
    if storage.swap(staged, target):
        storage.replace(staged, trash, durable=False)  # if lost: a stale staging dir, swept
        return
    try:
        storage.replace(target, trash, durable=False)
    except FileNotFoundError:
        pass  # removed between the check above and here
    storage.replace(staged, target)


def carry_over_listed(storage: Storage, old: str, new: str, files: dict[str, dict],
                      checksum: str) -> list[str]:
    """Rank 0, before the manifest of ``new`` (staged to replace ``old``) is written: carry
    ``old``'s other files over (see :func:`_carry_over`) and list in ``files`` those the
    committed manifest of ``old`` listed, with its sizes and checksums (the same bytes: hard
    links), so that they are verified as the rest; returns their paths. Files ``old`` did not
    list (or lists with another checksum) are carried over unlisted, as they were there."""
    if not os.path.isdir(old):
        return []
    linked = _carry_over(storage, old, new, top=True)
    try:
        previous = read_manifest(old)
    except IntegrityError:  # never committed, or damaged: nothing of it to vouch for
        return []
    if previous["checksum"] != checksum:
        return []
    carried = [rel for rel in linked if rel in previous["files"] and rel not in files]
    for rel in carried:
        files[rel] = previous["files"][rel]
    return carried


def _carry_over(storage: Storage, old: str, new: str, *, top: bool, rel: str = "") -> list[str]:
    """Link into ``new`` what ``old`` holds and ``new`` lacks (files the training script put
    into the checkpoint's directory: a tokenizer, a config; another rank count's files),
    durably: once the swap is durable, the old directory is deleted. This engine's own
    temporary files are left out. Returns the paths linked, relative to the top ``new``."""
    changed, linked = False, []
    for entry in os.scandir(old):
        if (top and entry.name == META_DIR) or is_temporary(entry.name):
            continue
        dst = os.path.join(new, entry.name)
        if entry.is_dir(follow_symlinks=False):
            if not os.path.lexists(dst):
                storage.makedirs(dst)
                changed = True
            if os.path.isdir(dst):
                linked += _carry_over(storage, entry.path, dst, top=False, rel=f"{rel}{entry.name}/")
        elif not os.path.lexists(dst):
            storage.link(entry.path, dst)
            changed = True
            linked.append(rel + entry.name)
    if changed:
        storage.sync_dir(new)
    return linked


def finish_replacements(storage: Storage, save_dir: str, busy: set[str], *,
                        sweep: bool = True) -> tuple[list[str], bool]:
    """Rank 0, before a save into ``save_dir`` and before a load from it: complete what a crash
    cut short. A staging directory whose target is missing and whose manifest is committed was
    between :func:`replace_checkpoint`'s two renames: it is renamed into place. With
    ``sweep`` (before a save), every other staging directory not in ``busy`` (saves of this
    process still in flight) is left over from a save that never committed: it is renamed for
    deletion. A load does not sweep: the directory may be another job's, saving right now
    (what is already renamed for deletion is nobody's any more). Returns the target names
    rolled forward, and whether anything awaits :func:`remove_trash`."""
    rolled: list[str] = []
    try:
        names = storage.listdir(save_dir)
    except FileNotFoundError:
        return rolled, False
    trash = False
    for name in names:
        trash = trash or name.startswith(REMOVING_PREFIX)
        if not name.startswith(STAGING_PREFIX):
            continue
        path = os.path.join(save_dir, name)
        if path in busy:
            continue
        save_id, _, target_name = name[len(STAGING_PREFIX):].partition(".")
        target = os.path.join(save_dir, target_name)
        if target_name and not os.path.lexists(target) and is_committed(path):
            storage.replace(path, target)
            rolled.append(target_name)
        elif sweep:
            storage.replace(path, os.path.join(save_dir, f"{REMOVING_PREFIX}{save_id}.{target_name}"),
                            durable=False)
            trash = True
    return rolled, trash


def remove_trash(storage: Storage, save_dir: str) -> list[str]:
    """Delete what retention and :func:`replace_checkpoint` renamed for deletion under
    ``save_dir`` (:data:`.layout.REMOVING_PREFIX`), including deletions a crash cut short. An
    entry that cannot be deleted is logged and left for the next call; the others still go."""
    removed = []
    for name in storage.listdir(save_dir):
        if name.startswith(REMOVING_PREFIX) and delete_renamed(storage, os.path.join(save_dir, name)):
            removed.append(name)
    return removed


def delete_renamed(storage: Storage, trash: str) -> bool:
    """Delete what was renamed to ``trash``; a failure is logged (the next commit tries again)."""
    try:
        storage.remove_tree(trash)
    except OSError as exc:
        logger.warning("async checkpoint: deleting %s failed (tried again after the next "
                       "commit): %s", trash, exc)
        return False
    return True


def remove_stale_temporaries(storage: Storage, pointer_path: str) -> None:
    """Rank 0, before a save: delete the temporary files of the pointer (``latest``) that a
    process killed between writing and renaming one left beside it. This process's own
    (``<pointer>.tmp.<pid>``, its committer may be writing it now) is kept: a stale one of the
    same pid, after a restart in a container, say, is overwritten by its next commit."""
    parent, name = os.path.split(pointer_path)
    mine = os.path.basename(temporary_path(pointer_path, os.getpid()))
    try:
        entries = storage.listdir(parent)
    except FileNotFoundError:  # the first save: nothing there yet
        return
    for entry in entries:
        path = os.path.join(parent, entry)
        if entry.startswith(f"{name}.tmp.") and is_temporary(entry) and entry != mine \
                and (os.path.islink(path) or not os.path.isdir(path)):  # a tag may be so named
            storage.remove_tree(path)
