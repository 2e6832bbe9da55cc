"""The capacity planner: :func:`make_plan` applies the formulas (:mod:`.formulas`, numbered
there) to validated inputs (:mod:`.plan_inputs`) and returns one frozen :class:`Plan`.

Answers, before any hardware is bought or ``--save-interval`` is chosen: how big is a
checkpoint of this model, how many GPUs write it, what storage bandwidth that takes, how often
the cluster fails, and how often to checkpoint. Pure standard-library math: no torch /
deepspeed / megatron. ``ds-async-ckpt plan`` (:mod:`.plan_cli`) is its command line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from .formulas import (PCIE_D2H_GBPS, SECONDS_PER_DAY, TARGETS, busiest_node_bytes, bytes_per_param,
                       cluster_mttf_s, estimate_params, interval_for_k_s, lazy_stall_s,
                       max_cost_for_overhead_s, nodes_for, required_gbps, schedule, transfer_time_s,
                       write_time_s, writing_gpu_count)
from .memory_plan import MemoryPlan, plan_memory
from .plan_inputs import ModelShape, PlanInputError, PlanInputs

__all__ = ["MemoryPlan", "ModelShape", "Plan", "PlanInputError", "PlanInputs", "make_plan"]


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Plan:
    """Planning results; the unit of every number is in its field name."""

    inputs: PlanInputs
    # Size
    params: int
    params_estimated: bool  # True when derived from the shape
    bytes_per_param: int
    weights_bytes: int
    master_weights_bytes: int
    optimizer_bytes: int
    total_bytes: int
    # Writers
    total_gpus: int
    total_nodes: int
    writing_gpus: int
    writing_nodes: int
    bytes_per_writing_gpu: float
    bytes_per_writing_node: float  # busiest writing node
    # Bandwidth
    write_time_s: float
    required_checkpoint_time_s: Optional[float]
    required_write_gbps: Optional[float]  # aggregate
    required_write_gbps_per_node: Optional[float]
    required_write_gbps_per_gpu: Optional[float]
    required_d2h_gbps: Optional[float]  # overhead target, lazy mode
    read_bytes: int
    read_bytes_per_node: float  # busiest node
    restore_time_s: Optional[float]
    # Failures & interval
    mttf_s: float
    stall_s: float  # C used for the interval (lazy or sync per mode)
    young_daly_interval_s: float  # raw sqrt(2*C*M)
    interval_s: float  # chosen interval
    interval_basis: str  # "young_daly" | "write_time_floor" | "k_per_failure"
    save_interval_steps: Optional[int]
    checkpoints_per_failure: float
    checkpoints_per_day: float
    write_bytes_per_day: float
    avg_write_gbps: float
    checkpoint_overhead_fraction: float
    rework_fraction: float
    restart_fraction: float
    lost_fraction: float
    max_stall_for_target_s: Optional[float]
    target: Optional[str]
    target_met: Optional[bool]
    # Stall: both modes side by side
    d2h_gbps: float
    lazy_copy_s: float
    lazy_stall_s: float
    sync_stall_s: float
    lazy_interval_s: float
    lazy_lost_fraction: float
    sync_interval_s: float
    sync_lost_fraction: float
    lazy_host_buffer_bytes_per_node: float  # pinned staging on the busiest node
    memory: Optional[MemoryPlan] = None  # the memory tier (formula 11), with ``inputs.memory``
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready dict (nested inputs included, tuples become lists)."""
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        if self.memory is not None:  # the async_checkpoint.memory object it suggests
            d["memory"]["config"] = self.memory.config()
        return d


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------

def make_plan(inputs: PlanInputs) -> Plan:
    """Apply formulas 1-10 to validated inputs."""
    i = inputs
    warnings: list[str] = []

    # Size (1, 2)
    params = i.params if i.params is not None else estimate_params(i.shape)
    w_b, m_b, o_b = bytes_per_param(i.precision, i.optimizer)
    weights, master, moments = params * w_b, params * m_b, params * o_b
    total = weights + master + moments

    # Writers (3)
    total_gpus = i.tp * i.pp * i.dp
    writing_gpus = writing_gpu_count(i.tp, i.pp, i.dp, i.writers)
    per_gpu = total / writing_gpus
    per_node = busiest_node_bytes(per_gpu, writing_gpus, i.gpus_per_node)

    # Write and restore (4, 5)
    write_s = write_time_s(total, per_node, i.storage_write_gbps, i.storage_write_gbps_per_node)
    read_total = total * i.dp
    read_node = busiest_node_bytes(total / (i.tp * i.pp), total_gpus, i.gpus_per_node)
    restore_s = write_time_s(read_total, read_node, i.storage_read_gbps, i.storage_read_gbps_per_node)

    # Stall (6) and failures (7)
    d2h = i.d2h_gbps if i.d2h_gbps is not None else PCIE_D2H_GBPS[i.pcie_gen]
    lazy_copy = transfer_time_s(per_gpu, d2h)
    lazy = lazy_stall_s(per_gpu, d2h, i.step_time_s)
    sync = write_s
    cost = lazy if i.mode == "lazy" else sync
    mttf = cluster_mttf_s(i.mtbf_hours, total_gpus)

    # Interval (8) and loss (9), both modes side by side
    _, lazy_interval, lazy_lost = schedule(lazy, mttf, write_s, i.restart_s)
    _, sync_interval, sync_lost = schedule(sync, mttf, write_s, i.restart_s)
    yd_raw, interval, _ = schedule(cost, mttf, write_s, i.restart_s)
    if i.target_checkpoints_per_failure is not None:
        interval = interval_for_k_s(mttf, i.target_checkpoints_per_failure)
        basis = "k_per_failure"
        if interval < write_s:
            warnings.append(f"interval {interval:.4g} s is shorter than the write time "
                            f"{write_s:.4g} s: writes would queue up")
    elif yd_raw < write_s:
        basis = "write_time_floor"
        warnings.append(f"Young/Daly interval {yd_raw:.4g} s is shorter than the write time; "
                        f"using the write time {write_s:.4g} s")
    else:
        basis = "young_daly"
    overhead = cost / interval
    rework = interval / (2.0 * mttf)
    restart = i.restart_s / mttf
    lost = overhead + rework + restart
    if interval > mttf:
        warnings.append("interval exceeds the cluster MTTF: the first-order loss model is optimistic")
    if lost >= 1.0:
        warnings.append("expected lost fraction >= 100%: the job would make no progress")
    per_day = SECONDS_PER_DAY / interval
    steps = None
    if i.step_time_s:
        steps = max(1, round(interval / i.step_time_s))
        if basis != "k_per_failure":  # whole steps, never shorter than the write (8): round()
            # alone would give 1 step of 7 s for a 9.8 s write
            steps = max(steps, math.ceil(write_s / i.step_time_s * (1 - 1e-12)))

    # Targets (10)
    target = next((name for name in TARGETS if getattr(i, name) is not None), None)
    required_time = required_d2h = max_stall = None
    target_met = None
    if i.target_checkpoint_time_s is not None:
        required_time = i.target_checkpoint_time_s
        target_met = write_s <= required_time
        if not target_met:
            warnings.append(f"write time {write_s:.4g} s exceeds target_checkpoint_time_s "
                            f"{required_time:g} s")
    elif i.target_overhead_fraction is not None:
        max_stall = max_cost_for_overhead_s(i.target_overhead_fraction, mttf, i.restart_s)
        target_met = lost <= i.target_overhead_fraction
        if not target_met:
            warnings.append(f"lost fraction {lost:.4g} exceeds target_overhead_fraction "
                            f"{i.target_overhead_fraction:g}")
        if max_stall > 0:
            required_time = max_stall
            required_d2h = required_gbps(per_gpu, max_stall + (i.step_time_s or 0.0))
        else:
            warnings.append("restart time alone exceeds the overhead target")
    elif i.target_checkpoints_per_failure is not None:
        target_met = write_s <= interval

    # Memory tier (11)
    memory = None
    if i.memory:
        memory, notes = plan_memory(
            weights_bytes=weights, master_and_moments_bytes=master + moments, gpus=total_gpus,
            gpus_per_node=i.gpus_per_node, model_parallel=i.tp * i.pp, copy_s=lazy_copy, lazy_stall_s=lazy,
            stall_s=cost, write_s=write_s, mttf_s=mttf, restart_s=i.restart_s, step_time_s=i.step_time_s,
            survives=i.memory_survives_fraction, keep_last=i.memory_keep_last, memory_save_s=i.memory_save_s,
            disk_save_s=i.disk_save_s, memory_restart_s=i.memory_restart_s)
        warnings += notes
        if i.host_memory_gb_per_node is not None:
            need = memory.host_bytes_per_node + per_node  # the keeper's slots and the pinned pool
            if need > i.host_memory_gb_per_node * 1e9:
                warnings.append(f"the memory tier needs {need / 1e9:.4g} GB of host memory per node "
                                f"({i.memory_keep_last} + 1 checkpoints of {memory.node_bytes / 1e9:.4g} GB and "
                                f"{per_node / 1e9:.4g} GB of pinned staging), more than --host-memory-gb "
                                f"{i.host_memory_gb_per_node:g}: lower --memory-keep-last")

    return Plan(
        inputs=i,
        params=params,
        params_estimated=i.params is None,
        bytes_per_param=w_b + m_b + o_b,
        weights_bytes=weights,
        master_weights_bytes=master,
        optimizer_bytes=moments,
        total_bytes=total,
        total_gpus=total_gpus,
        total_nodes=nodes_for(total_gpus, i.gpus_per_node),
        writing_gpus=writing_gpus,
        writing_nodes=nodes_for(writing_gpus, i.gpus_per_node),
        bytes_per_writing_gpu=per_gpu,
        bytes_per_writing_node=per_node,
        write_time_s=write_s,
        required_checkpoint_time_s=required_time,
        required_write_gbps=None if required_time is None else required_gbps(total, required_time),
        required_write_gbps_per_node=None if required_time is None else required_gbps(per_node, required_time),
        required_write_gbps_per_gpu=None if required_time is None else required_gbps(per_gpu, required_time),
        required_d2h_gbps=required_d2h,
        read_bytes=read_total,
        read_bytes_per_node=read_node,
        restore_time_s=restore_s,
        mttf_s=mttf,
        stall_s=cost,
        young_daly_interval_s=yd_raw,
        interval_s=interval,
        interval_basis=basis,
        save_interval_steps=steps,
        checkpoints_per_failure=mttf / interval,
        checkpoints_per_day=per_day,
        write_bytes_per_day=total * per_day,
        avg_write_gbps=required_gbps(total, interval),
        checkpoint_overhead_fraction=overhead,
        rework_fraction=rework,
        restart_fraction=restart,
        lost_fraction=lost,
        max_stall_for_target_s=max_stall,
        target=target,
        target_met=target_met,
        d2h_gbps=d2h,
        lazy_copy_s=lazy_copy,
        lazy_stall_s=lazy,
        sync_stall_s=sync,
        lazy_interval_s=lazy_interval,
        lazy_lost_fraction=lazy_lost,
        sync_interval_s=sync_interval,
        sync_lost_fraction=sync_lost,
        lazy_host_buffer_bytes_per_node=per_node,
        memory=memory,
        warnings=tuple(warnings),
    )
