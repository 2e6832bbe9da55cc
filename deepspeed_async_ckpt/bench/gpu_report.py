"""With an NVIDIA GPU: the snapshot's and persist's bandwidth and stall, beside NVML samples."""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from typing import Any, Callable

from deepspeed_async_ckpt.bench.bandwidth import storage_bandwidth
from deepspeed_async_ckpt.bench.sizing import GB


def gpu_report(work_root: str, seconds_budget: float = 120.0) -> dict:
    """With an NVIDIA GPU: pinned D2H bandwidth, this engine's snapshot bandwidth and stall for a
    save overlapped with compute, NVML samples of PCIe throughput and memory during it, and
    the save's persist throughput against the disk's, measured after it in the same directory
    (:func:`storage_bandwidth`): the persist target where the host cores are idle. Scratch files go under
    ``work_root``."""
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
    with tempfile.TemporaryDirectory(dir=work_root) as d:
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
