"""On-disk names of the commit stage, the rules a checkpoint's name must meet, and the making
of a checkpoint directory.

Inside a save directory::

    <name>/                                  a checkpoint (DeepSpeed's tag, Megatron's iter_NNNNNNN)
    <name>/.async_ckpt/                      this engine's marker and records (META_DIR)
    <name>/.async_ckpt/manifest.json         written once every rank's record exists: the commit
    .async_ckpt_staging.<save_id>.<name>/    a re-save of <name>, written beside it (STAGING_PREFIX)
    .async_ckpt_removing.<...>/              renamed for deletion (REMOVING_PREFIX)
    .async_ckpt.lock                         the saving process's claim (LOCK_FILE)

Every name this engine makes starts with :data:`META_DIR`, which :func:`check_name` refuses as
a checkpoint's name, so the engine's own entries never pass for checkpoints. Rank 0 calls
:func:`make_checkpoint_dir`; the rest are pure functions any rank may call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..storage import Storage

META_DIR = ".async_ckpt"
MANIFEST = "manifest.json"
FORMAT = "deepspeed_async_ckpt/1"
FORMAT_NAME, FORMAT_VERSION = FORMAT.rpartition("/")[0], int(FORMAT.rpartition("/")[2])

LOCK_FILE = ".async_ckpt.lock"
"""In a save directory: the lock its saving process holds (see :func:`.claims.claim_save_dir`)."""

#: Sizes and checksums of a checkpoint's ``late_files`` (see :func:`.manifest.record_late_files`).
LATE_FILES = "late_files.json"

#: Retention renames a checkpoint to this prefix + its name before deleting it: one atomic
#: rename, after which it is no longer a checkpoint (nor where a new save would write).
REMOVING_PREFIX = ".async_ckpt_removing."

#: A save into a directory that holds files writes into this prefix + ``<save_id>.<name>``
#: beside it; the commit swaps it in (:func:`.replace.replace_checkpoint`).
STAGING_PREFIX = ".async_ckpt_staging."

#: The longest checkpoint directory name (in bytes) whose derived names (staging, removal:
#: :data:`REMOVING_PREFIX` + name + ``.`` + the 16-digit save id) fit 255 bytes.
MAX_NAME_BYTES = 255 - len(".async_ckpt_removing.") - 1 - 16


@dataclass(frozen=True)
class Pointer:
    """A small file that names the newest committed checkpoint, e.g. ``latest`` -> tag."""

    path: str
    text: str


def check_name(name: str, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``name`` can name a checkpoint directory:
    one non-empty path component, not ``.`` or ``..``, and not this engine's own
    (``META_DIR``, staging, removal: they all start with it); without control characters or
    whitespace at either end, which a pointer's readers strip (DeepSpeed's ``latest``: a tag
    ``"step10\n"`` would be committed, then loaded as ``step10``, and ``" "`` as the save
    directory)."""
    if name in ("", ".", "..") or os.sep in name or (os.altsep and os.altsep in name) \
            or name.startswith(META_DIR) or name != name.strip() \
            or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"{what}: {name!r} cannot name a checkpoint directory (one plain, "
                         f"non-empty path component, not '.', '..' nor starting with {META_DIR!r}, "
                         "without control characters or whitespace at either end)")
    if len(os.fsencode(name)) > MAX_NAME_BYTES:
        raise ValueError(f"{what}: {name[:40]!r}... is {len(os.fsencode(name))} bytes long; a "
                         f"checkpoint directory's name may have at most {MAX_NAME_BYTES} (the "
                         f"names this engine derives from it, such as {REMOVING_PREFIX!r} + name + "
                         "'.' + a 16-digit save id, must fit the filesystem's 255)")


def check_checkpoint_dir(ckpt_dir: str) -> str:
    """``ckpt_dir`` made absolute, once its last component is known to be a name a checkpoint
    can have (:func:`check_name`): an empty DeepSpeed tag would make ``save_dir`` itself the
    checkpoint, swapped in over everything in it, with retention run on the directory above."""
    check_name(os.path.basename(ckpt_dir), f"checkpoint directory {ckpt_dir!r}")
    return os.path.abspath(ckpt_dir)


def staging_dir(ckpt_dir: str, save_id: str) -> str:
    """Where a save of ``ckpt_dir`` that must not touch it before its commit writes instead."""
    parent, name = os.path.split(os.path.abspath(ckpt_dir))
    return os.path.join(parent, f"{STAGING_PREFIX}{save_id}.{name}")


def replaced_trash(ckpt_dir: str, save_id: str) -> str:
    """Where :func:`.replace.replace_checkpoint` moves the checkpoint it replaced, to be deleted."""
    parent, name = os.path.split(os.path.abspath(ckpt_dir))
    return os.path.join(parent, f"{REMOVING_PREFIX}{name}.{save_id}")


def find_checkpoint_dir(path: str) -> str | None:
    """The checkpoint directory holding ``path`` (itself or any parent: a save may put a file
    in subdirectories, at any depth), if ours; the nearest one."""
    d = os.path.abspath(path)
    if not os.path.isdir(d):
        d = os.path.dirname(d)
    while True:
        if os.path.isdir(os.path.join(d, META_DIR)):
            return d
        if d == os.path.dirname(d):
            return None
        d = os.path.dirname(d)


def make_checkpoint_dir(storage: Storage, ckpt_dir: str, save_id: str) -> None:
    """Rank 0, as a save begins: ``ckpt_dir`` with this engine's :data:`META_DIR` in it, in one
    step, so that a crash never leaves the directory without it: an empty directory looks like
    a stranger's (listed as ``other``, never removed by retention). Both are made under the
    staging name (:func:`staging_dir`; a crash there leaves a staging directory, which the
    next save sweeps) and renamed into place, over an empty directory already there (rename
    replaces an empty one). If ``ckpt_dir`` holds something meanwhile, the marker is made in
    it instead. No fsync: the commit syncs the directory that holds it (the pointer's update
    does, where the pointer lies beside it)."""
    if os.path.isdir(os.path.join(ckpt_dir, META_DIR)):
        return
    building = staging_dir(ckpt_dir, save_id)
    storage.makedirs(os.path.join(building, META_DIR))
    try:
        storage.replace(building, ckpt_dir, durable=False)
    except OSError:  # not empty (another rank's file already in it), or not a directory
        storage.remove_tree(building)
        storage.makedirs(os.path.join(ckpt_dir, META_DIR))
