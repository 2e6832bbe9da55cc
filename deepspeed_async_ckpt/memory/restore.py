"""Restore from memory: a load takes the node keeper's newest committed checkpoint where it is
newer than what the checkpoint directory and the durable tiers hold, laid out as a checkpoint
directory on tmpfs for the framework's own load code, which globs and opens files by path.

Which ranks do what (:func:`restore_from_memory`, every rank, two exchanges):

1. Global rank 0 asks its node's keeper for its newest committed slot and compares it with the
   checkpoint the tiers' rules would load (:func:`~..tiers.choose.newest_committed`) by
   :func:`memory_is_newer`; it proposes the slot (name, ``save_id``) or nothing.
2. Each node's leader (its lowest rank) asks its own keeper for that slot and lays each file
   the node's ranks read (the manifest's, or its node's share of them) that the keeper holds
   out under :func:`restore_dir` as a hard link to the keeper's segment holding it, verified
   against the rank's checksum (:meth:`.client.MemoryCopy.link`: the same tmpfs, no byte
   copied). On several nodes, the files a node lacks (each keeper holds its own ranks' files)
   come from the node that holds them (:mod:`.fetch`). Then the manifest and the framework's
   pointer naming it. The other ranks wait in the exchange.
3. If any node could not (no keeper: it died or the node was replaced; a copy failing its
   checksum; a file no node holds), every rank falls back to the checkpoint directory and the
   tiers as without the memory tier; rank 0 logs one line naming why (the file, where one failed).

The framework then loads from the restore directory; :meth:`MemoryRestore.close` removes it
(the node's leader), and the next load on the node removes one a killed load left. Nothing in
the save directory changes: its pointer still names the newest checkpoint on disk.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..agreement import Exchange, alone, outcome
from ..commit import MANIFEST, META_DIR
from ..commit.nodes import node_count, node_leader, node_of
from ..errors import IntegrityError
from .address import SHM_DIR, KeeperAddress

logger = logging.getLogger(__name__)

RESTORE_PREFIX = "dsack-load."
"""Restore directories are ``/dev/shm/dsack-load.<uid>.<hash of the save directory>.<save id>``."""


@dataclass(frozen=True)
class Held:
    """A committed checkpoint, as the chooser compares it: its name, save id and commit time
    (the manifest's ``committed_at``, seconds since the epoch)."""

    name: str
    save_id: str
    at: float


def _order(name: str, at: float) -> tuple[float, int]:
    """The commit order: the commit time, then the step in the name where both have one."""
    match = re.search(r"(\d+)$", name)
    return at, int(match.group(1)) if match else -1


def memory_is_newer(held: Held | None, on_disk: tuple[float, str] | None, tag: str | None = None) -> str | None:
    """Rank 0's choice: None where the memory checkpoint ``held`` is the one to load, else why
    not. ``on_disk``: (commit time, name) of the checkpoint the checkpoint directory and the
    tiers would give (None: none). A tag asked for is taken from memory where the keeper holds
    it and the disk holds no later commit of it; without a tag, memory wins where its commit
    is no older (a tie is the same save persisted: memory reads faster)."""
    if held is None:
        return "the keeper holds no committed checkpoint"
    if tag is not None:
        if held.name != tag:
            return f"the keeper's newest is {held.name}, not the {tag} asked for"
        if on_disk is not None and on_disk[1] == tag and on_disk[0] > held.at:
            return f"the checkpoint directory holds a later commit of {tag}"
        return None
    if on_disk is not None:
        at, name = on_disk
        if _order(name, at) > _order(held.name, held.at):
            return f"{name} on disk is newer than {held.name} in memory"
    return None


def restore_dir(save_dir: str, save_id: str, node: int = 0) -> str:
    """The tmpfs directory node ``node`` lays a memory checkpoint out in (each node has its own
    ``/dev/shm``), derived from its keeper's address and the save."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", save_id)
    return os.path.join(SHM_DIR, f"{RESTORE_PREFIX}{KeeperAddress.of(save_dir, node=node).key}.{safe}")


_SERVING: dict[str, str] = {}
"""The restore directories of this process's loads in progress (:func:`laid_out`): their save ids."""


class MemoryRestore:
    """A memory checkpoint laid out for a load: ``load_dir/name`` is the checkpoint."""

    def __init__(self, load_dir: str, name: str, save_id: str, owns: bool) -> None:
        self.load_dir, self.name, self.save_id, self._owns = load_dir, name, save_id, owns
        _SERVING[load_dir] = save_id

    def close(self) -> None:
        """Remove the directory (the node's leader; call once every rank of the node loaded)."""
        _SERVING.pop(self.load_dir, None)
        if self._owns:
            shutil.rmtree(self.load_dir, ignore_errors=True)


def laid_out(path: str) -> bool:
    """Whether ``path`` is a file of a memory checkpoint this process is loading: its bytes were
    verified against the keeper's checksums as they were laid out, and the framework's load may
    map it (``torch.load(mmap=True)``: the keeper's own pages, no copy, no second hash; the
    keeper never reuses them, see :class:`~.messages.Newest`)."""
    return _serving(os.path.abspath(path)) is not None


def agreement_key(path: str) -> str:
    """What ranks checking ``path`` together agree on: its absolute path, except in a memory
    checkpoint being loaded, whose restore directory differs from node to node (each is named
    by its node's keeper) while the checkpoint is the same: there, the save and the path in it."""
    path = os.path.abspath(path)
    serving = _serving(path)
    return path if serving is None else f"<memory save {_SERVING[serving]}>{path[len(serving):]}"


def _serving(path: str) -> str | None:
    """The restore directory of a load in progress that absolute ``path`` lies in, if any."""
    return next((d for d in _SERVING if path.startswith(d + os.sep)), None)


def restore_from_memory(save_dir: str, memory: Any, *, rank: int, world_size: int, pointer_name: str,
                        tag: str | None = None, on_disk: Callable[[], tuple[float, str] | None] = lambda: None,
                        required: Callable[[dict, int], Sequence[str]] | None = None,
                        pointer_text: Callable[[str], str] = str,
                        exchange: Exchange = alone) -> MemoryRestore | None:
    """Collective (every rank): lay the keeper's checkpoint out for the load, where it is the
    one to load and every node can make it whole (see the module's rules); None: load from the
    checkpoint directory and the tiers as without the memory tier. ``memory``: the job's
    :class:`.config.MemoryConfig`; ``on_disk``: rank 0's (commit time, name) of the checkpoint
    the other tiers would give; ``required(manifest, node)``: the files a node's ranks read
    (default: the node's share of the manifest's files, see :func:`required_files`);
    ``pointer_text``: the pointer's text naming a checkpoint (Megatron's tracker: the iteration)."""
    proposal, reason, level = None, None, logging.WARNING
    if rank == 0:
        try:
            proposal, reason, level = _propose(save_dir, memory, tag, on_disk)
        except Exception as exc:  # noqa: BLE001 - the memory tier never fails a load
            reason = f"{type(exc).__name__}: {exc}"
    proposal, failed = outcome("restore from memory", proposal, exchange=exchange)
    if failed is not None or proposal is None:
        if rank == 0 and reason is not None:
            logger.log(level, "async checkpoint: not loading from the memory tier (%s): loading from the "
                       "checkpoint directory", reason)
        return None
    name, save_id = proposal
    node, several = node_of(rank, world_size), node_count(world_size) > 1
    leads = node_leader(rank, world_size) == rank
    path = restore_dir(save_dir, save_id, node)
    own: BaseException | None = None
    layout: _Layout | None = None
    if leads:
        try:
            layout = _Layout.open(save_dir, memory, name, save_id, path, node, required or required_files)
            if layout.lacking and not several:
                raise IntegrityError(f"node {node}'s keeper lacks {', '.join(layout.lacking)} of {name}")
        except Exception as exc:  # noqa: BLE001 - shared below: every rank falls back alike
            own = exc
    failed = None
    if several:  # the files a node lacks come from the nodes that hold them
        from .fetch import fetch_lacking

        own, failed = fetch_lacking(layout, own, rank=rank, world_size=world_size)
    if failed is None and layout is not None and own is None:
        try:
            layout.finish((pointer_name, pointer_text(name)))
        except Exception as exc:  # noqa: BLE001 - shared below
            own = exc
    if failed is None:
        _, failed = outcome("restore from memory", None, own, exchange=exchange)
    if failed is not None:
        if layout is not None:  # its directory removed, the keeper's segments it mapped let go
            layout.abort()
        elif leads:
            shutil.rmtree(path, ignore_errors=True)
        if rank == 0:
            first = min(failed.failures)
            logger.warning("async checkpoint: not loading %s from the memory tier (rank %d: %s): loading "
                           "from the checkpoint directory", name, first, failed.failures[first])
        return None
    if rank == 0:
        logger.info("async checkpoint: loading %s (save %s) from the memory tier", name, save_id)
    return MemoryRestore(path, name, save_id, owns=leads)


def _propose(save_dir: str, memory: Any, tag: str | None, on_disk: Callable[[], tuple[float, str] | None]
             ) -> tuple[tuple[str, str] | None, str | None, int]:
    """Rank 0: ((name, save id) to load from memory or None, why not, the level to log it at).
    A keeper that is gone is a warning (where the disk holds a checkpoint: a job's first start
    has no keeper either); a disk checkpoint newer than memory's, or a keeper with nothing
    committed yet, is how things are between jobs."""
    from .client import KeeperClient

    client = KeeperClient.find(save_dir, memory)
    if client is None:  # a job's first start has none either: nothing on disk, nothing lost
        level = logging.INFO if on_disk() is None else logging.WARNING
        return None, f"no memory keeper runs for {os.path.realpath(save_dir)} on rank 0's node", level
    try:
        copy = client.newest()
    finally:
        client.close()
    held = None if copy is None or copy.manifest is None else \
        Held(copy.name, copy.save_id, float(copy.manifest.get("committed_at", 0.0)))
    why = memory_is_newer(held, on_disk(), tag)
    if why is not None:
        return None, why, logging.INFO
    return (held.name, held.save_id), None, logging.INFO


def required_files(manifest: dict, node: int) -> list[str]:
    """The files a node's ranks read: those the manifest places on the node (a node-local
    first tier), else every file (DeepSpeed's ZeRO-1/2 ranks read every rank's optimizer
    file). Late files are not (DeepSpeed's ``zero_to_fp32.py``: no load reads it); those the
    keeper holds are laid out too, and recorded (megatron-core's ``.metadata``,
    ``metadata.json``, which Megatron's loads read: its ``required`` lists them)."""
    from ..tiers.mirror import files_of_node

    return files_of_node(manifest, node)


class _Layout:
    """A node's leader making its restore directory: the files its keeper holds linked in at
    once (:meth:`open`), those it lacks fetched from other nodes' (:mod:`.fetch`), then the
    manifest, the late files and the pointer (:meth:`finish`)."""

    def __init__(self, copy: Any, node: int, path: str, ckpt: str, late: list[str],
                 held: dict[str, tuple[int, int, str]], lacking: list[str]) -> None:
        self.copy, self.node, self.path, self.ckpt, self.late = copy, node, path, ckpt, late
        self.held = held
        """Files linked in: path in the checkpoint -> (the rank whose part holds it, size, checksum)."""
        self.lacking = lacking
        """Files the node's ranks read that its keeper does not hold."""

    @classmethod
    def open(cls, save_dir: str, memory: Any, name: str, save_id: str, path: str, node: int,
             required: Callable[[dict, int], Sequence[str]]) -> "_Layout":
        from .client import KeeperClient

        address = KeeperAddress.of(save_dir, node=node)
        for stale in os.listdir(SHM_DIR):  # left by a load that was killed
            if stale.startswith(f"{RESTORE_PREFIX}{address.key}.") and os.path.join(SHM_DIR, stale) != path:
                shutil.rmtree(os.path.join(SHM_DIR, stale), ignore_errors=True)
        client = KeeperClient.find(save_dir, memory, node=node)
        if client is None:
            raise IntegrityError(f"no memory keeper runs for {address.save_dir} on node {node}")
        try:
            copy = client.newest(lend=True)
        finally:
            client.close()
        if copy is None or (copy.name, copy.save_id) != (name, save_id):
            held = "none" if copy is None else f"{copy.name} (save {copy.save_id})"
            if copy is not None:
                copy.close()
            raise IntegrityError(f"node {node}'s keeper holds {held}, not {name} (save {save_id})")
        where = {f.name: (r, f.size, f.checksum) for r, part in sorted(copy.ranks.items()) for f in part.files}
        files = list(required(copy.manifest, node))
        # the late files the keeper holds too (megatron-core's markers, given with the commit or
        # in a rank's part), recorded again in finish()
        late = [f for f in copy.manifest.get("late_files", ()) if f in where or f in copy.late]
        lacking = [f for f in files if f not in where and f not in copy.late]
        files = [f for f in files if f in where]  # from the ranks' parts; those given inline in finish()
        files += [f for f in late if f not in files and f in where]
        shutil.rmtree(path, ignore_errors=True)
        layout = cls(copy, node, path, os.path.join(path, name), late, {f: where[f] for f in files}, lacking)
        try:
            for rel in files:
                target = layout.target(rel)
                copy.link(where[rel][0], rel, target)
        except BaseException:
            layout.abort()
            raise
        return layout

    def target(self, rel: str) -> str:
        """Where ``rel`` goes in the restore directory (its directory made)."""
        target = os.path.join(self.ckpt, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        return target

    def finish(self, pointer: tuple[str, str]) -> None:
        """The manifest, the late files given inline, their records, and the pointer."""
        from ..commit.manifest import record_late_files
        from ..storage import LocalStorage

        try:
            manifest = dict(self.copy.manifest, late_files=self.late) if self.late else \
                {k: v for k, v in self.copy.manifest.items() if k != "late_files"}
            os.makedirs(os.path.join(self.ckpt, META_DIR), exist_ok=True)
            with open(os.path.join(self.ckpt, META_DIR, MANIFEST), "w", encoding="utf-8") as f:
                json.dump(manifest, f)
            for rel in self.late:
                if rel not in self.held and not os.path.exists(os.path.join(self.ckpt, rel)):
                    with open(self.target(rel), "wb") as f:  # given with the commit: small, kept by the keeper
                        f.write(self.copy.late[rel])
            if self.late:  # hashed from the bytes the keeper verified: the load's check covers them
                record_late_files(LocalStorage(fsync=False, direct_io=False), self.ckpt)
            with open(os.path.join(self.path, pointer[0]), "w", encoding="utf-8") as f:
                f.write(pointer[1])
        except BaseException:
            self.abort()
            raise
        self.copy.close()

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.copy.close()
