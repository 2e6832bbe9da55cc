"""The committer: one thread per checkpointer that takes the sealed saves in order, waits for
their files, and commits them.

Every rank runs one (``async-ckpt-committer``); a sync save runs :meth:`Committer.commit_one`
inline on the training thread instead. For each save, in this order::

    (every rank) wait for its files; make their directory entries durable; publish its record
    (rank 0)     wait for every rank's record; write the manifest     (:func:`~..commit.commit`)
    (rank 0)     run the save's finalize steps; record their files    (:mod:`~..commit.finalize`)
    (rank 0)     swap a re-saved checkpoint in; move the pointer
    (rank 0)     announce the commit (log, callbacks); queue retention (the checkpointer's policy)

With node-local storage (``config.node_local``: each node has its own directory, at the same
path) the records travel through the process group's store (:mod:`~..commit.exchange`), and
then::

    (each other node's leader) wait for rank 0's word; write the manifest rank 0 committed
                 and the late files its finalize steps wrote, swap, move the pointer, all in
                 this node's directory                          (:func:`~..commit.commit_on_node`)
    (each other node's leader) announce the commit; queue retention, as rank 0 does

A failure is recorded in the failure ledger (raised at the next ``begin`` or ``wait``, where
``begin``'s exchange and ``wait_all_ranks`` carry it to every rank) and, where this rank's own
part failed, written as this rank's failure record, so that rank 0 stops waiting. A save that
fails never moves the pointer.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable

from ..commit import META_DIR, commit, commit_on_node, poll_delay
from ..commit.exchange import LEADER_WAIT_FACTOR, StoreExchange
from ..commit.nodes import default_store, node_leader, node_of
from ..commit.records import DirectoryExchange, rank_record
from ..config import AsyncCheckpointConfig
from ..errors import CommitError, ConfigError, DurabilityError
from ..memory.client import KeeperError
from ..persist import FileEntry
from ..qos import lower_this_thread
from ..storage import Storage
from .failures import FailureLedger
from .files import missing_dirs
from .handle import CheckpointHandle
from .job import SaveJob
from .memory_saves import ManifestOnly, MemorySaves
from .reports import Reporter
from .retention import Retention
from .saves import Saves

logger = logging.getLogger(__name__)


def _timings(job: SaveJob, is_async: bool) -> dict[str, float]:
    """This rank's times of ``job`` for its record (see :data:`~..commit.records.TIMINGS`):
    its save call (in sync mode, ``end`` writes the files: to them persisted), its fence
    wait so far (its copies are done by now: a fence that waited for them has returned, or is
    just returning), and from ``begin`` to its files persisted."""
    times = job.times
    called = times.get("called", times["begin"])
    returned = times.get("end", times["persisted"]) if is_async else times["persisted"]
    return {"save_call_s": max(0.0, returned - called), "fence_wait_s": job.fence_wait_s,
            "persisted_s": times["persisted"] - times["begin"]}


class Committer:
    """Commits the saves of one rank, in the order they were sealed.

    ``written(job)``: called once ``job``'s files are written or failed (its eager copies
    are released). Starts its thread at once; :meth:`stop` ends it."""

    def __init__(self, saves: Saves, storage: Storage, config: AsyncCheckpointConfig, *, rank: int,
                 world_size: int, ledger: FailureLedger, retention: Retention, reporter: Reporter,
                 written: Callable[[SaveJob], None], memory: MemorySaves | None = None) -> None:
        self._saves, self._storage, self._config = saves, storage, config
        self._memory = memory
        self._rank, self._world_size = rank, world_size
        self._ledger, self._retention, self._reporter = ledger, retention, reporter
        self._written = written
        self._exchange: DirectoryExchange | StoreExchange = DirectoryExchange(storage)
        self._node = node_of(rank, world_size)
        self._leads_node = False
        """Whether this rank commits its node's checkpoint as rank 0 commits its own: the
        leader of a node other than rank 0's, with node-local storage."""
        if config.node_local and world_size > 1:
            try:
                self._exchange = StoreExchange(default_store(), world_size)
            except RuntimeError as exc:
                raise ConfigError(f"async_checkpoint.node_local: {exc}") from exc
            self._leads_node = self._node != 0 and rank == node_leader(rank, world_size)
        self._queue: queue.SimpleQueue[SaveJob | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="async-ckpt-committer", daemon=True)
        self.thread.start()

    @property
    def leads_node(self) -> bool:
        """Whether this rank commits its node's copy of each checkpoint (node-local storage,
        the lowest rank of a node other than rank 0's)."""
        return self._leads_node

    def mark_node_copy(self, write_dir: str) -> list[str]:
        """A node's leader, in ``begin`` (as rank 0 makes its write directory): this engine's
        marker in this node's ``write_dir``, so that a crash leaves this node's copy partial
        (refused by loads, removed by retention), not a stranger's. Returns the directories
        made, for their entries' sync; none if it could not be made (logged: the writes into
        it fail too, and say so)."""
        made = missing_dirs(os.path.join(write_dir, META_DIR))
        try:
            self._storage.makedirs(os.path.join(write_dir, META_DIR))
        except OSError as exc:
            logger.warning("async checkpoint: cannot create %s: %s", write_dir, exc)
            return []
        return made

    def put(self, job: SaveJob) -> None:
        """Queue the sealed save ``job`` (it is in flight: ``saves.inflight``)."""
        self._queue.put(job)

    def stop(self, timeout: float) -> None:
        """End the thread once what is queued is committed, waiting up to ``timeout`` s."""
        self._queue.put(None)
        self.thread.join(timeout=timeout)

    def _loop(self) -> None:
        lower_this_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.commit_one(job)

    def commit_one(self, job: SaveJob) -> None:
        """Commit the sealed save ``job`` (this rank's part of it), or settle it as failed."""
        handle = job.handle
        # a memory-only save's records go through the store: nothing in the checkpoint directory
        exchange = self._memory.exchange if job.memory_only and self._memory is not None else self._exchange
        recorded = False  # this rank's record is written: rank 0 takes it from there
        committing = False
        try:
            entries: list[FileEntry] = []
            first_error: BaseException | None = None
            for fut in job.files:  # wait for all, so no writer still runs after a failure
                try:
                    entries.append(fut.result())
                except BaseException as exc:
                    first_error = first_error or exc
            for fut in job.dependencies:  # outside work (depends_on): done before the commit
                try:
                    fut.result()
                except BaseException as exc:
                    first_error = first_error or exc
            self._written(job)  # its files are written (or failed): copies released
            if first_error is not None:
                raise first_error
            if job.abandoned:  # the framework's save raised here: rank 0 must not wait for
                why = job.failure or "the save raised on this rank before it was sealed"
                if self._memory is not None:
                    self._memory.abandon(handle)
                if self._rank != 0:  # this rank's record until commit_timeout_s
                    self._report_failure(handle, why, exchange)
                elif self._exchange.node_local:  # nor the other nodes' leaders for rank 0's word
                    self._tell_nodes_failed(handle, why)
                return
            # The entries of the directories made for it: files are synced in their own
            # directory as they are renamed into place, but a new directory's entry lies in its
            # parent (a first save's save directory, Trainer's checkpoint-N at every save).
            for parent in dict.fromkeys(os.path.dirname(d) for d in job.new_dirs):
                try:
                    self._storage.sync_dir(parent)
                except PermissionError as exc:  # a directory this process may not read (not open)
                    logger.warning("async checkpoint: cannot sync directory %s (%s): the entries "
                                   "made in it are as durable as the filesystem makes them", parent, exc)
            job.times["persisted"] = time.perf_counter()
            handle.mark_persisted()
            cfg = self._config
            swap = handle.write_dir != handle.ckpt_dir
            node = self._node if self._exchange.node_local else None
            exchange.publish(handle.write_dir, rank_record(
                handle.write_dir, rank=self._rank, save_id=handle.save_id, checksum=cfg.checksum,
                files=entries, node=node, timings=_timings(job, cfg.is_async)))
            recorded = True
            manifest = None
            if self._rank == 0:
                committing = True  # from here on, commit() tells the other nodes how it ended
                # a memory-only save's commit writes into memory: the manifest, its steps' files
                storage = ManifestOnly() if job.memory_only else self._storage
                manifest, late = commit(storage, handle.write_dir,
                                  tag=handle.tag, save_id=handle.save_id,
                                  world_size=self._world_size, checksum=cfg.checksum,
                                  timeout_s=cfg.commit_timeout_s, pointer=handle.pointer,
                                  replaces=handle.ckpt_dir if swap else None, finalize=job.finalize,
                                  rotation=handle.rotation, exchange=exchange)
                if self._memory is not None:
                    self._commit_slot(job, lambda: self._memory.commit_slot(handle, manifest, late))
            elif self._leads_node:
                manifest, late = self._exchange.await_commit(
                    handle.write_dir, tag=handle.tag, save_id=handle.save_id, node=self._node,
                    timeout_s=LEADER_WAIT_FACTOR * cfg.commit_timeout_s, poll_delay=poll_delay)
                commit_on_node(self._storage, handle.write_dir, manifest, pointer=handle.pointer,
                               replaces=handle.ckpt_dir if swap else None, late=late)
            elif self._memory is not None and self._memory.awaits_commit:
                self._commit_slot(job, lambda: self._memory.await_commit(handle))
            job.times["committed"] = time.perf_counter()
            if manifest is not None and handle.pointer is not None:
                self._retention.pointer_moved(handle)
            if manifest is not None:
                self._reporter.announce(job, manifest)
            if manifest is not None and swap:  # the checkpoint it replaced: deleted in the background
                self._retention.later(self._retention.remove_trash, os.path.dirname(handle.ckpt_dir))
            if manifest is not None and handle.pointer is not None and self._retention.policy is not None:
                self._retention.retire_older_later(job)
        except BaseException as exc:
            job.error = exc
            if self._memory is not None and "memory_committed" not in job.times:
                self._memory.abandon(handle)
            if isinstance(exc, DurabilityError) and exc.pointer_moved and handle.pointer is not None:
                self._retention.pointer_moved(handle)  # it names this one now: retention must keep it
            self._ledger.note(exc, os.path.dirname(handle.ckpt_dir))
            if self._rank == 0 and self._exchange.node_local:  # rank 0 waits for nobody's word:
                if not committing:  # the other nodes' leaders wait for its
                    self._tell_nodes_failed(handle, f"{type(exc).__name__}: {exc}")
            elif not recorded:  # this rank's own part failed (its files, or its record): tell rank 0
                self._report_failure(handle, f"{type(exc).__name__}: {exc}", exchange)
        finally:
            job.finalize = ()  # run or not, never again: what the steps hold is freed
            self._saves.settle(job)  # failed: never swapped in, its staging is abandoned
            self._written(job)
            handle.mark_settled()

    def _tell_nodes_failed(self, handle: CheckpointHandle, message: str) -> None:
        """Rank 0, node-local storage: the save failed before its commit began; the other
        nodes' leaders stop waiting for it."""
        try:
            self._exchange.tell_nodes_failed(handle.save_id, message)
        except (OSError, RuntimeError):  # the store gone (DistStoreError): they then time out
            pass

    def _commit_slot(self, job: SaveJob, commit_slot: Callable[[], None]) -> None:
        """Once ``job``'s save is committed, this node's slot in its keeper: ``commit_slot``
        commits it (rank 0: with the manifest and the late files the commit returned; another
        node's leader: on rank 0's word). A persist save is committed on disk already: a keeper
        (or a word) that fails it is logged (the memory tier then lacks this save); a
        memory-only save fails with it."""
        try:
            commit_slot()
        except (CommitError, KeeperError, OSError) as exc:
            if job.memory_only:
                raise
            logger.warning("async checkpoint: %s is committed on disk but not in node %d's memory keeper: %s",
                           job.handle.tag, self._node, exc)
            self._memory.abandon(job.handle)
            return
        job.times["memory_committed"] = time.perf_counter()

    def _report_failure(self, handle: CheckpointHandle, message: str, exchange=None) -> None:
        try:
            (exchange or self._exchange).fail(handle.write_dir, rank=self._rank, save_id=handle.save_id,
                                message=message)
        except (OSError, RuntimeError):  # a full disk, the store gone (DistStoreError)
            pass  # rank 0 then times out after commit_timeout_s
