"""The capacity planner's inputs: :class:`ModelShape` and :class:`PlanInputs`, validated once,
at construction, each error a :class:`PlanInputError` naming the offending field.

The bounds (:data:`MAX_PARAMS` and the rest) lie far outside any real cluster; inputs beyond them
are typos, and would overflow or divide by zero in the formulas (:mod:`.formulas`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .formulas import (DEFAULT_PCIE_GEN, MODES, OPTIMIZERS, PCIE_D2H_GBPS, PRECISIONS, TARGETS,
                       WRITERS, estimate_params)


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
    """A value for a message: a float that is a whole number keeps its point (for ``4096.0``,
    "must be an integer ..., got 4096" would contradict itself), a huge one stays short."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) < 10**16:
            return str(value)
        # not format(int, "g"): it converts to float, an OverflowError past 1e308
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
    # memory tier (formula 11): planned when ``memory`` is true
    memory: bool = False
    memory_survives_fraction: float = 0.3
    memory_keep_last: int = 2
    memory_save_s: Optional[float] = None  # None -> the lazy stall + the save call
    disk_save_s: Optional[float] = None  # None -> the mode's stall + the save call
    memory_restart_s: Optional[float] = None  # None -> restart_s
    host_memory_gb_per_node: Optional[float] = None

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
        if not isinstance(self.memory, bool):
            raise PlanInputError("memory", f"memory must be True or False, got {self.memory!r}")
        s = self.memory_survives_fraction
        if not _is_real(s) or not 0 < s < 1:
            raise PlanInputError("memory_survives_fraction", "memory_survives_fraction must be in (0, 1): the "
                                 f"share of failures that leave the node's memory, got {_show(s)}")
        _check_int("memory_keep_last", self.memory_keep_last)
        for name in ("memory_save_s", "disk_save_s"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), 1e-6)
        if self.memory_restart_s is not None:
            _check_non_negative("memory_restart_s", self.memory_restart_s)
        if self.host_memory_gb_per_node is not None:
            _check_positive("host_memory_gb_per_node", self.host_memory_gb_per_node, MIN_GBPS, MAX_GBPS)

