"""Which ranks hold and write what under DeepSpeed: the data-parallel replicas of the
model-states file, the tied-parameter list that only global rank 0 computes, and whether
node-local storage spans several nodes (then each node commits its own copy)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from ...core import Replicas
from ...commit.nodes import LOCAL_SIZE_VARIABLES, local_world_size
from ...errors import ConfigError


def data_parallel_replicas() -> Replicas:
    """This rank among the data-parallel replicas of its model-states file: DeepSpeed's
    (sequence-)data-parallel group, whose ranks ``is_data_parallel_writer`` is asked about."""
    from deepspeed.utils import groups

    return Replicas(rank=groups._get_sequence_data_parallel_rank(),
                    size=groups._get_sequence_data_parallel_world_size(),
                    group=groups._get_sequence_data_parallel_group())


def with_rank0_shared_params(state_dict: Any, ds_engine: Any, replicas: Replicas) -> Any:
    """The model-states ``state_dict`` of a replica of global rank 0 with ``shared_params`` as
    rank 0 has it. DeepSpeed lists tied parameters (``_get_shared_params``) on global rank 0
    only, so with any tied weight (tied embeddings) the replicas' files would differ and the
    first replica would write the file alone. Computed here as DeepSpeed computes it, without
    ZeRO-3 (no shares there); if it still differs from rank 0's, the replicas' digests say so
    and the first replica writes the file alone."""
    if not isinstance(state_dict, dict) or state_dict.get("shared_params") != {} \
            or dist.get_rank() == 0 or dist.get_global_rank(replicas.group or dist.group.WORLD, 0) != 0:
        return state_dict
    shared: dict[str, str] = {}
    first_name: dict[int, str] = {}

    def walk(module: torch.nn.Module, prefix: str) -> None:  # DeepSpeed's order, dict included
        for name, param in module.named_parameters(recurse=False):
            if param is None:
                continue
            if param.data_ptr() in first_name:
                shared[prefix + name] = first_name[param.data_ptr()]
            else:
                first_name[param.data_ptr()] = prefix + name
        for name, child in module.named_children():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(ds_engine.module, "")
    return dict(state_dict, shared_params=shared) if shared else state_dict


def needs_node_local(node_local: bool, world_size: int, ranks_here: int) -> bool:
    """Whether DeepSpeed's ``checkpoint.use_node_local_storage`` (``node_local``) spans several
    nodes (``ranks_here``: ranks on this node, :func:`ranks_on_this_node`), so that the engine
    must commit without a directory all ranks see (``async_checkpoint.node_local``): then the
    launcher's ranks-per-node variable must say so too, since it places each rank on its node
    (:func:`~deepspeed_async_ckpt.commit.nodes.node_of`); ``ConfigError`` if it does not. On
    one node, a node-local directory is everyone's."""
    if not node_local or world_size <= ranks_here:
        return False
    if local_world_size(world_size) != ranks_here:
        raise ConfigError(
            f"checkpoint.use_node_local_storage across nodes ({world_size} ranks, {ranks_here} on "
            f"this node): the launcher's ranks-per-node variable ({', '.join(LOCAL_SIZE_VARIABLES)}) "
            f"says {local_world_size(world_size)}; set LOCAL_WORLD_SIZE={ranks_here} so that "
            "each rank knows its node")
    return True


#: Ranks per node, as launchers say it (see :data:`~deepspeed_async_ckpt.commit.nodes.LOCAL_SIZE_VARIABLES`).
_LOCAL_SIZE_VARIABLES = LOCAL_SIZE_VARIABLES


def ranks_on_this_node(world_size: int) -> int:
    """Collective: how many ranks share this rank's node. Host names (all-gathered: every
    launcher, or none) and the innermost launcher's variable (the first set, in the order of
    :data:`_LOCAL_SIZE_VARIABLES`: torchrun under srun sets its own for its children) count;
    the smaller wins, so ranks on two nodes are seen as such if either says so (containers
    may share a host name)."""
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    local = hosts.count(hosts[dist.get_rank()])
    for name in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(local, int(value))
    return local
