"""How many layers of the benchmark's model make a checkpoint of a given size."""

from __future__ import annotations


GB = 1e9  # decimal, as storage bandwidth is quoted


def bytes_per_param(zero_stage: int) -> int:
    """fp32 Adam: weights 4 + two moments 8, plus a 4-byte fp32 master partition under ZeRO."""
    return 16 if zero_stage >= 1 else 12


def layers_for(size_gb: float, hidden: int, zero_stage: int) -> int:
    per_layer = hidden * hidden + hidden + 2 * hidden  # Linear + LayerNorm (ds_train.build_model)
    return max(1, round(size_gb * GB / bytes_per_param(zero_stage) / per_layer))
