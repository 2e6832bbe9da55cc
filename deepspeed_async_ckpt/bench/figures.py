"""The benchmark's figures from its ranks' records: stall, persist, overhead and lost time per
engine, the machine's load beside them, and the persist path's breakdown.
"""

from __future__ import annotations

import statistics

from deepspeed_async_ckpt.bench.foreign_load import ForeignLoad
from deepspeed_async_ckpt.bench.lost_time import baseline_step, lost_time, ratio, summary
from deepspeed_async_ckpt.bench.sizing import GB


def log_tail(path: str, n: int = 6) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:]).strip()
    except OSError:
        return ""


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


BUSY_CORES = 0.05  # other processes' average CPU use in a window above which it is flagged


def foreign(load: "ForeignLoad | None", t0: float, t1: float) -> dict:
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
    row.update(foreign(load, timed[0]["t0"], timed[0]["t1"]))  # during the timed window
    p0 = runs[0]["paired_baseline"]
    row["paired_foreign"] = foreign(load, p0["t0"], p0["t1"])
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
    """Training time lost per checkpoint (``bench.lost_time``) of one engine's cadence, ``per``
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
        "baseline_foreign": [foreign(load, b["t0"], b["t1"]) for b in r0["baseline"]],
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


def add_child_errors(cell: dict, log_prefix: str, found: list[str]) -> None:
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
