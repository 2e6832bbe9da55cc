"""Checkpoint benchmark: training stall, persist throughput and end-to-end overhead of this
package's engine against DeepSpeed's engines and torch DCP, measured in one run.

    PYTHONPATH=. python scripts/bench_checkpoint.py --out docs/bench_results/latest.json
    PYTHONPATH=. python scripts/bench_checkpoint.py --quick --out bench_out/quick.json   # < 1 min
    PYTHONPATH=. python scripts/bench_checkpoint.py --gpu-report                        # NVML

For each setting and model size it starts ``scripts/bench_worker.py`` ranks with
``scripts/launch.py`` (DeepSpeed on CPU, gloo; each rank's output in ``<work-dir>/logs/``), which
time every engine on the same model; see that file for the protocol. This process
measures, in the same run, what bounds the figures: the storage's sequential write bandwidth
with the engine's fsync policy (fio where installed, else a plain large-file write) and the
per-byte costs of the persist path (memcpy, the manifest checksum (xxh128) and zlib.crc32 for
reference, torch's zip writer, page-cache write, fsync). It prints a table, writes a JSON file
and a PNG bar chart next to it.

Settings:
  1rank  one rank, OMP_NUM_THREADS=1, the other core idle: a GPU node's host, whose CPUs are
         free while the GPUs compute (the headline).
  2rank  two ranks on the two cores: every background byte competes with training compute.

The ranks' glibc malloc keeps the memory it frees (``--malloc keep``, the default): with glibc's
defaults a CPU training step gives its gradient buffers back to the kernel and faults them in
again every step, and whether it does depends on the heap's history (in one process, the same
step ran at 0.54 s and, after a large free elsewhere left a hole that served it, at 0.27 s).
That makes the baseline, and so every overhead figure, a coin toss. A GPU job's host memory
does not churn like that either. ``--malloc default`` measures glibc's defaults.

The headline, per engine: **training time lost per checkpoint** (``lost_time.py``), the median
and the worst over ``--saves`` checkpoints made every K steps as a training loop makes them
(the engine's first ones in the process, so one-time costs show in the worst):

  lost        save call + the extra time of every step until the next save (step time minus
              the baseline step; the fence wait is inside the first of them) + any wait for the
              last save once its K steps are done. Baseline step: the median step of the K
              steps before the engine's first save and the K steps after its last one
              completed, the same process with no checkpoint in flight. Against DS
              TorchCheckpointEngine's lost time, counted the same way, as a ratio.

The lost-time run the docs quote (1 rank, this engine and TorchCheckpointEngine, 0.25/1/2 GB,
K=10, about 10 minutes on 2 idle cores):

    PYTHONPATH=. python scripts/bench_checkpoint.py --lost --out docs/bench_results/lost.json

Detail figures, per engine (seconds unless named), each the median over ``--repeats`` timed
checkpoints (3; every one after its own paired baseline window; one in ``--quick``):
  stall       save_checkpoint wall time + any wait the engine adds before the next optimizer
              step (max over ranks); "first" is the first checkpoint of the process, which
              also pays one-time allocations.
  persist     save start -> the checkpoint is complete (committed for this package, future done
              for DCP, save returned for torch.save); GB/s = bytes on disk / persist.
  overhead    (save + K steps) vs the K steps without checkpointing right before them (the
              paired baseline), same process, same model. The spread of all no-checkpoint
              windows of a cell is reported as its noise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "scripts", "bench_worker.py")
sys.path.insert(0, os.path.join(REPO, "scripts"))
from launch import launch, scratch_dir  # noqa: E402
from lost_time import baseline_step, lost_time, ratio, summary  # noqa: E402
GB = 1e9  # decimal, as storage bandwidth is quoted

ENGINES = ("async", "sync", "ds_torch", "ds_decoupled", "dcp_async")
ENGINE_LABELS = {
    "async": "this engine (async)",
    "sync": "this engine (sync)",
    "ds_torch": "DS TorchCheckpointEngine",
    "ds_decoupled": "DS DecoupledCheckpointEngine",
    "dcp_async": "torch DCP async_save (CPU: unpinned, blocking staging; no directory fsync)",
}
SETTINGS = {
    "1rank": {"nproc": 1, "label": "1 rank + spare core (headline)"},
    "2rank": {"nproc": 2, "label": "2 ranks on 2 cores"},
}
# Targets from the issue.
STALL_RATIO_TARGET = 20.0
PERSIST_FRACTION_TARGET = 0.80
OVERHEAD_TARGET = 0.05


# --------------------------------------------------------------------------- sizing
def bytes_per_param(zero_stage: int) -> int:
    """fp32 Adam: weights 4 + two moments 8, plus a 4-byte fp32 master partition under ZeRO."""
    return 16 if zero_stage >= 1 else 12


def layers_for(size_gb: float, hidden: int, zero_stage: int) -> int:
    per_layer = hidden * hidden + hidden + 2 * hidden  # Linear + LayerNorm (ds_train.build_model)
    return max(1, round(size_gb * GB / bytes_per_param(zero_stage) / per_layer))


# --------------------------------------------------------------------------- micro-benchmarks
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
    from deepspeed_async_ckpt.storage.files import _sync_file_range

    # page-aligned and in huge pages, as the engine's pool: direct writes from 4 KiB pages
    # are split into smaller block requests, which on this disk cost about half the bandwidth
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
    where the filesystem allows it; buffered writes alone are 1.5-3x slower on this VM, which
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


# --------------------------------------------------------------------------- other load
class ForeignLoad:
    """Samples, every ``interval`` seconds, the CPU time of every process that is not this one
    or its descendants (other users of the machine), from /proc. ``cpu_between(t0, t1)`` gives
    their CPU-seconds in a window of ``time.perf_counter`` (CLOCK_MONOTONIC, shared with the
    workers). Kernel threads (writeback of our files, the VM's DAMON page-out daemon...) are
    summed apart: ``cpu_between(t0, t1, kernel=True)``."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.tick = os.sysconf("SC_CLK_TCK")
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, foreign CPU s, kernel CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="foreign-load", daemon=True)
        self.available = os.path.isdir("/proc/self")

    def start(self) -> "ForeignLoad":
        if self.available:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _table(self) -> dict[int, tuple[int, int]]:
        procs = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            fields = data[data.rindex(b")") + 2:].split()
            procs[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, ticks
        return procs

    def _run(self) -> None:
        me, last, total, kernel = os.getpid(), {}, 0.0, 0.0
        while True:
            procs = self._table()
            ours: dict[int, bool] = {me: True, 0: False, 1: False, 2: False}

            def is_ours(pid: int) -> bool:
                chain = []
                while pid not in ours:
                    chain.append(pid)
                    pid = procs.get(pid, (0, 0))[0]
                for p in chain:
                    ours[p] = ours[pid]
                return ours[pid]

            for pid, (ppid, ticks) in procs.items():
                delta = max(0, ticks - last.get(pid, 0)) / self.tick if last else 0.0
                if pid == 2 or ppid == 2:
                    kernel += delta
                elif not is_ours(pid):
                    total += delta
            last = {pid: t for pid, (_, t) in procs.items()}
            self.samples.append((time.perf_counter(), total, kernel))
            if self._stop.wait(self.interval):
                return

    def cpu_between(self, t0: float, t1: float, kernel: bool = False) -> float | None:
        """Foreign (or kernel-thread) CPU-seconds between two perf_counter times."""
        i = 2 if kernel else 1
        if len(self.samples) < 2 or t0 < self.samples[0][0] or t1 > self.samples[-1][0]:
            return None

        def at(t: float) -> float:
            for a, b in zip(self.samples, self.samples[1:]):
                if a[0] <= t <= b[0]:
                    return a[i] + (b[i] - a[i]) * (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else a[i]
            return self.samples[-1][i]

        return at(t1) - at(t0)


# --------------------------------------------------------------------------- running workers
def _tail(path: str, n: int = 6) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:]).strip()
    except OSError:
        return ""


# --------------------------------------------------------------------------- aggregation
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


BUSY_CORES = 0.05  # other processes' average CPU use in a window above which it is flagged


def _foreign(load: "ForeignLoad | None", t0: float, t1: float) -> dict:
    cpu = load.cpu_between(t0, t1) if load is not None else None
    if cpu is None:
        return {"foreign_cpu_s": None, "kernel_threads_cpu_s": None, "busy": None}
    return {"foreign_cpu_s": cpu, "kernel_threads_cpu_s": load.cpu_between(t0, t1, kernel=True),
            "busy": cpu / (t1 - t0) > BUSY_CORES}


def _usage(windows: list[dict]) -> dict:
    """Summed over ranks: user and system CPU seconds and minor page faults of a window."""
    return {k: sum(w["usage"][k] for w in windows) for k in ("user_s", "sys_s", "minflt")}


def _paired(windows: list[dict]) -> dict:
    """One paired baseline window (K steps without checkpoints, right before a timed window),
    over ranks: the slowest rank's wall time, the median step, CPU summed over ranks."""
    return {"window_s": max(w["window_s"] for w in windows),
            "step_s": _median([s["step_s"] for w in windows for s in w["steps"]]),
            "usage": _usage(windows)}


def _timed_figures(name: str, durable: bool, runs: list[dict], base_window: float, expected: int,
                   storage: dict, load: "ForeignLoad | None") -> dict:
    """One engine's figures for one timed checkpoint (``runs``: that repeat on every rank)."""
    row: dict = {"durable": durable}
    timed = [r["timed"] for r in runs]
    pair = _paired([r["paired_baseline"] for r in runs])
    nbytes = timed[0]["bytes_on_disk"]
    # This engine's commit on rank 0 waits for every rank: its time is the checkpoint's.
    persist = timed[0]["persist_s"] if name in ("async", "sync") else max(t["persist_s"] for t in timed)
    window = max(t["window_s"] for t in timed)
    row.update({
        "stall_s": max(t["stall_s"] for t in timed),
        "save_s": max(t["save_s"] for t in timed),
        "wait_s": max(t["wait_s"] for t in timed),
        # the next step's slowdown beyond the wait the stall counts already (else a wait such
        # as the decoupled engine's 2.3 s commit would be counted twice)
        "next_step_extra_s": max(t["next_step_s"] - t["wait_s"] for t in timed) - pair["step_s"],
        "persist_s": persist,
        "bytes": nbytes,
        "expected_bytes": expected,
        "persist_gbps": nbytes / persist / GB,
        "window_s": window,
        "paired_baseline_s": pair["window_s"],
        "overhead": (window - pair["window_s"]) / pair["window_s"],
        "extra_s": window - pair["window_s"],
        "overhead_vs_run_baseline": (window - base_window) / base_window,
        "keeps_up": persist <= base_window,
    })
    row.update(_foreign(load, timed[0]["t0"], timed[0]["t1"]))  # during the timed window
    p0 = runs[0]["paired_baseline"]
    row["paired_foreign"] = _foreign(load, p0["t0"], p0["t1"])
    use = _usage(timed)  # this process's threads only: not the decoupled engine's writer process
    row["usage"] = use
    row["extra_user_s"] = use["user_s"] - pair["usage"]["user_s"]
    row["extra_sys_s"] = use["sys_s"] - pair["usage"]["sys_s"]
    row["extra_minflt"] = use["minflt"] - pair["usage"]["minflt"]
    ref = storage["fsync_gbps"] if row["durable"] else storage["nofsync_gbps"]
    row["storage_ref_gbps"] = ref
    row["persist_fraction"] = row["persist_gbps"] / ref
    if nbytes < 0.95 * expected:
        row["incomplete"] = f"{nbytes} bytes on disk, {expected} bytes of state"
    if "engine_times_s" in timed[0]:
        row["engine_times_s"] = [t["engine_times_s"] for t in timed]
        staged = max(t["engine_times_s"]["staged"] for t in timed)
        row["snapshot_s"] = staged
        row["snapshot_gbps"] = sum(t["staged_bytes"] for t in timed) / staged / GB  # all ranks
        row["pool_peak_bytes"] = [t["pool_peak_bytes"] for t in timed]
    return row


def lost_figures(per: list[dict]) -> dict:
    """Training time lost per checkpoint (``lost_time.py``) of one engine's cadence, ``per``
    holding its result on every rank: per save, the largest over ranks (each against its own
    baseline step); their median and worst; and, as details, the medians of the save call,
    the fence wait, and what the process spent beyond a quiet interval of K steps (CPU seconds
    of all its threads, minor page faults; summed over ranks)."""
    cads = [p["cadence"] for p in per]
    bases = [baseline_step(c["before"] + c["after"]) for c in cads]
    quiet = [{k: statistics.mean(u[k] for u in c["quiet_usage"]) for k in ("user_s", "sys_s", "minflt")}
             for c in cads]
    lost, save, wait, cpu, faults = [], [], [], [], []
    for i in range(len(cads[0]["saves"])):
        recs = [c["saves"][i] for c in cads]
        lost.append(max(lost_time(r["save_s"], r["steps_s"], b, r.get("tail_s", 0.0))
                        for r, b in zip(recs, bases)))
        save.append(max(r["save_s"] for r in recs))
        wait.append(max(r["wait_s"] for r in recs))
        cpu.append(sum(r["usage"]["user_s"] + r["usage"]["sys_s"] - q["user_s"] - q["sys_s"]
                       for r, q in zip(recs, quiet)))
        faults.append(sum(r["usage"]["minflt"] - q["minflt"] for r, q in zip(recs, quiet)))
    out = summary(lost)
    out.update({"per_save_s": lost, "baseline_step_s": max(bases), "save_call_s": _median(save),
                "fence_wait_s": _median(wait), "extra_cpu_s": _median(cpu), "extra_minflt": _median(faults),
                "tail_s": max(c["saves"][-1].get("tail_s", 0.0) for c in cads),
                "baseline": "median step of the K steps before the engine's first save and the K "
                            "steps after its last one completed"})
    return out


def _median_figures(runs: list[dict]) -> dict:
    """Per figure, the median over repeats; flags: whether any repeat was busy, whether every
    repeat kept up; everything else from the repeat whose overhead is the median one."""
    by_overhead = sorted(runs, key=lambda r: r["overhead"])
    out = dict(by_overhead[(len(runs) - 1) // 2])
    for key, value in out.items():
        if key in ("busy", "keeps_up"):
            vals = [r[key] for r in runs]
            out[key] = any(vals) if key == "busy" else all(v is not False for v in vals)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def summarize(ranks: list[dict], storage: dict, load: "ForeignLoad | None" = None) -> dict:
    """Per-engine figures of one (setting, size) from the per-rank worker results."""
    r0 = ranks[0]
    base_windows = [max(r["baseline"][i]["window_s"] for r in ranks) for i in range(len(r0["baseline"]))]
    base_window = statistics.mean(base_windows)
    base_steps = [s for r in ranks for b in r["baseline"] for s in b["steps"]]
    step = {
        "step_s": _median([s["step_s"] for s in base_steps]),
        "fwd_bwd_s": _median([s["fb_s"] for s in base_steps]),
        "optimizer_s": _median([s["opt_s"] for s in base_steps]),
        "baseline_window_s": base_window,
        "baseline_windows_s": base_windows,
        "baseline_drift": (max(base_windows) - min(base_windows)) / base_window,
        "baseline_foreign": [_foreign(load, b["t0"], b["t1"]) for b in r0["baseline"]],
        # DeepSpeed's own save_checkpoint work (a checkpoint engine that writes nothing)
        "ds_floor_s": max((r.get("ds_floor_s") or 0.0) for r in ranks),
    }
    bare = [r["bare_write"] for r in ranks if r.get("bare_write")]
    if bare:  # the floor for background writes: the same bytes, no copy, no checksum
        writers = [b for b in bare if b["bytes"] and b.get("write_s")]
        bare_window = max(b["window"]["window_s"] for b in bare)
        pair = _paired([b["paired_baseline"] for b in bare])
        write_s = max((b["write_s"] for b in writers), default=None)
        step["bare_write"] = {  # all writing ranks together, as persist counts the engines
            "bytes": sum(b["bytes"] for b in writers),
            "write_s": write_s,
            "gbps": sum(b["bytes"] for b in writers) / write_s / 1e9 if write_s else None,
            "overhead": (bare_window - pair["window_s"]) / pair["window_s"],
            "next_step_extra_s": max(b["window"]["steps"][0]["step_s"] for b in bare) - pair["step_s"],
        }
    base_use = [_usage([r["baseline"][i] for r in ranks]) for i in range(len(r0["baseline"]))]
    step["baseline_usage"] = {k: statistics.mean(u[k] for u in base_use) for k in base_use[0]}
    # Without ZeRO the optimizer state is replicated and only rank 0 writes it.
    optim = sum(r["optim_bytes"] for r in ranks) if r0["zero_stage"] > 0 else r0["optim_bytes"]
    expected = r0["module_bytes"] + optim
    engines = {}
    for name in r0["engines"]:
        per = [r["engines"].get(name, {}) for r in ranks]
        e0 = per[0]
        row = {"ok": all(p.get("ok") for p in per), "durable": e0.get("durable"), "note": e0.get("note", "")}
        errors = [p.get("error") for p in per if p.get("error")]
        if errors:
            row["error"] = errors[0]
        if "attempts" in e0:
            row["attempts"] = e0["attempts"]
        if not row["ok"]:
            engines[name] = row
            continue
        first = [p["first"] for p in per]
        runs = [_timed_figures(name, row["durable"], [p["runs"][i] for p in per], base_window,
                               expected, storage, load) for i in range(len(e0["runs"]))]
        row.update(_median_figures(runs))
        row["repeats"] = len(runs)
        row["runs"] = runs
        row["first_stall_s"] = max(t["stall_s"] for t in first)
        row["first_next_step_extra_s"] = max(t["next_step_s"] - t["wait_s"] for t in first) - step["step_s"]
        row["lost"] = lost_figures(per)
        engines[name] = row
    torch_lost = engines.get("ds_torch", {}).get("lost")
    for row in engines.values():
        if "lost" in row and torch_lost:
            row["lost"]["torch_over_this"] = ratio(torch_lost, row["lost"])
    # Every window of K steps without checkpoints in this cell: the run's two baselines and each
    # paired baseline. Their spread is the noise floor of the overhead figures.
    quiet = base_windows + [r["paired_baseline_s"] for e in engines.values() for r in e.get("runs", [])]
    quiet += [max(b["paired_baseline"]["window_s"] for b in bare)] if bare else []
    step["baseline_spread"] = (max(quiet) - min(quiet)) / statistics.mean(quiet)
    return {"steps": step, "engines": engines, "params": r0["params"], "expected_bytes": expected,
            "loadavg": [r0.get("loadavg_start"), r0.get("loadavg_end")]}


def _add_child_errors(cell: dict, log_prefix: str, found: list[str]) -> None:
    """DeepSpeed's decoupled engine reports only "process died" in the parent; the cause is
    printed by its writer subprocess into the rank's log (of the setting's first worker, which
    probes; ``found`` carries it to the later ones). Attach it to the probe attempts."""
    import re

    for r in range(cell["nproc"]):
        try:
            with open(f"{log_prefix}.rank{r}.log", encoding="utf-8", errors="replace") as f:
                found += re.findall(r"Checkpoint subprocess crashed with error: (.*)", f.read())
        except OSError:
            pass
    dec = cell.get("engines", {}).get("ds_decoupled")
    if dec and found:
        for a in dec.get("attempts", []):
            if a.get("error") and "died unexpectedly" in a["error"]:
                a["child_error"] = found[0].strip()


def targets(cell: dict, storage: dict) -> dict:
    """The issue's three targets for this engine (async) in one (setting, size)."""
    e = cell["engines"]
    a, t = e.get("async", {}), e.get("ds_torch", {})
    out = {}
    if a.get("ok") and t.get("ok"):
        ratio = t["stall_s"] / a["stall_s"] if a["stall_s"] > 0 else math.inf
        floor = cell["steps"]["ds_floor_s"]
        out["stall_ratio_vs_torch"] = {"value": ratio, "target": STALL_RATIO_TARGET, "met": ratio >= STALL_RATIO_TARGET,
                                       "ds_floor_ratio": t["stall_s"] / floor if floor > 0 else math.inf}
    if a.get("ok"):
        frac = a["persist_gbps"] / storage["fsync_gbps"]
        out["persist_fraction_of_storage"] = {"value": frac, "target": PERSIST_FRACTION_TARGET,
                                              "met": frac >= PERSIST_FRACTION_TARGET}
        repeats = [r["overhead"] for r in a.get("runs", [])] or [a["overhead"]]
        out["overhead_every_k"] = {"value": a["overhead"], "target": OVERHEAD_TARGET,
                                   "met": a["overhead"] < OVERHEAD_TARGET,
                                   # the spread of this engine's own paired overheads; the
                                   # spread of every quiet window of the cell, minutes and
                                   # engines apart, beside it
                                   "repeat_spread": max(repeats) - min(repeats), "repeats": len(repeats),
                                   "noise": cell["steps"]["baseline_spread"]}
        bare = cell["steps"].get("bare_write")
        if bare and bare.get("gbps"):
            out["persist_fraction_of_storage"]["of_bare_write"] = a["persist_gbps"] / bare["gbps"]
            out["overhead_every_k"]["bare_write"] = bare["overhead"]
    return out


def breakdown(micro: dict, storage: dict, nbytes: int) -> dict:
    """Seconds per checkpoint of each stage of this engine's persist path, from the
    micro-benchmarks (one core): copy to the host pool and the manifest checksum are CPU
    work; with direct I/O the disk reads the pool buffers itself, so the write costs disk time
    (``disk_s``, at the disk's measured bandwidth), not CPU. For reference:
    ``pagecache_write_s``, what a buffered write would cost in CPU, and ``zip_crc_s``, torch's
    own zip CRC, off by default (``zip_crc32``)."""
    b = nbytes / GB
    parts = {
        "copy_s": b / micro["memcpy_gbps"],
        "checksum_s": b / micro["checksum_gbps"],
        "disk_s": b / storage["fsync_gbps"],
        "pagecache_write_s": b / micro["pagecache_write_gbps"],
        "zip_crc_s": b / micro["zip_writer_crc_gbps"],
    }
    parts["cpu_total_s"] = parts["copy_s"] + parts["checksum_s"]
    # One writer thread hashes a file while an I/O thread writes the part before: the slower of
    # the two bounds the file's persist throughput.
    parts["persist_bound_gbps"] = b / max(parts["checksum_s"], parts["disk_s"])
    parts["persist_bound_fraction"] = parts["persist_bound_gbps"] / storage["fsync_gbps"]
    return parts


# --------------------------------------------------------------------------- output
def fmt_s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if abs(x) < 1 else f"{x:.2f} s"


def lost_table(result: dict) -> str:
    """The headline: training time lost per checkpoint, per engine and size."""
    lines = []
    for setting, cells in result["cells"].items():
        lines.append(f"\n## Training time lost per checkpoint: {SETTINGS[setting]['label']}\n")
        lines.append("| size | engine | lost: median | worst | worst/median | DS Torch's median / this "
                     "| save call | fence wait | baseline step | saves |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for size, cell in cells.items():
            if "error" in cell:
                lines.append(f"| {size} GB | (all) | run failed: {cell['error']} ||||||||")
                continue
            for name, e in cell["engines"].items():
                lost = e.get("lost")
                if not e["ok"] or not lost:
                    continue
                r, wm = lost.get("torch_over_this"), lost["worst_over_median"]
                lines.append(
                    f"| {cell['size_gb']:.2f} GB | {ENGINE_LABELS.get(name, name)} | {fmt_s(lost['median_s'])} "
                    f"| {fmt_s(lost['worst_s'])} | {f'{wm:.1f}x' if wm else '-'} | {f'{r:.1f}x' if r else '-'} "
                    f"| {fmt_s(lost['save_call_s'])} | {fmt_s(lost['fence_wait_s'])} "
                    f"| {fmt_s(lost['baseline_step_s'])} | {lost['saves']} |")
    lines.append("\nlost = save call + the extra time of every step until the next save (the fence wait is "
                 "inside the first) + any wait for the save after those steps; baseline step = median "
                 "step of the same run with no checkpoint in flight (K steps before the engine's first "
                 "save, K after its last one completed); the first save of the process is among them.")
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = []
    for setting, cells in result["cells"].items():
        lines.append(f"\n## Details: {SETTINGS[setting]['label']}\n")
        lines.append("| size | engine | stall | next step + | 1st save: stall, next step + | persist | GB/s "
                     "| % of disk | overhead, 1 ckpt / K steps | fsync |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for size, cell in cells.items():
            if "error" in cell:
                lines.append(f"| {size} GB | (all) | run failed: {cell['error']} ||||||||")
                continue
            st = cell["steps"]
            for name, e in cell["engines"].items():
                label = ENGINE_LABELS.get(name, name)
                if not e["ok"]:
                    lines.append(f"| {cell['size_gb']:.2f} GB | {label} | not run: {e.get('error', '?')} ||||||||")
                    continue
                flag = " (incomplete!)" if e.get("incomplete") else ""
                busy = e.get("busy") or (e.get("paired_foreign") or {}).get("busy") or \
                    any(b.get("busy") for b in st.get("baseline_foreign", []))
                mark = " †" if busy else ""
                if e.get("keeps_up") is False:  # its background work outlasted the K steps
                    mark += " ‡"
                lines.append(
                    f"| {cell['size_gb']:.2f} GB | {label}{flag} | {fmt_s(e['stall_s'])} "
                    f"| {fmt_s(e['next_step_extra_s'])} | {fmt_s(e['first_stall_s'])}, {fmt_s(e['first_next_step_extra_s'])} "
                    f"| {fmt_s(e['persist_s'])} | {e['persist_gbps']:.2f} | {100 * e['persist_fraction']:.0f}% "
                    f"| {100 * e['overhead']:+.1f}%{mark} | {'yes' if e['durable'] else 'no'} |")
            bw = st.get("bare_write") or {}
            bare = (f"; the same bytes written alone during training (no copy, no checksum): "
                    f"{bw['gbps']:.2f} GB/s, next step +{fmt_s(bw['next_step_extra_s'])}, overhead "
                    f"{100 * bw['overhead']:+.1f}%" if bw.get("gbps") else "")
            fcpu = cell.get("foreign", {}).get("foreign_cpu_s")
            kcpu = cell.get("foreign", {}).get("kernel_threads_cpu_s")
            other = (f", other processes {fcpu:.0f} CPU-s and kernel threads {kcpu:.0f} CPU-s in "
                     f"{cell['worker_wall_s']:.0f} s" if fcpu is not None else "")
            small = cell["storage"].get("fsync_direct_4k_pages_gbps")
            small = f" ({small:.2f} direct from 4 KiB pages)" if small else ""
            lines.append(f"| | *step {fmt_s(st['step_s'])} (fwd+bwd {fmt_s(st['fwd_bwd_s'])}), "
                         f"disk {cell['storage']['fsync_gbps']:.2f} GB/s fsync{small} / "
                         f"{cell['storage']['nofsync_gbps']:.2f} GB/s no fsync, no-checkpoint windows spread {100 * st['baseline_spread']:.1f}%, DeepSpeed's "
                         f"save_checkpoint with a no-op engine {fmt_s(st['ds_floor_s'])}{bare}{other}* |||||||||")
        lines.append("\n† other processes used more than 5% of a core during this window or a baseline window."
                     "\n‡ its background work outlasted the K steps after the save in some repeat: the overhead "
                     "leaves that tail out (a lower bound; the next save would overlap it).")
    return "\n".join(lines)


def targets_text(result: dict) -> str:
    lines = ["\nTargets (this engine, async mode):"]
    for setting, cells in result["cells"].items():
        for size, cell in cells.items():
            for key, t in cell.get("targets", {}).items():
                v = t["value"]
                shown = f"{v:.1f}x" if key == "stall_ratio_vs_torch" else f"{100 * v:.1f}%"
                goal = {"stall_ratio_vs_torch": f">= {STALL_RATIO_TARGET:.0f}x",
                        "persist_fraction_of_storage": f">= {100 * PERSIST_FRACTION_TARGET:.0f}%",
                        "overhead_every_k": f"< {100 * OVERHEAD_TARGET:.0f}%"}[key]
                extra = f" (baseline noise {100 * t['noise']:.1f}%)" if "noise" in t else ""
                if "repeat_spread" in t and t.get("repeats", 0) > 1:
                    extra += f" (its repeats {100 * t['repeat_spread']:.1f} points apart)"
                if "of_bare_write" in t:
                    extra += (f" (of the same bytes written alone by a thread during training: "
                              f"{100 * t['of_bare_write']:.0f}%)")
                if "bare_write" in t:
                    extra += (f" (that bare write alone, no copy or checksum: "
                              f"{100 * t['bare_write']:+.1f}%)")
                if "ds_floor_ratio" in t:
                    extra += (f" (DeepSpeed's own save_checkpoint work alone, with an engine that "
                             f"writes nothing: {t['ds_floor_ratio']:.1f}x)")
                lines.append(f"  {setting} {cell['size_gb']:.2f} GB {key}: {shown} ({goal}) "
                             f"{'MET' if t['met'] else 'MISSED'}{extra}")
    return "\n".join(lines)


def breakdown_text(result: dict) -> str:
    lines = ["\nWhere this engine's (async) cost goes. Per checkpoint, from the micro-benchmarks: CPU for "
             f"the copy and the checksum ({result['micro'].get('checksum', 'crc32')}), disk time for "
             "the (direct) write; then measured in the timed window vs its paired baseline window (all ranks' "
             "processes): extra wall time, extra user and system CPU, extra minor page faults.",
             "| setting | size | copy | checksum | disk | CPU total (model) "
             "| extra wall | extra user CPU | extra sys CPU | extra faults | persist bound: model (measured) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting, cells in result["cells"].items():
        for size, cell in cells.items():
            b, a = cell.get("breakdown"), cell.get("engines", {}).get("async", {})
            if not b or not a.get("ok"):
                continue
            faults = a["extra_minflt"] * 4096 / GB
            lines.append(f"| {setting} | {cell['size_gb']:.2f} GB | {fmt_s(b['copy_s'])} | {fmt_s(b['checksum_s'])} "
                         f"| {fmt_s(b['disk_s'])} | {fmt_s(b['cpu_total_s'])} | {fmt_s(a['extra_s'])} "
                         f"| {fmt_s(a['extra_user_s'])} | {fmt_s(a['extra_sys_s'])} | {faults:+.2f} GB "
                         f"| {b['persist_bound_gbps']:.2f} GB/s ({a['persist_gbps']:.2f}) |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Bars per engine and size: stall (log scale) and persist throughput, one column per
    setting; hatched bars are engines that do not fsync; dashed/dotted lines are the disk's
    sequential write bandwidth with and without fsync, measured in the same run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(result["cells"])
    fig, axes = plt.subplots(2, len(settings), figsize=(6.5 * len(settings), 8.5), squeeze=False)
    colors = dict(zip(ENGINES, ("tab:green", "tab:olive", "tab:red", "tab:purple", "tab:blue")))
    handles = {}
    for col, setting in enumerate(settings):
        cells = [c for c in result["cells"][setting].values() if "engines" in c]
        names = [n for n in ENGINES if any(c["engines"].get(n, {}).get("ok") for c in cells)]
        width = 0.8 / max(1, len(names))
        for row, (key, ylabel) in enumerate((("stall_s", "stall per checkpoint (s, log scale)"),
                                              ("persist_gbps", "persist throughput (GB/s)"))):
            ax = axes[row][col]
            for j, name in enumerate(names):
                for i, c in enumerate(cells):
                    e = c["engines"].get(name, {})
                    if not e.get("ok"):
                        continue
                    bar = ax.bar(i + (j - (len(names) - 1) / 2) * width, max(e[key], 1e-4), width,
                                 color=colors[name], hatch=None if e["durable"] else "//",
                                 edgecolor="white" if e["durable"] else "black", linewidth=0.5)
                    label = ENGINE_LABELS[name] + ("" if e["durable"] else " (no fsync)")
                    handles.setdefault(label, bar)
            if key == "persist_gbps":
                for i, c in enumerate(cells):
                    handles.setdefault("disk: write + fsync", ax.hlines(
                        c["storage"]["fsync_gbps"], i - 0.45, i + 0.45, colors="k", linestyles="--"))
                    handles.setdefault("disk: write, no fsync", ax.hlines(
                        c["storage"]["nofsync_gbps"], i - 0.45, i + 0.45, colors="grey", linestyles=":"))
            else:
                ax.set_yscale("log")
            ax.set_xticks(range(len(cells)), [f"{c['size_gb']:.2f} GB" for c in cells])
            ax.set_ylabel(ylabel)
            ax.set_title(SETTINGS[setting]["label"])
            ax.grid(axis="y", alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"DeepSpeed {result['meta']['deepspeed']} on CPU ({result['meta']['cores']} cores), "
                 f"checkpoint every {result['config']['k']} steps, {result['meta']['date']}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- GPU report
def gpu_report(seconds_budget: float = 120.0) -> dict:
    """With an NVIDIA GPU: pinned D2H bandwidth, this engine's snapshot bandwidth and stall for a
    save overlapped with compute, NVML samples of PCIe throughput and memory during it, and
    the save's persist throughput against the disk's, measured after it in the same directory
    (:func:`storage_bandwidth`): issue #4's persist target where the host cores are idle."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
        return {"available": False, "reason": f"no NVIDIA GPU/driver found ({type(exc).__name__}: {exc})"}
    if count == 0:
        return {"available": False, "reason": "no NVIDIA GPU/driver found (NVML reports 0 devices)"}
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": "NVML sees a GPU but this torch build has no CUDA"}
    from deepspeed_async_ckpt.core import AsyncCheckpointer
    from deepspeed_async_ckpt.config import AsyncCheckpointConfig

    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    name = pynvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else name
    nbytes = 2 << 30
    chunk = 64 << 20
    state = {f"t{i}": torch.randn(chunk // 4, device="cuda") for i in range(nbytes // chunk)}
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    flat = next(iter(state.values())).view(torch.uint8)
    for _ in range(3):
        host.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in state.values():
        host.copy_(t.view(torch.uint8), non_blocking=True)
    torch.cuda.synchronize()
    pinned_gbps = nbytes / (time.perf_counter() - t0) / GB

    samples: list[dict] = []
    unsupported: dict[str, str] = {}  # a query this GPU or VM refuses (PCIe counters often are)
    stop = threading.Event()

    def query(key: str, fn: Callable[[], Any]) -> Any:
        if key in unsupported:
            return None
        try:
            return fn()
        except pynvml.NVMLError as exc:
            unsupported[key] = f"{type(exc).__name__}: {exc}"
            return None

    def sample() -> None:
        while not stop.is_set():
            mem = query("mem_used_bytes", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used)
            samples.append({"t": time.perf_counter(),
                            "pcie_tx_kbps": query("pcie_tx_kbps", lambda: pynvml.nvmlDeviceGetPcieThroughput(
                                handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)),
                            "pcie_rx_kbps": query("pcie_rx_kbps", lambda: pynvml.nvmlDeviceGetPcieThroughput(
                                handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)),
                            "mem_used_bytes": mem})
            stop.wait(0.02)

    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    matmul_s = (time.perf_counter() - t0) / 10
    copy_s = nbytes / (pinned_gbps * GB)
    compute_iters = max(1, math.ceil(1.5 * copy_s / matmul_s))  # compute longer than the copy
    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, "bench_out")) as d:
        results = []
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ck = AsyncCheckpointer(AsyncCheckpointConfig(enabled=True, host_buffer_gb=3))
        try:
            for i in range(2):  # the first save allocates the pinned pool
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = ck.begin(os.path.join(d, f"c{i}"), tag=f"c{i}")
                ck.save(state, os.path.join(d, f"c{i}", "state.pt"))
                ck.end()
                t_saved = time.perf_counter()
                staged: list[float] = []
                watcher = threading.Thread(target=lambda: (h.wait_staged(), staged.append(time.perf_counter())))
                watcher.start()  # waits on CUDA events: notes when the last copy completed
                for _ in range(compute_iters):  # "forward+backward", longer than the copy
                    a @ a
                torch.cuda.synchronize()
                tw = time.perf_counter()
                ck.fence()  # before the "optimizer step": the stream waits for the copies
                torch.cuda.synchronize()
                t_fenced = time.perf_counter()
                watcher.join()
                t_staged = staged[0]
                ck.wait()
                results.append({"save_s": t_saved - t0, "fence_wait_s": t_fenced - tw,
                                "stall_s": (t_saved - t0) + (t_fenced - tw),
                                "snapshot_s": t_staged - t0, "snapshot_gbps": nbytes / (t_staged - t0) / GB,
                                "persist_s": h.times["committed"] - t0})
        finally:
            ck.close()
            stop.set()
            sampler.join()
        try:  # the same bytes to the same disk, with the engine's fsync policy, right after
            storage = storage_bandwidth(d, nbytes, reps=2)
        except Exception as exc:  # reported, not fatal: the GPU figures above stand
            storage = {"error": f"{type(exc).__name__}: {exc}"}
    steady = results[-1]
    compute_s = compute_iters * matmul_s
    snapshot_fraction = steady["snapshot_gbps"] / pinned_gbps
    persist_gbps = nbytes / steady["persist_s"] / GB
    disk_gbps = storage.get("fsync_gbps")
    persist_fraction = persist_gbps / disk_gbps if disk_gbps else None

    def peak(key: str) -> float:
        return max((s[key] for s in samples if s[key] is not None), default=0)

    return {
        "available": True, "device": name, "bytes": nbytes, "pinned_d2h_gbps": pinned_gbps,
        "compute_s": compute_s, "copy_s_at_pinned": copy_s, "saves": results,
        "snapshot_fraction_of_pinned": snapshot_fraction,
        "persist_gbps": persist_gbps, "storage": storage,
        "persist_fraction_of_storage": persist_fraction,
        "targets": {"snapshot_fraction": {"value": snapshot_fraction, "target": 0.85,
                                          "met": snapshot_fraction >= 0.85},
                    # "close to zero" when forward+backward outlasts the copy: read as under 5% of it
                    "stall_fraction_of_compute": {"value": steady["stall_s"] / compute_s, "target": 0.05,
                                                  "met": steady["stall_s"] < 0.05 * compute_s},
                    "persist_fraction": {"value": persist_fraction, "target": 0.8,
                                         "met": persist_fraction is not None and persist_fraction >= 0.8}},
        "nvml": {"samples": len(samples), "unsupported": unsupported,
                 "pcie_tx_peak_gbps": peak("pcie_tx_kbps") * 1024 / GB,
                 "pcie_rx_peak_gbps": peak("pcie_rx_kbps") * 1024 / GB,
                 "mem_used_peak_bytes": peak("mem_used_bytes"),
                 "trace": samples[:: max(1, len(samples) // 200)]},
    }


# --------------------------------------------------------------------------- main
def machine_info() -> dict:
    import deepspeed
    import torch

    top = subprocess.run(["top", "-bn1"], capture_output=True, text=True).stdout.splitlines()[:12] \
        if shutil.which("top") else []
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    def read(path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return None

    # Kernel memory management dominates page-fault cost on this kind of VM: record its setup.
    kernel = {"release": platform.release(),
              "transparent_hugepage": read("/sys/kernel/mm/transparent_hugepage/enabled"),
              "damon_kdamond_0": read("/sys/kernel/mm/damon/admin/kdamonds/0/state"),
              "damon_scheme_0_action": read("/sys/kernel/mm/damon/admin/kdamonds/0/contexts/0/schemes/0/action"),
              "swap_total_kb": next((ln.split()[1] for ln in (read("/proc/meminfo") or "").splitlines()
                                     if ln.startswith("SwapTotal")), None)}
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "kernel": kernel,
            "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "cuda": torch.cuda.is_available(), "loadavg": os.getloadavg(), "top": top}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.25,1,2", help="checkpoint sizes in GB (1e9 bytes), comma list")
    p.add_argument("--settings", default="1rank,2rank", help=f"comma list of {', '.join(SETTINGS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--k", type=int, default=10, help="training steps per checkpoint")
    p.add_argument("--hidden", type=int, default=2048, help="MLP width (layers follow from --sizes)")
    p.add_argument("--batch", type=int, default=6, help="micro-batch per rank")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before measuring")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed checkpoints per engine, each after its own paired baseline; "
                        "every figure is the median over them (default 3; 1 with --quick)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2),
                   help="DeepSpeed ZeRO stage (0: one model-states file written by rank 0; 1/2: "
                        "per-rank optimizer files, but DeepSpeed's decoupled engine cannot send "
                        "ZeRO optimizer state to its writer process)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (< 1 min): 0.02 GB, hidden 512, K=3, one warm-up step, one "
                        "repeat unless --repeats is given")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "bench_results", "latest.json"),
                   help="JSON result; the PNG goes next to it (.png)")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: the ranks' glibc malloc keeps freed memory (MALLOC_MMAP_MAX_=0, "
                        "MALLOC_TRIM_THRESHOLD_ huge), as a GPU job's host memory stays put; "
                        "default: glibc's defaults (the training step then page-faults its "
                        "gradients every step and its speed depends on heap history)")
    p.add_argument("--saves", type=int, default=5,
                   help="checkpoints every K steps per engine, from which its lost time is computed "
                        "(default 5; 2 with --quick)")
    p.add_argument("--lost", action="store_true",
                   help="the lost-time run: by default 1rank, this engine (async) and DS TorchCheckpointEngine "
                        "(--settings and --engines override them), one paired repeat (about 10 minutes at the default sizes on 2 idle cores)")
    p.add_argument("--async-config", default="{}",
                   help='this engine\'s async_checkpoint keys beyond the defaults (JSON), e.g. '
                        '\'{"pace_writes": true}\'')
    p.add_argument("--raw", action="store_true", help="also write every rank's raw measurements")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--work-dir", default=os.path.join(REPO, "bench_out", "bench"),
                   help="scratch directory for checkpoints (same disk as the repo); emptied after")
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker launch")
    p.add_argument("--gpu-report", action="store_true",
                   help="only the NVML GPU report (PCIe throughput, memory during a save)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.hidden, args.k, args.warmup = "0.02", 512, 3, 1
    if args.lost:  # 1 rank with a spare core, against TorchCheckpointEngine, unless named
        given = argv if argv is not None else sys.argv[1:]
        if not any(a.startswith("--settings") for a in given):
            args.settings = "1rank"
        if not any(a.startswith("--engines") for a in given):
            args.engines = "async,ds_torch"
        args.repeats = 1 if args.repeats is None else args.repeats
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.quick and "--saves" not in (argv if argv is not None else sys.argv[1:]):
        args.saves = 2
    if args.saves < 1:
        p.error(f"--saves: must be at least 1, got {args.saves}")
    if args.repeats < 1:
        p.error(f"--repeats: must be at least 1, got {args.repeats}")
    try:
        if not isinstance(json.loads(args.async_config), dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        p.error(f"--async-config: a JSON object of async_checkpoint keys, got {args.async_config!r} ({exc})")

    if args.gpu_report:
        out = args.out if "--out" in (argv or sys.argv) else os.path.join(REPO, "docs", "bench_results", "gpu_report.json")
        os.makedirs(os.path.join(REPO, "bench_out"), exist_ok=True)
        rep = gpu_report()
        if not rep["available"]:
            print("no NVIDIA GPU/driver found: --gpu-report skipped")
            print(f"  ({rep['reason']})")
        else:
            print(f"{rep['device']}: pinned D2H {rep['pinned_d2h_gbps']:.1f} GB/s, engine snapshot "
                  f"{rep['saves'][-1]['snapshot_gbps']:.1f} GB/s ({100 * rep['snapshot_fraction_of_pinned']:.0f}%), "
                  f"stall {fmt_s(rep['saves'][-1]['stall_s'])}, PCIe TX peak {rep['nvml']['pcie_tx_peak_gbps']:.1f} GB/s, "
                  f"persist {rep['persist_gbps']:.2f} GB/s, " +
                  (f"{100 * rep['persist_fraction_of_storage']:.0f}% of the disk's "
                   f"{rep['storage']['fsync_gbps']:.2f} GB/s fsync'd" if rep["persist_fraction_of_storage"]
                   else f"the disk not measured ({rep['storage'].get('error')})"))
        _write_json(out, {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds")}, "gpu": rep})
        print(f"wrote {out}")
        return 0

    sizes = [float(s) for s in args.sizes.split(",") if s]
    settings = [s for s in args.settings.split(",") if s]
    engines = [e for e in args.engines.split(",") if e]
    for s in settings:
        if s not in SETTINGS:
            p.error(f"--settings: unknown {s!r}; allowed: {', '.join(SETTINGS)}")
    for e in engines:
        if e not in ENGINES:
            p.error(f"--engines: unknown {e!r}; allowed: {', '.join(ENGINES)}")
    zero_stage = args.zero_stage
    work = scratch_dir(args.work_dir)  # refuses a directory these scripts did not make
    os.makedirs(os.path.join(work, "logs"))
    t_start = time.perf_counter()
    load = ForeignLoad().start()
    meta = machine_info()
    if meta["loadavg"][0] > 0.5:
        print(f"note: load average {meta['loadavg'][0]:.2f} at start: the machine is not idle, "
              "figures will be noisier", flush=True)
    print("micro-benchmarks ...", flush=True)
    micro = micro_benchmarks(work, 256 << 20)
    # Ranks run DeepSpeed on CPU with one thread each, importing this working tree's package.
    worker_env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    worker_env.update(MALLOC_KEEP if args.malloc == "keep" else {})
    cells: dict = {}
    raw: dict = {}
    for setting in settings:
        nproc = SETTINGS[setting]["nproc"]
        cells[setting] = {}
        child_errors: list[str] = []
        for size in sizes:
            layers = layers_for(size, args.hidden, zero_stage)
            tag = f"{setting}_{size:g}GB"
            prefix = os.path.join(work, tag)
            # The disk's bandwidth drifts (a VM's virtual disk): measured right before each cell.
            storage = storage_bandwidth(work, int(size * GB), reps=2)
            print(f"{tag}: {nproc} rank(s), hidden {args.hidden} x {layers} layers; disk "
                  f"{storage['fsync_gbps']:.2f} GB/s with fsync, {storage['nofsync_gbps']:.2f} without ...",
                  flush=True)
            wargs = ["--hidden", str(args.hidden), "--layers", str(layers), "--batch", str(args.batch),
                     "--k", str(args.k), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                     "--saves", str(args.saves),
                     "--engines", ",".join(engines),
                     "--work-dir", os.path.join(work, tag), "--result", prefix,
                     "--zero-stage", str(zero_stage), "--async-config", args.async_config,
                     # probed once per setting, by its first worker
                     "--decoupled-probe", os.path.join(work, f"{setting}_decoupled_probe.json")]
            t_cell = time.perf_counter()
            failure = None
            try:
                codes = launch(WORKER, wargs, nproc, args.timeout, env=worker_env, cwd=REPO,
                               log_prefix=os.path.join(work, "logs", tag))
                if any(codes):
                    failure = f"worker exit codes {codes}"
            except TimeoutError as exc:  # every rank was killed
                failure = str(exc)
            wall = time.perf_counter() - t_cell
            cell: dict = {"size_gb": size, "layers": layers, "hidden": args.hidden, "nproc": nproc,
                          "worker_wall_s": wall, "storage": storage}
            time.sleep(2 * load.interval)  # a sample after the cell
            cell["foreign"] = _foreign(load, t_cell, t_cell + wall)
            try:
                if failure:
                    raise RuntimeError(f"{failure}: {_tail(os.path.join(work, 'logs', tag + '.rank0.log'))}")
                ranks = []
                for r in range(nproc):
                    with open(f"{prefix}.rank{r}.json", encoding="utf-8") as f:
                        ranks.append(json.load(f))
                raw[tag] = ranks
                cell.update(summarize(ranks, storage, load))
                _add_child_errors(cell, os.path.join(work, "logs", tag), child_errors)
                cell["size_gb"] = cell["expected_bytes"] / GB
                cell["breakdown"] = breakdown(micro, storage, cell["expected_bytes"])
                cell["targets"] = targets(cell, storage)
                a = cell["engines"].get("async", {})
                al, tl = a.get("lost") or {}, cell["engines"].get("ds_torch", {}).get("lost") or {}
                busy = cell["foreign"]["foreign_cpu_s"]
                r = al.get("torch_over_this")
                print(f"  step {fmt_s(cell['steps']['step_s'])}; lost per checkpoint: async median "
                      f"{fmt_s(al.get('median_s'))} (worst {fmt_s(al.get('worst_s'))}), DS Torch "
                      f"{fmt_s(tl.get('median_s'))}{f', {r:.1f}x' if r else ''}; async stall {fmt_s(a.get('stall_s'))}, "
                      f"overhead {100 * a.get('overhead', float('nan')):+.1f}%; worker {wall:.0f} s; "
                      f"other processes used {busy if busy is not None else float('nan'):.1f} CPU-s meanwhile",
                      flush=True)
            except Exception as exc:
                cell["error"] = f"{type(exc).__name__}: {exc}"
                print(f"  FAILED: {cell['error']}", flush=True)
            cells[setting][f"{size:g}"] = cell
    load.stop()
    meta["loadavg_end"] = os.getloadavg()
    if len(load.samples) > 1:
        meta["foreign_cpu_s"] = load.cpu_between(load.samples[0][0], load.samples[-1][0])
        meta["kernel_threads_cpu_s"] = load.cpu_between(load.samples[0][0], load.samples[-1][0], kernel=True)
    meta["top_end"] = subprocess.run(["top", "-bn1"], capture_output=True, text=True).stdout.splitlines()[:12] \
        if shutil.which("top") else []
    meta["wall_s"] = time.perf_counter() - t_start
    meta["command"] = " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:]))
    result = {
        "meta": meta,
        "config": {"sizes_gb": sizes, "settings": settings, "engines": engines, "k": args.k,
                   "repeats": args.repeats, "saves": args.saves,
                   "hidden": args.hidden, "batch": args.batch, "warmup": args.warmup,
                   "zero_stage": zero_stage, "dtype": "fp32", "optimizer": "torch Adam (fused)",
                   "bytes_per_param": bytes_per_param(zero_stage),
                   "async_checkpoint": "enabled, all other keys default (xxh128, fsync, 4 writer threads, 8 GiB pool)"
                   + (f", and {args.async_config}" if json.loads(args.async_config) else ""),
                   "malloc": args.malloc, "malloc_env": MALLOC_KEEP if args.malloc == "keep" else {}},
        "micro": micro,
        "cells": cells,
        "gpu": {"available": False, "reason": "not measured in this run; see --gpu-report"},
    }
    if args.raw:  # every rank's every step: large, so not in the results committed to docs/
        result["raw"] = raw
    print(lost_table(result))
    print(table(result))
    print(targets_text(result))
    print(breakdown_text(result))
    _write_json(args.out, result)
    print(f"\nwrote {args.out}")
    if not args.no_plot:
        png = os.path.splitext(args.out)[0] + ".png"
        plot(result, png)
        print(f"wrote {png}")
    print(f"total {meta['wall_s']:.0f} s; load average at start {meta['loadavg'][0]:.2f}, "
          f"at end {meta['loadavg_end'][0]:.2f}; other processes used "
          f"{meta['foreign_cpu_s'] or 0:.0f} CPU-s of the {meta['cores'] * meta['wall_s']:.0f} available")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
