"""Storage: the filesystem under the persist and commit stages.

- :mod:`.protocol`: the :class:`Storage` seam both stages use, and the temporary names files
  are written under before their rename.
- :mod:`.local`: :class:`LocalStorage`, the POSIX implementation (fsync, atomic renames and
  directory swaps).
- :mod:`.files`: the buffered file objects it opens (:class:`WholeFile`,
  :class:`WriteBehindFile`).
- :mod:`.direct`: direct I/O: page-aligned host memory (:func:`host_buffer`, also the snapshot
  pool's memory, or :func:`shared_host_buffer` where another process writes it) and :class:`DirectFile`.
"""

from .direct import (DIRECT_ALIGN, DirectFile, aligned_size, buffer_address, host_buffer,
                     shared_host_buffer)
from .buffered import WholeFile, WriteBehindFile
from .local import LocalStorage
from .protocol import Storage, is_temporary, temporary_path

__all__ = [
    "DIRECT_ALIGN",
    "DirectFile",
    "LocalStorage",
    "Storage",
    "WholeFile",
    "WriteBehindFile",
    "aligned_size",
    "buffer_address",
    "host_buffer",
    "shared_host_buffer",
    "is_temporary",
    "temporary_path",
]
