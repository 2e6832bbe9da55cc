"""megatron-core's ``torch_dist`` checkpoint format, planned by megatron and torch DCP, with the
bytes routed through the engine.

What megatron-core's ``TorchDistSaveShardedStrategy`` does, and what we keep or replace:

==========================  ===============================================  ================
step                        megatron-core 0.16                                here
==========================  ===============================================  ================
translate shards            ``mcore_to_pyt_state_dict``                      reused
plan (local, global)        ``MCoreSavePlanner`` + decentralized global plan reused
device -> host              ``preload_tensors``: fresh buffers + full sync   engine snapshot
write                       forked workers, a ``.distcp`` per worker thread  engine persist
``.metadata`` + commit      finalize fns; tracker written by the trainer     engine finalize step
==========================  ===============================================  ================

Layout of a checkpoint directory (readable by ``megatron.core.dist_checkpointing.load``)::

    common.pt            rank 0: everything that is not a ShardedTensor/ShardedObject
    __<rank>_<f>.distcp  the items (tensor shards, objects) this rank writes, spread over at
                         most ``writer_threads`` files balanced by bytes; each item one
                         torch.save archive, starting on a page
    .metadata            rank 0, after every rank persisted: torch DCP global metadata
    metadata.json        rank 0, then: {"sharded_backend": "torch_dist", ...}
    .async_ckpt/         the engine's per-rank records and manifest (sizes, checksums, and
                         where each item lies in its file)

As in megatron-core, a rank writes a few files (one per writer thread), not one per item: a
large model has thousands of items per rank, and a file each would load a shared filesystem's
metadata servers with millions of files per checkpoint. ``.metadata`` points each item at its
offset and length in its file; those are only known once every rank has persisted, so
``.metadata`` is written from the committed manifest on rank 0, before the tracker moves: the
engine's finalize step :class:`Markers`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from deepspeed_async_ckpt.commit import FinalizeContext

BACKEND = "torch_dist"
BACKEND_VERSION = 1
COMMON_FILE = "common.pt"
DCP_METADATA_FILE = ".metadata"
CONFIG_FILE = "metadata.json"
#: The files whose presence makes a directory look like a complete megatron checkpoint.
MARKER_FILES = (DCP_METADATA_FILE, CONFIG_FILE)


def distcp_name(rank: int, f: int) -> str:
    return f"__{rank}_{f}.distcp"


_DISTCP_NAME = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True)
class WriteJob:
    """One item this rank writes, a tensor shard or the payload of a sharded object: the
    archive named ``part`` (the item's number in this rank's plan) in file ``relpath``."""

    relpath: str
    part: str
    key: str
    offset: tuple | None
    """Global offset of a tensor shard; None for a sharded object."""
    data: Any = field(repr=False)


@dataclass(frozen=True)
class GlobalIndex:
    """Rank 0: what ``.metadata`` needs once every rank persisted (no tensor data)."""

    metadata: Any
    """torch DCP ``Metadata`` from the global plan, still without storage locations."""
    item_indices: list[list[Any]]
    """``item_indices[r][k]`` is the DCP index of rank ``r``'s item ``k`` (part ``str(k)``)."""


@dataclass
class SavePlan:
    """What one save writes, as planned on every rank."""

    jobs: list[WriteJob]
    index: GlobalIndex | None = None
    """Rank 0 only."""

    def files(self) -> dict[str, list[WriteJob]]:
        """The jobs grouped by file, in plan order within each file."""
        files: dict[str, list[WriteJob]] = {}
        for job in self.jobs:
            files.setdefault(job.relpath, []).append(job)
        return files


def plan_save(sharded_part: dict, *, rank: int, world_size: int, max_files: int) -> SavePlan:
    """Collective (all ranks): plan the ``.distcp`` items with megatron-core's own planner, and
    spread this rank's items over at most ``max_files`` files of about equal bytes.

    Only main replicas are kept, so a rank plans exactly the shards it was elected to write.
    Raises on every rank if the global plan is invalid (a shard missing or written twice).
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.planner import WriteItemType

    local_plan, error = None, None
    try:  # local: it fails on some ranks only (an object that cannot be pickled, say)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, is_loading=False)
        planner = MCoreSavePlanner(flatten_state_dict=False)
        planner.set_up_planner(pyt_state_dict, is_coordinator=rank == 0)
        local_plan = planner.create_local_plan()
    except Exception as exc:  # gathered as this rank's plan, so no rank waits for it in vain
        error = f"rank {rank}: {type(exc).__name__}: {exc}"

    gathered = [None] * world_size if rank == 0 else None
    if world_size > 1:
        dist.gather_object((local_plan, error), gathered, dst=0)
    else:
        gathered = [(local_plan, error)]
    plan = SavePlan(jobs=[])
    if rank == 0:
        errors = [e for _, e in gathered if e is not None]
        error = "; ".join(errors) if errors else None
        gathered = [p for p, _ in gathered]
    if rank == 0 and error is None:
        item_indices = [[item.index for item in p.items] for p in gathered]
        try:
            _, metadata = planner.create_global_plan(gathered)
            # As megatron-core stores it, so its own cached-structure save can reuse it.
            metadata.all_local_plans = gathered
            plan.index = GlobalIndex(metadata=metadata, item_indices=item_indices)
        except Exception as exc:  # raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    if world_size > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"torch_dist save plan rejected: {error}")

    final_plan = planner.finish_plan(planner.create_decentralized_global_plan(local_plan))
    items = []
    for item in final_plan.items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            # megatron serialized the objects into a BytesIO when translating; a private,
            # frozen copy of them is what the engine writes (torch.load gives the same list back).
            nbytes = len(data.getbuffer())
            data = torch.load(io.BytesIO(data.getvalue()), weights_only=False)
            items.append((item, None, data, nbytes))
        else:
            items.append((item, tuple(item.index.offset), data, data.numel() * data.element_size()))
    files = _balance([nbytes for *_, nbytes in items], max_files)
    for k, ((item, offset, data, _), f) in enumerate(zip(items, files)):
        plan.jobs.append(WriteJob(relpath=distcp_name(rank, f), part=str(k), key=item.index.fqn,
                                  offset=offset, data=data))
    return plan


def _balance(sizes: list[int], max_files: int) -> list[int]:
    """File number of each item: the largest items first, each to the file with the fewest
    bytes so far (lowest number on ties), as megatron-core spreads items over its workers."""
    nfiles = max(1, min(max_files, len(sizes)))
    load = [0] * nfiles
    files = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        f = min(range(nfiles), key=lambda f: load[f])
        files[k] = f
        load[f] += sizes[k]
    return files


@dataclass(frozen=True)
class Markers:
    """The engine's finalize step for a save in this format (see
    :mod:`deepspeed_async_ckpt.commit.finalize`): run by rank 0's committer once every rank
    persisted, after the manifest and before the tracker moves, it writes ``.metadata`` and
    ``metadata.json`` (:func:`write_markers`), which the commit then records."""

    index: GlobalIndex = field(repr=False)
    files: tuple[str, ...] = MARKER_FILES

    def __call__(self, ctx: FinalizeContext) -> None:
        write_markers(ctx, self.index)


def write_markers(ctx: FinalizeContext, index: GlobalIndex) -> None:
    """Rank 0, in the commit: write ``.metadata``, each item at the offset and length the
    committed manifest gives for it, then ``metadata.json``. Each is written to a temporary
    name, fsynced and renamed."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    where = {}  # (rank, item number) -> (file, offset, length), from the committed manifest
    for name, entry in ctx.manifest["files"].items():
        match = _DISTCP_NAME.fullmatch(name)
        if match:
            for part, (offset, length) in entry.get("parts", {}).items():
                where[int(match[1]), int(part)] = (name, offset, length)
    storage_data = {}
    for r, indices in enumerate(index.item_indices):
        for k, item_index in enumerate(indices):
            if (r, k) not in where:
                raise RuntimeError(f"the manifest of {ctx.ckpt_dir!r} does not say where rank {r} "
                                   f"wrote item {k} ({item_index.fqn})")
            name, offset, length = where[r, k]
            storage_data[item_index] = _StorageInfo(relative_path=name, offset=offset, length=length)
    metadata = index.metadata
    metadata.storage_data = storage_data
    metadata.version = CURRENT_DCP_VERSION
    ctx.write_file(DCP_METADATA_FILE, pickle.dumps(metadata))
    ctx.write_file(CONFIG_FILE, json.dumps(asdict(CheckpointingConfig(BACKEND, BACKEND_VERSION))))


def top_name(key: str) -> str:
    """The top-level name of a sharded key (torch DCP's fqn): ``decoder``, ``embedding``,
    ``optimizer``, ``chained_0`` (one of several chained optimizers), ``rng_state``, ..."""
    return re.split(r"[./]", key, maxsplit=1)[0]


def is_optimizer_name(name: str) -> bool:
    """Whether a top-level name is the optimizer state's (megatron-core's optimizers key theirs
    ``optimizer.*``, or ``chained_<i>.optimizer.*`` under a ChainedOptimizer)."""
    return name == "optimizer" or re.fullmatch(r"chained_\d+", name) is not None


def requested_names(sharded_state_dict: dict) -> set[str]:
    """The top-level names of the sharded keys a load requests."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {top_name(v.key) for v in nested_values(sharded_state_dict) if isinstance(getattr(v, "key", None), str)}


def reads_of_load(ckpt_dir: str, wanted: Callable[[str], bool]) -> dict[str, list[tuple[int, int]]]:
    """Where a load from ``ckpt_dir`` can read: .distcp file -> (offset, length) of every item
    whose top-level name ``wanted`` accepts (:func:`requested_names` of the load's sharded state
    dict, say), from ``.metadata``. A load without the optimizer state reads no ``optimizer.*``
    item. Coarser than the exact items on purpose: a key the request derives (a factory's, a
    resharded one) keeps its top-level name."""
    with open(os.path.join(ckpt_dir, DCP_METADATA_FILE), "rb") as f:
        metadata = pickle.load(f)
    reads: dict[str, list[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        if wanted(top_name(index.fqn)):
            reads.setdefault(info.relative_path, []).append((info.offset, info.length))
    return reads
