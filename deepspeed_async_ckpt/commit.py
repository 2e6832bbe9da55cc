"""Stage 3 of 3: commit (per-rank records -> manifest -> pointer), and load-time verification.

Layout inside a checkpoint directory (``<save_dir>/<tag>`` for DeepSpeed, ``iter_NNNNNNN`` for
Megatron)::

    .async_ckpt/rank_00003.<save_id>.json   each rank, once all its files are durable
    .async_ckpt/manifest.json               rank 0, once every rank's record exists: the commit

Only after ``manifest.json`` is durable does rank 0 replace the pointer (DeepSpeed's ``latest``,
Megatron's ``latest_checkpointed_iteration.txt``), by write-to-temp, fsync, rename. A crash at
any moment therefore leaves the pointer on the previous, complete checkpoint. Records are
exchanged through the checkpoint directory itself (which rank 0 must see, as DeepSpeed's own
``latest`` already assumes), so no collective ever runs on a background thread.

A save into a directory that already holds files (the tag or iteration the pointer names, saved
again) is written beside it, into ``.async_ckpt_staging.<save_id>.<name>``, and the commit swaps
it in: ``renameat2(RENAME_EXCHANGE)`` where the filesystem has it, else two renames that
:func:`finish_replacements` completes after a crash between them. Until that swap the old
checkpoint is untouched, so a crash or a failed save leaves it loadable. See
:func:`replace_checkpoint`.

Retention (``keep_last``) runs after the pointer moved: see :func:`retire_checkpoints`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .errors import AsyncCheckpointError, CommitError, DurabilityError, IntegrityError
from .persist import HASHERS, FileRecord, hash_ranges
from .storage import Storage, is_temporary, temporary_path

logger = logging.getLogger(__name__)

META_DIR = ".async_ckpt"
MANIFEST = "manifest.json"
FORMAT = "deepspeed_async_ckpt/1"
_FORMAT_NAME, _FORMAT_VERSION = FORMAT.rpartition("/")[0], int(FORMAT.rpartition("/")[2])


@dataclass(frozen=True)
class Pointer:
    """A small file that names the newest committed checkpoint, e.g. ``latest`` -> tag."""

    path: str
    text: str


LOCK_FILE = ".async_ckpt.lock"
"""In a save directory: the lock its saving process holds (see :func:`claim_save_dir`)."""

_claims: dict[str, list] = {}  # real path of a save directory -> [lock file's fd, claims]
_claims_lock = threading.Lock()
_unlockable_warned: set[str] = set()


def claim_save_dir(save_dir: str) -> str | None:
    """Rank 0, at a save's begin: claim ``save_dir`` for this process, with an exclusive
    ``flock`` on its :data:`LOCK_FILE` (host and pid written in it), held until
    :func:`release_save_dir` (the checkpointer's close) or the process's end. Two jobs saving
    into one directory would sweep each other's staging directories and temporaries, and
    retention would remove the other's checkpoints. Checkpointers of one process share the
    claim. Returns the key to release; None where the filesystem has no such locks (logged
    once). Raises ``AsyncCheckpointError`` naming the holder if another process has it."""
    key = os.path.realpath(save_dir)
    with _claims_lock:
        if key in _claims:
            _claims[key][1] += 1
            return key
        path = os.path.join(key, LOCK_FILE)
        try:  # the save directory exists: begin claims it once it does
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # not ours to open (another user's?): saves go on unlocked
            logger.warning("async checkpoint: cannot open %s (%s): two jobs saving into %s "
                           "would not be told apart", path, exc, save_dir)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                host, _, pid = holder.partition(" ")
                raise AsyncCheckpointError(
                    f"save directory {save_dir!r} is being saved into by another process "
                    f"(host {host or '?'}, pid {pid or '?'}, per {path}): two jobs must not share a "
                    "save directory (each would remove the other's checkpoints); give this one "
                    "its own, or end the other (nothing was written)") from None
            if key not in _unlockable_warned:
                _unlockable_warned.add(key)
                logger.warning("async checkpoint: %s cannot be locked (%s): two jobs saving into "
                               "it would not be told apart", path, exc)
            return None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        _claims[key] = [fd, 1]
        return key


def forget_claims_in_child() -> None:
    """In a forked child: the parent's claims are not the child's. Its copies of the lock
    files' descriptors are closed (the parent's own still hold the locks), so the parent can
    claim again after its checkpointer closes, and a checkpointer made in the child must
    claim for itself (and is refused where the parent saves)."""
    global _claims_lock
    _claims_lock = threading.Lock()  # the parent may have held it at the fork
    for fd, _ in _claims.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _claims.clear()


def release_save_dir(key: str, *, remove: bool = False) -> None:
    """Give back one claim of :func:`claim_save_dir`; the last one unlocks. The file stays
    (removing it would race with another process opening it to lock), unless ``remove``: a
    save directory that the refused save had just made, to be removed with it."""
    with _claims_lock:
        claim = _claims.get(key)
        if claim is None:
            return
        claim[1] -= 1
        if claim[1] == 0:
            del _claims[key]
            if remove:
                try:
                    os.unlink(os.path.join(key, LOCK_FILE))
                except OSError:
                    pass
            os.close(claim[0])


def write_text_atomic(storage: Storage, path: str, text: str | bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``text`` (or bytes): temp file, fsync, rename, fsync of the
    directory. ``durable=False``: temp file and rename only, for what others must see whole but
    a crash may lose (a rank's record: see :func:`write_rank_record`)."""
    tmp = temporary_path(path, os.getpid())
    try:
        storage.write_small(tmp, text.encode() if isinstance(text, str) else text, durable=durable)
        storage.replace(tmp, path, durable=durable)
    except OSError as exc:  # a full disk, say: no temporary left, and the file named
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), path) from exc
        raise


def _rank_record_path(ckpt_dir: str, rank: int, save_id: str) -> str:
    return os.path.join(ckpt_dir, META_DIR, f"rank_{rank:05d}.{save_id}.json")


def _failure_record_path(ckpt_dir: str, rank: int, save_id: str) -> str:
    return os.path.join(ckpt_dir, META_DIR, f"rank_{rank:05d}.{save_id}.failed")


def write_rank_failure(storage: Storage, ckpt_dir: str, *, rank: int, save_id: str, message: str) -> None:
    """Called by a rank whose part of a save failed, so rank 0 abandons the commit at once
    instead of waiting ``commit_timeout_s`` for a record that will never come."""
    storage.makedirs(os.path.join(ckpt_dir, META_DIR))
    write_text_atomic(storage, _failure_record_path(ckpt_dir, rank, save_id), message, durable=False)


def write_rank_record(storage: Storage, ckpt_dir: str, *, rank: int, save_id: str,
                      checksum: str, files: Iterable[FileRecord]) -> None:
    """Called by every rank (writer or not) once all of its files for this save are durable.

    The record is published (written whole, then renamed into place) but not fsynced: rank 0
    copies every record into the manifest, which is made durable before the pointer moves, so
    a record a crash loses belongs to a save that was not committed anyway. Two fsyncs fewer
    on every rank's way to the commit (1.7 -> 0.1 ms for this step on this VM's disk)."""
    storage.makedirs(os.path.join(ckpt_dir, META_DIR))
    entries = {}
    for r in files:
        rel = os.path.relpath(r.path, ckpt_dir)
        if r.segment is not None:  # a share of a file: its bytes, and where all shares went
            entries[rel] = {"bytes": r.nbytes, "segments": [[*r.segment, r.checksum]],
                            "tmp": os.path.relpath(r.tmp, ckpt_dir)}
            continue
        if r.parts is not None:  # a packed file: where each archive lies, and its checksum
            entries[rel] = {"bytes": r.nbytes, "parts": {n: list(s) for n, s in r.parts.items()},
                            "segments": [list(s) for s in r.part_checksums]}
            continue
        entries[rel] = {"bytes": r.nbytes, checksum: r.checksum}
    record = {"rank": rank, "save_id": save_id, "checksum": checksum, "files": entries}
    write_text_atomic(storage, _rank_record_path(ckpt_dir, rank, save_id), json.dumps(record, indent=1),
                      durable=False)


#: Rank 0 polls for the ranks' records at once, then again after a wait of 1/16 of the time it
#: has waited so far, at least ``_POLL_MIN_S`` and at most ``_POLL_MAX_S``: the commit comes
#: at most about 6% (and 1 ms) after the last rank's record, or ``_POLL_MAX_S`` once it has
#: waited 0.8 s. Each poll is one directory listing whatever the world size: about 16 polls
#: per doubling of the wait, 20 a second after that. (Earlier versions doubled the wait from
#: 5 ms to 50 ms each time: the commit came 13-56 ms after the last of 2 ranks.)
_POLL_MIN_S = 0.001
_POLL_FRACTION = 1 / 16
_POLL_MAX_S = 0.05


def poll_delay(waited_s: float) -> float:
    """How long rank 0 sleeps before its next look for the ranks' records, having waited
    ``waited_s`` seconds for them so far."""
    return min(_POLL_MAX_S, max(_POLL_MIN_S, waited_s * _POLL_FRACTION))


def commit(storage: Storage, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
           checksum: str, timeout_s: float, pointer: Pointer | None,
           replaces: str | None = None, late_files: Sequence[str] = (),
           rotation: bool = True) -> dict:
    """Rank 0: wait for every rank's record, write the manifest, swap ``ckpt_dir`` in for
    ``replaces`` if given (a staging directory, see :func:`replace_checkpoint`), then move the
    pointer. If the commit fails, the files the replicas were writing in shares are removed (a
    rank's own temporary files are removed by that rank). ``late_files``: files the caller
    writes after the commit (see :func:`record_late_files`), listed in the manifest so that
    verification requires them. ``rotation=False``: a save that moves no pointer (DeepSpeed's
    ``save_latest=False``), which retention must leave alone (see :func:`retire_checkpoints`)."""
    try:
        manifest = _commit(storage, ckpt_dir, tag=tag, save_id=save_id, world_size=world_size,
                           checksum=checksum, timeout_s=timeout_s, late_files=late_files,
                           rotation=rotation, replaces=replaces)
    except (CommitError, OSError):  # OSError: a share's rename, the records' listing
        suffix = temporary_path("", save_id)
        # at any depth: a file saved in a subdirectory (os.walk of a missing directory, staged
        # with no rank yet writing, yields nothing; until session 29 only the top was swept)
        for top, _, names in os.walk(ckpt_dir):
            for name in names:
                if name.endswith(suffix):
                    try:
                        os.unlink(os.path.join(top, name))
                    except OSError:
                        pass
        raise
    parent = os.path.dirname(os.path.abspath(ckpt_dir))
    try:
        if replaces is not None:  # the exchange syncs the directory holding both names
            replace_checkpoint(storage, ckpt_dir, replaces, save_id=save_id)
        elif pointer is None or os.path.dirname(os.path.abspath(pointer.path)) != parent:
            # The checkpoint's own entry (renamed into place without fsync by
            # make_checkpoint_dir) is made durable by the pointer's update when the pointer
            # lies beside it; else here, before any pointer elsewhere names it.
            storage.sync_dir(parent)
        if pointer is not None:
            write_text_atomic(storage, pointer.path, pointer.text)
    except OSError as exc:
        raise after_the_manifest(exc, ckpt_dir, replaces, tag, save_id, pointer,
                                  finished_later=bool(late_files)) from exc
    return manifest


def after_the_manifest(exc: OSError, written: str, replaces: str | None, tag: str, save_id: str,
                        pointer: Pointer | None, *, finished_later: bool) -> BaseException:
    """What a failure after the manifest was written means, from what is on disk: if the new
    checkpoint is where loads look (a re-save's exchange done; the pointer's rename done, its
    fsync failed; no pointer to move), a :class:`DurabilityError` saying so, since "the last
    committed one is intact" would be false; else ``exc`` (nothing a load sees changed). Not
    for a checkpoint its caller finishes after the commit (``late_files``: Megatron's markers,
    then its swap and tracker), which a failure here leaves unfinished, wherever it is; the
    caller asks again for its own last steps (``finished_later=False``: the Megatron adapter's
    swap and tracker, once its markers are recorded)."""
    target = replaces or written
    if finished_later or os.path.basename(target).startswith(STAGING_PREFIX):
        return exc
    if replaces is not None and not os.path.lexists(replaces) and _holds(written, save_id):
        # two renames (no exchange): the old one moved to the trash, then this one failed
        return DurabilityError(f"checkpoint {replaces!r} (tag {tag}) is committed, at {written!r}, "
                               f"but renaming it into place failed: {exc}: the next load or save "
                               "renames it there (the checkpoint it replaces is gone)")
    if not _holds(target, save_id):
        return exc
    named = False
    if pointer is not None:
        try:
            with open(pointer.path, encoding="utf-8") as f:
                named = f.read() == pointer.text
        except (OSError, ValueError):  # unreadable: not known to name it
            pass
    if not (replaces is not None or named or pointer is None):  # a new tag the pointer does not name
        return exc
    where = (f"and {pointer.path} names it" if named else
             "no pointer names it" if pointer is None else f"but {pointer.path} was not moved to it")
    return DurabilityError(f"checkpoint {target!r} (tag {tag}) is committed and in place, {where}, "
                           f"but a step after that failed: {exc}: it loads now, yet a crash may "
                           "undo it (then the previous checkpoint is what a load finds)",
                           pointer_moved=named)


def _commit(storage: Storage, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
            checksum: str, timeout_s: float, late_files: Sequence[str] = (),
            rotation: bool = True, replaces: str | None = None) -> dict:
    start = time.monotonic()
    deadline = start + timeout_s
    meta = os.path.join(ckpt_dir, META_DIR)
    paths = {r: _rank_record_path(ckpt_dir, r, save_id) for r in range(world_size)}
    # What each rank leaves in ``meta``: its record, or a failure record (names built once).
    done = {r: os.path.basename(p) for r, p in paths.items()}
    failure = {r: os.path.basename(_failure_record_path(ckpt_dir, r, save_id)) for r in paths}
    missing = sorted(paths)
    while True:
        try:
            names = set(storage.listdir(meta))
        except FileNotFoundError:
            names = set()
        missing = [r for r in missing if done[r] not in names]
        if not missing:
            break
        failed = [r for r in missing if failure[r] in names]
        if failed:
            with open(_failure_record_path(ckpt_dir, failed[0], save_id), encoding="utf-8") as f:
                reason = f.read()
            raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: rank(s) "
                              f"{_ranges(failed)} failed to persist their part ({reason})")
        if time.monotonic() > deadline:
            raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: rank(s) "
                              f"{_ranges(missing)} did not finish persisting within "
                              f"{timeout_s:.0f} s (async_checkpoint.commit_timeout_s)")
        time.sleep(poll_delay(time.monotonic() - start))
    files: dict[str, dict] = {}
    ranks: dict[str, list[str]] = {}
    writer: dict[str, int] = {}  # file -> the first rank whose record has it
    for r, p in paths.items():
        record = _read_rank_record(p, r, save_id=save_id, checksum=checksum, ckpt_dir=ckpt_dir, tag=tag)
        for rel, entry in record["files"].items():
            if rel not in files:
                files[rel], writer[rel] = entry, r
            elif "tmp" in entry and "tmp" in files[rel]:  # another share of a file seen already
                files[rel]["segments"] += entry["segments"]
            elif entry != files[rel]:  # (equal: the same bytes, whichever rename came last)
                # two ranks wrote different bytes to one name: the manifest would describe one
                # of them and the file on disk may be the other's, failing every load
                raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: ranks "
                                  f"{writer[rel]} and {r} both wrote {rel}, with different "
                                  "contents; each file must be saved by one rank")
        ranks[str(r)] = sorted(record["files"])
    _join_shares(storage, ckpt_dir, files, tag)
    carried = _carry_over_listed(storage, replaces, ckpt_dir, files, checksum) if replaces else []
    manifest = {"format": FORMAT, "tag": tag, "save_id": save_id, "world_size": world_size,
                "checksum": checksum, "committed_at": time.time(), "files": files, "ranks": ranks}
    if carried:
        manifest["carried"] = carried
    if late_files:
        manifest["late_files"] = sorted(late_files)
    if not rotation:  # absent (as in manifests before session 19) means in the rotation
        manifest["rotation"] = False
    problem = _manifest_problem(manifest)  # what every reader would refuse: never committed
    if problem:
        raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: its manifest would "
                          f"be damaged: {problem}")
    write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, MANIFEST),
                      json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _holds(ckpt_dir: str, save_id: str) -> bool:
    """Whether ``ckpt_dir`` holds the committed manifest of save ``save_id``."""
    try:
        return read_manifest(ckpt_dir).get("save_id") == save_id
    except (IntegrityError, OSError):
        return False


def _read_rank_record(path: str, rank: int, *, save_id: str, checksum: str, ckpt_dir: str,
                      tag: str) -> dict:
    """Rank ``rank``'s record at ``path``, as :func:`write_rank_record` writes it; a record that
    is not (damaged, or another version's) is a ``CommitError`` naming it and the rank, before
    anything of it reaches the manifest."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        problem = _record_problem(record, rank, save_id, checksum)
    except (OSError, ValueError) as exc:  # unreadable; not JSON (ValueError), not UTF-8
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: rank {rank}'s record "
                          f"{path} is damaged: {problem}")
    return record


def _record_problem(record: object, rank: int, save_id: str, checksum: str) -> str | None:
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return "no 'files' object"
    for key, want in (("rank", rank), ("save_id", save_id), ("checksum", checksum)):
        if record.get(key) != want or type(record.get(key)) is not type(want):
            return f"{key} {record.get(key)!r}, expected {want!r}"
    for rel, entry in record["files"].items():
        if os.path.isabs(rel) or os.pardir in rel.split("/") or not rel:
            return f"file {rel!r} is outside the checkpoint"
        if not isinstance(entry, dict) or type(entry.get("bytes")) is not int or entry["bytes"] < 0:
            return f"file {rel!r} has no size"
        segments = entry.get("segments", [])
        if not isinstance(segments, list) or not all(_is_segment(seg) for seg in segments):
            return f"file {rel!r} has malformed segments"
        if "segments" not in entry and not isinstance(entry.get(checksum), str):
            return f"file {rel!r} has no {checksum} checksum"
        if "tmp" in entry and not (isinstance(entry["tmp"], str) and segments
                                   and not os.path.isabs(entry["tmp"]) and os.pardir not in entry["tmp"].split("/")):
            return f"file {rel!r}: a share without its temporary name or segment"
    return None


def _is_segment(seg: object) -> bool:
    """``[offset, length, checksum]``: where a part of a file lies, and its checksum."""
    return (isinstance(seg, list) and len(seg) == 3 and all(type(v) is int and v >= 0 for v in seg[:2])
            and isinstance(seg[2], str))


def _join_shares(storage: Storage, ckpt_dir: str, files: dict[str, dict], tag: str) -> None:
    """Files written in shares by several ranks: check that the shares cover each file, end to
    end, then rename it from its temporary name (what no rank could do alone: each knows only
    that its own share is durable)."""
    for rel, entry in sorted(files.items()):
        if "tmp" not in entry:  # written whole by one rank
            continue
        entry["segments"].sort()
        at = 0
        for offset, length, _ in entry["segments"]:
            if offset != at:
                raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: {rel} "
                                  f"has {'no share for' if offset > at else 'overlapping shares at'} "
                                  f"bytes {min(at, offset)}-{max(at, offset)}")
            at = offset + length
        if at != entry["bytes"]:
            raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: {rel} has no "
                              f"share for bytes {at}-{entry['bytes']}")
        storage.replace(os.path.join(ckpt_dir, entry.pop("tmp")), os.path.join(ckpt_dir, rel))


#: Retention renames a checkpoint to this prefix + its name before deleting it: one atomic
#: rename, after which it is no longer a checkpoint (nor where a new save would write).
REMOVING_PREFIX = ".async_ckpt_removing."


#: A save into a directory that holds files writes into this prefix + ``<save_id>.<name>``
#: beside it; the commit swaps it in (:func:`replace_checkpoint`).
STAGING_PREFIX = ".async_ckpt_staging."


def check_name(name: str, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``name`` can name a checkpoint directory:
    one non-empty path component, not ``.`` or ``..``, and not this engine's own
    (``META_DIR``, staging, removal: they all start with it); without control characters or
    whitespace at either end, which a pointer's readers strip (DeepSpeed's ``latest``: a tag
    ``"step10\n"`` was committed, then loaded as ``step10``, and ``" "`` as the save directory)."""
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


#: The longest checkpoint directory name (in bytes) whose derived names (staging, removal:
#: :data:`REMOVING_PREFIX` + name + ``.`` + the 16-digit save id) fit 255 bytes.
MAX_NAME_BYTES = 255 - len(".async_ckpt_removing.") - 1 - 16


def check_checkpoint_dir(ckpt_dir: str) -> str:
    """``ckpt_dir`` made absolute, once its last component is known to be a name a checkpoint
    can have (:func:`check_name`): an empty DeepSpeed tag made ``save_dir`` itself the
    checkpoint, swapped in over everything in it, with retention run on the directory above."""
    check_name(os.path.basename(ckpt_dir), f"checkpoint directory {ckpt_dir!r}")
    return os.path.abspath(ckpt_dir)


def staging_dir(ckpt_dir: str, save_id: str) -> str:
    """Where a save of ``ckpt_dir`` that must not touch it before its commit writes instead."""
    parent, name = os.path.split(os.path.abspath(ckpt_dir))
    return os.path.join(parent, f"{STAGING_PREFIX}{save_id}.{name}")


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


def replaced_trash(ckpt_dir: str, save_id: str) -> str:
    """Where :func:`replace_checkpoint` moves the checkpoint it replaced, to be deleted."""
    parent, name = os.path.split(os.path.abspath(ckpt_dir))
    return os.path.join(parent, f"{REMOVING_PREFIX}{name}.{save_id}")


def replace_checkpoint(storage: Storage, staged: str, target: str, *, save_id: str) -> None:
    """Rank 0, once the manifest in ``staged`` is durable: make it ``target``, atomically.

    First, whatever ``target`` holds that the new save did not write (a file some other code
    put there, another rank count's files) is linked into ``staged``, so the result is what
    writing over ``target`` in place would have left, as DeepSpeed's own engine does. Then one
    ``renameat2(RENAME_EXCHANGE)`` swaps the two (fsynced) and the old one is renamed to
    :func:`replaced_trash`. Where the filesystem cannot exchange (NFS, say), ``target`` is
    renamed to the trash and ``staged`` to ``target``: a crash between the two leaves
    ``target`` missing and ``staged`` committed, which :func:`finish_replacements` renames
    into place (before a load, and before the next save)."""
    if not os.path.lexists(target):  # removed meanwhile: nothing to swap with (an exchange
        storage.replace(staged, target)  # needs both names, and would fail with ENOENT)
        return
    if os.path.isdir(target):
        _carry_over(storage, target, staged, top=True)
    trash = replaced_trash(target, save_id)
    if storage.exchange(staged, target):
        storage.replace(staged, trash, durable=False)  # if lost: a stale staging dir, swept
        return
    try:
        storage.replace(target, trash, durable=False)
    except FileNotFoundError:
        pass  # removed between the check above and here
    storage.replace(staged, target)


def _carry_over_listed(storage: Storage, old: str, new: str, files: dict[str, dict],
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
    durably: once the exchange is durable, the old directory is deleted. This engine's own
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
        if target_name and not os.path.lexists(target) and _is_committed(path):
            storage.replace(path, target)
            rolled.append(target_name)
        elif sweep:
            storage.replace(path, os.path.join(save_dir, f"{REMOVING_PREFIX}{save_id}.{target_name}"),
                            durable=False)
            trash = True
    return rolled, trash


def _is_committed(ckpt_dir: str) -> bool:
    try:
        read_manifest(ckpt_dir)
    except (IntegrityError, OSError, ValueError):
        return False
    return True


def remove_trash(storage: Storage, save_dir: str) -> list[str]:
    """Delete what retention and :func:`replace_checkpoint` renamed for deletion under
    ``save_dir`` (:data:`REMOVING_PREFIX`), including deletions a crash cut short. An entry
    that cannot be deleted is logged and left for the next call; the others still go (one
    such entry stopped every later retention before)."""
    removed = []
    for name in storage.listdir(save_dir):
        if name.startswith(REMOVING_PREFIX) and _delete(storage, os.path.join(save_dir, name)):
            removed.append(name)
    return removed


def _delete(storage: Storage, trash: str) -> bool:
    """Delete what was renamed to ``trash``; a failure is logged (the next commit tries again)."""
    try:
        storage.remove_tree(trash)
    except OSError as exc:
        logger.warning("async checkpoint: deleting %s failed (tried again after the next "
                       "commit): %s", trash, exc)
        return False
    return True


def _checkpoint_candidates(save_dir: str) -> list[os.DirEntry]:
    """The directories directly under ``save_dir`` that may be checkpoints: not links, not
    this engine's own (staging and removal directories start with :data:`META_DIR`, which
    :func:`check_name` refuses as a checkpoint's name). Other names starting with a dot are
    tags like any other (DeepSpeed takes ``tag=".last"``)."""
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


def retire_checkpoints(storage: Storage, save_dir: str, *, keep_last: int,
                       protected: Callable[[], set[str]], lock: threading.Lock,
                       keep: Callable[[str], bool] | None = None,
                       committed_now: str | None = None) -> list[str]:
    """Retention, on rank 0 once a commit has moved the pointer: remove the committed
    checkpoints of ``save_dir`` beyond the ``keep_last`` most recently committed, except those
    whose name ``keep`` accepts (e.g. every N-th iteration) or a symbolic link in ``save_dir``
    names (:func:`linked_checkpoints`), which stay, and those saved aside, without moving a
    pointer (a "best" model kept with DeepSpeed's ``save_latest=False``): neither counted nor
    removed. With ``committed_now`` (the name
    of the checkpoint whose commit this follows), also this engine's checkpoints that can
    never be loaded and were last changed before that commit (see :func:`scan_checkpoints`):
    a crash during a save otherwise leaves one behind for good, as large as a checkpoint.
    Returns the names removed.

    ``protected()`` gives the absolute paths that must stay (the pointer's target, and the
    directory of every save begun and not yet committed); it is called with ``lock`` held, and
    a save announces its directory under the same lock before any rank can write into it, so a
    directory is never taken away from under a save. Each removal is an atomic rename to
    :data:`REMOVING_PREFIX` + name (made durable), then the deletion; a deletion that a crash
    cut short is finished by the next call.
    """
    save_dir = os.path.abspath(save_dir)
    remove_trash(storage, save_dir)  # removals a crash cut short
    removed = []
    committed, abandoned = scan_checkpoints(save_dir, rotation_only=True)
    before = None if committed_now is None else committed.get(committed_now)
    if committed_now is not None and before is None \
            and os.path.lexists(os.path.join(save_dir, committed_now)):  # gone: an earlier pass's
        logger.warning("async checkpoint: %s is not a committed checkpoint of %s: checkpoints "
                       "that never committed are left there", committed_now, save_dir)
    unloadable = [] if before is None else sorted(n for n, changed in abandoned.items() if changed < before)
    linked = linked_checkpoints(save_dir)
    for name in _newest_first(committed)[keep_last:] + unloadable:
        if (keep is not None and keep(name)) or name in linked:
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
        _delete(storage, trash)
    return removed


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


def read_manifest(ckpt_dir: str) -> dict:
    """The committed manifest of ``ckpt_dir``; ``IntegrityError`` naming it if there is none
    or it is damaged (a truncated copy, say: not JSON, or without the fields a commit writes)."""
    path = os.path.join(ckpt_dir, META_DIR, MANIFEST)
    try:
        manifest = _read_json(ckpt_dir, path, "its manifest")
    except FileNotFoundError:
        raise IntegrityError(f"checkpoint {ckpt_dir!r} was never committed (no {META_DIR}/{MANIFEST}): "
                             "it is partial; load the checkpoint its pointer names") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise IntegrityError(f"checkpoint {ckpt_dir!r}: its manifest {path} is damaged: {problem}")
    return manifest


def _read_json(ckpt_dir: str, path: str, what: str) -> object:
    """The JSON at ``path`` (``FileNotFoundError`` if none); ``IntegrityError`` naming it and
    ``ckpt_dir`` if it is not UTF-8 JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, IsADirectoryError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise IntegrityError(f"checkpoint {ckpt_dir!r}: {what} {path} is damaged: {exc}") from None


#: What every committed manifest holds (see :func:`_commit`), and of which type.
_MANIFEST_FIELDS = {"format": str, "tag": str, "save_id": str, "world_size": int, "checksum": str,
                    "committed_at": (int, float), "files": dict}


def _manifest_problem(manifest: object) -> str | None:
    if not isinstance(manifest, dict):
        return f"a {type(manifest).__name__}, not an object"
    for key, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            return f"{key!r} missing or of the wrong type"
    name, _, version = manifest["format"].rpartition("/")
    if name != _FORMAT_NAME or not version.isdigit():
        return f"format {manifest['format']!r} is not this engine's"
    if int(version) > _FORMAT_VERSION:
        return (f"format {manifest['format']!r} is newer than this version of deepspeed_async_ckpt "
                f"reads ({FORMAT!r}): upgrade it")
    if manifest["checksum"] not in HASHERS:
        return f"checksum {manifest['checksum']!r} unknown to this version"
    if not 0 <= manifest["committed_at"] < 253402300800:  # a time (before year 10000), not NaN
        return f"'committed_at' {manifest['committed_at']!r} is not a time"
    late = manifest.get("late_files", [])
    if not isinstance(late, list) or not all(isinstance(rel, str) for rel in late):
        return "'late_files' of the wrong type"
    for rel in [*manifest["files"], *late]:
        if os.path.isabs(rel) or os.pardir in rel.split("/"):
            return f"file {rel!r} is outside the checkpoint"
    for rel, entry in manifest["files"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            return f"file {rel!r} has no size"
        segments = entry.get("segments", [])
        if not isinstance(segments, list) or not all(_is_segment(seg) for seg in segments):
            return f"file {rel!r} has malformed segments"
        if "segments" not in entry and not isinstance(entry.get(manifest["checksum"]), str):
            return f"file {rel!r} has no {manifest['checksum']} checksum"
    return None


#: Sizes and checksums of a checkpoint's ``late_files`` (see :func:`record_late_files`).
LATE_FILES = "late_files.json"


def record_late_files(storage: Storage, ckpt_dir: str) -> None:
    """Rank 0, once the files its manifest lists under ``late_files`` are written (what an
    adapter writes after the commit, from what the commit recorded: megatron-core's
    ``.metadata`` and ``metadata.json``): record their sizes and checksums, durably, so that
    verification covers them as it covers the rest. Until then, the checkpoint does not
    verify ("committed but never finalized")."""
    manifest = read_manifest(ckpt_dir)
    algorithm = manifest["checksum"]
    files = {}
    for rel in manifest.get("late_files", ()):
        ((size, digest),) = hash_ranges(os.path.join(ckpt_dir, rel), algorithm, [(0, None)])
        files[rel] = {"bytes": size, algorithm: digest}
    write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, LATE_FILES),
                      json.dumps(files, indent=1, sort_keys=True))


def is_finalized(ckpt_dir: str, manifest: dict) -> bool:
    """Whether a committed checkpoint's ``late_files`` are recorded (always, without any)."""
    return not manifest.get("late_files") or os.path.exists(os.path.join(ckpt_dir, META_DIR, LATE_FILES))


def _verify_late_files(ckpt_dir: str, manifest: dict) -> None:
    names = manifest.get("late_files")
    if not names:
        return
    path = os.path.join(ckpt_dir, META_DIR, LATE_FILES)
    try:
        files = _read_json(ckpt_dir, path, "the record of its late files")
    except FileNotFoundError:
        raise IntegrityError(f"checkpoint {ckpt_dir!r} was committed but never finalized "
                             f"({', '.join(names)} not recorded): load the one the pointer "
                             "names") from None
    with_late = dict(manifest, files=files)
    problem = _manifest_problem(with_late)
    if problem or sorted(files) != sorted(names):
        raise IntegrityError(f"checkpoint {ckpt_dir!r}: {path} is damaged: "
                             f"{problem or f'it records {sorted(files)}, not {sorted(names)}'}")
    for rel in names:
        verify_file(os.path.join(ckpt_dir, rel), with_late, ckpt_dir=ckpt_dir)


def verify_file(path: str, manifest: dict | None = None, segment: int | Sequence[int] | None = None,
                *, ckpt_dir: str | None = None) -> None:
    """Check one file against the committed manifest of its checkpoint; raises IntegrityError
    naming the file. Files outside any checkpoint of ours are not checked. ``segment``: check
    only that segment, or those, of a file checksummed in segments (a file the replicas wrote
    in shares, a packed file's archives), and the file's size."""
    ckpt_dir = ckpt_dir or find_checkpoint_dir(path)
    if ckpt_dir is None:
        return
    manifest = manifest or read_manifest(ckpt_dir)
    rel = os.path.relpath(os.path.abspath(path), ckpt_dir)
    entry = manifest["files"].get(rel)
    if entry is None:
        raise IntegrityError(f"{path} is not listed in the manifest of checkpoint {ckpt_dir!r}")
    algorithm = manifest["checksum"]
    if algorithm not in HASHERS:
        raise IntegrityError(f"manifest of checkpoint {ckpt_dir!r} uses checksum {algorithm!r}, "
                             f"which this version cannot compute (it knows {', '.join(HASHERS)})")
    # [offset, length, checksum] of each part checksummed on its own: the whole file, each
    # share of a file the replicas wrote in shares, or each archive of a packed file
    segments = entry.get("segments") or [[0, None, entry.get(algorithm)]]
    if segment is not None:
        segments = [segments[i] for i in ([segment] if isinstance(segment, int) else segment)]
    try:
        size = os.path.getsize(path)
        if size == entry["bytes"]:
            hashed = hash_ranges(path, algorithm, [(offset, length) for offset, length, _ in segments])
    except OSError as exc:  # missing, unreadable: as bad as a wrong checksum
        raise IntegrityError(f"{path}: listed in the manifest of checkpoint {ckpt_dir!r} but "
                             f"cannot be read: {exc}") from exc
    if size != entry["bytes"]:
        raise IntegrityError(f"{path}: size {size} bytes, manifest says {entry['bytes']}: file truncated or replaced")
    for (offset, length, expected), (n, digest) in zip(segments, hashed):
        where = "" if length is None else f" (bytes {offset}-{offset + length})"
        if n != (size if length is None else length):  # changed while it was read
            raise IntegrityError(f"{path}: read {n} bytes{where}, expected {length or size}: file truncated")
        if algorithm != "none" and digest != expected:
            raise IntegrityError(f"{path}: {algorithm} {digest}{where} does not match manifest "
                                 f"{expected}: file corrupted")


def verify_checkpoint(ckpt_dir: str, *, rank: int = 0, world_size: int = 1,
                      manifest: dict | None = None,
                      include: Callable[[str], bool] | None = None,
                      reads: Callable[[str], Iterable[tuple[int, int]] | None] | None = None) -> dict:
    """Verify the files of a committed checkpoint (against ``manifest`` if already read);
    returns its manifest. With ``world_size`` ranks each verifying its share, rank ``r``
    checks the units ``r, r + world_size, ...`` of the manifest, a unit being a file or one
    share of a file the replicas wrote in shares (so the largest file, which every replica
    loads, is read by as many ranks as wrote it), and together they read every byte once.
    ``include``: check only the files (by path within the checkpoint) it accepts, those a
    partial load reads. ``reads``: the (offset, length) ranges a load reads in a file, None
    for all of it; of a packed file, only the archives holding those are checked."""
    manifest = manifest or read_manifest(ckpt_dir)
    units: list[tuple[str, int | list[int] | None]] = []
    for rel, entry in sorted(manifest["files"].items()):
        if include is not None and not include(rel):
            continue
        if "parts" in entry and "segments" in entry:  # packed: one unit, the archives read
            # (older manifests have one checksum per packed file, checked whole below)
            wanted = None if reads is None else reads(rel)
            chosen = [i for i, (offset, length, _) in enumerate(entry["segments"])
                      if wanted is None or any(o < offset + length and offset < o + n for o, n in wanted)]
            if chosen:
                units.append((rel, chosen))
        else:
            units += [(rel, i if "segments" in entry else None)
                      for i in range(len(entry.get("segments", [None])))]
    for rel, segment in units[rank::world_size]:
        verify_file(os.path.join(ckpt_dir, rel), manifest, segment, ckpt_dir=ckpt_dir)
    if rank == 0:  # a few small files, which every load reads
        _verify_late_files(ckpt_dir, manifest)
    return manifest


def _ranges(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
