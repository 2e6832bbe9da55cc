"""The durable tiers of one checkpointer: their remotes, drainers and restore, wired to the
engine through its public seams (begin and commit callbacks, and a hold on retention).

Which ranks do what:

- every rank builds each tier's remote and checks it can be reached (so that a bad URL or
  credentials fail engine build on every rank alike, never one rank alone);
- global rank 0 (with a node-local first tier, each node's leader: its lowest rank, see
  :mod:`..commit.nodes`) runs a drainer per tier; it drains what its node holds, once the
  commit callback fires there;
- global rank 0 commits each tier (manifest, pointer) and runs its retention;
- the node leaders note, beside the first tier's pointer, the text each commit wrote to it
  (:func:`.choose.record_pointer`), so that a restore tells a pointer edited by hand from it;
- at the first save into a save directory, or the load from it, each drainer's rank queues the
  checkpoint the directory's pointer names, drained first if a tier lacks it (a drain that a
  dead store cut short, or close gave up: :meth:`DurableTiers.catch_up`);
- before a load, rank 0 chooses the checkpoint and rank 0 (each node's leader, with a
  node-local first tier) restores it into the first tier (:mod:`.restore`), every rank taking
  each step in the same exchanges.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Callable

from ..commit import Pointer
from ..commit.nodes import node_leader, node_of
from .choose import record_pointer
from .config import TierConfig
from .drain import Drainer
from .remote import Remote, open_remote
from .restore import restore

logger = logging.getLogger(__name__)


def open_remotes(tiers: tuple[TierConfig, ...]) -> list[Remote]:
    """The remote of each tier, each reached once (:func:`.remote.open_remote`): every rank
    calls it at engine build, so that a bad tier raises ConfigError on every rank alike."""
    return [open_remote(t, index=i) for i, t in enumerate(tiers)]


class DurableTiers:
    """The tiers after the checkpoint directory, for one checkpointer on one rank."""

    def __init__(self, tiers: tuple[TierConfig, ...], *, rank: int,
                 hold: Callable[[str], Callable[[], None]],
                 remotes: list[Remote] | None = None, world_size: int = 1,
                 node_local: bool = False, report: Callable[..., None] | None = None) -> None:
        self.tiers, self.rank, self.world_size, self._hold = tiers, rank, world_size, hold
        self.node_local = node_local and world_size > 1
        """Whether the first tier is node-local: each node's leader drains and restores its
        node's directory (the commit callbacks fire there), not rank 0 alone."""
        self.node = node_of(rank, world_size) if self.node_local else 0
        self.remotes = remotes if remotes is not None else open_remotes(tiers)
        self.drainers = [Drainer(r, t, node=self.node, coordinator=rank == 0)
                         for r, t in zip(self.remotes, tiers)] if self._leads() else []
        self._pointers: collections.OrderedDict[str, Pointer | None] = collections.OrderedDict()
        self._commits = 0
        self._report = report
        """Runs a function after every commit callback queued before it (the checkpointer's
        ``report``); None: drains are queued at once."""
        self._caught_up: set[str] = set()
        self.name_of: Callable[[str], str] = str
        """The name of the checkpoint directory a pointer's text names (:meth:`catch_up`,
        :meth:`restore_all_ranks`): the text itself (DeepSpeed's ``latest`` holds the tag), or
        what the framework's adapter sets (Megatron's tracker holds an iteration, its
        directory is ``iter_NNNNNNN``)."""

    @classmethod
    def attach(cls, checkpointer: Any, hold: Callable[[str], Callable[[], None]],
               remotes: list[Remote]) -> "DurableTiers":
        """The tiers of ``checkpointer.config`` (``remotes``: from :func:`open_remotes`), their
        callbacks registered on it."""
        tiers = cls(checkpointer.config.tiers, rank=checkpointer.rank, hold=hold, remotes=remotes,
                    world_size=checkpointer.world_size, node_local=checkpointer.config.node_local,
                    report=checkpointer.report)
        checkpointer.add_begin_callback(tiers.begun)
        checkpointer.add_commit_callback(tiers.committed)
        return tiers

    def begun(self, handle: Any) -> None:
        """Begin callback (every rank): note the pointer the save will move; at the first
        save into a save directory, catch the tiers up with it (:meth:`catch_up`)."""
        self._pointers[handle.ckpt_dir] = handle.pointer
        while len(self._pointers) > 64:
            self._pointers.popitem(last=False)
        if handle.pointer is not None:
            self.catch_up(os.path.dirname(handle.ckpt_dir), handle.pointer.path,
                          saving=handle.ckpt_dir)

    def catch_up(self, save_dir: str, pointer_path: str, *, saving: str | None = None) -> None:
        """Drainers' ranks, once per save directory (its first save or load here; the
        others return at once): queue, for each tier, the checkpoint the pointer file
        ``pointer_path`` names (the directory :attr:`name_of` its text), to be drained
        before anything else if the tier lacks it: a drain a dead store cut short, or close
        gave up, in an earlier run. The drain thread checks the tier
        (:func:`.mirror.tier_lacks`); nothing is asked of the tier here, on the caller's
        thread. ``saving``: the checkpoint the save that calls it writes, not queued if it is
        the one the pointer names (its own commit drains it)."""
        save_dir = os.path.abspath(save_dir)
        if not self.drainers or save_dir in self._caught_up:
            return
        self._caught_up.add(save_dir)
        try:
            with open(pointer_path, encoding="utf-8") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            return  # nothing committed there yet
        name = self.name_of(text)
        ckpt_dir = os.path.join(save_dir, name)
        if not name or not os.path.isdir(ckpt_dir) or (saving is not None and os.path.abspath(saving) == ckpt_dir):
            return
        for drainer in self.drainers:
            drainer.submit(ckpt_dir, Pointer(pointer_path, text), self._hold(ckpt_dir), if_behind=True)

    def committed(self, info: Any) -> None:
        """Commit callback (node leaders, after the pointer moved): note the pointer's text
        (see :func:`.choose.record_pointer`) and queue the drains due. Checkpoints saved
        aside (no pointer) are not drained."""
        pointer = self._pointers.get(info.ckpt_dir)
        if pointer is None or not self.drainers:
            return
        try:
            record_pointer(os.path.dirname(os.path.abspath(pointer.path)), os.path.basename(info.ckpt_dir),
                           os.path.basename(pointer.path), pointer.text)
        except OSError as exc:  # a restore then takes the pointer for one edited by hand: follows it
            logger.warning("async checkpoint: cannot note the pointer %s: %s", pointer.path, exc)
        self._commits += 1
        for drainer in self.drainers:
            if self._commits % drainer.tier.every == 0:
                drainer.submit(info.ckpt_dir, pointer, self._hold(info.ckpt_dir))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the checkpoints committed so far (``wait()`` returned) are drained, or
        given up after a failure, on every tier, for at most ``timeout`` seconds each (tests,
        benchmarks); returns whether they were."""
        return self.wait_queued(timeout) and all(d.wait_idle(timeout) for d in self.drainers)

    def wait_queued(self, timeout: float | None = None) -> bool:
        """Wait until the drains of the checkpoints committed so far are queued: commit callbacks
        run on the checkpointer's reporting thread, after ``wait()`` returned. Returns whether
        they ran within ``timeout`` seconds."""
        if self._report is None or not self.drainers:
            return True
        queued = threading.Event()
        self._report(queued.set)  # runs after every callback reported before it
        return queued.wait(timeout)

    def close(self) -> None:
        """Every tier's last try at once: each tier's ``close_timeout_s`` counts from here, so
        several tiers that do not answer hold the exit for the longest of them, not their sum
        (see :mod:`.drain`)."""
        for drainer in self.drainers:
            drainer.stop()
        for drainer in self.drainers:
            drainer.close()

    def _leads(self) -> bool:
        """Whether this rank drains and restores: rank 0, or a node's leader (node-local)."""
        return node_leader(self.rank, self.world_size) == self.rank if self.node_local else self.rank == 0

    def restore_all_ranks(self, checkpointer: Any, save_dir: str, *, pointer_name: str,
                          tag: str | None = None, node_local: bool | None = None,
                          every_file: bool = False) -> str | None:
        """Collective (every rank): bring the checkpoint to load into ``save_dir`` from the
        tiers, before the framework reads it (see :func:`.restore.restore`). Global rank 0
        chooses; rank 0 (with a node-local first tier, each node's leader) makes it whole in
        its ``save_dir``; every rank raises if any failed. Returns the checkpoint's name (None:
        no tier holds one). ``node_local``: whether ``save_dir`` is node-local (None: as the
        engine commits); ``every_file``: each node restores every file of the checkpoint, not
        only those its directory held (its ranks read files written on other nodes: Megatron).

        Every node loads the checkpoint rank 0 chose, its pointer moved to it: one that some
        node cannot make whole (a node kept a checkpoint whose drain failed, another lost its
        disk) is passed over on every node alike for the next older one every node can, unless
        its tag was asked for."""
        local = self.node_local if node_local is None else node_local and self.world_size > 1
        leads = node_leader(self.rank, self.world_size) == self.rank if local else self.rank == 0
        name = restore(save_dir, self.remotes, pointer_name=pointer_name, tag=tag, name_of=self.name_of,
                       every_file=every_file, node=node_of(self.rank, self.world_size) if local else None,
                       exchange=checkpointer.exchange, chooses=self.rank == 0, restores=leads)
        if local == self.node_local:  # the drainers' directory: caught up before any save
            self.catch_up(save_dir, os.path.join(save_dir, pointer_name))
        return name
