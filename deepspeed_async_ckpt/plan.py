"""Checkpoint planning arithmetic behind ``ds-async-ckpt plan``.

Answers, before any hardware is bought or ``--save-interval`` is chosen: how
big is a checkpoint of this model, how many GPUs write it, what storage
bandwidth that takes, how often the cluster fails, and how often to
checkpoint.  Pure standard-library math: no torch / deepspeed / megatron.

Units
-----
Decimal units throughout: 1 GB = 1e9 bytes, 1 GB/s = 1e9 bytes/s.  Times are
in seconds except the per-accelerator MTBF input, which is in hours.  Every
numeric field of :class:`Plan` carries its unit in its name (``_bytes``,
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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

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


class PlanInputError(ValueError):
    """Invalid planning input; ``field`` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------

def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value) -> str:
    """A value for a message: a float that is a whole number keeps its point (``4096.0``:
    "must be an integer ..., got 4096" contradicted itself), a huge one stays short."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) < 10**16:
            return str(value)
        # format(int, "g") converts to float: OverflowError past 1e308 (a review, session 30)
        exponent = int((abs(value).bit_length() - 1) * math.log10(2))  # at most one too low
        if 10 ** (exponent + 1) <= abs(value):
            exponent += 1
        return f"{'-' if value < 0 else ''}~1e{exponent}"
    return format(value, "g") if _is_real(value) else repr(value)


#: Bounds no real cluster reaches, far outside (1000x the largest models and clusters, a
#: byte per second to a petabyte per second, up to 31 years): inputs beyond them are typos,
#: and would overflow or divide by zero in the arithmetic, or give a plan of nonsense.
MAX_PARAMS = 10**16
MAX_COUNT = 10**8
MIN_GBPS, MAX_GBPS = 1e-9, 1e6
MAX_SECONDS = 1e9


def _check_int(name: str, value, minimum: int = 1, maximum: int = MAX_COUNT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanInputError(name, f"{name} must be an integer >= {minimum}, got {_show(value)}")
    if value < minimum:
        raise PlanInputError(name, f"{name} must be >= {minimum}, got {_show(value)}")
    if value > maximum:
        raise PlanInputError(name, f"{name} must be <= {maximum:g}, got {_show(value)}")


def _check_positive(name: str, value, low: float = 0.0, high: float = MAX_SECONDS) -> None:
    """``value`` in (0, high], and not below ``low`` (where it divides: a bandwidth)."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise PlanInputError(name, f"{name} must be > 0, got {_show(value)}")
    if value < low or value > high:
        raise PlanInputError(name, f"{name} must be between {low:g} and {high:g}, got {_show(value)}")


def _check_non_negative(name: str, value, high: float = MAX_SECONDS) -> None:
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise PlanInputError(name, f"{name} must be >= 0, got {_show(value)}")
    if value > high:
        raise PlanInputError(name, f"{name} must be <= {high:g}, got {_show(value)}")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise PlanInputError(name, f"{name} must be one of {options}, got {value!r}")


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Megatron-style model shape from which the parameter count is estimated."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None  # None -> 4 * hidden_size
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None  # GQA; None -> num_attention_heads
    untie_embeddings: bool = False
    swiglu: bool = False

    def __post_init__(self):
        _check_int("shape.num_layers", self.num_layers)
        _check_int("shape.hidden_size", self.hidden_size)
        _check_int("shape.vocab_size", self.vocab_size)
        if self.ffn_hidden_size is not None:
            _check_int("shape.ffn_hidden_size", self.ffn_hidden_size)
        if self.num_attention_heads is not None:
            _check_int("shape.num_attention_heads", self.num_attention_heads)
            if self.hidden_size % self.num_attention_heads:
                raise PlanInputError(
                    "shape.num_attention_heads",
                    f"shape.num_attention_heads must divide hidden_size {self.hidden_size}, "
                    f"got {self.num_attention_heads}")
        if self.num_query_groups is not None:
            _check_int("shape.num_query_groups", self.num_query_groups)
            if self.num_attention_heads is None or self.num_attention_heads % self.num_query_groups:
                raise PlanInputError(
                    "shape.num_query_groups",
                    "shape.num_query_groups must divide num_attention_heads "
                    f"({self.num_attention_heads}), got {self.num_query_groups}")
        for name in ("untie_embeddings", "swiglu"):
            if not isinstance(getattr(self, name), bool):
                raise PlanInputError(f"shape.{name}",
                                     f"shape.{name} must be True or False, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything the plan depends on; validated once, at construction."""

    # model: exactly one of params / shape
    params: Optional[int] = None
    shape: Optional[ModelShape] = None
    precision: str = "bf16"
    optimizer: str = "adam"
    # parallel layout
    tp: int = 1
    pp: int = 1
    dp: int = 1
    gpus_per_node: int = 8
    writers: str = "replica"
    # storage, GB/s; at least one write bandwidth is required
    storage_write_gbps: Optional[float] = None
    storage_write_gbps_per_node: Optional[float] = None
    storage_read_gbps: Optional[float] = None
    storage_read_gbps_per_node: Optional[float] = None
    # failures
    mtbf_hours: float  # per accelerator
    restart_s: float = 0.0
    # at most one target
    target_checkpoint_time_s: Optional[float] = None
    target_overhead_fraction: Optional[float] = None
    target_checkpoints_per_failure: Optional[float] = None
    # stall model
    mode: str = "lazy"
    d2h_gbps: Optional[float] = None  # None -> PCIE_D2H_GBPS[pcie_gen]
    pcie_gen: int = DEFAULT_PCIE_GEN
    step_time_s: Optional[float] = None

    def __post_init__(self):
        if (self.params is None) == (self.shape is None):
            raise PlanInputError("params", "exactly one of params or shape must be given")
        if self.params is not None:
            _check_int("params", self.params, maximum=MAX_PARAMS)
        if self.shape is not None and not isinstance(self.shape, ModelShape):
            raise PlanInputError("shape", f"shape must be a ModelShape, got {type(self.shape).__name__}")
        if self.shape is not None and (n := estimate_params(self.shape)) > MAX_PARAMS:
            raise PlanInputError("shape.hidden_size",
                                 f"the model shape gives {n:.3g} parameters, "
                                 f"more than {MAX_PARAMS:g}: check hidden_size and num_layers")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        for name in ("tp", "pp", "dp", "gpus_per_node"):
            _check_int(name, getattr(self, name))
        _check_choice("writers", self.writers, WRITERS)

        for name in ("storage_write_gbps", "storage_write_gbps_per_node",
                     "storage_read_gbps", "storage_read_gbps_per_node"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), MIN_GBPS, MAX_GBPS)
        if self.storage_write_gbps is None and self.storage_write_gbps_per_node is None:
            raise PlanInputError("storage_write_gbps",
                                 "storage_write_gbps or storage_write_gbps_per_node is required (> 0)")

        _check_positive("mtbf_hours", self.mtbf_hours, 1e-6, MAX_SECONDS / 3600)
        _check_non_negative("restart_s", self.restart_s)

        given = [name for name in TARGETS if getattr(self, name) is not None]
        if len(given) > 1:
            raise PlanInputError(given[1], f"give at most one target, got {', '.join(given)}")
        if self.target_checkpoint_time_s is not None:
            _check_positive("target_checkpoint_time_s", self.target_checkpoint_time_s, 1e-6)
        if self.target_overhead_fraction is not None:
            f = self.target_overhead_fraction
            if not _is_real(f) or not (0 < f < 1):
                raise PlanInputError("target_overhead_fraction",
                                     f"target_overhead_fraction must be in (0, 1), got {_show(f)}")
            if f < 1e-6:  # the interval it asks for underflows to 0, the bandwidth to infinity
                raise PlanInputError("target_overhead_fraction",
                                     f"target_overhead_fraction must be at least 1e-06, got {_show(f)}")
        if self.target_checkpoints_per_failure is not None:
            _check_positive("target_checkpoints_per_failure", self.target_checkpoints_per_failure, 1e-6)

        _check_choice("mode", self.mode, MODES)
        if self.d2h_gbps is not None:
            _check_positive("d2h_gbps", self.d2h_gbps, MIN_GBPS, MAX_GBPS)
        _check_choice("pcie_gen", self.pcie_gen, tuple(PCIE_D2H_GBPS))
        if self.step_time_s is not None:
            _check_non_negative("step_time_s", self.step_time_s)
            if 0 < self.step_time_s < 1e-6:  # the steps per interval would overflow
                raise PlanInputError("step_time_s", "step_time_s must be 0 (unknown) or at least 1e-06 s, "
                                                    f"got {_show(self.step_time_s)}")


# --------------------------------------------------------------------------
# Formulas (one small pure function each)
# --------------------------------------------------------------------------

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


def schedule(cost_s: float, mttf_s: float, write_s: float, restart_s: float = 0.0):
    """Young/Daly interval floored at the write time: (raw, chosen, lost fraction)."""
    raw = young_daly_interval_s(cost_s, mttf_s)
    chosen = max(raw, write_s)
    return raw, chosen, lost_fraction(cost_s, chosen, mttf_s, restart_s)


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
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready dict (nested inputs included, tuples become lists)."""
        d = asdict(self)
        d["warnings"] = list(self.warnings)
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
            # gave 1 step of 7 s for a 9.8 s write until session 30
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
        warnings=tuple(warnings),
    )
