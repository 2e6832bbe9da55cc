"""The ``plan`` report: a :class:`~.capacity.Plan` as an aligned text table, one block per
section (size, writers, bandwidth, failures and interval, stall), in decimal units with three
significant figures.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from .capacity import Plan


def _num(x: float) -> str:
    """Three significant figures, no exponent."""
    if x == 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{digits}f}"


def _count(n: int) -> str:
    return f"{_num(n / 1e12)} trillion" if n >= 1e12 else f"{_num(n / 1e9)} billion"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{_num(n)} {unit}"
        n /= 1000.0
    return f"{_num(n)} EB"


def fmt_duration(s: float) -> str:
    if s < 120:
        return f"{_num(s)} s"
    if s < 2 * 3600:
        return f"{_num(s / 60)} min ({s:.0f} s)"
    if s < 10 * 86400:
        return f"{_num(s / 3600)} h ({s:.0f} s)"
    return f"{_num(s / 86400)} d ({s:.0f} s)"


def fmt_gbps(x: float) -> str:
    return f"{_num(x)} GB/s"


def fmt_pct(fraction: float) -> str:
    return f"{_num(fraction * 100)} %"


def _bandwidth_given(agg: Optional[float], node: Optional[float]) -> str:
    parts = []
    if agg is not None:
        parts.append(f"{fmt_gbps(agg)} aggregate")
    if node is not None:
        parts.append(f"{fmt_gbps(node)} per node")
    return " + ".join(parts)


def _sections(plan: Plan):
    i = plan.inputs
    w = plan.weights_bytes // plan.params
    mb = plan.master_weights_bytes // plan.params
    ob = plan.optimizer_bytes // plan.params
    size = [
        ("parameters", f"{plan.params:,} ({_count(plan.params)}"
                       + (", estimated from shape)" if plan.params_estimated else ")")),
        ("bytes per parameter", f"{plan.bytes_per_param} = {i.precision} weights {w} + fp32 master {mb}"
                                f" + {i.optimizer} moments {ob}"),
        ("weights", fmt_bytes(plan.weights_bytes)),
        ("fp32 master weights", fmt_bytes(plan.master_weights_bytes)),
        ("optimizer moments", fmt_bytes(plan.optimizer_bytes)),
        ("checkpoint total", fmt_bytes(plan.total_bytes)),
    ]
    writers = [
        ("layout", f"tp {i.tp} x pp {i.pp} x dp {i.dp} = {plan.total_gpus} GPUs on "
                   f"{plan.total_nodes} nodes ({i.gpus_per_node}/node)"),
        ("writers", f"{plan.writing_gpus} GPUs on {plan.writing_nodes} nodes "
                    + ("(one DP replica)" if i.writers == "replica" else "(balanced over all DP ranks)")),
        ("bytes per writing GPU", fmt_bytes(plan.bytes_per_writing_gpu)),
        ("bytes per writing node", fmt_bytes(plan.bytes_per_writing_node) + " (busiest node)"),
    ]
    bandwidth = [
        ("storage write", _bandwidth_given(i.storage_write_gbps, i.storage_write_gbps_per_node)),
        ("write time", fmt_duration(plan.write_time_s)),
    ]
    if plan.required_checkpoint_time_s is not None:
        if plan.target == "target_checkpoint_time_s":
            label, why = "target write time", ""
        else:
            label, why = "max sync write time", f" (keeps lost <= {fmt_pct(i.target_overhead_fraction)})"
        bandwidth += [
            (label, fmt_duration(plan.required_checkpoint_time_s) + why),
            ("  needs aggregate", fmt_gbps(plan.required_write_gbps)),
            ("  needs per node", fmt_gbps(plan.required_write_gbps_per_node)),
            ("  needs per writing GPU", fmt_gbps(plan.required_write_gbps_per_gpu)),
        ]
        if plan.required_d2h_gbps is not None:
            bandwidth.append(("  needs D2H (lazy)", fmt_gbps(plan.required_d2h_gbps)))
    bandwidth += [
        ("restore reads", f"{fmt_bytes(plan.read_bytes)} (full checkpoint x dp {i.dp}), "
                          f"{fmt_bytes(plan.read_bytes_per_node)} per node"),
    ]
    if plan.restore_time_s is not None:
        bandwidth.append(("restore time", f"{fmt_duration(plan.restore_time_s)} at "
                          + _bandwidth_given(i.storage_read_gbps, i.storage_read_gbps_per_node)))

    if plan.interval_basis == "k_per_failure":
        basis = f"k = {i.target_checkpoints_per_failure:g} per failure"
    else:
        basis = {"young_daly": "Young/Daly", "write_time_floor": "write time; Young/Daly is shorter"}[
            plan.interval_basis]
    failures = [
        ("cluster MTTF", f"{fmt_duration(plan.mttf_s)}: {i.mtbf_hours:g} h / {plan.total_gpus} GPUs"),
        ("checkpoint cost C", f"{fmt_duration(plan.stall_s)}, {i.mode} stall"),
        ("Young/Daly sqrt(2CM)", fmt_duration(plan.young_daly_interval_s)),
        ("interval", f"{fmt_duration(plan.interval_s)}, {basis}"),
    ]
    if plan.save_interval_steps is not None:
        failures.append(("save interval", f"{plan.save_interval_steps} steps of {i.step_time_s:g} s"))
    failures += [
        ("checkpoints per failure", _num(plan.checkpoints_per_failure)),
        ("checkpoints per day", _num(plan.checkpoints_per_day)),
        ("written per day", fmt_bytes(plan.write_bytes_per_day)),
        ("average write bandwidth", fmt_gbps(plan.avg_write_gbps)),
        ("lost: checkpoint stalls", fmt_pct(plan.checkpoint_overhead_fraction)),
        ("lost: rework", fmt_pct(plan.rework_fraction)),
        ("lost: restarts", fmt_pct(plan.restart_fraction)),
        ("lost total", fmt_pct(plan.lost_fraction)),
    ]
    if plan.max_stall_for_target_s is not None:
        failures.append(("max C for overhead target", fmt_duration(plan.max_stall_for_target_s)))
    if plan.target_met is not None:
        failures.append(("target met", "yes" if plan.target_met else "NO"))

    step = f"{i.step_time_s:g} s step" if i.step_time_s else "no step time"
    stall = [
        ("", "lazy", "sync"),
        ("what blocks training", f"D2H copy - step ({step})", "full storage write"),
        ("copy / write time", f"{fmt_duration(plan.lazy_copy_s)} at {fmt_gbps(plan.d2h_gbps)}",
         fmt_duration(plan.write_time_s)),
        ("stall per checkpoint", fmt_duration(plan.lazy_stall_s), fmt_duration(plan.sync_stall_s)),
        ("interval (Young/Daly)", fmt_duration(plan.lazy_interval_s), fmt_duration(plan.sync_interval_s)),
        ("lost total", fmt_pct(plan.lazy_lost_fraction), fmt_pct(plan.sync_lost_fraction)),
        ("pinned host memory/node", fmt_bytes(plan.lazy_host_buffer_bytes_per_node), "-"),
    ]
    out = [("Size", size), ("Writers", writers), ("Bandwidth", bandwidth),
           ("Failures & interval", failures), ("Stall", stall)]
    if plan.memory is not None:
        out.append(("Memory tier", _memory_rows(plan)))
        out.append(("Suggested config", [("async_checkpoint.memory", json.dumps(plan.memory.config()))]))
    return out


def _memory_rows(plan: Plan):
    m, i = plan.memory, plan.inputs
    steps = f" ({m.memory_interval_steps} steps)" if m.memory_interval_steps is not None else ""
    return [
        ("", "with memory tier", "disk only"),
        ("failures served from memory", f"{fmt_pct(m.survives_fraction)} (--memory-survives)", "-"),
        ("memory save cost C_m", fmt_duration(m.memory_save_s), "-"),
        ("disk save cost C", fmt_duration(m.disk_save_s), fmt_duration(m.disk_save_s)),
        ("restart", f"{fmt_duration(m.memory_restart_s)} from memory, {fmt_duration(i.restart_s)} from disk",
         fmt_duration(i.restart_s)),
        ("memory interval", f"{fmt_duration(m.memory_interval_s)}{steps}", "-"),
        ("disk interval", f"{fmt_duration(m.disk_interval_s)} (persist_every {m.persist_every})",
         fmt_duration(m.interval_without_s)),
        ("work lost per failure", fmt_duration(m.lost_per_failure_s), fmt_duration(m.lost_per_failure_without_s)),
        ("lost per day (rework + restarts)",
         f"{fmt_duration(m.lost_per_day_s)} ({_num(m.failures_per_day)} failures)",
         fmt_duration(m.lost_per_day_without_s)),
        ("lost total", fmt_pct(m.lost_fraction), fmt_pct(m.lost_fraction_without)),
        ("host memory per node", f"{fmt_bytes(m.host_bytes_per_node)} ({i.memory_keep_last} + 1 x "
                                 f"{fmt_bytes(m.node_bytes)})", "-"),
    ]


def format_plan(plan: Plan) -> str:
    """Aligned text table, one block per section."""
    sections = _sections(plan)
    label_w = max(len(row[0]) for _, rows in sections for row in rows)
    lines = []
    for title, rows in sections:
        if lines:
            lines.append("")
        lines.append(title)
        ncols = max(len(r) for r in rows)
        widths = [max(len(r[c]) for r in rows if len(r) > c) for c in range(1, ncols)]
        for row in rows:
            cells = [row[0].ljust(label_w)]
            for c, cell in enumerate(row[1:]):
                cells.append(cell.ljust(widths[c]) if c < len(row) - 2 else cell)
            lines.append(("  " + "   ".join(cells)).rstrip())
    if plan.warnings:
        lines += ["", "Warnings"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)
