"""One ``torch.save`` archive, written record by record with torch's own zip writer
(``torch._C.PyTorchFileWriter``) as the snapshot stage delivers each record's host copy, so an
archive larger than the host pool streams through it.

Record data is laid out on pages (``.storage_alignment`` is :data:`~..storage.DIRECT_ALIGN`),
so every record can be written directly from its pool buffer. :func:`layout` finds where each
record's data will start before anything is written: a file that several ranks write together
(:mod:`.shares`) is cut at those offsets.
"""

from __future__ import annotations

import mmap
import sys
from typing import BinaryIO, Callable

import torch

from ..errors import PersistError
from ..snapshot import FilePlan, TensorItem
from ..storage import DIRECT_ALIGN, buffer_address
from .checksum import ChecksumSink

#: Linux's MAP_NORESERVE, which Python's mmap module names only from 3.13 on: without it the
#: never-touched mapping of :class:`_Phantom` would count against the commit limit.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def check_torch_writer() -> None:
    """Raise ``PersistError`` unless torch's zip writer takes a storage alignment (the third
    argument of ``torch._C.PyTorchFileWriter``, which lays record data out on pages for
    direct I/O): older torch releases have no such argument, and every save would fail."""
    import io

    try:
        torch._C.PyTorchFileWriter(io.BytesIO(), False, DIRECT_ALIGN)
    except TypeError as exc:
        raise PersistError(f"torch {torch.__version__} is too old for this engine: its zip writer "
                           f"takes no storage alignment ({exc}); install torch 2.7 or later") from None


def _header_records(pickle_bytes: bytes) -> list[tuple[str, bytes | str]]:
    # The same records, in the same order, as torch.serialization._save writes. Record data is
    # aligned to pages rather than torch's default 64 bytes, so it can be written directly.
    return [("data.pkl", pickle_bytes), (".format_version", "1"),
            (".storage_alignment", str(DIRECT_ALIGN)), ("byteorder", sys.byteorder)]


def write_archive(sink: ChecksumSink, f: BinaryIO, plan: FilePlan, pending: list[TensorItem],
                  zip_crc32: bool, stage: Callable[[TensorItem], None] | None,
                  owned: range | None = None) -> None:
    """One ``torch.save`` archive of ``plan`` into ``sink``; each item leaves ``pending`` (the
    file's items not yet handed back) once written. Items outside ``owned`` (when given) are
    another share's: their records are laid out from a stand-in buffer, never read."""
    writer = None
    phantom = None
    try:
        writer = torch._C.PyTorchFileWriter(sink, zip_crc32, DIRECT_ALIGN)
        for name, value in _header_records(plan.pickle_bytes):
            writer.write_record(name, value, len(value))
            sink.check()
        for j, item in enumerate(plan.items):
            if owned is not None and j not in owned:
                phantom = phantom if phantom is not None else _Phantom(plan)
                writer.write_record(f"data/{item.key}", phantom.storage(item.nbytes), item.nbytes)
                continue
            if stage is not None:
                stage(item)
            host = item.wait_staged()
            # the host buffer may be a slice of a larger pool block: write just its bytes
            start = host.storage_offset()
            sink.stable = (host.data_ptr(), host.data_ptr() + item.nbytes)
            writer.write_record(f"data/{item.key}",
                                host.untyped_storage()[start:start + item.nbytes], item.nbytes)
            sink.stable = None
            _release_when_written(f, pending.pop(0))  # ``item``: written in order
            sink.check()
        writer.write_end_of_file()
        sink.check()
    except BaseException:
        sink.discard = True  # what the writer's destructor writes now goes nowhere
        raise
    finally:
        del writer


def _release_when_written(f: BinaryIO, item: TensorItem) -> None:
    """Return ``item``'s host buffer to the pool once the file's writes of it are done: at
    once for files that copy what they are given, else when the I/O thread gets there, so
    the writer hashes the next record meanwhile. (On failure, closing the file waits for the
    I/O thread, so every buffer still comes back.)"""
    barrier = getattr(f, "barrier", None)
    if barrier is None:
        item.release()
    else:
        barrier().add_done_callback(lambda _done: item.release())


class _Phantom:
    """Stands in for the bytes of records this rank does not write: the archive writer needs
    a buffer of each record's size to lay the file out, and hands it to the sink, which drops
    it unread. An anonymous mapping of the largest record, never touched: no memory."""

    def __init__(self, plan: FilePlan) -> None:
        largest = max((i.nbytes for i in plan.items), default=0)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self.base = torch.frombuffer(mmap.mmap(-1, max(largest, 1), flags=flags), dtype=torch.uint8)

    def storage(self, nbytes: int):
        return self.base.untyped_storage()[0:nbytes]


class _Counter:
    """The sink of a layout pass: counts bytes, and notes where the write of ``expect`` (a
    record's stand-in data: address, length) starts."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.expect: tuple[int, int] | None = None
        self.found: int | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.expect is not None and len(view) == self.expect[1] \
                and buffer_address(view) == self.expect[0]:
            self.found = self.nbytes
        self.nbytes += len(view)
        return len(view)

    def flush(self) -> None:
        pass


def layout(plan: FilePlan) -> tuple[list[int | None], int]:
    """Where each item's data starts in ``plan``'s archive (None for 0 bytes), and its size:
    the archive written with stand-in data into a sink that only counts (no zip CRCs)."""
    counter, phantom, starts = _Counter(), _Phantom(plan), []
    writer = torch._C.PyTorchFileWriter(counter, False, DIRECT_ALIGN)
    try:
        for name, value in _header_records(plan.pickle_bytes):
            writer.write_record(name, value, len(value))
        for item in plan.items:
            counter.expect, counter.found = (phantom.base.data_ptr(), item.nbytes), None
            writer.write_record(f"data/{item.key}", phantom.storage(item.nbytes), item.nbytes)
            starts.append(counter.found if item.nbytes else None)
        counter.expect = None
        writer.write_end_of_file()
    finally:
        del writer
    if any(s is None or s % DIRECT_ALIGN for s, i in zip(starts, plan.items) if i.nbytes):
        raise PersistError(f"{plan.items[0].what}: records not laid out on pages: {starts}")
    return starts, counter.nbytes
