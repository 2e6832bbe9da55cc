"""Small files replaced whole: the records, the manifest, the pointer.

Every rank writes its record through :func:`write_text_atomic`; rank 0 writes the manifest, the
record of late files and the pointer (``latest``) with it. A reader sees the old file or the
new one, never a part.
"""

from __future__ import annotations

import os

from ..storage import Storage, temporary_path


def write_text_atomic(storage: Storage, path: str, text: str | bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``text`` (or bytes): temp file, fsync, rename, fsync of the
    directory. ``durable=False``: temp file and rename only, for what others must see whole but
    a crash may lose (a rank's record: see :func:`.records.write_rank_record`)."""
    tmp = temporary_path(path, os.getpid())
    try:
        storage.write_small(tmp, text.encode() if isinstance(text, str) else text, durable=durable)
        storage.replace(tmp, path, durable=durable)
    except OSError as exc:  # a full disk, say: no temporary left, and the file named
        try:
            storage.remove_tree(tmp)
        except Exception:  # the write's error is the one to raise
            pass
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), path) from exc
        raise
