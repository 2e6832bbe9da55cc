"""Per-rank records: how each rank tells rank 0 that its part of a save is durable, or failed.

Every rank (writer or not) writes ``.async_ckpt/rank_NNNNN.<save_id>.json`` once all of its
files for a save are durable (:func:`write_rank_record`), or ``rank_NNNNN.<save_id>.failed``
if its part failed (:func:`write_rank_failure`). Rank 0's commit (:func:`.sequence.commit`)
waits for them and reads them back (:class:`DirectoryExchange`). Records are exchanged through
the checkpoint directory itself (which rank 0 must see, as DeepSpeed's own ``latest`` already
assumes), so no collective ever runs on a background thread. Where the ranks share no
directory (node-local storage), the same records travel through the process group's store
instead (:mod:`.exchange`). Both ways are a :class:`RecordExchange`, the seam the commit is
written against.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Protocol, runtime_checkable

from ..errors import CommitError
from ..persist import FileEntry
from ..storage import Storage
from .atomic import write_text_atomic
from .layout import META_DIR
from .manifest import is_segment


def rank_record_path(ckpt_dir: str, rank: int, save_id: str) -> str:
    """Where rank ``rank`` records that its part of save ``save_id`` is durable."""
    return os.path.join(ckpt_dir, META_DIR, f"rank_{rank:05d}.{save_id}.json")


def failure_record_path(ckpt_dir: str, rank: int, save_id: str) -> str:
    """Where rank ``rank`` records that its part of save ``save_id`` failed."""
    return os.path.join(ckpt_dir, META_DIR, f"rank_{rank:05d}.{save_id}.failed")


def write_rank_failure(storage: Storage, ckpt_dir: str, *, rank: int, save_id: str, message: str) -> None:
    """Called by a rank whose part of a save failed, so rank 0 abandons the commit at once
    instead of waiting ``commit_timeout_s`` for a record that will never come."""
    storage.makedirs(os.path.join(ckpt_dir, META_DIR))
    write_text_atomic(storage, failure_record_path(ckpt_dir, rank, save_id), message, durable=False)


def write_rank_record(storage: Storage, ckpt_dir: str, *, rank: int, save_id: str,
                      checksum: str, files: Iterable[FileEntry]) -> None:
    """Called by every rank (writer or not) once all of its files for this save are durable.

    The record is published (written whole, then renamed into place) but not fsynced: rank 0
    copies every record into the manifest, which is made durable before the pointer moves, so
    a record a crash loses belongs to a save that was not committed anyway. Two fsyncs fewer
    on every rank's way to the commit (measured in docs/benchmarks.md, "Small choices")."""
    DirectoryExchange(storage).publish(ckpt_dir, rank_record(ckpt_dir, rank=rank, save_id=save_id,
                                                             checksum=checksum, files=files))


#: What a rank's record may say of its save's times (seconds, see :func:`rank_record`).
TIMINGS = ("save_call_s", "fence_wait_s", "persisted_s")


def rank_record(ckpt_dir: str, *, rank: int, save_id: str, checksum: str,
                files: Iterable[FileEntry], node: int | None = None,
                timings: dict[str, float] | None = None) -> dict:
    """Rank ``rank``'s record of its durable files for save ``save_id``: each file's path
    within ``ckpt_dir``, size and checksum (or its segments). ``node``: the node it ran on,
    recorded with node-local storage only (see :mod:`.nodes`). ``timings``: this rank's
    seconds of :data:`TIMINGS` (its save call, its fence wait, to its files persisted), which
    rank 0's commit takes the largest of, so no collective carries them."""
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
    if node is not None:
        record["node"] = node
    if timings:
        record["timings"] = {k: round(float(v), 6) for k, v in timings.items()}
    return record


def read_rank_record(path: str, rank: int, *, save_id: str, checksum: str, ckpt_dir: str,
                     tag: str) -> dict:
    """Rank 0: rank ``rank``'s record at ``path``, as :func:`write_rank_record` writes it; a
    record that is not (damaged, or another version's) is a ``CommitError`` naming it and the
    rank, before anything of it reaches the manifest."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as exc:  # unreadable; not UTF-8 (ValueError)
        text = exc
    return parse_rank_record(text, path, rank, save_id=save_id, checksum=checksum,
                             ckpt_dir=ckpt_dir, tag=tag)


def parse_rank_record(text: str | bytes | Exception, where: str, rank: int, *, save_id: str,
                      checksum: str, ckpt_dir: str, tag: str) -> dict:
    """Rank 0: rank ``rank``'s record from its JSON ``text`` (or the error reading it), found
    at ``where`` (a path, a store key); ``CommitError`` naming both if it is damaged."""
    problem = None
    if isinstance(text, Exception):
        problem = f"{type(text).__name__}: {text}"
    else:
        try:
            record = json.loads(text)
            problem = record_problem(record, rank, save_id, checksum)
        except ValueError as exc:  # not JSON, not UTF-8
            problem = f"{type(exc).__name__}: {exc}"
    if problem:
        raise CommitError(f"checkpoint {ckpt_dir!r} (tag {tag}) not committed: rank {rank}'s record "
                          f"{where} is damaged: {problem}")
    return record


def record_problem(record: object, rank: int, save_id: str, checksum: str) -> str | None:
    """What makes ``record`` not rank ``rank``'s record of save ``save_id``, or None."""
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return "no 'files' object"
    for key, want in (("rank", rank), ("save_id", save_id), ("checksum", checksum)):
        if record.get(key) != want or type(record.get(key)) is not type(want):
            return f"{key} {record.get(key)!r}, expected {want!r}"
    if "node" in record and (type(record["node"]) is not int or record["node"] < 0):
        return f"node {record['node']!r} is not a node index"
    timings = record.get("timings", {})
    if not isinstance(timings, dict) or not all(
            k in TIMINGS and type(v) in (int, float) and v >= 0 for k, v in timings.items()):
        return f"timings {timings!r} are not seconds of {', '.join(TIMINGS)}"
    for rel, entry in record["files"].items():
        if os.path.isabs(rel) or os.pardir in rel.split("/") or not rel:
            return f"file {rel!r} is outside the checkpoint"
        if not isinstance(entry, dict) or type(entry.get("bytes")) is not int or entry["bytes"] < 0:
            return f"file {rel!r} has no size"
        segments = entry.get("segments", [])
        if not isinstance(segments, list) or not all(is_segment(seg) for seg in segments):
            return f"file {rel!r} has malformed segments"
        if "segments" not in entry and not isinstance(entry.get(checksum), str):
            return f"file {rel!r} has no {checksum} checksum"
        if "tmp" in entry and not (isinstance(entry["tmp"], str) and segments
                                   and not os.path.isabs(entry["tmp"]) and os.pardir not in entry["tmp"].split("/")):
            return f"file {rel!r}: a share without its temporary name or segment"
    return None


@runtime_checkable
class RecordExchange(Protocol):
    """How the ranks' records of one save reach rank 0, and how rank 0's word on the commit
    reaches the other nodes: :class:`DirectoryExchange` (the checkpoint directory) or
    :class:`.exchange.StoreExchange` (the process group's store, node-local storage).

    Call order, per save, with the ranks that make each call:

    - (every rank) :meth:`publish` its record once its files are durable, or :meth:`fail`;
    - (rank 0, :func:`.sequence.commit`) :meth:`look` until every record is there; on a
      failure :meth:`reason`, on a timeout :meth:`missing`; then :meth:`read`, or
      :meth:`discard` if the wait ended in an error;
    - (rank 0, once the pointer moved or the commit failed) :meth:`tell_nodes` or
      :meth:`tell_nodes_failed`: nothing to tell where :attr:`node_local` is False.
    """

    node_local: bool
    """Whether every node commits the checkpoint in a directory of its own (the records then
    say which node wrote each file, and the manifest lists them per node)."""

    def publish(self, ckpt_dir: str, record: dict) -> None:
        """Every rank: its record (:func:`rank_record`), once all its files are durable."""

    def fail(self, ckpt_dir: str, *, rank: int, save_id: str, message: str) -> None:
        """A rank whose part failed: ``message`` says why; rank 0 abandons the commit at once."""

    def look(self, ckpt_dir: str, *, save_id: str, world_size: int) -> tuple[bool, list[int]]:
        """Rank 0: whether every rank's record is there, and which ranks reported a failure."""

    def reason(self, ckpt_dir: str, *, save_id: str, rank: int) -> str:
        """Rank 0: why rank ``rank``'s part failed, as it reported."""

    def missing(self, ckpt_dir: str, *, save_id: str, world_size: int) -> list[int]:
        """Rank 0: the ranks whose record is not there."""

    def read(self, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
             checksum: str) -> dict[int, dict]:
        """Rank 0, once :meth:`look` found them all: every rank's record (rank -> record),
        checked; ``CommitError`` naming a damaged one."""

    def discard(self, *, save_id: str, world_size: int) -> None:
        """Rank 0, once the records are read or the commit failed: what the exchange holds of
        the save goes."""

    def tell_nodes(self, save_id: str, manifests: dict[int, dict], late: dict[str, bytes]) -> None:
        """Rank 0, once its pointer moved: each other node's manifest (node -> manifest) and the
        late files its finalize steps wrote (path -> bytes)."""

    def tell_nodes_failed(self, save_id: str, message: str) -> None:
        """Rank 0, once the save failed: why, to the other nodes."""


class DirectoryExchange:
    """The records of a save, through its checkpoint directory (which rank 0 must see): every
    rank :meth:`publish`\ es its record (or :meth:`fail`\ s), rank 0 :meth:`read`\ s them. A
    :class:`RecordExchange` of one node: nothing to tell other nodes."""

    #: No node other than rank 0's has a checkpoint of its own to commit.
    node_local = False

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def publish(self, ckpt_dir: str, record: dict) -> None:
        """Every rank: its record (see :func:`write_rank_record`)."""
        self.storage.makedirs(os.path.join(ckpt_dir, META_DIR))
        write_text_atomic(self.storage, rank_record_path(ckpt_dir, record["rank"], record["save_id"]),
                          json.dumps(record, indent=1), durable=False)

    def fail(self, ckpt_dir: str, *, rank: int, save_id: str, message: str) -> None:
        """A rank whose part failed (see :func:`write_rank_failure`)."""
        write_rank_failure(self.storage, ckpt_dir, rank=rank, save_id=save_id, message=message)

    def look(self, ckpt_dir: str, *, save_id: str, world_size: int) -> tuple[bool, list[int]]:
        """Rank 0: whether every rank's record is there, and which ranks reported a failure
        meanwhile. One listing of the records' directory, whatever the world size."""
        try:
            names = set(self.storage.listdir(os.path.join(ckpt_dir, META_DIR)))
        except FileNotFoundError:
            names = set()
        missing = [r for r in range(world_size)
                   if os.path.basename(rank_record_path(ckpt_dir, r, save_id)) not in names]
        return not missing, [r for r in missing
                             if os.path.basename(failure_record_path(ckpt_dir, r, save_id)) in names]

    def reason(self, ckpt_dir: str, *, save_id: str, rank: int) -> str:
        """Rank 0: why rank ``rank``'s part failed, as it reported."""
        with open(failure_record_path(ckpt_dir, rank, save_id), encoding="utf-8") as f:
            return f.read()

    def missing(self, ckpt_dir: str, *, save_id: str, world_size: int) -> list[int]:
        """Rank 0: the ranks whose record is not there."""
        return [r for r in range(world_size) if not os.path.exists(rank_record_path(ckpt_dir, r, save_id))]

    def read(self, ckpt_dir: str, *, tag: str, save_id: str, world_size: int,
             checksum: str) -> dict[int, dict]:
        """Rank 0, once :meth:`look` found them all: every rank's record, checked."""
        return {r: read_rank_record(rank_record_path(ckpt_dir, r, save_id), r, save_id=save_id,
                                    checksum=checksum, ckpt_dir=ckpt_dir, tag=tag)
                for r in range(world_size)}

    def discard(self, *, save_id: str, world_size: int) -> None:
        """Rank 0, once the commit failed: nothing to remove (the records stay with the
        checkpoint's partial directory, which retention removes)."""

    def tell_nodes(self, save_id: str, manifests: dict[int, dict], late: dict[str, bytes]) -> None:
        """Rank 0: no other node commits (every rank sees this directory)."""

    def tell_nodes_failed(self, save_id: str, message: str) -> None:
        """Rank 0: no other node waits for word of the commit."""
