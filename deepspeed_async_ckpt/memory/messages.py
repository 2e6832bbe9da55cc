"""The messages between a rank's :class:`~.client.KeeperClient` and the node's keeper: one
frozen dataclass each, sent as one JSON line (``{"type": "Reserve", ...fields}``), decoded
back into the same class. The keeper dispatches on the class, never on a string.

Call order (which ranks make each call, on every node):

1. (every rank) :class:`Hello` once per connection; the job's settings travel with it.
2. (every rank of the node, per save) :class:`Reserve` its files' space in the save's slot
   (one segment per file), write the bytes into the segments, then :class:`Report` their
   sizes and checksums. The slot is *copied* once every rank in ``node_ranks`` reported.
3. (any rank, once every node has its slot copied: the job's global commit) :class:`Commit`,
   with the checkpoint's manifest: the keeper's pointer names the slot; older committed slots
   beyond ``keep_last`` are freed.
   :class:`Abandon` drops a save that failed instead.
4. (a restarting rank) :class:`Newest`: the newest committed slot, each rank's files in it;
   a node's leader laying it out for a load asks with ``lend``.
5. (the job's end, its last save persisted) :class:`Shutdown`.
"""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class FileSpace:
    """A file a rank will write: its name and the bytes it may take (its capacity)."""
    name: str
    capacity: int


@dataclass(frozen=True)
class FilePlace:
    """Where a file is written: its own segment, of at least ``capacity`` bytes. At the
    report the keeper cuts the segment to the file's size, so the segment *is* the file (a
    restore hard-links it into the checkpoint directory it lays out)."""
    name: str
    segment: str
    capacity: int


@dataclass(frozen=True)
class FileDigest:
    """A file copied: its size in bytes (<= its capacity) and checksum (``algorithm``)."""
    name: str
    size: int
    checksum: str


@dataclass(frozen=True)
class StoredFile:
    """A file of a copied slot, as a reader finds it: its segment holds exactly its bytes."""
    name: str
    segment: str
    size: int
    checksum: str


@dataclass(frozen=True)
class InlineFile:
    """A small file the keeper holds in its own memory, given at the commit: a file a
    framework's finalize step wrote once every rank had copied (megatron-core's ``.metadata``
    and ``metadata.json``). ``data`` is its bytes in base64."""
    name: str
    data: str


@dataclass(frozen=True)
class RankFiles:
    """One rank's part of a slot: its files."""
    rank: int
    files: tuple[StoredFile, ...]


# Requests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    pid: int
    keep_last: int
    max_bytes: int | None
    idle_timeout_s: float


@dataclass(frozen=True)
class Reserve:
    name: str
    save_id: str
    rank: int
    node_ranks: tuple[int, ...]
    files: tuple[FileSpace, ...]


@dataclass(frozen=True)
class Report:
    name: str
    save_id: str
    rank: int
    algorithm: str
    files: tuple[FileDigest, ...]


@dataclass(frozen=True)
class Commit:
    name: str
    save_id: str | None = None
    manifest: dict | None = None
    """The checkpoint's manifest (``manifest.json`` as the job's commit wrote or would write
    it), kept with the slot so a restore can put the checkpoint on disk whole."""
    late: tuple[InlineFile, ...] = ()
    """The files the commit's finalize steps wrote (the manifest's ``late_files``)."""


@dataclass(frozen=True)
class Abandon:
    name: str
    save_id: str


@dataclass(frozen=True)
class Newest:
    lend: bool = False
    """The asker hard-links the slot's segments into a load's directory: the keeper never
    gives them to a later save as spares (the loaded state may still map them)."""


@dataclass(frozen=True)
class Status:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


# Replies --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome:
    pid: int
    log_path: str


@dataclass(frozen=True)
class Reserved:
    files: tuple[FilePlace, ...]


@dataclass(frozen=True)
class SlotState:
    """A slot's name, save and state: ``open`` (being written), ``copied`` (every rank of the
    node copied its files), ``committed`` (the keeper's pointer may name it)."""
    name: str
    save_id: str
    state: str
    missing_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class SlotView:
    name: str
    save_id: str
    algorithm: str
    ranks: tuple[RankFiles, ...]
    manifest: dict | None = None
    late: tuple[InlineFile, ...] = ()


@dataclass(frozen=True)
class NoSlot:
    pass


@dataclass(frozen=True)
class KeeperState:
    pid: int
    held_bytes: int
    max_bytes: int | None
    keep_last: int
    clients: int
    slots: tuple[SlotState, ...]


@dataclass(frozen=True)
class Busy:
    """Another save's slot is still being written or waits for its commit: ask again."""
    reason: str


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Done:
    pass


REQUESTS = (Hello, Reserve, Report, Commit, Abandon, Newest, Status, Shutdown)
REPLIES = (Welcome, Reserved, SlotState, SlotView, NoSlot, KeeperState, Busy, Refused, Done)
_BY_NAME = {cls.__name__: cls for cls in REQUESTS + REPLIES}


def encode(message: Any) -> bytes:
    """One JSON line."""
    return json.dumps({"type": type(message).__name__, **asdict(message)}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Any:
    """The message of one JSON line; ``ValueError`` for anything else."""
    raw = json.loads(line)
    if not isinstance(raw, dict) or raw.get("type") not in _BY_NAME:
        raise ValueError(f"not a keeper message: {line[:200]!r}")
    return _build(_BY_NAME[raw.pop("type")], raw)


def _build(cls: type, raw: dict) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    if set(raw) - names:
        raise ValueError(f"unknown field(s) {sorted(set(raw) - names)} in {cls.__name__}")
    try:
        return cls(**{k: _value(hints[k], v) for k, v in raw.items()})
    except (TypeError, AttributeError) as exc:  # a field missing, a nested value of the wrong shape
        raise ValueError(f"malformed {cls.__name__}: {exc}") from exc


def _value(hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]
        item = typing.get_args(hint)[0]
        return tuple(_build(item, v) if isinstance(item, type) and hasattr(item, "__dataclass_fields__")
                     else v for v in value)
    return value
