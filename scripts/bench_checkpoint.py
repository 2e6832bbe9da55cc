"""Checkpoint benchmark: training stall, persist throughput and end-to-end overhead of this
package's engine against DeepSpeed's engines and torch DCP, measured in one run.

    PYTHONPATH=. python scripts/bench_checkpoint.py --out docs/bench_results/latest.json
    PYTHONPATH=. python scripts/bench_checkpoint.py --quick --out bench_out/quick.json   # a smoke run
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
again every step, and whether it does depends on the heap's history (docs/benchmarks.md,
Method). That makes the baseline, and so every overhead figure, a coin toss. A GPU job's host memory
does not churn like that either. ``--malloc default`` measures glibc's defaults.

The headline, per engine: **training time lost per checkpoint** (``bench.lost_time``), the median
and the worst over ``--saves`` checkpoints made every K steps as a training loop makes them
(the engine's first ones in the process, so one-time costs show in the worst):

  lost        save call + the extra time of every step until the next save (step time minus
              the baseline step; the fence wait is inside the first of them) + any wait for the
              last save once its K steps are done. Baseline step: the median step of the K
              steps before the engine's first save and the K steps after its last one
              completed, the same process with no checkpoint in flight. Against DS
              TorchCheckpointEngine's lost time, counted the same way, as a ratio.

The lost-time run the docs quote (1 rank, this engine and TorchCheckpointEngine, 0.25/1/2 GB,
K=10):

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
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "scripts", "bench_worker.py")
sys.path.insert(0, REPO)  # this checkout's package, before an installed one
from deepspeed_async_ckpt.bench.bandwidth import MALLOC_KEEP, micro_benchmarks, storage_bandwidth  # noqa: E402
from deepspeed_async_ckpt.bench.engines import ENGINES, SETTINGS  # noqa: E402
from deepspeed_async_ckpt.bench.figures import add_child_errors, breakdown, foreign, log_tail, summarize  # noqa: E402
from deepspeed_async_ckpt.bench.foreign_load import ForeignLoad  # noqa: E402
from deepspeed_async_ckpt.bench.gpu_report import gpu_report  # noqa: E402
from deepspeed_async_ckpt.bench.machine import machine_info  # noqa: E402
from deepspeed_async_ckpt.bench.plot import plot  # noqa: E402
from deepspeed_async_ckpt.bench.sizing import GB, bytes_per_param, layers_for  # noqa: E402
from deepspeed_async_ckpt.bench.tables import breakdown_text, fmt_s, lost_table, table  # noqa: E402
from deepspeed_async_ckpt.bench.targets import targets, targets_text  # noqa: E402
from deepspeed_async_ckpt.tools.launch import launch, scratch_dir  # noqa: E402


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
        rep = gpu_report(os.path.join(REPO, "bench_out"))
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
            cell["foreign"] = foreign(load, t_cell, t_cell + wall)
            try:
                if failure:
                    raise RuntimeError(f"{failure}: {log_tail(os.path.join(work, 'logs', tag + '.rank0.log'))}")
                ranks = []
                for r in range(nproc):
                    with open(f"{prefix}.rank{r}.json", encoding="utf-8") as f:
                        ranks.append(json.load(f))
                raw[tag] = ranks
                cell.update(summarize(ranks, storage, load))
                add_child_errors(cell, os.path.join(work, "logs", tag), child_errors)
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
