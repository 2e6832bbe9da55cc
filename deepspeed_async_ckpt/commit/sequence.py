"""The commit: per-rank records -> manifest -> finalize steps -> swap -> pointer, on rank 0.

Every rank writes its record once its files are durable (:mod:`.records`); rank 0's
:func:`commit` waits for all of them, joins the files written in shares, writes the manifest
(the commit itself), runs the save's finalize steps and records the files they wrote
(:mod:`.finalize`: Megatron's marker files), swaps a re-saved checkpoint in (:mod:`.replace`)
and only then replaces the pointer (DeepSpeed's ``latest``, Megatron's
``latest_checkpointed_iteration.txt``) by write-to-temp, fsync, rename. A crash at any moment
therefore leaves the pointer on the previous, complete checkpoint. Retention runs after the
pointer moved (:mod:`.retire`).

The records reach rank 0 through the checkpoint directory (:class:`.records.DirectoryExchange`)
or, where each node has a directory of its own (node-local storage), through the process
group's store (:class:`.exchange.StoreExchange`); then the manifest also says which node holds
each file (``nodes``), and the leader of every other node commits the same checkpoint in its
own directory once rank 0 did (:func:`commit_on_node`): manifest first, pointer last.
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

from ..errors import CommitError, DurabilityError
from ..storage import Storage, temporary_path
from .atomic import write_text_atomic
from .finalize import FinalizeContext, FinalizeStep, declared_files, step_name
from .layout import FORMAT, MANIFEST, META_DIR, STAGING_PREFIX, Pointer
from .manifest import holds_save, manifest_problem, record_late_files
from .records import DirectoryExchange, RecordExchange
from .replace import carry_over_listed, replace_checkpoint

#: Rank 0 polls for the ranks' records at once, then again after a wait of 1/16 of the time it
#: has waited so far, at least ``_POLL_MIN_S`` and at most ``_POLL_MAX_S``: the commit comes
#: at most about 6% (and 1 ms) after the last rank's record, or ``_POLL_MAX_S`` once it has
#: waited 0.8 s. Each poll is one directory listing whatever the world size: about 16 polls
#: per doubling of the wait, 20 a second after that.
_POLL_MIN_S = 0.001
_POLL_FRACTION = 1 / 16
_POLL_MAX_S = 0.05


def poll_delay(waited_s: float) -> float:
    """How long rank 0 sleeps before its next look for the ranks' records, having waited
    ``waited_s`` seconds for them so far."""
    return min(_POLL_MAX_S, max(_POLL_MIN_S, waited_s * _POLL_FRACTION))


def commit(storage: Storage, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
           checksum: str, timeout_s: float, pointer: Pointer | None,
           replaces: str | None = None, finalize: Sequence[FinalizeStep] = (), rotation: bool = True,
           exchange: RecordExchange | None = None) -> tuple[dict, dict[str, bytes]]:
    """Rank 0: wait for every rank's record, write the manifest, run the save's ``finalize``
    steps (see :mod:`.finalize`) and record the files they wrote, swap ``ckpt_dir`` in for
    ``replaces`` if given (a staging directory, see :func:`.replace.replace_checkpoint`), then
    move the pointer. If the commit fails before the manifest, the files the replicas were
    writing in shares are removed (a rank's own temporary files are removed by that rank); if
    a step fails, the checkpoint stays where it was written, unfinalized (it never verifies),
    and the pointer where it was. ``rotation=False``: a save that moves no pointer (DeepSpeed's
    ``save_latest=False``), which retention must leave alone (see
    :func:`.retire.retire_checkpoints`).

    Returns the manifest and the late files: the bytes the steps wrote, by path in the
    checkpoint (Megatron's markers), for a copy of the checkpoint kept elsewhere (the memory
    tier's slot), as the other nodes' leaders get them.

    ``exchange``: how the records arrive (:class:`.records.DirectoryExchange` by default); a
    node-local one (:class:`.exchange.StoreExchange`) also hears the outcome, for the other
    nodes' leaders: their manifests and the late files once the pointer moved, or why the save
    failed."""
    exchange = exchange or DirectoryExchange(storage)
    try:
        manifest, per_node, late = _commit_here(storage, ckpt_dir, tag=tag, save_id=save_id,
                                          world_size=world_size, checksum=checksum,
                                          timeout_s=timeout_s, pointer=pointer, replaces=replaces,
                                          finalize=finalize, rotation=rotation, exchange=exchange)
    except BaseException as exc:
        exchange.tell_nodes_failed(save_id, f"{type(exc).__name__}: {exc}")
        raise
    exchange.tell_nodes(save_id, per_node, late if exchange.node_local else {})
    return manifest, late


def _commit_here(storage: Storage, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
                 checksum: str, timeout_s: float, pointer: Pointer | None, replaces: str | None,
                 finalize: Sequence[FinalizeStep], rotation: bool,
                 exchange: RecordExchange) -> tuple[dict, dict[int, dict], dict[str, bytes]]:
    """:func:`commit` on rank 0's node; returns the manifest, each node's (see
    :func:`_commit`) and the bytes of the late files."""
    late_files = declared_files(finalize)
    try:
        manifest, per_node = _commit(storage, ckpt_dir, tag=tag, save_id=save_id,
                                     world_size=world_size, checksum=checksum, timeout_s=timeout_s,
                                     late_files=late_files, rotation=rotation, replaces=replaces,
                                     exchange=exchange)
    except (CommitError, OSError):  # OSError: a share's rename, the records' listing
        suffix = temporary_path("", save_id)
        # at any depth: a file saved in a subdirectory (os.walk of a missing directory, staged
        # with no rank yet writing, yields nothing)
        for top, _, names in os.walk(ckpt_dir):
            for name in names:
                if name.endswith(suffix):
                    try:
                        storage.remove_tree(os.path.join(top, name))
                    except Exception:  # (a storage of another kind raises its own errors)
                        pass  # the commit's own error is the one to raise
        raise
    late: dict[str, bytes] = {}
    if finalize:
        ctx = FinalizeContext(storage, ckpt_dir, replaces or ckpt_dir, tag, save_id, manifest,
                              frozenset(late_files))
        _finalize(finalize, ctx)
        late = dict(ctx.written)  # small files (Megatron's markers)
    _move_pointer(storage, ckpt_dir, tag=tag, save_id=save_id, pointer=pointer, replaces=replaces)
    return manifest, per_node, late


def commit_on_node(storage: Storage, ckpt_dir: str, manifest: dict, *, pointer: Pointer | None,
                   replaces: str | None = None, late: dict[str, bytes] | None = None) -> None:
    """The leader of a node other than rank 0's, with node-local storage, once rank 0
    committed (``manifest``: this node's, from :meth:`.exchange.StoreExchange.await_commit`):
    the same commit in this node's directory. The manifest is written (durably) first, then
    the late files rank 0's finalize steps wrote (``late``: path in the checkpoint -> bytes:
    Megatron's markers) and their record, then ``ckpt_dir`` swapped in for ``replaces`` if
    given, then the pointer moved, as rank 0 does, so that a crash leaves this node's pointer
    on a checkpoint complete on this node. The files the manifest places on this node were
    made durable by the ranks that wrote them before they sent their records."""
    late = late or {}
    problem = manifest_problem(manifest)
    if not problem and sorted(late) != manifest.get("late_files", []):
        problem = f"it lists late files {manifest.get('late_files', [])}, rank 0 sent {sorted(late)}"
    if problem:  # as a reader would refuse it: never written
        raise CommitError(f"checkpoint {ckpt_dir!r} (tag {manifest.get('tag')}) not committed on "
                          f"this node: the manifest rank 0 sent is damaged: {problem}")
    storage.makedirs(os.path.join(ckpt_dir, META_DIR))
    write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, MANIFEST),
                      json.dumps(manifest, indent=1, sort_keys=True))
    if late:
        ctx = FinalizeContext(storage, ckpt_dir, replaces or ckpt_dir, manifest["tag"],
                              manifest["save_id"], manifest, frozenset(late))
        _finalize([_RankZerosLateFiles(late)], ctx)
    _move_pointer(storage, ckpt_dir, tag=manifest["tag"], save_id=manifest["save_id"],
                  pointer=pointer, replaces=replaces)


class _RankZerosLateFiles:
    """A node leader's finalize step: the late files rank 0's steps wrote, byte for byte."""

    def __init__(self, late: dict[str, bytes]) -> None:
        self.late = late

    def __call__(self, ctx: FinalizeContext) -> None:
        for rel, data in sorted(self.late.items()):
            ctx.write_file(rel, data)


def _move_pointer(storage: Storage, ckpt_dir: str, *, tag: str, save_id: str,
                  pointer: Pointer | None, replaces: str | None) -> None:
    """After the manifest: swap ``ckpt_dir`` in for ``replaces`` if given, make its entry
    durable, and move the pointer."""
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
        raise _after_the_manifest(exc, ckpt_dir, replaces, tag, save_id, pointer) from exc


def _finalize(steps: Sequence[FinalizeStep], ctx: FinalizeContext) -> None:
    """Run ``steps`` in order, then record the files they declared; a failure is the save's,
    as a :class:`CommitError` naming the step (nothing a load sees changed)."""
    what = ""
    try:
        for step in steps:
            what = f"its finalize step {step_name(step)} failed"
            step(ctx)
        if ctx.files:
            what = "recording the files its finalize steps wrote failed"
            record_late_files(ctx.storage, ctx.write_dir, ctx.manifest, ctx.written)
    except Exception as exc:
        raise CommitError(f"checkpoint {ctx.ckpt_dir!r} (tag {ctx.tag}) not committed: its files "
                          f"are persisted, but {what} ({type(exc).__name__}: {exc}); the pointer "
                          "still names the previous checkpoint") from exc


def _after_the_manifest(exc: OSError, written: str, replaces: str | None, tag: str, save_id: str,
                        pointer: Pointer | None) -> BaseException:
    """What a failure after the manifest and the finalize steps means, from what is on disk:
    if the new checkpoint is where loads look (a re-save's exchange done; the pointer's rename
    done, its fsync failed; no pointer to move), a :class:`DurabilityError` saying so, since
    "the last committed one is intact" would be false; else ``exc`` (nothing a load sees
    changed)."""
    target = replaces or written
    if os.path.basename(target).startswith(STAGING_PREFIX):
        return exc
    if replaces is not None and not os.path.lexists(replaces) and holds_save(written, save_id):
        # two renames (no exchange): the old one moved to the trash, then this one failed
        return DurabilityError(f"checkpoint {replaces!r} (tag {tag}) is committed, at {written!r}, "
                               f"but renaming it into place failed: {exc}: the next load or save "
                               "renames it there (the checkpoint it replaces is gone)")
    if not holds_save(target, save_id):
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
            rotation: bool = True, replaces: str | None = None,
            exchange: RecordExchange | None = None) -> tuple[dict, dict[int, dict]]:
    """Wait for the records, join the shares, write the manifest. Returns it and, with
    node-local storage, each node's: the same but for a file written on several nodes with
    different bytes (DeepSpeed's model states carry each replica's BatchNorm statistics), whose
    size and checksum are those of that node's copy; without, ``{0: manifest}``."""
    exchange = exchange or DirectoryExchange(storage)
    records = _gather(exchange, ckpt_dir, tag=tag, save_id=save_id, world_size=world_size,
                      checksum=checksum, timeout_s=timeout_s)
    # node -> file -> its entry, as that node's first rank to write it recorded it
    by_node: dict[int, dict[str, dict]] = {}
    ranks: dict[str, list[str]] = {}
    writer: dict[tuple[int, str], int] = {}  # (node, file) -> the first rank whose record has it
    for r, record in sorted(records.items()):
        node = record.get("node", 0) if exchange.node_local else 0
        here = by_node.setdefault(node, {})
        for rel, entry in record["files"].items():
            if "tmp" in entry and node:  # only rank 0 renames a file joined from shares
                raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: rank {r} "
                                  f"wrote a share of {rel} on node {node}: with node-local "
                                  "storage, files are written in shares on rank 0's node only")
            if rel not in here:
                here[rel], writer[node, rel] = entry, r
            elif "tmp" in entry and "tmp" in here[rel]:  # another share of a file seen already
                here[rel]["segments"] += entry["segments"]
            elif entry != here[rel]:  # (equal: the same bytes, whichever rename came last)
                # two ranks wrote different bytes to one name: the manifest would describe one
                # of them and the file on disk may be the other's, failing every load
                raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: ranks "
                                  f"{writer[node, rel]} and {r} both wrote {rel}, with different "
                                  "contents; each file must be saved by one rank")
        ranks[str(r)] = sorted(record["files"])
    by_node.setdefault(0, {})
    files = by_node[0]
    _join_shares(storage, ckpt_dir, files, tag)
    carried = carry_over_listed(storage, replaces, ckpt_dir, files, checksum) if replaces else []
    listed = {str(n): sorted(by_node[n]) for n in sorted(by_node)}
    files = dict(files)
    for node in sorted(by_node)[1:]:  # a file on several nodes: as node 0, or the lowest, has it
        for rel, entry in by_node[node].items():
            files.setdefault(rel, entry)
    manifest = {"format": FORMAT, "tag": tag, "save_id": save_id, "world_size": world_size,
                "checksum": checksum, "committed_at": time.time(), "files": files, "ranks": ranks}
    if exchange.node_local:
        manifest["nodes"] = listed
    if carried:
        manifest["carried"] = carried
    if late_files:
        manifest["late_files"] = sorted(late_files)
    timings = slowest(records)
    if timings:
        manifest["timings"] = timings
    if not rotation:  # absent means in the rotation
        manifest["rotation"] = False
    problem = manifest_problem(manifest)  # what every reader would refuse: never committed
    if problem:
        raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: its manifest would "
                          f"be damaged: {problem}")
    write_text_atomic(storage, os.path.join(ckpt_dir, META_DIR, MANIFEST),
                      json.dumps(manifest, indent=1, sort_keys=True))
    per_node = {0: manifest}
    for node in sorted(by_node)[1:]:
        own = {rel: entry for rel, entry in by_node[node].items() if entry != files[rel]}
        per_node[node] = dict(manifest, files={**files, **own}) if own else manifest
    return manifest, per_node


def slowest(records: dict[int, dict]) -> dict[str, dict]:
    """Of each time the ranks' records carry (:data:`.records.TIMINGS`), the largest and the
    lowest rank with it: ``{"save_call_s": {"max": 0.21, "rank": 3}, ...}``."""
    out: dict[str, dict] = {}
    for r, record in sorted(records.items()):
        for key, value in record.get("timings", {}).items():
            if key not in out or value > out[key]["max"]:
                out[key] = {"max": value, "rank": r}
    return out


def _gather(exchange: RecordExchange, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
            checksum: str, timeout_s: float) -> dict[int, dict]:
    """Every rank's record, once all are there (rank -> record); ``CommitError`` as soon as a
    rank reported its part failed, or after ``timeout_s`` without every record."""
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        while True:
            done, failed = exchange.look(ckpt_dir, save_id=save_id, world_size=world_size)
            if done:
                break
            if failed:
                reason = exchange.reason(ckpt_dir, save_id=save_id, rank=failed[0])
                raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: rank(s) "
                                  f"{_ranges(failed)} failed to persist their part ({reason})")
            if time.monotonic() > deadline:
                missing = exchange.missing(ckpt_dir, save_id=save_id, world_size=world_size)
                raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: rank(s) "
                                  f"{_ranges(missing)} did not finish persisting within "
                                  f"{timeout_s:.0f} s (async_checkpoint.commit_timeout_s)")
            time.sleep(poll_delay(time.monotonic() - start))
    except BaseException:
        exchange.discard(save_id=save_id, world_size=world_size)
        raise
    return exchange.read(ckpt_dir, tag=tag, save_id=save_id, world_size=world_size, checksum=checksum)


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


def _ranges(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
