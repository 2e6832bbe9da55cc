"""The memory tier's part of each save (``async_checkpoint.memory``): which saves stay in the
node keeper's memory only, the keeper's slot of each save, and its commit.

Saves are counted per checkpointer, from 0: save ``i`` persists (is also written to the
checkpoint directory and committed there, as without the tier) when ``i % persist_every`` is
0, so the first save of a run is always on disk; the others are memory-only. Every rank
counts its own ``begin`` calls, which are collective, so all agree without a word.

Call order, per save::

    (every rank, training thread)    next_only() in begin, counted() once it began
    (every rank, a writer thread)    reserve() the rank's files in the slot, report() them
                                     (:class:`~..memory.saver.MemoryWriter`)
    (every rank, committer thread)   a memory-only save's record goes through `exchange` (the
                                     process group's store), a persist save's through the
                                     checkpoint directory
    (rank 0, committer thread)       the job's commit: the manifest, written for a persist
                                     save, kept in memory (:class:`ManifestOnly`) for a
                                     memory-only one; then commit_slot() with it
    (any rank, on failure)           abandon() the slot
    (rank 0, close)                  close(): shutdown() of the keeper once the last save persisted

One node: rank 0 leads it and commits its slot once every rank's record is there, which each
rank publishes only after reporting its files to the keeper (the slot is copied by then).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping

from ..commit.exchange import StoreExchange
from ..commit.nodes import default_store, local_world_size, node_count
from ..errors import ConfigError
from ..memory.client import KeeperClient, KeeperError, Reservation
from ..memory.config import KEY, MemoryConfig

logger = logging.getLogger(__name__)


class _NodeStoreExchange(StoreExchange):
    """The records of memory-only saves, through the process group's store: one node, one
    manifest (nothing is told to other nodes)."""

    node_local = False


class ManifestOnly:
    """The :class:`~..storage.Storage` rank 0 commits a memory-only save through: the manifest
    the commit writes is kept here (``files``, by path), nothing reaches a disk."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def write_small(self, path: str, data: bytes, *, durable: bool = True) -> None:
        self.files[path] = bytes(data)

    def replace(self, src: str, dst: str, *, durable: bool = True) -> None:
        self.files[dst] = self.files.pop(src)

    def remove_tree(self, path: str) -> None:
        self.files.pop(path, None)

    def sync_dir(self, path: str) -> None:
        pass

    def makedirs(self, path: str) -> None:
        pass


def slot_name(save: Any) -> str:
    """A save's slot in the keeper: its checkpoint's directory name (DeepSpeed's tag,
    Megatron's ``iter_NNNNNNN``), the name a restore lays it out under."""
    return os.path.basename(save.ckpt_dir)


class MemorySaves:
    """The memory tier of one checkpointer (rank ``rank`` of ``world_size``, on one node)."""

    def __init__(self, config: MemoryConfig, *, rank: int, world_size: int, commit_timeout_s: float) -> None:
        if node_count(world_size) > 1:
            raise ConfigError(f"{KEY}.enabled: the memory tier serves one node for now, and these "
                              f"{world_size} ranks span {node_count(world_size)} ({local_world_size(world_size)} "
                              "per node); turn it off to save on several nodes")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.node_ranks = tuple(range(local_world_size(world_size)))
        self._wait_s = commit_timeout_s
        self._count = 0
        self._clients: dict[tuple[str, str], KeeperClient] = {}
        """(save directory, "write" or "commit") -> this rank's connection: the writer thread's
        reservation may wait for the commit the committer thread makes on the other."""
        self._lock = threading.Lock()
        self._exchange: _NodeStoreExchange | None = None

    # training thread -------------------------------------------------------------
    def next_only(self) -> bool:
        """Whether the save about to begin stays in memory only."""
        return self._count % self.config.persist_every != 0

    def counted(self, only: bool) -> None:
        """The save ``next_only`` was asked for began (on every rank alike)."""
        self._count += 1

    @property
    def exchange(self) -> _NodeStoreExchange:
        """How memory-only saves' records reach rank 0: the process group's store (a
        ``HashStore`` of its own in a single process)."""
        if self._exchange is None:
            if self.world_size == 1:
                import torch.distributed as dist
                store = dist.HashStore()
            else:
                store = default_store()
            self._exchange = _NodeStoreExchange(store, self.world_size)
        return self._exchange

    # a writer thread ----------------------------------------------------------------
    def only(self, save: Any) -> bool:
        return save.memory_only

    def reserve(self, save: Any, sizes: Mapping[str, int]) -> Reservation:
        """This rank's space for ``sizes`` (file -> bytes) in ``save``'s slot, waiting (up to
        ``commit_timeout_s``) while the previous slot awaits its commit."""
        client = self._client(save, "write")
        return client.reserve(slot_name(save), save.save_id, self.rank, self.node_ranks, dict(sizes), wait_s=self._wait_s)

    def report(self, reservation: Reservation, sizes: Mapping[str, int]) -> None:
        reservation.report(sizes)

    # committer thread -----------------------------------------------------------------
    def commit_slot(self, save: Any, manifest: dict, late: Mapping[str, bytes] | None = None) -> None:
        """Rank 0, once the job committed ``save``: the slot, with its manifest and the files
        its finalize steps wrote (``late``: path in the checkpoint -> bytes)."""
        self._client(save, "commit").commit(slot_name(save), save.save_id, manifest=manifest, late=late)

    def abandon(self, save: Any) -> None:
        """The save failed: free its slot (whatever was copied of it). Never raises."""
        try:
            self._client(save, "commit").abandon(slot_name(save), save.save_id)
        except (KeeperError, OSError) as exc:
            logger.info("async checkpoint: memory slot %s (save %s) not abandoned: %s", slot_name(save),
                        save.save_id, exc)

    def _client(self, save: Any, use: str) -> KeeperClient:
        save_dir = os.path.dirname(save.ckpt_dir)
        with self._lock:
            client = self._clients.get((save_dir, use))
            if client is None:
                client = self._clients[(save_dir, use)] = KeeperClient.connect(save_dir, self.config)
            return client

    # close -------------------------------------------------------------------------
    def close(self, persisted: bool) -> None:
        """Rank 0, when the last save ``persisted`` (committed on disk): end each keeper (the
        job ended normally, its newest checkpoint is on disk). Otherwise the keeper stays, for
        a restart to read, until its idle timeout. Every rank closes its connections."""
        with self._lock:
            clients, self._clients = self._clients, {}
        shut: set[str] = set()
        for (save_dir, _use), client in clients.items():
            try:
                if self.rank == 0 and persisted and save_dir not in shut:
                    shut.add(save_dir)
                    client.shutdown()
                    logger.info("async checkpoint: memory keeper of %s ended (the last save is on disk)",
                                save_dir)
                else:
                    client.close()
            except (KeeperError, OSError) as exc:
                logger.warning("async checkpoint: memory keeper of %s: %s", save_dir, exc)


def memory_committed_s(times: Mapping[str, float]) -> float | None:
    """From the save's begin to its slot committed (None: no slot was committed)."""
    at = times.get("memory_committed")
    return None if at is None else at - times["begin"]

