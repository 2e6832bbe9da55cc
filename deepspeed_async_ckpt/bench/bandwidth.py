"""What bounds the persist path: per-byte costs of its steps and the storage's sequential write
bandwidth under the engine's fsync policy (fio where installed, else a plain large-file write).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import statistics
import subprocess
import time
import zlib

from deepspeed_async_ckpt.bench.sizing import GB


def _median_rate(fn, nbytes: int, reps: int) -> float:
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0) / GB)
    return statistics.median(rates)


def micro_benchmarks(work_dir: str, nbytes: int, reps: int = 3) -> dict:
    """Single-thread GB/s of each step a checkpoint byte goes through on the persist path."""
    import torch
    from torch.serialization import _get_storage_alignment

    from deepspeed_async_ckpt.config import AsyncCheckpointConfig
    from deepspeed_async_ckpt.persist import new_hasher

    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = {"bytes": nbytes}
    out["memcpy_gbps"] = _median_rate(lambda: dst.copy_(src), nbytes, reps)
    out["memcpy_fresh_gbps"] = _median_rate(lambda: torch.empty_like(src).copy_(src), nbytes, reps)
    view = memoryview(src.numpy())
    out["crc32_gbps"] = _median_rate(lambda: zlib.crc32(view), nbytes, reps)
    out["checksum"] = AsyncCheckpointConfig().checksum  # the engine's default manifest checksum
    out["checksum_gbps"] = _median_rate(lambda: new_hasher(out["checksum"]).update(view), nbytes, reps)

    class _Null:
        def write(self, data):
            return memoryview(data).nbytes

        def flush(self):
            pass

    def zip_write(crc: bool):
        w = torch._C.PyTorchFileWriter(_Null(), crc, _get_storage_alignment())
        w.write_record("data/0", src.untyped_storage(), nbytes)
        w.write_end_of_file()

    # torch.save's zip writer computes its own CRC-32 of every record (torch.serialization's
    # compute_crc32 option, on by default); without it the writer only copies pointers.
    out["zip_writer_crc_gbps"] = _median_rate(lambda: zip_write(True), nbytes, reps)
    path = os.path.join(work_dir, "micro.bin")
    writes, fsyncs = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            _write_all(f, view)
            t1 = time.perf_counter()
            os.fsync(f.fileno())
            t2 = time.perf_counter()
        writes.append(nbytes / (t1 - t0) / GB)
        fsyncs.append(nbytes / (t2 - t1) / GB)
        os.unlink(path)
    out["pagecache_write_gbps"] = statistics.median(writes)
    out["fsync_gbps"] = statistics.median(fsyncs)
    return out


def _write_all(f, view, chunk: int = 8 << 20) -> None:
    for off in range(0, len(view), chunk):
        part = view[off:off + chunk]
        while part:
            part = part[f.write(part):]


MALLOC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""glibc tunables for the ranks (``--malloc keep``): every allocation from the heap, and the
heap never trimmed, so memory freed by a training step is reused by the next one."""


def storage_bandwidth(work_dir: str, nbytes: int, reps: int = 3) -> dict:
    """Sequential write bandwidth of the disk under ``work_dir`` for ``nbytes``: with the
    engine's policy (write, fsync, rename, fsync dir) and without any fsync (page cache).

    With fsync, up to four ways of writing are measured and the fastest is the disk's figure:
    plain writes then one fsync; writes with writeback started as they go
    (``storage.WriteBehindFile``: ``sync_file_range`` + dropping written pages), much faster
    than plain writes on some machines, this one included; and ``O_DIRECT`` writes
    (``storage.DirectFile``, what this engine uses where the filesystem allows it), from a
    buffer in huge pages (``storage.host_buffer``, the engine's pool) and from one in 4 KiB
    pages (to show what the page size is worth).
    """
    fio = shutil.which("fio")
    if fio:
        return _fio_bandwidth(fio, work_dir, nbytes, reps)
    from deepspeed_async_ckpt.storage import DirectFile, LocalStorage, WriteBehindFile, host_buffer
    from deepspeed_async_ckpt.storage.buffered import _sync_file_range

    # page-aligned and in huge pages, as the engine's pool: direct writes from 4 KiB pages
    # are split into smaller block requests, which cost a disk bandwidth (docs/benchmarks.md)
    buf = memoryview(host_buffer(8 << 20))
    small_pages = memoryview(mmap.mmap(-1, 8 << 20))  # shmem, 4 KiB pages
    # filled, as the pool is when it is written: an untouched mapping is read from the
    # kernel's zero page (no memory of its own), which a disk write reads faster
    pattern = os.urandom(8 << 20)
    buf[:], small_pages[:] = pattern, pattern
    path = os.path.join(work_dir, "storage.bin")
    res = {"tool": "python large-file write, 8 MiB chunks (fio not installed)", "bytes": nbytes}
    ways = {"fsync_plain": (True, "plain"), "nofsync": (False, "plain")}
    if _sync_file_range is not None:
        ways["fsync_write_behind"] = (True, "behind")
    probe = LocalStorage(fsync=True).open_write(path + ".probe")
    if isinstance(probe, DirectFile):
        ways["fsync_direct"] = (True, "direct")
        ways["fsync_direct_4k_pages"] = (True, "direct_4k")
    probe.close()
    os.unlink(path + ".probe")
    for way, (fsync, how) in ways.items():
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            direct = how.startswith("direct")
            src = small_pages if how == "direct_4k" else buf
            f = LocalStorage(fsync=True).open_write(path + ".tmp") if direct else \
                open(path + ".tmp", "wb", buffering=0)
            with (WriteBehindFile(f) if how == "behind" else f) as out:
                left = nbytes
                # through the wrapper, which starts writeback as it goes (writing to the raw
                # file would be a second plain-write sample)
                write = f.write_stable if direct else out.write  # in place, as the engine
                while left > 0:
                    left -= write(src[:min(left, len(src))])
                if direct:
                    f.finish()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            if fsync:
                fd = os.open(work_dir, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            rates.append(nbytes / (time.perf_counter() - t0) / GB)
            os.unlink(path)
            os.sync()
        res[f"{way}_gbps"] = statistics.median(rates)
        res[f"{way}_runs_gbps"] = rates
    res["fsync_gbps"] = max(v for k, v in res.items()
                            if k in ("fsync_plain_gbps", "fsync_write_behind_gbps", "fsync_direct_gbps",
                                     "fsync_direct_4k_pages_gbps"))
    return res


def _fio_bandwidth(fio: str, work_dir: str, nbytes: int, reps: int) -> dict:
    """fio's sequential write: with fsync, the faster of direct I/O (what the engine uses
    where the filesystem allows it; buffered writes alone are slower (docs/benchmarks.md), which
    would inflate "% of disk") and buffered writes with a final fsync."""
    res = {"tool": "fio", "bytes": nbytes}
    for way, flags in (("fsync_direct", ["--direct=1", "--end_fsync=1"]),
                       ("fsync_plain", ["--end_fsync=1"]), ("nofsync", ["--end_fsync=0"])):
        rates = []
        for _ in range(reps):
            cmd = [fio, "--name=seqwrite", "--rw=write", "--bs=8M", f"--size={nbytes}",
                   f"--filename={os.path.join(work_dir, 'fio.bin')}", "--ioengine=psync",
                   *flags, "--output-format=json"]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0 and way == "fsync_direct":  # no O_DIRECT here: not measured
                break
            if run.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}): {run.stderr.strip()}")
            rates.append(json.loads(run.stdout)["jobs"][0]["write"]["bw_bytes"] / GB)
            os.unlink(os.path.join(work_dir, "fio.bin"))
        if rates:
            res[f"{way}_gbps"] = statistics.median(rates)
    if os.path.exists(os.path.join(work_dir, "fio.bin")):
        os.unlink(os.path.join(work_dir, "fio.bin"))
    res["fsync_gbps"] = max(res.get("fsync_direct_gbps", 0.0), res["fsync_plain_gbps"])
    return res
