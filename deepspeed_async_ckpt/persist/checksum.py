"""Checksums: the streaming hashers a manifest names (:data:`HASHERS`), the
:class:`ChecksumSink` that hashes a file's bytes while they are written, and
:func:`hash_ranges`, which hashes them again from storage when a checkpoint is verified.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import BinaryIO, Callable, Sequence

import xxhash

from ..storage import buffer_address

_READ_CHUNK = 8 * 1024 * 1024
_PART = 64 * 1024 * 1024
"""Bytes hashed and handed to the file at a time. Each part takes the GIL back from the
training thread (after the hash, which releases it): fewer parts, fewer hand-overs (measured
in docs/benchmarks.md, "Where the lost time goes")."""


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


class ChecksumSink:
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
