"""The parallel layout of this rank, read from ``megatron.core.parallel_state``.

The layout decides nothing by itself: which rank writes which shard comes from the sharded state
dict's replica ids (see :mod:`.election`); the checkpoint holds no record of it (megatron-core's
shards carry global offsets, which is what a load in another layout needs; the caller's ``args``
in ``common.pt``, as Megatron-LM saves them, say which grid wrote it). It gives the checkpointer
its rank and world size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Sizes and this rank's coordinates along each parallel dimension (all called ranks)."""

    world_size: int
    rank: int
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    dp: int
    """Data-parallel size without context parallelism."""
    dp_rank: int
    cp: int = 1
    cp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0

    @property
    def dp_cp(self) -> int:
        """Size of the data+context-parallel group: the ranks that hold replicas of one shard."""
        return self.dp * self.cp

    def describe(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}", f"DP={self.dp}"]
        if self.cp > 1:
            parts.append(f"CP={self.cp}")
        if self.ep > 1:
            parts.append(f"EP={self.ep}")
        return ",".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_parallel_state(cls) -> "ParallelLayout":
        """Read the layout megatron-core was initialized with (``initialize_model_parallel``)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("megatron.core.parallel_state is not initialized: call "
                               "initialize_model_parallel() before building the checkpointer")
        return cls(world_size=dist.get_world_size(), rank=dist.get_rank(),
                   tp=ps.get_tensor_model_parallel_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp=ps.get_pipeline_model_parallel_world_size(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(),
                   dp=ps.get_data_parallel_world_size(),
                   dp_rank=ps.get_data_parallel_rank(),
                   cp=ps.get_context_parallel_world_size(),
                   cp_rank=ps.get_context_parallel_rank(),
                   ep=ps.get_expert_model_parallel_world_size(),
                   ep_rank=ps.get_expert_model_parallel_rank())


def replica_group():
    """The process group over which a shard's replicas live: data parallel with context
    parallel, as megatron-core's fully parallel save uses by default."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)
