"""Storage fakes shared by the tests: ``LocalStorage`` with one fault injected each (a full
disk, a slow disk, a failing commit step, no rename exchange, a failing record)."""

import errno
import os
import time

from deepspeed_async_ckpt.commit import META_DIR
from deepspeed_async_ckpt.storage import LocalStorage


class FailingStorage(LocalStorage):
    """Raises ENOSPC once `budget` bytes of checkpoint data were written."""

    def __init__(self, budget):
        super().__init__(fsync=True)
        self.budget = budget

    def open_write(self, path):
        f = super().open_write(path)
        storage = self

        class W:
            def write(self, data, write=f.write):
                storage.budget -= len(memoryview(data).cast("B"))
                if storage.budget < 0 and f"/{META_DIR}/" not in path and not path.endswith(("latest.tmp." + str(os.getpid()),)):
                    raise OSError(errno.ENOSPC, "No space left on device")
                return write(data)

            if hasattr(f, "write_stable"):
                def write_stable(self, data):
                    return self.write(data, write=f.write_stable)

            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *a):
                f.close()

        return W()


class NoExchangeStorage(FailingStorage):
    """A filesystem without ``renameat2(RENAME_EXCHANGE)`` (NFS, say): two renames instead."""

    def exchange(self, a, b):
        return False


class SlowStorage(FailingStorage):
    """A disk slower than the saves: each write of checkpoint data sleeps first."""

    def __init__(self, delay_s):
        super().__init__(budget=10**12)
        self.delay_s = delay_s

    def open_write(self, path):
        f = super().open_write(path)
        write, delay_s = f.write, self.delay_s

        def slow(data, **kw):
            if f"/{META_DIR}/" not in path:
                time.sleep(delay_s)
            return write(data, **kw)

        f.write = slow
        return f


class FailingAfter(LocalStorage):
    """Fails one step of the commit: ``"pointer"`` (its temporary file: ENOSPC, nothing
    renamed), ``"pointer_fsync"`` (the directory fsync after its rename: EIO)."""

    def __init__(self):
        super().__init__(fsync=True)
        self.where = None

    def write_small(self, path, data, *, durable=True):
        if self.where == "pointer" and os.path.basename(path).startswith("latest"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_small(path, data, durable=durable)

    def replace(self, src, dst, *, durable=True):
        super().replace(src, dst, durable=durable)
        if self.where == "pointer_fsync" and os.path.basename(dst) == "latest":
            raise OSError(errno.EIO, "Input/output error")


class NoExchangeFailingRename(LocalStorage):
    """No ``renameat2`` exchange (NFS), and the staged directory's rename into place fails."""

    def __init__(self):
        super().__init__(fsync=True)
        self.fail = False

    def exchange(self, a, b):
        return False

    def replace(self, src, dst, *, durable=True):
        if self.fail and os.path.basename(src).startswith(".async_ckpt_staging."):
            raise OSError(errno.EIO, "Input/output error")
        super().replace(src, dst, durable=durable)


class _RecordFails(LocalStorage):
    """Rank 1's files are written; its record (the small file rank 0 waits for) is not."""

    def write_small(self, path, data, *, durable=True):
        if os.path.basename(path).startswith("rank_00001.") and ".json" in os.path.basename(path):
            raise OSError(errno.EIO, "Input/output error", path)
        return super().write_small(path, data, durable=durable)


class _FullDisk(LocalStorage):
    """Every ``.pt`` file's open fails with ENOSPC while ``full``."""

    full = False

    def open_write(self, path):
        if self.full and ".pt" in os.path.basename(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super().open_write(path)
