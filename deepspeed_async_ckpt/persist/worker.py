"""The persist worker: a process that writes the files a training process hands it, from the
host pool it shares with that process, so the training interpreter runs none of the writing,
checksumming or fsyncing.

Started by :class:`~.process.ProcessWriter` as ``python -m deepspeed_async_ckpt.persist.worker
FD``, ``FD`` being its end of a socket pair, over which both sides send the messages of
:mod:`.messages`: the storage first, pool blocks to map and forget, files to write and, as
each record is staged, where its host copy lies; it answers when a record's buffer may be
reused and when a file is written (a :class:`~.writer.FileEntry`) or failed. Each file is
written on a thread of its own by :func:`~.writer.write_file`, the function the writer threads
run, so both write the same bytes. The worker exits at once when the training process goes
away: nothing it writes then would be committed.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any, Callable

import torch

from ..errors import PersistError, SnapshotError, describe
from ..qos import lower_this_process
from ..snapshot import FilePlan
from .messages import (FileWritten, ForgetBlock, FromWorker, MapBlock, RecordBytes, RecordFailed,
                       RecordStaged, Released, Stop, UseStorage, WriteFile)
from .writer import write_file


class _Record:
    """A record of a file, as :func:`~.writer.write_file` sees a
    :class:`~..snapshot.TensorItem`: its host copy, a view of the shared pool, comes when
    the training process says it is staged."""

    __slots__ = ("key", "nbytes", "what", "host", "error", "_ready", "_release")

    def __init__(self, key: str, nbytes: int, what: str, release: Callable[[], None]) -> None:
        self.key, self.nbytes, self.what = key, nbytes, what
        self.host: torch.Tensor | None = None
        self.error: str | None = None
        self._ready = threading.Event()
        self._release: Callable[[], None] | None = release

    def staged(self, host: torch.Tensor | None, error: str | None = None) -> None:
        self.host, self.error = host, error
        self._ready.set()

    def wait_staged(self) -> torch.Tensor:
        self._ready.wait()
        if self.error is not None:
            raise SnapshotError(self.error)
        return self.host

    def cancel(self) -> None:
        """Nothing to cancel here: the training process stages."""

    def release(self) -> None:
        release, self._release, self.host = self._release, None, None
        if release is not None:
            release()


class _WriteLoop:
    """The worker process's side: reads the messages the training process sends, maps its
    blocks and writes the files it is asked to."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._storage: Any = None
        self._blocks: dict[int, torch.Tensor] = {}
        self._files: dict[int, list[_Record]] = {}
        self._threads: list[threading.Thread] = []

    def send(self, msg: FromWorker) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def run(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):  # the training process is gone: nothing will commit
                os._exit(1)
            if isinstance(msg, RecordStaged):
                record = self._files[msg.file][msg.record]
                record.staged(self._blocks[msg.block][msg.offset:msg.offset + record.nbytes])
            elif isinstance(msg, RecordBytes):
                data = self._conn.recv_bytes()
                self._files[msg.file][msg.record].staged(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                    else torch.empty(0, dtype=torch.uint8))
            elif isinstance(msg, RecordFailed):
                self._files[msg.file][msg.record].staged(None, msg.message)
            elif isinstance(msg, WriteFile):
                self._start_file(msg)
            elif isinstance(msg, MapBlock):
                self._map_block(msg.block, msg.nbytes, recv_handle(self._conn))
            elif isinstance(msg, ForgetBlock):
                self._blocks.pop(msg.block, None)  # unmapped with the last view of it
            elif isinstance(msg, UseStorage):
                self._storage = pickle.loads(msg.storage)
            elif isinstance(msg, Stop):
                for thread in self._threads:
                    thread.join()
                return
            else:
                raise TypeError(f"the persist worker was sent {msg!r}, not a message of "
                                "deepspeed_async_ckpt.persist.messages")

    def _map_block(self, block: int, nbytes: int, fd: int) -> None:
        try:  # faulted in now, once, rather than by the first file that reads it
            memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._blocks[block] = torch.frombuffer(memory, dtype=torch.uint8)

    def _start_file(self, msg: WriteFile) -> None:
        fid = msg.file
        records: list[_Record] = []
        plans = []
        for archive in msg.archives:
            mine = [_Record(key, nbytes, what, self._releaser(fid, len(records) + j))
                    for j, (key, nbytes, what) in enumerate(archive.records)]
            records += mine
            plans.append(FilePlan(archive.pickle_bytes, mine))
        self._files[fid] = records
        thread = threading.Thread(target=self._write, name=f"async-ckpt-persist-{fid}", daemon=True,
                                  args=(msg, plans))
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _releaser(self, fid: int, k: int) -> Callable[[], None]:
        return lambda: self.send(Released(fid, k))

    def _write(self, msg: WriteFile, plans: list[FilePlan]) -> None:
        entry, error = None, None
        try:
            entry = write_file(self._storage, msg.path, plans, msg.checksum, part_names=msg.part_names,
                               zip_crc32=msg.zip_crc32, share=msg.share)
        except BaseException as exc:
            error = exc
            try:
                pickle.dumps(exc)
            except Exception:
                error = PersistError(f"writing {msg.path} failed: {describe(exc)}")
        self._files.pop(msg.file, None)
        self.send(FileWritten(msg.file, entry, error))


def main(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group: the training process handles it (its exit
    # flush still needs this worker), so the worker ignores it and ends with Stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lower_this_process()  # below the training process, as its background threads are
    _WriteLoop(Connection(int(argv[1]))).run()


if __name__ == "__main__":
    main(sys.argv)
