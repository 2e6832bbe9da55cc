"""Which node a rank runs on, and the key-value store the ranks reach from any thread.

Launchers place ranks node-major (torchrun, DeepSpeed's launcher, Slurm's default block
distribution): with ``L`` ranks per node, ranks ``n*L .. n*L + L - 1`` are node ``n``, and the
lowest of them leads it (:func:`node_leader`). With node-local storage (see :mod:`.exchange`)
each node has its own first-tier directory, whose manifest and pointer its leader writes. The
node functions read the environment only (any rank, any thread, no collective).
"""

from __future__ import annotations

import os
from typing import Any

#: Ranks per node, as launchers say it: torchrun, DeepSpeed's own launcher, Open MPI,
#: MVAPICH, Slurm. The first one set counts (torchrun under srun sets its own for its children).
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")

#: The prefix of this engine's keys in the process group's store.
STORE_PREFIX = "async_ckpt/"


def local_world_size(world_size: int) -> int:
    """Ranks per node, from the first launcher variable set (:data:`LOCAL_SIZE_VARIABLES`);
    ``world_size`` (one node) without any."""
    for name in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), world_size)
    return world_size


def node_of(rank: int, world_size: int) -> int:
    """The node rank ``rank`` runs on: ``rank // ranks per node``."""
    return rank // local_world_size(world_size)


def node_leader(rank: int, world_size: int) -> int:
    """The lowest rank on ``rank``'s node, which writes the node's manifest and pointer."""
    return node_of(rank, world_size) * local_world_size(world_size)


def node_count(world_size: int) -> int:
    """How many nodes the ranks span."""
    per_node = local_world_size(world_size)
    return -(-world_size // per_node)


def default_store() -> Any:
    """The default process group's key-value store under :data:`STORE_PREFIX`, on a
    connection of its own where the store can open one (a ``TCPStore``: a client whose
    requests never queue behind a training thread's). Safe to use from any thread, unlike a
    collective. ``RuntimeError`` without an initialized process group."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("node-local storage needs an initialized torch.distributed process group")
    store = _get_default_store()
    try:
        store = store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):  # a store that cannot
        pass
    return dist.PrefixStore(STORE_PREFIX, store)
