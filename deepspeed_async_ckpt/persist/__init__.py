"""Stage 2 of 3: persist (host copies -> storage), run by background writer threads, or by a
worker process.

Each file is written in ``torch.save``'s zip format with torch's own writer, record by record as
the snapshot stage delivers them, so a file larger than the host pool streams through it.
Files stay ``torch.load``-compatible: DeepSpeed's ``zero_to_fp32.py`` and ``ds_to_universal.py``
read them unchanged. Each is written under a temporary name, checksummed while the bytes go
out, fsynced, then renamed.

- :mod:`.writer`: :func:`write_file`, one file to storage, and its :class:`FileEntry`;
  :class:`FileWriter`, how the core hands files over; :class:`ThreadWriter` runs
  :func:`write_file` on the writer threads.
- :mod:`.pacing`: a save's writes spread over the save interval (config ``pace_writes``).
- :mod:`.process`: :class:`ProcessWriter` runs it in a worker process (:mod:`.worker`),
  from the host pool in shared memory (config ``persist_in: "process"``).
- :mod:`.archive`: one ``torch.save`` archive, record by record, laid out on pages.
- :mod:`.shares`: a file that several ranks write at once, each a :class:`Share` of it.
- :mod:`.checksum`: the hashers (:data:`HASHERS`), the sink that hashes while writing, and
  :func:`hash_ranges` for verification.
- :mod:`.safetensors`: :func:`write_safetensors`, for files written beside a checkpoint.

The commit stage (:mod:`..commit`) renames shared files and records every file in the manifest.
"""

from .archive import check_torch_writer
from .checksum import HASHERS, hash_ranges, new_hasher
from .safetensors import SAFETENSORS_DTYPES, safetensors_writable, write_safetensors
from .shares import Share, split_items
from .process import ProcessWriter
from .writer import FileEntry, FileWriter, ThreadWriter, write_file

__all__ = [
    "HASHERS",
    "SAFETENSORS_DTYPES",
    "FileEntry",
    "FileWriter",
    "ProcessWriter",
    "Share",
    "ThreadWriter",
    "check_torch_writer",
    "hash_ranges",
    "new_hasher",
    "safetensors_writable",
    "split_items",
    "write_file",
    "write_safetensors",
]
