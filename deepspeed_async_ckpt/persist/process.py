""":class:`ProcessWriter`: files persisted by a worker process (config ``persist_in:
"process"``) instead of writer threads in the training interpreter.

The host pool is then in shared memory (:class:`~..snapshot.HostBufferPool` with
``shared=True``); the worker (:mod:`.worker`) maps its blocks and runs the same
:func:`~.writer.write_file` the writer threads run, so the files are byte for byte the same.
All the training process does per file is describe it (its archives' pickles, each record's
key and size), then say where each record's host copy lies in the pool as it is staged, and
release the buffers the worker is done with. So the hashing, the copies into the direct-I/O
stage, the writes and the fsyncs never hold its GIL nor take its cores' time slices from its
threads.

The worker is started with ``subprocess`` (fork and exec, as multiprocessing's ``spawn``
does, never a bare ``fork`` of a process that holds CUDA), running ``python -m
deepspeed_async_ckpt.persist.worker``: unlike multiprocessing's ``spawn`` and
``forkserver``, that does not import the training script again as ``__mp_main__`` (a script
without a ``__main__`` guard would start training a second time). It is started with the
checkpointer, so its imports are done by the first save. A worker that dies fails the files it
was writing, naming its exit code or signal (the save then fails and is reported at the next
``begin`` or ``wait``, the previous checkpoint stays the committed one); the next file starts
a new one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Executor, Future
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Callable, Sequence

import torch

from ..errors import AsyncCheckpointError, PersistError
from ..qos import lower_this_thread
from ..snapshot import FilePlan, HostBufferPool, TensorItem
from .messages import (Archive, FileWritten, ForgetBlock, MapBlock, RecordBytes, RecordFailed,
                       RecordStaged, Released, Stop, ToWorker, UseStorage, WriteFile)
from .pacing import PacedWrites, WritePacer
from .shares import Share
from .writer import FileEntry

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 60.0


def _exit_status(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _File:
    """A file in the worker's hands: its records (numbered across its archives, in file
    order) and which of them this process has handed over and released."""

    def __init__(self, items: list[TensorItem]) -> None:
        self.items = items
        self.result: Future = Future()
        self._lock = threading.Lock()
        self._sent: set[int] = set()
        self._released: set[int] = set()

    def sent(self, k: int) -> None:
        with self._lock:
            self._sent.add(k)

    def release(self, k: int) -> None:
        """Give record ``k``'s buffer back to the pool, once (the worker says so, or the file
        is over)."""
        with self._lock:
            if k in self._released:
                return
            self._released.add(k)
            self.items[k].release()

    def fail(self, exc: BaseException) -> None:
        """The worker is gone: the file failed, and the buffers it had are free again (a
        synchronous save may be waiting for pool room they hold)."""
        if not self.result.done():
            self.result.set_exception(exc)
        with self._lock:
            sent = sorted(self._sent)
        for k in sent:
            self.release(k)


class _WorkerProcess:
    """The training process's side of one worker process: the process, its connection, and the
    thread that reads its answers."""

    def __init__(self, storage: bytes, pool: HostBufferPool) -> None:
        self._pool = pool
        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "deepspeed_async_ckpt.persist.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._send_lock = threading.RLock()  # also keeps ``_blocks`` in step with what was sent
        self._lock = threading.Lock()
        self._files: dict[int, _File] = {}
        self._ids = itertools.count()
        self._blocks: set[int] = set()  # pool blocks the worker has mapped
        self.death: PersistError | None = None
        self._reader = threading.Thread(target=self._read, name="async-ckpt-persist-reader",
                                        daemon=True)
        self._reader.start()
        self._send(UseStorage(storage))

    # ------------------------------------------------------------------ to the worker
    def _send(self, *msgs: ToWorker, handle: int | None = None, data: Any = None) -> None:
        try:
            with self._send_lock:
                for msg in msgs:
                    self.conn.send(msg)
                if handle is not None:
                    send_handle(self.conn, handle, self.process.pid)
                if data is not None:
                    self.conn.send_bytes(data)
        except OSError:  # it died: say how, as the reader does
            self._reader.join(timeout=_STOP_TIMEOUT_S)
            raise self.death or PersistError(f"the persist worker process (pid {self.process.pid}) "
                                             "stopped answering") from None

    def open(self, path: str, plans: Sequence[FilePlan], part_names: Sequence[str] | None,
             share: Share | None, checksum: str, zip_crc32: bool, items: list[TensorItem]) -> tuple[int, _File]:
        entry = _File(items)
        with self._lock:
            if self.death is not None:
                raise self.death
            fid = next(self._ids)
            self._files[fid] = entry
        archives = tuple(Archive(plan.pickle_bytes, tuple((i.key, i.nbytes, i.what) for i in plan.items))
                         for plan in plans)
        self._send(WriteFile(fid, path, archives, checksum,
                             None if part_names is None else tuple(part_names), zip_crc32, share))
        return fid, entry

    def staged(self, fid: int, k: int, host: torch.Tensor) -> None:
        """Tell the worker where record ``k``'s host copy is: a place in the pool, or (a copy
        outside it: eager state) its bytes."""
        found = self._pool.locate(host) if host.numel() else None
        if found is None:
            self._send(RecordBytes(fid, k), data=host.numpy() if host.numel() else b"")
            return
        block, offset = found
        with self._send_lock:
            if block.id not in self._blocks:  # its first record: the worker maps it first
                self._send(MapBlock(block.id, block.size), handle=block.fd)
                self._blocks.add(block.id)
            self._send(RecordStaged(fid, k, block.id, offset))

    def failed(self, fid: int, k: int, message: str) -> None:
        self._send(RecordFailed(fid, k, message))

    def forget(self, block_id: int) -> None:
        """The pool dropped the block: the worker unmaps it too, so its memory goes."""
        with self._send_lock:
            if block_id not in self._blocks or self.death is not None:
                return
            self._blocks.discard(block_id)
            try:
                self._send(ForgetBlock(block_id))
            except PersistError:  # gone: its mapping went with it
                pass

    def stop(self) -> None:
        if self.death is None:
            try:
                self._send(Stop())
            except PersistError:
                pass
        try:
            self.process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("async checkpoint: the persist worker process (pid %d) did not stop "
                           "in %g s; killing it", self.process.pid, _STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=_STOP_TIMEOUT_S)
        self.conn.close()

    # ------------------------------------------------------------------ from the worker
    def _read(self) -> None:
        lower_this_thread()
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, Released):
                with self._lock:
                    entry = self._files.get(msg.file)
                if entry is not None:
                    entry.release(msg.record)
            elif isinstance(msg, FileWritten):
                with self._lock:
                    entry = self._files.pop(msg.file, None)
                if entry is None:
                    continue
                if msg.error is not None:
                    entry.result.set_exception(msg.error)
                else:
                    entry.result.set_result(msg.entry)
        try:
            code = self.process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        with self._lock:
            self.death = PersistError(
                f"the persist worker process (pid {self.process.pid}) {_exit_status(code)}: the "
                "files it was writing were not written (a new worker starts with the next save)")
            files, self._files = list(self._files.values()), {}
        for entry in files:
            entry.fail(self.death)


class ProcessWriter(PacedWrites):
    """A :class:`~.writer.FileWriter` that writes files in a worker process (see the
    module's description); the counterpart of :class:`~.writer.ThreadWriter`.

    ``storage`` (picklable) is what the worker writes with; ``pool``: the shared host pool
    the records are staged in; ``threads``: the writer threads, on which each file's records
    are handed to the worker as they are staged (one file per thread, as in thread mode);
    ``pacer``: paces that hand-over, record by record (the worker writes only what it holds).
    :meth:`close` stops the worker once the files in its hands are written."""

    def __init__(self, storage: Any, pool: HostBufferPool, threads: Executor, *, checksum: str,
                 zip_crc32: bool, pacer: WritePacer | None = None) -> None:
        super().__init__(pacer)
        if not pool.shared:
            raise ValueError("ProcessWriter needs a pool in shared memory (HostBufferPool(shared=True))")
        try:
            self._storage = pickle.dumps(storage)
        except Exception as exc:
            raise AsyncCheckpointError(
                f"async_checkpoint.persist_in 'process' sends the storage to the worker process, "
                f"but {type(storage).__name__} cannot be pickled: {exc}") from exc
        self._pool, self._threads = pool, threads
        self._checksum, self._zip_crc32 = checksum, zip_crc32
        self._lock = threading.Lock()
        # started now, so it is ready by the first save
        self._worker: _WorkerProcess | None = _WorkerProcess(self._storage, pool)
        pool.on_block_freed.append(self._forget)

    def submit(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
               share: Share | None = None) -> Future:
        """Write the file in the background; the future holds its :class:`FileEntry`."""
        return self._threads.submit(self.write, path, plans, part_names=part_names, share=share,
                                    pace=self.take())

    def write(self, path: str, plans: Sequence[FilePlan], *, part_names: Sequence[str] | None = None,
              share: Share | None = None, stage: Callable[[TensorItem], None] | None = None,
              pace: Callable[[int], None] | None = None) -> FileEntry:
        """Write the file and return its record, handing each record to the worker as it is
        staged (``stage``, when given, stages it first: the synchronous mode; ``pace``, when
        given, is called with its size first, see :meth:`~.pacing.Schedule.take`). Every
        record's buffer is back in the pool when this returns or raises."""
        items = [item for plan in plans for item in plan.items]
        owned = range(len(items)) if share is None else share.items(len(items))
        worker = self._current()
        entry = None
        try:
            fid, entry = worker.open(path, plans, part_names, share, self._checksum,
                                     self._zip_crc32, items)
            for k in owned:
                if entry.result.done():  # failed already: the worker waits for no more
                    break
                item = items[k]
                try:
                    if stage is not None:
                        stage(item)
                    host = item.wait_staged()
                except BaseException as exc:  # the worker fails the file at this record
                    with contextlib.suppress(PersistError):  # (or it died: the file failed)
                        worker.failed(fid, k, str(exc))
                    if not isinstance(exc, Exception):  # Ctrl-C: the save is abandoned
                        raise
                    break
                if pace is not None:
                    pace(item.nbytes)
                entry.sent(k)
                worker.staged(fid, k, host)
            return entry.result.result()
        finally:
            for k in owned:  # what the worker did not release (it failed, or died)
                if stage is not None:
                    items[k].cancel()
                if entry is not None:
                    entry.release(k)
                else:
                    items[k].release()

    def _current(self) -> _WorkerProcess:
        with self._lock:
            if self._worker is None:
                raise AsyncCheckpointError("the persist worker process was stopped (the checkpointer is closed)")
            if self._worker.death is not None:
                logger.warning("async checkpoint: %s; starting a new one", self._worker.death)
                old, self._worker = self._worker, _WorkerProcess(self._storage, self._pool)
                old.stop()
            return self._worker

    def _forget(self, block_id: int) -> None:
        worker = self._worker
        if worker is not None:
            worker.forget(block_id)

    def close(self) -> None:
        """Stop the worker, once it has written the files in its hands."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
