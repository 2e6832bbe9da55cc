"""The durable tiers of one checkpointer: their remotes, drainers and restore, wired to the
engine through its public seams (begin and commit callbacks, and a hold on retention).

Which ranks do what:

- every rank builds each tier's remote and checks it can be reached (so that a bad URL or
  credentials fail engine build on every rank alike, never one rank alone);
- each node's leader (local rank 0: global rank 0 with a shared first tier) runs a drainer per
  tier; it drains what its node holds, once the commit callback fires there;
- global rank 0 commits each tier (manifest, pointer) and runs its retention;
- before a load, rank 0 (each node's leader, with a node-local first tier) restores the
  checkpoint to load into the first tier (:mod:`.restore`), every rank waiting in one exchange.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Callable

from ..commit import Pointer
from ..errors import IntegrityError
from .config import TierConfig
from .drain import Drainer
from .remote import Remote, open_remote
from .restore import restore

logger = logging.getLogger(__name__)


def local_world_size() -> int:
    """Ranks per node, from ``LOCAL_WORLD_SIZE`` (torchrun, DeepSpeed's launcher); 0 if unset."""
    try:
        return max(0, int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
    except ValueError:
        return 0


def node_index(rank: int) -> int:
    """The node a global rank runs on: ``rank // LOCAL_WORLD_SIZE`` (0 without it)."""
    size = local_world_size()
    return rank // size if size else 0


def is_node_leader(rank: int) -> bool:
    size = local_world_size()
    return rank == 0 or (size > 0 and rank % size == 0)


def open_remotes(tiers: tuple[TierConfig, ...]) -> list[Remote]:
    """The remote of each tier, each reached once (:func:`.remote.open_remote`): every rank
    calls it at engine build, so that a bad tier raises ConfigError on every rank alike."""
    return [open_remote(t, index=i) for i, t in enumerate(tiers)]


class DurableTiers:
    """The tiers after the checkpoint directory, for one checkpointer on one rank."""

    def __init__(self, tiers: tuple[TierConfig, ...], *, rank: int,
                 hold: Callable[[str], Callable[[], None]],
                 remotes: list[Remote] | None = None) -> None:
        self.tiers, self.rank, self._hold = tiers, rank, hold
        self.node = node_index(rank)
        self.remotes = remotes if remotes is not None else open_remotes(tiers)
        self.drainers = [Drainer(r, t, node=self.node, coordinator=rank == 0)
                         for r, t in zip(self.remotes, tiers)] if is_node_leader(rank) else []
        self._pointers: collections.OrderedDict[str, Pointer | None] = collections.OrderedDict()
        self._commits = 0
        self._report: Callable[..., None] | None = None

    @classmethod
    def attach(cls, checkpointer: Any, hold: Callable[[str], Callable[[], None]],
               remotes: list[Remote]) -> "DurableTiers":
        """The tiers of ``checkpointer.config`` (``remotes``: from :func:`open_remotes`), their
        callbacks registered on it."""
        tiers = cls(checkpointer.config.tiers, rank=checkpointer.rank, hold=hold, remotes=remotes)
        tiers._report = checkpointer.report
        checkpointer.add_begin_callback(tiers.begun)
        checkpointer.add_commit_callback(tiers.committed)
        return tiers

    def begun(self, handle: Any) -> None:
        """Begin callback (every rank): note the pointer the save will move."""
        self._pointers[handle.ckpt_dir] = handle.pointer
        while len(self._pointers) > 64:
            self._pointers.popitem(last=False)

    def committed(self, info: Any) -> None:
        """Commit callback (node leaders, after the pointer moved): queue the drains due.
        Checkpoints saved aside (no pointer) are not drained."""
        pointer = self._pointers.get(info.ckpt_dir)
        if pointer is None or not self.drainers:
            return
        self._commits += 1
        for drainer in self.drainers:
            if self._commits % drainer.tier.every == 0:
                drainer.submit(info.ckpt_dir, pointer, self._hold(info.ckpt_dir))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the checkpoints committed so far (``wait()`` returned) are drained, or
        given up after a failure, on every tier, for at most ``timeout`` seconds each (tests,
        benchmarks); returns whether they were."""
        if self._report is not None and self.drainers:  # their commit callbacks queued them first
            queued = threading.Event()
            self._report(queued.set)
            if not queued.wait(timeout):
                return False
        return all(d.wait_idle(timeout) for d in self.drainers)

    def close(self) -> None:
        for drainer in self.drainers:
            drainer.close()

    def restore_all_ranks(self, checkpointer: Any, save_dir: str, *, pointer_name: str,
                          tag: str | None = None, node_local: bool = False,
                          name_of: Callable[[str], str] = str) -> None:
        """Collective (every rank): bring the checkpoint to load into ``save_dir`` from the
        tiers, before the framework reads it (see :func:`.restore.restore`). Rank 0 (with
        ``node_local``, each node's leader) restores; every rank raises if any failed."""
        error = None
        if rank_restores(self.rank, node_local):
            try:
                restore(save_dir, self.remotes, pointer_name=pointer_name, tag=tag, name_of=name_of,
                        node=self.node if node_local else None)
            except (IntegrityError, OSError) as exc:
                error = exc
        _, failed = checkpointer.exchange("restore from durable tiers",
                                          None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if failed:
            rank = min(failed)
            raise IntegrityError(f"restoring from the durable tiers failed on rank {rank}: {failed[rank]}")


def rank_restores(rank: int, node_local: bool) -> bool:
    return is_node_leader(rank) if node_local else rank == 0
