"""The persist worker: a process that writes the files a training process hands it, from the
host pool it shares with that process, so the training interpreter runs none of the writing,
checksumming or fsyncing.

Started by :class:`~.process.ProcessWriter` as ``python -m deepspeed_async_ckpt.persist.worker
FD``, ``FD`` being its end of a socket pair. It reads, in order:

- ``("storage", pickled_storage)``: first, the :class:`~..storage.Storage` to write with;
- ``("block", id, nbytes)`` followed by the block's memory file (``SCM_RIGHTS``): a pool block,
  mapped here until ``("forget", id)``;
- ``("file", file_id, path, archives, checksum, part_names, zip_crc32, share)``: a file to
  write, ``archives`` being ``(pickle_bytes, [(key, nbytes, what), ...])`` per archive; its
  records are numbered across the archives, in file order;
- ``("staged", file_id, k, block_id, offset)``: record ``k``'s host copy is in the pool;
  ``("bytes", file_id, k)`` followed by its bytes (a copy outside the pool: eager state);
  ``("failed", file_id, k, message)``: it could not be staged;
- ``("stop",)``: finish the files in hand, then exit.

It answers ``("released", file_id, k)`` once record ``k``'s buffer may be reused, and
``("done", file_id, record, error)`` once a file is written (a :class:`~.writer.FileRecord`)
or failed. Each file is written on a thread of its own by :func:`~.writer.write_file`, the
function the writer threads run, so both write the same bytes. The worker exits at once when
the training process goes away: nothing it writes then would be committed.
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


class _Worker:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._storage: Any = None
        self._blocks: dict[int, torch.Tensor] = {}
        self._files: dict[int, list[_Record]] = {}
        self._threads: list[threading.Thread] = []

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def run(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):  # the training process is gone: nothing will commit
                os._exit(1)
            kind = msg[0]
            if kind == "staged":
                _, fid, k, block, offset = msg
                record = self._files[fid][k]
                record.staged(self._blocks[block][offset:offset + record.nbytes])
            elif kind == "bytes":
                data = self._conn.recv_bytes()
                self._files[msg[1]][msg[2]].staged(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                    else torch.empty(0, dtype=torch.uint8))
            elif kind == "failed":
                self._files[msg[1]][msg[2]].staged(None, msg[3])
            elif kind == "file":
                self._start_file(*msg[1:])
            elif kind == "block":
                self._map_block(msg[1], msg[2], recv_handle(self._conn))
            elif kind == "forget":
                self._blocks.pop(msg[1], None)  # unmapped with the last view of it
            elif kind == "storage":
                self._storage = pickle.loads(msg[1])
            elif kind == "stop":
                for thread in self._threads:
                    thread.join()
                return

    def _map_block(self, block: int, nbytes: int, fd: int) -> None:
        try:  # faulted in now, once, rather than by the first file that reads it
            memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._blocks[block] = torch.frombuffer(memory, dtype=torch.uint8)

    def _start_file(self, fid: int, path: str, archives: list, checksum: str,
                    part_names: list[str] | None, zip_crc32: bool, share: Any) -> None:
        records: list[_Record] = []
        plans = []
        for pickle_bytes, described in archives:
            mine = [_Record(key, nbytes, what, self._releaser(fid, len(records) + j))
                    for j, (key, nbytes, what) in enumerate(described)]
            records += mine
            plans.append(FilePlan(pickle_bytes, mine))
        self._files[fid] = records
        thread = threading.Thread(target=self._write, name=f"async-ckpt-persist-{fid}", daemon=True,
                                  args=(fid, path, plans, checksum, part_names, zip_crc32, share))
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _releaser(self, fid: int, k: int) -> Callable[[], None]:
        return lambda: self.send(("released", fid, k))

    def _write(self, fid: int, path: str, plans: list, checksum: str, part_names: list[str] | None,
               zip_crc32: bool, share: Any) -> None:
        record, error = None, None
        try:
            record = write_file(self._storage, path, plans, checksum, part_names=part_names,
                                zip_crc32=zip_crc32, share=share)
        except BaseException as exc:
            error = exc
            try:
                pickle.dumps(exc)
            except Exception:
                error = PersistError(f"writing {path} failed: {describe(exc)}")
        self._files.pop(fid, None)
        self.send(("done", fid, record, error))


def main(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group: the training process handles it (its exit
    # flush still needs this worker), so the worker ignores it and ends with ("stop",).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lower_this_process()  # below the training process, as its background threads are
    _Worker(Connection(int(argv[1]))).run()


if __name__ == "__main__":
    main(sys.argv)
