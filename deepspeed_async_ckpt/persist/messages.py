"""What the training process (:class:`~.process.ProcessWriter`) and its persist worker
(:mod:`.worker`) send each other over their socket: one frozen dataclass per kind of message,
each side dispatching on the message's type.

To the worker, in this order:

- :class:`UseStorage`, first: the :class:`~..storage.Storage` to write with;
- :class:`MapBlock`, followed by the block's memory file (``SCM_RIGHTS``): a pool block, mapped
  there until :class:`ForgetBlock`;
- :class:`WriteFile`: a file to write, its records numbered across its archives, in file order;
- per record of such a file, once it is staged: :class:`RecordStaged` (its host copy is in the
  pool), :class:`RecordBytes` followed by its bytes (a copy outside the pool: eager state), or
  :class:`RecordFailed` (it could not be staged);
- :class:`Stop`: finish the files in hand, then exit.

From the worker: :class:`Released` once a record's buffer may be reused, :class:`FileWritten`
once a file is written or failed. :data:`ToWorker` and :data:`FromWorker` name each way's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shares import Share
from .writer import FileEntry


@dataclass(frozen=True)
class UseStorage:
    """The storage the worker writes with, pickled (it must be picklable)."""

    storage: bytes


@dataclass(frozen=True)
class MapBlock:
    """Pool block ``block``, ``nbytes`` long: its memory file follows the message."""

    block: int
    nbytes: int


@dataclass(frozen=True)
class ForgetBlock:
    """The pool dropped block ``block``: the worker unmaps it, so its memory goes."""

    block: int


@dataclass(frozen=True)
class Archive:
    """One ``torch.save`` archive of a file: its pickle, and each record's ``(key, nbytes,
    what)`` (``what`` names the tensor in errors), in order."""

    pickle_bytes: bytes
    records: tuple[tuple[str, int, str], ...]


@dataclass(frozen=True)
class WriteFile:
    """Write file ``file`` (an id of the training process's) to ``path``, as
    :func:`~.writer.write_file` is called with these arguments; its records come as they are
    staged."""

    file: int
    path: str
    archives: tuple[Archive, ...]
    checksum: str
    part_names: tuple[str, ...] | None
    zip_crc32: bool
    share: Share | None


@dataclass(frozen=True)
class RecordStaged:
    """Record ``record`` of file ``file`` is in the pool: block ``block`` from ``offset``."""

    file: int
    record: int
    block: int
    offset: int


@dataclass(frozen=True)
class RecordBytes:
    """Record ``record`` of file ``file`` lies outside the pool: its bytes follow the message."""

    file: int
    record: int


@dataclass(frozen=True)
class RecordFailed:
    """Record ``record`` of file ``file`` could not be staged: the file fails with ``message``."""

    file: int
    record: int
    message: str


@dataclass(frozen=True)
class Stop:
    """Finish the files in hand, then exit."""


@dataclass(frozen=True)
class Released:
    """From the worker: record ``record`` of file ``file`` is written; its buffer may be reused."""

    file: int
    record: int


@dataclass(frozen=True)
class FileWritten:
    """From the worker: file ``file`` is written (``entry``) or failed (``error``, picklable)."""

    file: int
    entry: FileEntry | None
    error: BaseException | None


#: What the training process sends the worker.
ToWorker = (UseStorage | MapBlock | ForgetBlock | WriteFile | RecordStaged | RecordBytes | RecordFailed
            | Stop)

#: What the worker answers.
FromWorker = Released | FileWritten
