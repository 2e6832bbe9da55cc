"""The checkpoint capacity formulas behind ``ds-async-ckpt plan``: one small pure function each.

The planner (:mod:`.capacity`) applies them to validated inputs (:mod:`.plan_inputs`).
Pure standard-library math: no torch / deepspeed / megatron.

Units
-----
Decimal units throughout: 1 GB = 1e9 bytes, 1 GB/s = 1e9 bytes/s.  Times are
in seconds except the per-accelerator MTBF input, which is in hours.  Every
numeric field of :class:`~.capacity.Plan` carries its unit in its name (``_bytes``,
``_s``, ``_gbps``, ``_per_day``, ``_fraction``); bare counts have none.

Formulas
--------
Notation: P parameters, h hidden size, f FFN hidden size, L layers, V vocab,
a attention heads, g query groups, TP/PP/DP the parallel degrees, G = TP*PP*DP
GPUs, n GPUs per node.

1. Parameters from a Megatron-style shape (:func:`estimate_params`).  Per
   transformer layer, with biases and LayerNorm (Megatron GPT defaults)::

       attention  qkv   h*(h + 2*kv) + (h + 2*kv)   kv = h*g/a (= h without GQA)
                  proj  h*h + h
       MLP        fc1   m*h*f + m*f                 m = 2 for SwiGLU, else 1
                  fc2   f*h + h
       norms      2 LayerNorms x 2h

   which without GQA/SwiGLU is 4h^2 + 2hf + 9h + f (= 12h^2 + 13h at f = 4h).
   Whole model: L * per_layer + 2h (final norm) + V*h (word embeddings)
   + V*h again when input and output embeddings are untied.  Rotary / no
   position embeddings are assumed (a learned absolute table adds seq*h,
   < 0.02 % for GPT-3).  Bias-free RMSNorm models differ only in the O(h)
   terms.

2. Bytes per parameter (:func:`bytes_per_param`) = weights + master + moments:
   weights 2 (bf16/fp16) or 4 (fp32); fp32 master copy 4 with bf16/fp16
   mixed precision, 0 with fp32 or with optimizer "none" (a weights-only
   checkpoint has no optimizer, hence no master copy); optimizer moments
   8 (adam/adamw: m and v in fp32), 4 (sgd: momentum), 0 (none).
   bf16 + adam = 2 + 4 + 8 = 14 B/param, so 175e9 params -> 2.45e12 bytes.

3. Writers (:func:`writing_gpu_count`, :func:`nodes_for`,
   :func:`busiest_node_bytes`).  "replica" (default): one data-parallel
   replica writes, TP*PP GPUs, packed on ceil(TP*PP/n) consecutive nodes.
   "balanced": shards are spread over the DP ranks so all G GPUs write.
   bytes/writing GPU = total / writers; bytes on the busiest writing node
   = min(n, writers) * bytes/writing GPU.

4. Write time (:func:`write_time_s`): aggregate bandwidth B gives total/B;
   per-node bandwidth B_node gives busiest-node bytes / B_node; with both,
   the larger (slower) of the two.  Bandwidth needed for a checkpoint time T:
   total/T aggregate, busiest-node bytes/T per node, bytes-per-GPU/T per GPU.

5. Restore: every DP replica reads the whole checkpoint, read bytes =
   total*DP, spread over all ceil(G/n) nodes; each GPU reads total/(TP*PP),
   the busiest node min(n, G) times that.  Restore time as in (4) with the
   read bandwidths.

6. Stall per checkpoint (time training is blocked), per writing GPU:
   sync  = the full write time of (4) (tensors copied and written at storage
           speed before training resumes);
   lazy  = max(0, bytes_per_writing_gpu / D2H - step_time) (:func:`lazy_stall_s`):
           only the pinned device-to-host copy not hidden behind the next
           forward/backward; the full copy time if no step time is given.
   D2H defaults by PCIe generation (measured pinned): gen3 12, gen4 25,
   gen5 53 GB/s.  The cost C used below is the lazy stall in lazy mode
   (default) and the sync stall in sync mode.  Lazy mode stages the busiest
   node's bytes in pinned host memory (lazy_host_buffer_bytes_per_node).

7. Failures (:func:`cluster_mttf_s`): independent failures, so the cluster
   MTTF M = per-GPU MTBF / G.

8. Interval.  Young/Daly optimum (:func:`young_daly_interval_s`)
   tau = sqrt(2*C*M), floored at the write time (a checkpoint cannot start
   before the previous one has reached storage).  With a "k checkpoints per
   failure" target, tau = M/k (:func:`interval_for_k_s`).
   checkpoints/day = 86400/tau; bytes/day = total * checkpoints/day;
   average sustained write bandwidth = total/tau.

9. Expected fraction of time lost (:func:`lost_fraction`)
   = C/tau (checkpoint stalls) + tau/(2M) (rework: half an interval per
   failure on average) + R/M (restart time R per failure).  At the
   Young/Daly interval this equals sqrt(2C/M) + R/M.

10. Targets.  "checkpoint time" T: bandwidth needed per (4).  "overhead" F:
    solve C/tau + tau/(2M) + R/M <= F at tau = sqrt(2CM), i.e.
    sqrt(2C/M) <= F - R/M, so C <= (F - R/M)^2 * M / 2 (= F^2*M/2 with R = 0)
    (:func:`max_cost_for_overhead_s`); that C is the longest allowed sync
    write, giving the storage bandwidth per (4), and for lazy mode the D2H
    bandwidth bytes_per_writing_gpu / (C + step_time).
    "k per failure": tau = M/k.

11. Memory tier (:func:`memory_node_bytes`, :func:`memory_lost_fraction`;
    applied in :mod:`.memory_plan`).  A fraction s of failures kills the
    processes and leaves the node (a software bug, an NCCL timeout, a network
    fault): the restart reads the node keeper's host memory.  The rest (a
    faulty GPU, a host fault: the node leaves the job) falls back to disk.
    Every save goes to memory at cost C_m (the save call and the lazy copy,
    formula 6); every k-th also to disk, from host memory, at the disk cost C
    of formula 6 on top (an upper bound: no second device copy is made).
    Each interval is Young/Daly with its own cost and the failures that fall
    back to it::

        tau_m = sqrt(2 C_m M / s)        floored at the copy time and a step
        tau_d = sqrt(2 C M / (1 - s))    floored at the write time (8)
        k = max(1, round(tau_d / tau_m)), disk interval k * tau_m
        lost = C_m/tau_m + C/(k tau_m) + s tau_m/(2M) + (1-s) k tau_m/(2M)
               + (s R_m + (1-s) R)/M

    R_m is the restart from memory (no storage read; R by default).  Work
    lost per failure: s (tau_m/2 + R_m) + (1-s) (k tau_m/2 + R), against
    tau/2 + R without the tier, tau = sqrt(2 C M) at the same C.  Host memory per node: (keep_last + 1) checkpoints of
    what its n GPUs read back, the optimizer state sharded over all G GPUs
    and one copy of each of the TP*PP weight shards on the node:
    n (master + moments)/G + min(n, TP*PP) weights/(TP*PP).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the shape is validated where it is made; the formulas only read it
    from .plan_inputs import ModelShape

GB = 1e9  # bytes; decimal, as storage vendors quote bandwidth
SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam", "adamw", "sgd", "none")
MODES = ("lazy", "sync")
WRITERS = ("replica", "balanced")
TARGETS = ("target_checkpoint_time_s", "target_overhead_fraction",
           "target_checkpoints_per_failure")

WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MASTER_BYTES = {"bf16": 4, "fp16": 4, "fp32": 0}
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "none": 0}

# Measured pinned device-to-host copy bandwidth per PCIe generation (GB/s).
PCIE_D2H_GBPS = {3: 12.0, 4: 25.0, 5: 53.0}
DEFAULT_PCIE_GEN = 5


def estimate_params(shape: ModelShape) -> int:
    """Formula 1: parameter count of a Megatron GPT model."""
    h, L, V = shape.hidden_size, shape.num_layers, shape.vocab_size
    f = shape.ffn_hidden_size if shape.ffn_hidden_size is not None else 4 * h
    if shape.num_query_groups is not None:
        kv = h * shape.num_query_groups // shape.num_attention_heads
    else:
        kv = h
    m = 2 if shape.swiglu else 1
    qkv = h * (h + 2 * kv) + (h + 2 * kv)
    proj = h * h + h
    fc1 = m * h * f + m * f
    fc2 = f * h + h
    norms = 2 * 2 * h
    per_layer = qkv + proj + fc1 + fc2 + norms
    embeddings = V * h * (2 if shape.untie_embeddings else 1)
    return L * per_layer + 2 * h + embeddings


def bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    """Formula 2: (weights, fp32 master, optimizer moments) bytes per parameter."""
    weights = WEIGHT_BYTES[precision]
    master = MASTER_BYTES[precision] if optimizer != "none" else 0
    return weights, master, OPTIMIZER_BYTES[optimizer]


def writing_gpu_count(tp: int, pp: int, dp: int, writers: str = "replica") -> int:
    """Formula 3: TP*PP GPUs (one replica) or all TP*PP*DP (balanced)."""
    return tp * pp * (dp if writers == "balanced" else 1)


def nodes_for(gpus: int, gpus_per_node: int) -> int:
    """Nodes occupied by ``gpus`` GPUs packed onto consecutive nodes."""
    return -(-gpus // gpus_per_node)


def busiest_node_bytes(bytes_per_gpu: float, gpus: int, gpus_per_node: int) -> float:
    """Bytes moved by the fullest node when ``gpus`` GPUs move ``bytes_per_gpu`` each."""
    return min(gpus_per_node, gpus) * bytes_per_gpu


def transfer_time_s(nbytes: float, gbps: float) -> float:
    """Seconds to move ``nbytes`` at ``gbps`` GB/s (decimal)."""
    return nbytes / (gbps * GB)


def write_time_s(total_bytes: float, node_bytes: float,
                 gbps: Optional[float], gbps_per_node: Optional[float]) -> Optional[float]:
    """Formula 4: limited by aggregate and/or per-node bandwidth, whichever is slower."""
    times = []
    if gbps is not None:
        times.append(transfer_time_s(total_bytes, gbps))
    if gbps_per_node is not None:
        times.append(transfer_time_s(node_bytes, gbps_per_node))
    return max(times) if times else None


def required_gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth (GB/s) to move ``nbytes`` in ``seconds``."""
    return nbytes / seconds / GB


def lazy_stall_s(bytes_per_gpu: float, d2h_gbps: float,
                 step_time_s: Optional[float] = None) -> float:
    """Formula 6: D2H copy time not hidden behind the next forward/backward."""
    return max(0.0, transfer_time_s(bytes_per_gpu, d2h_gbps) - (step_time_s or 0.0))


def cluster_mttf_s(mtbf_hours: float, gpus: int) -> float:
    """Formula 7: MTTF of ``gpus`` independent accelerators, in seconds."""
    return mtbf_hours * SECONDS_PER_HOUR / gpus


def young_daly_interval_s(cost_s: float, mttf_s: float) -> float:
    """Formula 8: optimal interval sqrt(2*C*M)."""
    return math.sqrt(2.0 * cost_s * mttf_s)


def interval_for_k_s(mttf_s: float, k: float) -> float:
    """Formula 8: interval giving k checkpoints per failure, M/k."""
    return mttf_s / k


def lost_fraction(cost_s: float, interval_s: float, mttf_s: float, restart_s: float = 0.0) -> float:
    """Formula 9: C/tau + tau/(2M) + R/M."""
    return cost_s / interval_s + interval_s / (2.0 * mttf_s) + restart_s / mttf_s


def max_cost_for_overhead_s(target_fraction: float, mttf_s: float, restart_s: float = 0.0) -> float:
    """Formula 10: largest C with sqrt(2C/M) + R/M <= target; 0 if R alone exceeds it."""
    headroom = target_fraction - restart_s / mttf_s
    return headroom * headroom * mttf_s / 2.0 if headroom > 0 else 0.0


def memory_node_bytes(weights: float, master_and_moments: float, gpus: int, gpus_per_node: int,
                      model_parallel: int) -> float:
    """Formula 11: bytes of one checkpoint a node's keeper holds."""
    n = min(gpus_per_node, gpus)
    return n * master_and_moments / gpus + min(n, model_parallel) * weights / model_parallel


def memory_lost_fraction(memory_cost_s: float, disk_cost_s: float, memory_interval_s: float,
                         persist_every: int, mttf_s: float, survives: float, restart_s: float = 0.0,
                         memory_restart_s: Optional[float] = None) -> float:
    """Formula 11: the lost fraction with every save in memory and every k-th on disk."""
    disk_interval = persist_every * memory_interval_s
    r_m = restart_s if memory_restart_s is None else memory_restart_s
    return (memory_cost_s / memory_interval_s + disk_cost_s / disk_interval
            + survives * memory_interval_s / (2.0 * mttf_s)
            + (1.0 - survives) * disk_interval / (2.0 * mttf_s)
            + (survives * r_m + (1.0 - survives) * restart_s) / mttf_s)


def schedule(cost_s: float, mttf_s: float, write_s: float, restart_s: float = 0.0):
    """Young/Daly interval floored at the write time: (raw, chosen, lost fraction)."""
    raw = young_daly_interval_s(cost_s, mttf_s)
    chosen = max(raw, write_s)
    return raw, chosen, lost_fraction(cost_s, chosen, mttf_s, restart_s)

