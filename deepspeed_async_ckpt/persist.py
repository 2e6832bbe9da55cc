"""Stage 2 of 3: persist (host copies -> storage), run by background writer threads.

Each file is written in ``torch.save``'s zip format with torch's own writer
(``torch._C.PyTorchFileWriter``), record by record as the snapshot stage delivers them, so a file
larger than the host pool streams through it. Files stay ``torch.load``-compatible: DeepSpeed's
``zero_to_fp32.py`` and ``ds_to_universal.py`` read them unchanged.

A file is written under a temporary name, checksummed while the bytes go out, fsynced, then
renamed: a crash never leaves a half-written file under the final name.

A file may also pack several archives back to back, each starting on a page (megatron-core's
``.distcp`` files hold many items, each a ``torch.save`` archive found by offset and length).

And a file that several ranks hold alike (DeepSpeed's model states, on every data-parallel
replica) may be written by all of them at once, each a :class:`Share`: a run of its records
and the bytes around them, under one temporary name that the commit renames.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Sequence

import torch
import xxhash

from .errors import PersistError, describe
from .snapshot import FilePlan, TensorItem
from .storage import DIRECT_ALIGN, Storage, buffer_address, temporary_path

_READ_CHUNK = 8 * 1024 * 1024
_PART = 8 * 1024 * 1024
#: Linux's MAP_NORESERVE, which Python's mmap module names only from 3.13 on: without it the
#: never-touched mapping of :class:`_Phantom` counted against the commit limit.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says about one persisted file."""

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


@dataclass(frozen=True)
class Share:
    """One rank's part of a file that ``len(cuts) + 1`` ranks write together, each planning
    the same archive: share ``index`` holds the records from ``cuts[index - 1]`` (0 for the
    first) up to ``cuts[index]`` (the end for the last), as item indices of the plan. In bytes,
    a share runs from the start of its first record's data (0 for the first share, which thus
    also writes the headers and the pickle) to the start of the next share's (the end of the
    file for the last, which writes the zip directory): every boundary is on a page, so each
    rank writes whole pages of its own, directly."""

    index: int
    cuts: tuple[int, ...]
    tmp: str

    def items(self, n_items: int) -> range:
        """Indices of the plan's items (of ``n_items``) that this share writes."""
        bounds = (0, *self.cuts, n_items)
        return range(bounds[self.index], bounds[self.index + 1])


def split_items(sizes: Sequence[int], shares: int) -> tuple[int, ...]:
    """Cuts (see :class:`Share`) for at most ``shares`` contiguous runs of items of about equal
    bytes: an item starts a new share when its middle lies past the next ``1/shares`` of the
    total. Items of 0 bytes never start one (their data has no offset of its own). Fewer runs
    come back when there are too few items to go round."""
    total = sum(sizes)
    cuts: list[int] = []
    before = 0
    for j, n in enumerate(sizes):
        if j and n and len(cuts) < shares - 1 and before + n / 2 > total * (len(cuts) + 1) / shares:
            cuts.append(j)
        before += n
    return tuple(cuts)


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


class _Crc32:
    """zlib's CRC-32 behind hashlib's ``update``/``hexdigest`` interface."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


class _NoHash:
    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


#: Checksum name (config ``checksum``, manifest ``checksum``) -> a new streaming hasher. Every
#: one releases the GIL while it hashes a large buffer. xxh128 reads memory at memory speed
#: (33 GB/s here, vs 6 GB/s for zlib's crc32) and its hex digest is what ``xxh128sum`` prints.
HASHERS: dict[str, Callable[[], object]] = {
    "xxh128": xxhash.xxh3_128,
    "crc32": _Crc32,
    "sha256": hashlib.sha256,
    "none": _NoHash,
}


def new_hasher(algorithm: str):
    """A streaming hasher (``update``/``hexdigest``) for a checksum name of :data:`HASHERS`."""
    return HASHERS[algorithm]()


class _ChecksumSink:
    """The file object handed to torch's zip writer: hashes and counts every byte written.

    Bytes inside :attr:`stable` (the host buffer of the record being written, which stays
    untouched until its writes are done) go to the file's ``write_stable`` where it has one
    (:class:`~.storage.DirectFile`: written in place, asynchronously); everything else is
    written with ``write``, which is done with the bytes when it returns.

    An exception must never cross torch's C++ writer: it would leave the archive's offsets
    inconsistent and the writer's destructor would abort the process. So a failed write is
    recorded, later bytes are discarded (reported as written), and :meth:`check` raises it from
    Python between records.
    """

    def __init__(self, f: BinaryIO, algorithm: str, window: tuple[int, int] | None = None) -> None:
        self._f = f
        self._write_stable = getattr(f, "write_stable", None)
        self.hasher = new_hasher(algorithm)
        self.nbytes = 0
        """Bytes the archive writer produced so far: the offset of the next one in the file."""
        self.window = window
        """A share's [start, end) offsets: only those bytes are hashed and written to ``f``."""
        self.error: BaseException | None = None
        self.discard = False
        self.stable: tuple[int, int] | None = None
        """[start, end) addresses of a buffer that stays unchanged until the file's writes
        are done."""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.discard:
            return len(view)
        start = self.nbytes
        self.nbytes += len(view)
        if self.window is None:
            self._write(view)
        else:  # a share: what lies outside it is another rank's
            lo, hi = max(start, self.window[0]), min(self.nbytes, self.window[1])
            if lo < hi:
                self._write(view[lo - start:hi - start])
        return len(view)

    def _write(self, view: memoryview) -> None:
        write = self._f.write
        if self._write_stable is not None and self.stable is not None and len(view):
            addr = buffer_address(view)
            if self.stable[0] <= addr and addr + len(view) <= self.stable[1]:
                write = self._write_stable
        try:
            # In parts, so the file (DirectFile) writes one part while the next is hashed.
            for start in range(0, len(view), _PART):
                part = view[start:start + _PART]
                self.hasher.update(part)
                while len(part):
                    n = write(part)
                    if not n:
                        raise OSError(f"short write to {getattr(self._f, 'name', '?')}")
                    part = part[n:]
        except BaseException as exc:
            self.error, self.discard = exc, True

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def flush(self) -> None:
        pass


def write_file(storage: Storage, path: str, plans: Sequence[FilePlan], checksum: str, *,
               part_names: Sequence[str] | None = None, zip_crc32: bool = False,
               stage: Callable[[TensorItem], None] | None = None,
               share: Share | None = None) -> FileRecord:
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
            sink = _ChecksumSink(f, checksum)
        else:
            starts, size = _layout(plans[0])
            bounds = (0, *(starts[j] for j in share.cuts), size)
            window = (bounds[share.index], bounds[share.index + 1])
            f = storage.open_write_at(tmp, window[0])
            sink = _ChecksumSink(f, checksum, window)
        try:
            for plan in plans:
                if sink.nbytes % DIRECT_ALIGN:  # the next archive starts on a page
                    sink.write(bytes(DIRECT_ALIGN - sink.nbytes % DIRECT_ALIGN))
                    sink.check()
                start = sink.nbytes
                _write_archive(sink, f, plan, pending, zip_crc32, stage, owned)
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
            return FileRecord(path=path, nbytes=size, checksum=sink.hasher.hexdigest(),
                              segment=(window[0], window[1] - window[0]), tmp=tmp)
        storage.replace(tmp, path)
        if part_names is not None:
            return FileRecord(path=path, nbytes=sink.nbytes, checksum="",
                              parts=dict(zip(part_names, spans)), part_checksums=tuple(sums))
        return FileRecord(path=path, nbytes=sink.nbytes, checksum=sink.hasher.hexdigest())
    except BaseException as exc:
        for item in pending:
            if stage is not None:
                item.cancel()
            item.release()
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, PersistError) or not isinstance(exc, Exception):  # Ctrl-C stays Ctrl-C
            raise
        raise PersistError(f"writing {path} failed: {describe(exc)}") from exc


def _write_archive(sink: _ChecksumSink, f: BinaryIO, plan: FilePlan, pending: list[TensorItem],
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


def _layout(plan: FilePlan) -> tuple[list[int | None], int]:
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


def _header_records(pickle_bytes: bytes) -> list[tuple[str, bytes | str]]:
    # The same records, in the same order, as torch.serialization._save writes. Record data is
    # aligned to pages rather than torch's default 64 bytes, so it can be written directly.
    return [("data.pkl", pickle_bytes), (".format_version", "1"),
            (".storage_alignment", str(DIRECT_ALIGN)), ("byteorder", sys.byteorder)]


def hash_ranges(path: str, algorithm: str, ranges: Sequence[tuple[int, int | None]]) -> list[tuple[int, str]]:
    """(size in bytes, checksum) of each (offset, length) of ``ranges`` of a file on storage
    (length None: to the end; the size is how many bytes there were), read in 8 MiB chunks,
    the file opened once."""
    out = []
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        for offset, length in ranges:
            hasher = new_hasher(algorithm)
            size = 0
            left = length
            f.seek(offset)
            while left is None or left > 0:
                n = f.readinto(view if left is None or left >= len(buf) else view[:left])
                if not n:
                    break
                hasher.update(view[:n])
                size += n
                if left is not None:
                    left -= n
            out.append((size, hasher.hexdigest()))
    return out


# --------------------------------------------------------------------------- safetensors
SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
                      torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
                      torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
"""The dtypes :func:`write_safetensors` writes, with their names in the format, in the order
in which the ``safetensors`` library lays tensors out (its ``Dtype`` enum, reversed)."""
_SAFETENSORS_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}


def safetensors_writable(tensors: dict, metadata: Any = None) -> bool:
    """Whether :func:`write_safetensors` can write ``tensors`` and ``metadata`` as
    ``safetensors.torch.save_file`` would: string names of dense CPU tensors of a known dtype,
    contiguous, no two sharing memory, and metadata None or strings to strings (that function
    refuses anything else, with its own errors, which callers leave it to raise: until session
    30 an integer in the metadata, or an integer name, was written into a file that function
    would not have written, and which ``safe_open`` refuses)."""
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        return False
    seen = set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            return False
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type != "cpu" \
                or t.dtype not in SAFETENSORS_DTYPES or not t.is_contiguous():
            return False
        if t.numel():
            storage = t.untyped_storage().data_ptr()
            if storage in seen:
                return False
            seen.add(storage)
    return True


def write_safetensors(f: BinaryIO, tensors: dict, metadata: dict | None = None) -> None:
    """Write ``tensors`` to ``f`` in the safetensors format (an 8-byte little-endian header
    length, the JSON header padded with spaces to 8 bytes, then every tensor's bytes, packed),
    the bytes ``safetensors.torch.save_file`` writes, from the tensors' memory to ``f``: no copy
    of them in between, and with :class:`~.storage.DirectFile` no page cache (that function
    writes through it, which cost 0.55 s of CPU for 0.37 GB here against 0.02-0.14 s). Tensors
    are laid out as that library lays them out: by dtype (larger elements first), then by name,
    so every one is aligned in the file and the file is byte for byte that library's (tested).
    ``tensors`` and ``metadata`` must pass :func:`safetensors_writable`."""
    import json
    import struct

    order = sorted(tensors, key=lambda name: (_SAFETENSORS_RANK[tensors[name].dtype], name))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)) + text)
    for name in order:
        t = tensors[name]
        if t.numel():
            f.write(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
