"""The checkpoint benchmark's results as text tables."""

from __future__ import annotations


from deepspeed_async_ckpt.bench.engines import ENGINE_LABELS, SETTINGS
from deepspeed_async_ckpt.bench.sizing import GB


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
