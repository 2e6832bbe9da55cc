"""Writer election: which rank writes each unique shard, decided from replica ids, not names.

Every ``ShardedTensor``/``ShardedObject`` of a megatron-core sharded state dict carries a
``replica_id``; the *main* replica (id 0 or all zeros) is the one copy that gets written. Tensors
replicated across tensor-parallel ranks (layer norms), data-parallel ranks (every weight) or
pipeline stages (tied embeddings) thus get written once, whatever they are called.

Modes (``--async-ckpt-writers``):

- ``replica`` (default): keep megatron-core's replica ids; in practice data-parallel replica 0
  writes every (TP, PP) shard. No communication.
- ``balanced``: spread the unique shards of each data-parallel group over all of its ranks, so
  every node's storage bandwidth is used. Replica ids are rewritten (0 = this rank writes,
  1 = another does) after one metadata-only all-gather within the group, using megatron-core's
  own greedy assignment (``distribute_shards_to_ranks``, as its fully parallel save does).

Non-writers never stage a byte of a shard they do not write: the adapter hands the engine only
main-replica shards.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Sequence

from deepspeed_async_ckpt.agreement import gather

WRITER_MODES = ("replica", "balanced")


def check_mode(mode: str) -> str:
    if mode not in WRITER_MODES:
        raise ValueError(f"--async-ckpt-writers must be one of {', '.join(map(repr, WRITER_MODES))}, "
                         f"got {mode!r}")
    return mode


def shard_id(sh_ten: Any) -> tuple:
    """Identity of a tensor shard, equal on every rank holding a replica of it."""
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    return _sharded_tensor_shard_id(sh_ten)


def is_writer(sh_base: Any) -> bool:
    """Whether this rank writes ``sh_base`` (it is the main replica)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    return is_main_replica(sh_base.replica_id)


def shard_nbytes(sh_ten: Any) -> int:
    import math

    import torch

    return math.prod(sh_ten.local_shape) * torch._utils._element_size(sh_ten.dtype)


def assign_balanced(rank_shards: Sequence[Iterable[Any]]) -> dict[tuple, int]:
    """Pure assignment for ``balanced`` mode.

    ``rank_shards[i]`` lists the ``ShardedTensor`` metadata group rank ``i`` holds. Returns, for
    each shard whose main replica lives in this group, the group rank that writes it: lowest
    coverage first, then largest first, each to the least loaded rank holding a replica.
    Deterministic, so every rank computes the same answer from the same input.
    """
    from megatron.core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks

    ranks_of: dict[tuple, list[int]] = defaultdict(list)
    size_of: dict[tuple, int] = {}
    with_main: set[tuple] = set()
    for rank, shards in enumerate(rank_shards):
        for sh in shards:
            sid = shard_id(sh)
            ranks_of[sid].append(rank)
            size_of.setdefault(sid, shard_nbytes(sh))
            if is_writer(sh):
                with_main.add(sid)
    # A shard whose main replica is in another group (e.g. a layer norm held by every TP rank)
    # is written by that group, never here.
    ranks_of = {sid: r for sid, r in ranks_of.items() if sid in with_main}
    return distribute_shards_to_ranks(ranks_of, size_of, len(rank_shards), set())


def elect_writers(sharded_tensors: list[Any], mode: str, group: Any = None) -> None:
    """Collective over ``group`` (``balanced`` only): rewrite replica ids in place so that this
    rank's main replicas are exactly the shards it writes. ``replica`` mode changes nothing.
    Every rank of the group raises the same :class:`~deepspeed_async_ckpt.errors.AgreementError`
    if one cannot list its shards."""
    check_mode(mode)
    if mode == "replica":
        return
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size <= 1:
        return
    # every rank's shards, or the same AgreementError on every rank of the group
    gathered = gather("electing writers", lambda: [sh.without_data() for sh in sharded_tensors], group=group)
    assignment = assign_balanced(gathered)
    me = dist.get_rank(group)
    for sh in sharded_tensors:
        sh.replica_id = 0 if assignment.get(shard_id(sh)) == me else 1
