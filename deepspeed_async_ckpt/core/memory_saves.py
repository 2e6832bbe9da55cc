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
                                     memory-only one; then commit_slot() with it, which also
                                     tells the other nodes' leaders (the process group's store)
    (each other node's leader,       await_commit(): rank 0's word, then its own node's slot
     committer thread)               committed with the same manifest and late files
    (any rank, on failure)           abandon() the slot (rank 0: the other leaders abandon theirs)
    (rank 0, close)                  close(): shutdown() of the keeper once the last save persisted

Each node runs its own keeper (:class:`~..memory.address.KeeperAddress` by node index) and
holds its own ranks' files. Rank 0 commits the job's save once every rank's record is there,
which each rank publishes only after reporting its files to its node's keeper: every node's
slot is copied by then. Rank 0's node commits its slot first and each other node's leader
commits its own once rank 0 says so, so a node's keeper never names a checkpoint the job did
not commit. A crash between two nodes' commits leaves the nodes' newest apart: the restore then
finds the slot on one node only and loads from disk.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping

from ..commit import poll_delay
from ..commit.exchange import LEADER_WAIT_FACTOR, StoreExchange
from ..commit.nodes import default_store, local_world_size, node_count, node_leader, node_of
from ..memory.client import KeeperClient, KeeperError, Reservation
from ..memory.config import MemoryConfig

logger = logging.getLogger(__name__)


class _NodeStoreExchange(StoreExchange):
    """The records of memory-only saves, through the process group's store: one manifest for
    the job; rank 0's word to the other nodes' leaders goes through the same store."""

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
    """The memory tier of one checkpointer (rank ``rank`` of ``world_size``)."""

    def __init__(self, config: MemoryConfig, *, rank: int, world_size: int, commit_timeout_s: float) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.node, self.nodes = node_of(rank, world_size), node_count(world_size)
        first = node_leader(rank, world_size)
        self.node_ranks = tuple(range(first, min(first + local_world_size(world_size), world_size)))
        self.awaits_commit = self.node != 0 and rank == first
        """This rank leads a node other than rank 0's: it commits its node's slot on rank 0's word."""
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
        its finalize steps wrote (``late``: path in the checkpoint -> bytes); then the other
        nodes' leaders are told to commit theirs."""
        self._client(save, "commit").commit(slot_name(save), save.save_id, manifest=manifest, late=late)
        if self.nodes > 1:
            self.exchange.tell_nodes(save.save_id, {n: manifest for n in range(1, self.nodes)}, dict(late or {}))

    def await_commit(self, save: Any) -> None:
        """A node's leader other than rank 0's (:attr:`awaits_commit`): wait for rank 0's word
        on ``save`` (up to twice ``commit_timeout_s``), then commit this node's slot with the
        job's manifest and late files. ``CommitError`` if rank 0 says the save failed or says
        nothing in time (the slot is then abandoned by the caller)."""
        manifest, late = self.exchange.await_commit(
            save.write_dir, tag=save.tag, save_id=save.save_id, node=self.node,
            timeout_s=LEADER_WAIT_FACTOR * self._wait_s, poll_delay=poll_delay)
        self._client(save, "commit").commit(slot_name(save), save.save_id, manifest=manifest, late=late)

    def abandon(self, save: Any) -> None:
        """The save failed: free its slot (whatever was copied of it); rank 0 also tells the
        other nodes' leaders, which abandon theirs. Never raises."""
        try:
            self._client(save, "commit").abandon(slot_name(save), save.save_id)
        except (KeeperError, OSError) as exc:
            logger.info("async checkpoint: memory slot %s (save %s) not abandoned: %s", slot_name(save),
                        save.save_id, exc)
        if self.rank == 0 and self.nodes > 1:
            try:
                self.exchange.tell_nodes_failed(save.save_id, f"memory slot {slot_name(save)} abandoned on rank 0")
            except (OSError, RuntimeError) as exc:  # the store gone: they then time out
                logger.info("async checkpoint: the other nodes not told of %s's failure: %s", save.save_id, exc)

    def _client(self, save: Any, use: str) -> KeeperClient:
        save_dir = os.path.dirname(save.ckpt_dir)
        with self._lock:
            client = self._clients.get((save_dir, use))
            if client is None:
                client = self._clients[(save_dir, use)] = KeeperClient.connect(save_dir, self.config,
                                                                                node=self.node)
            return client

    # close -------------------------------------------------------------------------
    def close(self, persisted: bool) -> None:
        """Each node's leader, when the last save ``persisted`` (committed on disk): end its
        node's keepers (the job ended normally, its newest checkpoint is on disk). Otherwise the
        keeper stays, for a restart to read, until its idle timeout. Every rank closes its
        connections."""
        with self._lock:
            clients, self._clients = self._clients, {}
        shut: set[str] = set()
        for (save_dir, _use), client in clients.items():
            try:
                if self.rank == self.node_ranks[0] and persisted and save_dir not in shut:
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

