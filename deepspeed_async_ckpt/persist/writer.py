""":func:`write_file`: one checkpoint file from its plans' host copies to storage, and the
:class:`FileEntry` the manifest keeps of it.

A file is written under a temporary name, checksummed while the bytes go out, fsynced, then
renamed: a crash never leaves a half-written file under the final name. It holds one
``torch.save`` archive (:mod:`.archive`), or several packed back to back, each starting on a
page (megatron-core's ``.distcp`` files hold many items, each a ``torch.save`` archive found by
offset and length), or one rank's :class:`~.shares.Share` of a file several ranks write.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..errors import PersistError, describe
from ..snapshot import FilePlan, TensorItem
from ..storage import DIRECT_ALIGN, Storage, temporary_path
from .archive import layout, write_archive
from .checksum import ChecksumSink, new_hasher
from .pacing import PacedWrites, WritePacer
from .shares import Share


@dataclass(frozen=True)
class FileEntry:
    """One persisted file as the manifest lists it (an entry of a rank's record's ``files``)."""

    path: str
    nbytes: int
    checksum: str
    parts: dict[str, tuple[int, int]] | None = None
    """For a packed file: each archive's name -> (offset, length) in bytes."""
    part_checksums: tuple[tuple[int, int, str], ...] | None = None
    """For a packed file, instead of ``checksum``: (offset, length, checksum) of each archive
    with the padding before it, in file order, end to end; a load that reads some archives
    only (megatron-core's, without the optimizer state) checks only those."""
    segment: tuple[int, int] | None = None
    """For a share of a file: the (offset, length) this rank wrote, which ``checksum`` covers;
    ``nbytes`` is the whole file's size."""
    tmp: str | None = None
    """For a share: the temporary name all the file's shares were written to (the commit
    renames it to ``path`` once every share is durable)."""


def write_file(storage: Storage, path: str, plans: Sequence[FilePlan], checksum: str, *,
               part_names: Sequence[str] | None = None, zip_crc32: bool = False,
               stage: Callable[[TensorItem], None] | None = None,
               share: Share | None = None, pace: Callable[[int], None] | None = None) -> FileEntry:
    """Write ``plans`` to ``path``, one ``torch.save`` archive each, waiting for each record's
    host copy as it goes.

    One plan makes an ordinary ``torch.save`` file. Several are packed back to back, each
    archive starting on a page (its records stay page-aligned for direct I/O, and its zip
    offsets count from its own start, so ``torch.load`` reads it from a view of its bytes);
    ``part_names`` names them, and the record gives each name's offset and length.
    ``zip_crc32`` makes torch's writer also store a CRC-32 per zip record, as ``torch.save``
    does by default; ``torch.load`` reads the file either way (see
    ``torch.serialization.set_crc32_options``), and ``checksum`` already covers every byte.
    ``stage``, when given, stages each item inline right before it is written (the synchronous
    mode). On any failure every remaining item is still released, so the pool never leaks.

    With ``share`` (one plan, no zip CRC: the last share would need every record's bytes for
    the zip directory's CRCs), only that share's bytes are written, to ``share.tmp``, and only
    its items are waited for and released (the plan's other items are other ranks'); the file
    is laid out first without any data, so every rank knows where each share starts. The
    commit renames ``share.tmp`` once every share is durable.

    ``pace``, when given, is called with the size of every write before it is made (a
    :meth:`~.pacing.Schedule.take`), and may sleep: the file's hashing and writing follow it.
    """
    if part_names is not None and len(part_names) != len(plans):
        raise ValueError(f"{path}: {len(plans)} archives but {len(part_names)} part names")
    if share is not None and (len(plans) != 1 or zip_crc32):
        raise ValueError(f"{path}: a share is one archive without zip CRCs")
    tmp = share.tmp if share is not None else temporary_path(path, os.getpid())
    owned = share.items(len(plans[0].items)) if share is not None else None
    pending = [item for plan in plans for item in plan.items] if owned is None else \
        [plans[0].items[j] for j in owned]
    spans: list[tuple[int, int]] = []
    sums: list[tuple[int, int, str]] = []  # a packed file's checksums, one per archive
    try:
        if share is None:
            f = storage.open_write(tmp)
            sink = ChecksumSink(f if pace is None else _Paced(f, pace), checksum)
        else:
            starts, size = layout(plans[0])
            bounds = (0, *(starts[j] for j in share.cuts), size)
            window = (bounds[share.index], bounds[share.index + 1])
            f = storage.open_write_at(tmp, window[0])
            sink = ChecksumSink(f if pace is None else _Paced(f, pace), checksum, window)
        try:
            for plan in plans:
                if sink.nbytes % DIRECT_ALIGN:  # the next archive starts on a page
                    sink.write(bytes(DIRECT_ALIGN - sink.nbytes % DIRECT_ALIGN))
                    sink.check()
                start = sink.nbytes
                write_archive(sink, f, plan, pending, zip_crc32, stage, owned)
                spans.append((start, sink.nbytes - start))
                if part_names is not None:  # this archive's bytes (and padding) hashed alone
                    done = sums[-1][0] + sums[-1][1] if sums else 0
                    sums.append((done, sink.nbytes - done, sink.hasher.hexdigest()))
                    sink.hasher = new_hasher(checksum)
            storage.sync_file(f)
        except BaseException:
            sink.discard = True
            raise
        finally:
            f.close()
        if share is not None:
            if sink.nbytes != size:
                raise PersistError(f"writing {path}: share {share.index} laid the file out as "
                                   f"{sink.nbytes} bytes, its layout pass as {size}")
            return FileEntry(path=path, nbytes=size, checksum=sink.hasher.hexdigest(),
                             segment=(window[0], window[1] - window[0]), tmp=tmp)
        storage.replace(tmp, path)
        if part_names is not None:
            return FileEntry(path=path, nbytes=sink.nbytes, checksum="",
                             parts=dict(zip(part_names, spans)), part_checksums=tuple(sums))
        return FileEntry(path=path, nbytes=sink.nbytes, checksum=sink.hasher.hexdigest())
    except BaseException as exc:
        for item in pending:
            if stage is not None:
                item.cancel()
            item.release()
        try:
            storage.remove_tree(tmp)
        except Exception:  # (a storage of another kind raises its own): the write's error is raised
            pass
        if isinstance(exc, PersistError) or not isinstance(exc, Exception):  # Ctrl-C stays Ctrl-C
            raise
        raise PersistError(f"writing {path} failed: {describe(exc)}") from exc


class _Paced:
    """A file as the checksum sink writes to it: every write first waits for ``take``."""

    def __init__(self, f: Any, take: Callable[[int], None]) -> None:
        self._f, self._take = f, take
        self.name = getattr(f, "name", "?")
        if getattr(f, "write_stable", None) is not None:
            self.write_stable = self._write_stable

    def write(self, data) -> int:
        self._take(memoryview(data).nbytes)
        return self._f.write(data)

    def _write_stable(self, data) -> int:
        self._take(memoryview(data).nbytes)
        return self._f.write_stable(data)


class FileWriter(Protocol):
    """How the core hands a save's files to the persist stage: :class:`ThreadWriter` (the
    writer threads, config ``persist_in: "thread"``) or :class:`~.process.ProcessWriter` (a
    worker process, ``"process"``). Both write each file with :func:`write_file`, so the bytes
    are the same.

    Call order, on each rank that writes: (training thread, async mode) :meth:`pace` with a
    save's bytes, then :meth:`submit` per file of that save; (training thread, sync mode)
    :meth:`write` per file instead; (any thread) :meth:`hurry` when someone waits for the
    saves; (the checkpointer's ``close``) :meth:`close` once, after the last file. A writer
    that takes each save's files together (:class:`~..memory.saver.MemoryWriter`) also has
    ``end(save) -> Future``, called once the save is sealed for good; the save waits for it
    before its record."""

    def pace(self, save: Any, begun_at: float, nbytes: int) -> None:
        """The files :meth:`submit` is handed next are the save ``save``'s (begun at
        ``begun_at``, ``time.perf_counter`` seconds), ``nbytes`` more of its bytes."""

    def hurry(self) -> None:
        """Someone waits for the saves: stop pacing their writes."""

    def submit(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
               share: Share | None = None) -> Future:
        """Write the file in the background (paced, see :meth:`pace`); the future holds its
        :class:`FileEntry`, or the error."""

    def write(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
              share: Share | None = None, stage: Callable[[TensorItem], None] | None = None) -> FileEntry:
        """Write the file now and return its record; ``stage``, when given, stages each record
        first (the synchronous mode)."""

    def close(self) -> None:
        """Stop what the writer started of its own, once the files in its hands are written."""


class ThreadWriter(PacedWrites):
    """A :class:`FileWriter` that runs :func:`write_file` on the writer threads (``threads``)
    of the training process (config ``persist_in: "thread"``); its background writes follow
    ``pacer``'s schedules, if given (:class:`~.pacing.PacedWrites`)."""

    def __init__(self, storage: Storage, threads: Executor, *, checksum: str, zip_crc32: bool,
                 pacer: WritePacer | None = None) -> None:
        super().__init__(pacer)
        self._storage, self._threads = storage, threads
        self._checksum, self._zip_crc32 = checksum, zip_crc32

    def submit(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
               share: Share | None = None) -> Future:
        return self._threads.submit(write_file, self._storage, path, plans, self._checksum,
                                    part_names=part_names, zip_crc32=self._zip_crc32, share=share,
                                    pace=self.take())

    def write(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
              share: Share | None = None, stage: Callable[[TensorItem], None] | None = None) -> FileEntry:
        return write_file(self._storage, path, plans, self._checksum, part_names=part_names,
                          zip_crc32=self._zip_crc32, stage=stage, share=share)

    def close(self) -> None:
        """Nothing of its own to stop: the threads are the checkpointer's."""
