"""A rank's files of a save into the keeper's memory: :class:`MemoryWriter`, the
:class:`~..persist.FileWriter` of a checkpointer with the memory tier on.

Each file is written by :func:`~..persist.write_file`, as without the tier, into a
:class:`SlotStorage`: its bytes go from the host pool's buffers (the one device-to-host copy)
into the file's space in the keeper's shared memory and, for a save that persists, to the
file on disk from the same buffers, hashed once for the manifest on the way. A memory-only
save opens, syncs and renames nothing on disk.

Call order (one rank)::

    (training thread) pace(save, ...); submit(path, plans) per file   # at each seal
    (training thread) end(save) -> Future                             # the save has no more files
    (its copy thread) reserve every file in the slot, write each, report their sizes

The keeper takes one reservation per rank and slot, with every file's size: sizes come from
the archives' layout (:func:`~..persist.archive.layout`), and the reservation, which waits
while the previous save's slot awaits its commit, runs on the writer's own thread, never on
the training thread. That one thread takes the saves in order: a later save's reservation
taken first would wait for a commit that waits for the earlier save's copy. A rank with no file still reserves (nothing) and reports: the slot is copied
once every rank of the node has.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ..errors import PersistError
from ..persist import FileEntry, write_file
from ..persist.archive import layout
from ..qos import lower_this_thread
from ..snapshot import FilePlan, TensorItem
from ..storage import DIRECT_ALIGN, Storage

logger = logging.getLogger(__name__)


def file_size(plans: Sequence[FilePlan]) -> int:
    """The bytes :func:`~..persist.write_file` writes for ``plans``: their archives back to
    back, each from a page."""
    size = 0
    for plan in plans:
        size = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN + layout(plan)[1]
    return size


class _SlotFile:
    """A file as :func:`write_file` writes it: each write lands in ``space`` (the keeper's
    memory) and, when ``disk`` is given, in that file too, from the same buffer."""

    def __init__(self, space: memoryview, disk: Any | None, name: str) -> None:
        self._space, self.disk, self.name, self._at = space, disk, name, 0
        if disk is not None and getattr(disk, "write_stable", None) is not None:
            self.write_stable = self._write_stable
        if disk is not None and getattr(disk, "barrier", None) is not None:
            self.barrier = disk.barrier  # the pool's buffer comes back once the disk wrote it

    def _copy(self, view: memoryview) -> None:
        end = self._at + len(view)
        if end > len(self._space):
            raise PersistError(f"{self.name}: {end} bytes do not fit the {len(self._space)} reserved "
                               "for it in the keeper's memory")
        self._space[self._at:end] = view
        self._at = end

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._copy(view)
        return len(view) if self.disk is None else _all(self.disk.write, view)

    def _write_stable(self, data) -> int:
        view = memoryview(data).cast("B")
        self._copy(view)
        return _all(self.disk.write_stable, view)

    def close(self) -> None:
        try:
            if self.disk is not None:
                self.disk.close()
        finally:
            self._space.release()


def _all(write: Callable[[memoryview], int], view: memoryview) -> int:
    done = 0
    while done < len(view):
        n = write(view[done:])
        if not n:
            raise OSError("short write")
        done += n
    return done


class SlotStorage:
    """The :class:`~..storage.Storage` :func:`write_file` writes one file of a memory save
    through: into ``space`` (None: the reservation failed, ``error`` says why) and, with
    ``disk``, also to the checkpoint directory as without the tier. Serves only the calls
    :func:`write_file` makes of a whole file."""

    def __init__(self, space: memoryview | None, disk: Storage | None, *, error: BaseException | None = None,
                 name: str = "?") -> None:
        self._space, self._disk, self._error, self._name = space, disk, error, name

    def open_write(self, path: str) -> _SlotFile:
        if self._space is None:
            raise self._error or PersistError(f"{self._name}: no space in the keeper's memory")
        return _SlotFile(self._space, None if self._disk is None else self._disk.open_write(path), self._name)

    def sync_file(self, f: _SlotFile) -> None:
        if self._disk is not None:
            self._disk.sync_file(f.disk)

    def replace(self, src: str, dst: str, *, durable: bool = True) -> None:
        if self._disk is not None:
            self._disk.replace(src, dst, durable=durable)

    def remove_tree(self, path: str) -> None:
        if self._disk is not None:
            self._disk.remove_tree(path)


class MemoryWriter:
    """A :class:`~..persist.FileWriter` that copies every file of a save into the keeper's
    slot (``memory``: a :class:`~..core.memory_saves.MemorySaves`) and, for a save that
    persists, to ``storage`` as it does. Its writes are not paced: a memory copy is quick, and
    a persist save is the one a restart falls back to."""

    def __init__(self, storage: Storage, memory: Any, *, checksum: str, zip_crc32: bool) -> None:
        self._storage, self._memory = storage, memory
        self._checksum, self._zip_crc32 = checksum, zip_crc32
        self._save: Any = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-memory", initializer=lower_this_thread)
        """One save copies at a time, in the order they were sealed, on one connection: the
        next one's reservation waits for the previous slot's commit anyway (the keeper holds
        one slot being written)."""
        self._files: dict[Any, list[tuple[str, Sequence[FilePlan], Sequence[str] | None, Future]]] = {}

    def pace(self, save: Any, begun_at: float, nbytes: int) -> None:
        self._save = save

    def hurry(self) -> None:
        pass

    def submit(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
               share: Any = None) -> Future:
        if share is not None:  # the adapters write a replicated file whole with the tier on
            raise PersistError(f"{path}: a share of a file cannot go to the keeper's memory, which holds "
                               "each node's files whole")
        future: Future = Future()
        self._files.setdefault(self._save, []).append((path, plans, part_names, future))
        return future

    def end(self, save: Any) -> Future:
        """``save`` has no more files on this rank: copy them all, in one reservation, on a
        writer thread. The future fails if any file did (each file's own future says which)."""
        files = self._files.pop(save, [])
        return self._thread.submit(self._write, save, files)

    def _write(self, save: Any, files: list) -> None:
        memory = self._memory
        names = {path: os.path.relpath(path, save.write_dir) for path, *_ in files}
        error: BaseException | None = None
        reservation = None
        try:
            sizes = {names[path]: file_size(plans) for path, plans, _, _ in files}
            reservation = memory.reserve(save, sizes)
        except BaseException as exc:  # each file still drains its copies, failing with it
            error = exc
        disk = None if memory.only(save) else self._storage
        written: dict[str, int] = {}
        for path, plans, part_names, future in files:
            rel = names[path]
            space = reservation.buffer(rel) if reservation is not None and error is None else None
            storage = SlotStorage(space, disk, error=error, name=f"{rel} of {save.tag}")
            try:
                entry: FileEntry = write_file(storage, path, plans, self._checksum, part_names=part_names,
                                              zip_crc32=self._zip_crc32)
            except BaseException as exc:
                error = error or exc
                future.set_exception(exc)
                continue
            written[rel] = entry.nbytes
            future.set_result(entry)
        if reservation is not None:
            if error is None:
                memory.report(reservation, written)
            else:
                reservation.close()
        if error is not None:
            raise error

    def write(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
              share: Any = None, stage: Callable[[TensorItem], None] | None = None) -> FileEntry:
        raise PersistError("the memory tier saves in async mode only")  # refused by the config

    def close(self) -> None:
        self._thread.shutdown(wait=True)
