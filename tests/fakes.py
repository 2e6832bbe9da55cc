"""Storage fakes shared by the tests: ``LocalStorage`` with one fault injected or one kind of
call recorded each. Faults: a disk that fills up (after a byte budget, for ``.pt`` files, for
small commit files), a slow disk, writes held until released, a failing commit step, no rename
exchange, a failing rank record, failing listings, directories that cannot be made, removals
refused. Records:
directory syncs and renames in order, listings counted. Tier fakes: a slow store
recording its writes, one that refuses every call, one whose uploads never answer. A record
exchange held in memory."""

import errno
import os
import threading
import time

from deepspeed_async_ckpt.commit import META_DIR
from deepspeed_async_ckpt.storage import LocalStorage
from deepspeed_async_ckpt.tiers.remote import PathRemote


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

    def swap(self, a, b):
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

    def swap(self, a, b):
        return False

    def replace(self, src, dst, *, durable=True):
        if self.fail and os.path.basename(src).startswith(".async_ckpt_staging."):
            raise OSError(errno.EIO, "Input/output error")
        super().replace(src, dst, durable=durable)


class RecordFailing(LocalStorage):
    """Rank 1's files are written; its record (the small file rank 0 waits for) is not."""

    def write_small(self, path, data, *, durable=True):
        if os.path.basename(path).startswith("rank_00001.") and ".json" in os.path.basename(path):
            raise OSError(errno.EIO, "Input/output error", path)
        return super().write_small(path, data, durable=durable)


class FullDisk(LocalStorage):
    """Every ``.pt`` file's open fails with ENOSPC while ``full``."""

    full = False

    def open_write(self, path):
        if self.full and ".pt" in os.path.basename(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super().open_write(path)


class SmallFileFull(LocalStorage):
    """The small commit files (rank records, manifest, pointer) whose names start with
    ``prefix`` fail with ENOSPC, left behind empty, as a full disk leaves them."""

    def __init__(self, prefix):
        super().__init__()
        self.prefix = prefix

    def write_small(self, path, data, *, durable=True):
        if os.path.basename(path).startswith(self.prefix):
            open(path, "wb").close()  # created, then the write fails, as on a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        super().write_small(path, data, durable=durable)


class HeldWrites(FailingStorage):
    """Every checkpoint data file's open waits (30 s at most) until ``released`` is set, so
    saves stay in flight while a test acts."""

    def __init__(self, budget=10**9):
        super().__init__(budget)
        self.released = threading.Event()

    def open_write(self, path):
        if f"/{META_DIR}/" not in path:
            self.released.wait(30)
        return super().open_write(path)


class ListingFailing(LocalStorage):
    """Every directory listing fails with EIO (rank 0's commit lists the ranks' records)."""

    def listdir(self, path):
        raise OSError(errno.EIO, "Input/output error", path)


class CountingListings(LocalStorage):
    """Counts directory listings in ``listings`` (a commit polls for records by listing)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.listings = 0

    def listdir(self, path):
        self.listings += 1
        return super().listdir(path)


class MakedirsRefused(LocalStorage):
    """Making a directory whose path ends with ``suffix`` fails with EACCES while ``refuse``."""

    def __init__(self, suffix="sub"):
        super().__init__()
        self.suffix, self.refuse = suffix, True

    def makedirs(self, path, *args, **kwargs):
        if self.refuse and path.endswith(self.suffix):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return super().makedirs(path, *args, **kwargs)


class RemovalsRefused(LocalStorage):
    """While ``refuse`` (True: every path; a set: those paths), every removal (of a tree, a
    file, an empty directory) and every rename for deletion (to ``.async_ckpt_removing.*``)
    fails with EACCES, as in a directory this process may not change; ``refused`` lists the
    paths."""

    def __init__(self):
        super().__init__()
        self.refuse, self.refused = True, []

    def _check(self, path):
        if self.refuse is True or (self.refuse and path in self.refuse):
            self.refused.append(path)
            raise PermissionError(errno.EACCES, "Permission denied", path)

    def remove_tree(self, path):
        self._check(path)
        super().remove_tree(path)

    def remove_dir(self, path):
        self._check(path)
        super().remove_dir(path)

    def replace(self, src, dst, *, durable=True):
        if os.path.basename(dst).startswith(".async_ckpt_removing."):
            self._check(src)
        super().replace(src, dst, durable=durable)


class RecordingStorage(LocalStorage):
    """Records in ``events``, in order and with absolute paths, ``("sync", directory)`` for
    each directory fsync (a durable rename's included) and ``("rename", destination)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def sync_dir(self, path):
        self.events.append(("sync", os.path.abspath(path)))
        super().sync_dir(path)

    def replace(self, src, dst, *, durable=True):
        super().replace(src, dst, durable=durable)
        if durable:  # fsyncs dst's directory
            self.events.append(("sync", os.path.dirname(os.path.abspath(dst))))
        self.events.append(("rename", os.path.abspath(dst)))


class MemoryExchange:
    """A :class:`~deepspeed_async_ckpt.commit.RecordExchange` in memory: ``records`` (rank ->
    record) and ``failures`` (rank -> message) as the ranks left them, and in ``told`` what
    rank 0 said to the other nodes."""

    node_local = False

    def __init__(self):
        self.records, self.failures, self.told = {}, {}, []

    def publish(self, ckpt_dir, record):
        self.records[record["rank"]] = record

    def fail(self, ckpt_dir, *, rank, save_id, message):
        self.failures[rank] = message

    def look(self, ckpt_dir, *, save_id, world_size):
        missing = [r for r in range(world_size) if r not in self.records]
        return not missing, [r for r in missing if r in self.failures]

    def reason(self, ckpt_dir, *, save_id, rank):
        return self.failures[rank]

    def missing(self, ckpt_dir, *, save_id, world_size):
        return [r for r in range(world_size) if r not in self.records]

    def read(self, ckpt_dir, *, tag, save_id, world_size, checksum):
        return {r: self.records[r] for r in range(world_size)}

    def discard(self, *, save_id, world_size):
        self.records.clear()

    def tell_nodes(self, save_id, manifests, late):
        self.told.append(("committed", save_id, sorted(manifests)))

    def tell_nodes_failed(self, save_id, message):
        self.told.append(("failed", save_id, message))


class GatedRemote(PathRemote):
    """A path tier whose uploads wait for ``gate`` (a slow remote), recording every write;
    ``started`` is set at its first read (a drain reads the tier's pointer before it uploads)."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.writes = []

    def put_file(self, local_path, key):
        self.gate.wait(60)
        self.writes.append(key)
        super().put_file(local_path, key)

    def put_bytes(self, key, data):
        self.writes.append(key)
        super().put_bytes(key, data)

    def get_bytes(self, key):
        self.started.set()
        return super().get_bytes(key)


class DeadRemote(PathRemote):
    """A path tier whose every write and read is refused while ``dead`` (a store that went
    away), counting the refusals in ``refused``."""

    def __init__(self, root):
        super().__init__(root)
        self.dead, self.refused = False, 0

    def _refuse(self):
        if self.dead:
            self.refused += 1
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused", self.root)

    def put_file(self, local_path, key):
        self._refuse()
        super().put_file(local_path, key)

    def put_bytes(self, key, data):
        self._refuse()
        super().put_bytes(key, data)

    def get_bytes(self, key):
        self._refuse()
        return super().get_bytes(key)


class HungRemote(PathRemote):
    """A path tier whose uploads never answer (until ``answer`` is set, 120 s at most)."""

    def __init__(self, root):
        super().__init__(root)
        self.answer = threading.Event()

    def put_file(self, local_path, key):
        self.answer.wait(120)
        super().put_file(local_path, key)
