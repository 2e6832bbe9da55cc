"""The memory tier in the capacity plan: formula 11 of :mod:`.formulas` applied to a plan's
figures, giving two intervals (memory and disk), the ``persist_every`` between them, the work lost
per failure with and without the tier, and the host memory each node's keeper needs.

The tier (``async_checkpoint.memory``, docs/tiers.md) commits every save in host memory that
outlives the training processes and writes every ``persist_every``-th to disk. A failure that
leaves the node (a software bug, an NCCL timeout, a network fault) restarts from memory; one that
takes the node out of the job (a faulty GPU, a host fault) restarts from disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .formulas import (SECONDS_PER_DAY, lost_fraction, memory_lost_fraction, memory_node_bytes,
                       young_daly_interval_s)

SAVE_CALL_S = 0.05
"""Training time a save call takes besides its copies, seconds: the save call measured 14-54 ms
for a 4.97 GB checkpoint on an H100 (docs/benchmarks.md). Added to the lazy stall as the default
cost of a memory save, and to the mode's stall as the default cost of a disk save (a disk save is
a memory save whose files are also written)."""

DEFAULT_SURVIVES = 0.3
"""The default share of failures after which the node's host memory serves the restart. In
Meta's Llama 3 405B run (16,384 H100s, 54 days, 419 unexpected interruptions, about one every
3 hours) 58.7% of the unexpected interruptions were GPU faults, after which the node leaves the
job and its memory copy with it; most of the other 41.3% (software bugs, network switches and
cables, NCCL timeouts) leave the node up, some (host hardware) do not. 0.3 is a conservative
share; planned restarts (preemption, upgrades, a job resubmitted) add more."""

GIB = 1 << 30
HEADROOM = 1.05
"""``max_gb`` suggested: the keeper's need with 5% for page rounding of each file."""


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The memory tier's figures; units in the field names."""

    survives_fraction: float
    keep_last: int
    memory_save_s: float  # C_m: training time one memory save costs
    memory_restart_s: float  # R_m: a restart from memory
    memory_copy_s: float  # the lazy copy a memory save waits for: the memory interval's floor
    young_daly_memory_interval_s: float  # sqrt(2 C_m M / s)
    memory_interval_s: float  # chosen (floored, whole steps)
    memory_interval_steps: Optional[int]
    disk_save_s: float  # C: training time one disk save costs
    young_daly_disk_interval_s: float  # sqrt(2 C M / (1 - s)), floored at the write time
    persist_every: int
    disk_interval_s: float  # persist_every * memory interval
    interval_without_s: float  # disk only, at the same C: sqrt(2 C M), floored at the write time
    lost_fraction: float
    lost_fraction_without: float
    lost_per_failure_s: float
    lost_per_failure_without_s: float
    failures_per_day: float
    lost_per_day_s: float  # rework and restarts, job time
    lost_per_day_without_s: float
    node_bytes: float  # one checkpoint in a node's keeper
    host_bytes_per_node: float  # (keep_last + 1) checkpoints
    max_gb: float  # suggested async_checkpoint.memory.max_gb (GiB)

    def config(self) -> dict:
        """The ``async_checkpoint.memory`` object this plan suggests."""
        return {"enabled": True, "persist_every": self.persist_every, "keep_last": self.keep_last,
                "max_gb": self.max_gb}


def plan_memory(*, weights_bytes: float, master_and_moments_bytes: float, gpus: int, gpus_per_node: int,
                model_parallel: int, copy_s: float, lazy_stall_s: float, stall_s: float, write_s: float,
                mttf_s: float, restart_s: float, step_time_s: Optional[float], survives: float, keep_last: int,
                memory_save_s: Optional[float], disk_save_s: Optional[float],
                memory_restart_s: Optional[float] = None) -> tuple[MemoryPlan, list[str]]:
    """Formula 11 on a plan's figures (``stall_s``: the mode's stall of formula 6): the
    :class:`MemoryPlan` and its warnings. Both columns, with the tier and disk only, use the same
    disk save cost."""
    warnings: list[str] = []
    cost_m = memory_save_s if memory_save_s is not None else lazy_stall_s + SAVE_CALL_S
    disk_cost_s = disk_save_s if disk_save_s is not None else stall_s + SAVE_CALL_S
    if disk_cost_s < cost_m:
        warnings.append(f"a disk save is given as cheaper ({disk_cost_s:.4g} s) than a memory save "
                        f"({cost_m:.4g} s), yet it is one plus its writes: check --disk-save-s and --memory-save-s")
    interval_s = max(young_daly_interval_s(disk_cost_s, mttf_s), write_s)
    yd_m = young_daly_interval_s(cost_m, mttf_s / survives)
    floor_m = max(copy_s, step_time_s or 0.0)  # a save cannot start before the last one's copy ends
    tau_m = max(yd_m, floor_m)
    steps = None
    if step_time_s:
        steps = max(1, round(tau_m / step_time_s))
        if steps * step_time_s < floor_m:
            steps += 1
        tau_m = steps * step_time_s
    if yd_m < floor_m:
        warnings.append(f"memory Young/Daly interval {yd_m:.4g} s is shorter than a save's copy "
                        f"{copy_s:.4g} s: using {tau_m:.4g} s")
    yd_d = max(young_daly_interval_s(disk_cost_s, mttf_s / (1.0 - survives)), write_s)
    k = max(1, round(yd_d / tau_m))
    if k * tau_m < write_s:  # the disk saves may not queue up
        k = math.ceil(write_s / tau_m)
    tau_d = k * tau_m
    r_m = restart_s if memory_restart_s is None else memory_restart_s
    lost = memory_lost_fraction(cost_m, disk_cost_s, tau_m, k, mttf_s, survives, restart_s, r_m)
    without = lost_fraction(disk_cost_s, interval_s, mttf_s, restart_s)
    per_failure = survives * (tau_m / 2.0 + r_m) + (1.0 - survives) * (tau_d / 2.0 + restart_s)
    per_failure_without = interval_s / 2.0 + restart_s
    per_day = SECONDS_PER_DAY / mttf_s
    node = memory_node_bytes(weights_bytes, master_and_moments_bytes, gpus, gpus_per_node, model_parallel)
    host = (keep_last + 1) * node
    return MemoryPlan(
        survives_fraction=survives, keep_last=keep_last, memory_save_s=cost_m, memory_restart_s=r_m, memory_copy_s=copy_s,
        young_daly_memory_interval_s=yd_m, memory_interval_s=tau_m, memory_interval_steps=steps,
        disk_save_s=disk_cost_s, young_daly_disk_interval_s=yd_d, persist_every=k, disk_interval_s=tau_d,
        interval_without_s=interval_s, lost_fraction=lost, lost_fraction_without=without,
        lost_per_failure_s=per_failure, lost_per_failure_without_s=per_failure_without,
        failures_per_day=per_day, lost_per_day_s=per_day * per_failure,
        lost_per_day_without_s=per_day * per_failure_without,
        node_bytes=node, host_bytes_per_node=host,
        max_gb=math.ceil(host * HEADROOM / GIB * 10) / 10,
    ), warnings
