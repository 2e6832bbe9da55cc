"""The files of the open save: each planned on the training thread as ``save`` is called, its
eager copies made at once, and, when the save is sealed, handed to the writer threads with its
lazy copies queued for the copier.

``save``/``save_packed`` and ``seal`` run on the training thread of every rank that writes; a
fence on another thread (an evaluation thread's :func:`~.lifecycle.fence_all`) may seal the
open save too, hence the seal lock. ``save(replicas=...)`` is collective over the replicas.
The committer thread calls :meth:`SaveFiles.eager_written` once a save's files are written.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, Iterable

import torch
import xxhash

from ..config import AsyncCheckpointConfig
from ..errors import AsyncCheckpointError, SnapshotError
from ..persist import FileWriter, ProcessWriter, Share, ThreadWriter, split_items
from ..persist.pacing import WritePacer
from ..snapshot import (FilePlan, HostBufferPool, PlanCache, Stager, TensorItem, plan_file,
                        storage_addresses, tensor_ids)
from ..storage import Storage, aligned_size, temporary_path
from .collectives import Replicas, layout_digest
from .job import SaveJob
from .saves import Saves

logger = logging.getLogger(__name__)

_PLAN_CACHES = 64
"""How many files' plans a rank keeps (a rank writes a few files per checkpoint)."""


def missing_dirs(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while path != os.path.dirname(path) and not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def smallest_host_buffer_gb(nbytes: int) -> float:
    """The smallest ``host_buffer_gb``, in hundredths, whose pool holds ``nbytes``."""
    gb = -(-nbytes * 100 // 2**30) / 100
    while int(gb * 2**30) < nbytes:  # float rounding
        gb = round(gb + 0.01, 2)
    return gb


_PLANNED, _FAILED = b"\x01", b"\x00"
"""The first byte of a replica's digest in the gather of :meth:`SaveFiles._share_of`."""


class SaveFiles:
    """Adds files to the open save of one rank and hands them to the background.

    ``stager``: the copier (device -> pinned host, in ``pool``); ``writers``: the writer
    threads, which write the files (``persist_in: "thread"``) or hand them to a worker
    process (``"process"``); ``rank``: for the log."""

    def __init__(self, saves: Saves, storage: Storage, config: AsyncCheckpointConfig, *, rank: int,
                 pool: HostBufferPool, stager: Stager, writers: Executor, memory: Any = None) -> None:
        self._saves, self._storage, self._config, self._rank = saves, storage, config, rank
        self._pool, self.stager = pool, stager
        persist = dict(checksum=config.checksum, zip_crc32=config.zip_crc32,
                       pacer=WritePacer() if config.pace_writes and config.is_async else None)
        self._persist: FileWriter
        if memory is not None:  # the memory tier (a MemorySaves): every file into the keeper's slot
            from ..memory.saver import MemoryWriter
            self._persist = MemoryWriter(storage, memory, checksum=config.checksum, zip_crc32=config.zip_crc32)
        elif config.persist_in == "process":
            self._persist = ProcessWriter(storage, pool, writers, **persist)
        else:
            self._persist = ThreadWriter(storage, writers, **persist)
        self._eager_held: dict[SaveJob, int] = {}
        """Bytes of each save's eager copies (outside the pool) until its files are written."""
        self._eager_cond = threading.Condition()
        self._seal_lock = threading.Lock()
        """Held while an open save's files and lazy copies are listed (``save``) or handed to the
        writers and the copier (``end``, or a fence): a fence on another thread (an eval
        thread's :func:`fence_all`) may seal them while the training thread is still saving."""
        self._warned_replicas_differ = False
        self._warned_pool_too_small = False
        self._plans: collections.OrderedDict[tuple[str, int], PlanCache] = collections.OrderedDict()
        """The last plan of each file, by its path in the checkpoint and archive index (the
        most recently saved :data:`_PLAN_CACHES` of them): see :class:`PlanCache`."""

    def add(self, path: str, states: list[Any], names: list[str] | None,
                  eager_keys: Iterable[str], eager_tensors: Iterable[torch.Tensor] = (),
                  replicas: Replicas | None = None) -> list[int]:
        """Add one file of ``states`` (one archive each; ``names``: of the parts of a packed
        file, else None) to the open save; see :meth:`AsyncCheckpointer.save
        <.checkpointer.AsyncCheckpointer.save>`. Returns the tensor bytes each state stages."""
        job = self._saves.current
        if job is None:
            raise AsyncCheckpointError(f"save({path!r}) outside begin()/end()")
        handle = job.handle
        path = os.path.abspath(path)
        rel = os.path.relpath(path, handle.ckpt_dir)
        if rel in (os.curdir, os.pardir) or rel.startswith(os.pardir + os.sep):
            # the manifest lists files by their path in the checkpoint: one outside it would
            # make a manifest that every reader refuses as damaged, once `latest` names it
            raise ValueError(f"save({path!r}): not a file inside the checkpoint directory "
                             f"{handle.ckpt_dir!r} (tag {handle.tag!r})")
        if rel in job.paths:  # async: two writers on one temporary name, and no commit
            raise ValueError(f"save({path!r}): this file was already saved in checkpoint "
                             f"{handle.tag!r}: save each file of a checkpoint once")
        job.paths.add(rel)
        if handle.write_dir != handle.ckpt_dir:  # staged: the same name in the staging directory
            path = os.path.join(handle.write_dir, rel)
        plans, shared = [], False
        try:  # up to its directory: a failure leaves the save as it was (a retry may come)
            eager_storages = storage_addresses(eager_tensors)
            for state in states:
                lazy = tensor_ids(state, except_storages=eager_storages)
                if isinstance(state, dict):
                    for k in eager_keys:
                        if k in state:
                            lazy -= tensor_ids(state[k])
                plans.append(plan_file(state, lazy, what=path, cache=self._plan_cache(rel, len(plans))))
            self._check_fits_pool(plans)
            share = None
            if replicas is not None and replicas.size > 1:
                shared = True  # the replicas met: a retry on this rank alone would wait for them
                share = self._share_of(path, plans[0], replicas, handle.save_id)
                if (share is None and replicas.rank != 0) or (share is not None and share.index < 0):
                    for item in plans[0].items:  # the other replicas write it
                        item.cancel()
                    return [0]
            new_dirs = [] if handle.memory_only else missing_dirs(os.path.dirname(path))
            if not handle.memory_only:  # in the keeper's memory only: no directory on disk
                self._storage.makedirs(os.path.dirname(path))
        except BaseException:
            # a failed makedirs must not leave the file's items listed and never issued
            # (handle.wait_staged() would never return), nor its path "already saved"
            if not shared:
                job.paths.discard(rel)
            for plan in plans:
                for item in plan.items:
                    item.cancel()
            raise
        job.new_dirs += new_dirs
        staged = []  # this rank's items of each plan: all, or its share's
        for plan in plans:
            mine = plan.items if share is None else \
                [plan.items[j] for j in share.items(len(plan.items))]
            if share is not None:
                for item in set(plan.items).difference(mine):
                    item.cancel()  # another rank's: never staged here
            job.items.extend(mine)
            job.nbytes += sum(i.nbytes for i in mine)
            staged.append(mine)
        if not self._config.is_async:
            largest = max((i.nbytes for mine in staged for i in mine), default=0)
            stage = functools.partial(self.stager.stage, ready=self.stager.ready_event(),
                                      expected_bytes=largest)  # with CUDA: after queued kernels
            try:
                record = self._persist.write(path, plans, part_names=names, share=share, stage=stage)
            except BaseException as exc:  # for rank 0's error, once the caller abandons the save
                job.failure = f"{type(exc).__name__}: {exc}"
                raise
            done: Future = Future()
            done.set_result(record)
            job.files.append(done)
        else:
            self._eager_room(job, sum(i.nbytes for mine in staged for i in mine if i.eager))
            try:
                for mine in staged:
                    self.stager.stage_eager(i for i in mine if i.eager)
            except BaseException:  # the file is not written: none of its items may be queued
                for mine in staged:  # (a queued one would hold its pool buffer for good)
                    for i in mine:
                        i.cancel()
                raise
            with self._seal_lock:  # the file and its copies together, or neither
                for mine in staged:
                    job.copies.extend(i for i in mine if not i.eager)
                job.writes.append((path, plans, names, share))
        return [sum(i.nbytes for i in mine) for mine in staged]

    def _check_fits_pool(self, plans: list[FilePlan]) -> None:
        """Refuse a file with a record the pool can never hold, before anything of it is
        staged: a record is staged in one piece (one buffer from copy to write), so one larger
        than ``host_buffer_gb`` would fail in the copier, after the save returned, leaving a
        save that never commits. Every record of the file counts, this replica's share or not,
        so that the replicas of a shared file all refuse it together. The records staged
        through the pool: the lazy ones (eager copies are made outside it), or, in sync mode,
        every one."""
        capacity = self._pool.capacity_bytes
        through_pool = [i for plan in plans for i in plan.items if not self._config.is_async or not i.eager]
        largest = max(through_pool, key=lambda i: aligned_size(i.nbytes), default=None)
        if largest is None or aligned_size(largest.nbytes) <= capacity:
            return
        need = aligned_size(largest.nbytes)
        raise SnapshotError(
            f"{largest.what} needs {need} bytes of host staging ({largest.nbytes} rounded up to "
            f"whole pages), more than async_checkpoint.host_buffer_gb {self._config.host_buffer_gb:g} "
            f"allows ({capacity} bytes): a record is staged in one piece. Nothing of this save "
            f"was staged; set host_buffer_gb to at least {smallest_host_buffer_gb(need):g}")

    def _plan_cache(self, rel: str, index: int) -> PlanCache:
        cache = self._plans.pop((rel, index), None) or PlanCache()
        self._plans[(rel, index)] = cache  # the most recent last
        while len(self._plans) > _PLAN_CACHES:  # file names that change from save to save
            self._plans.popitem(last=False)
        return cache

    def _eager_room(self, job: SaveJob, nbytes: int) -> None:
        """Count ``nbytes`` of eager copies for the save ``job``, first waiting (backpressure, as
        the pool's) while the earlier saves' eager copies not yet written would take the total
        over ``host_buffer_gb``. Only those are waited for: they are written without this
        thread, where this save's own are written once it is sealed, so one save's eager
        copies may exceed the bound alone. Without it, saves of eager state (``client_state``,
        module buffers) against a slow disk would pile up host copies without limit."""
        if not nbytes:
            return
        start = None
        with self._eager_cond:
            while True:
                with self._saves.lock:
                    earlier = sum(n for j, n in self._eager_held.items() if j in self._saves.inflight)
                if not earlier or earlier + self._eager_held.get(job, 0) + nbytes <= self._pool.capacity_bytes:
                    break
                start = start or time.perf_counter()
                self._eager_cond.wait(0.5)  # notified as saves are written; polled in case
            self._eager_held[job] = self._eager_held.get(job, 0) + nbytes
        if start is not None:
            job.eager_wait_s += time.perf_counter() - start

    def eager_written(self, job: SaveJob) -> None:
        """The committer: ``job``'s files are written (or failed), its eager copies freed."""
        with self._eager_cond:
            if self._eager_held.pop(job, None) is not None:
                self._eager_cond.notify_all()

    def _share_of(self, path: str, plan: FilePlan, replicas: Replicas, save_id: str) -> Share | None:
        """This rank's share of a file its replicas all save (index -1: the others' shares
        cover it all), or None where they do not split it, and the first replica writes it
        whole: with zip CRCs, or when the replicas planned different archives (found by one
        collective over them)."""
        if self._config.zip_crc32:
            return None
        name = xxhash.xxh3_64_digest(os.path.basename(path).encode())
        # every replica takes part in the gather, one whose digest failed too (it says so in
        # the first byte): else the others would wait in it for good
        try:
            mine, failure = _PLANNED + name + layout_digest(plan), None
        except Exception as exc:
            mine, failure = _FAILED + name + bytes(16), exc
        every = replicas.gather(mine)
        if failure is not None:
            raise failure
        failed = [r for r, d in enumerate(every) if d[:1] == _FAILED]
        if failed:
            raise AsyncCheckpointError(
                f"save({path!r}, replicas=...): replica(s) {failed} failed to lay the file out (each "
                "raised its own error): no replica saves it")
        every = [d[1:] for d in every]
        if any(d[:8] != name for d in every):
            raise AsyncCheckpointError(
                f"save({path!r}, replicas=...): the replicas are saving different files (replica "
                f"{replicas.rank} this one, replicas {[r for r, d in enumerate(every) if d[:8] != name]} "
                "another): every replica must save the same file at the same point")
        if any(d != every[0] for d in every):
            if replicas.rank == 0 and not self._warned_replicas_differ:
                self._warned_replicas_differ = True
                logger.warning("async checkpoint: %s differs between its data-parallel "
                               "replicas (buffers such as BatchNorm's statistics, or "
                               "rank-specific client state): the first replica writes it "
                               "alone, as DeepSpeed's own engine does (logged once)", path)
            return None
        # balanced as the file and the pool hold records: each on whole pages
        cuts = split_items([aligned_size(i.nbytes) for i in plan.items], replicas.size)
        if not cuts:
            return None
        return Share(index=replicas.rank if replicas.rank <= len(cuts) else -1, cuts=cuts,
                     tmp=temporary_path(path, save_id))

    def seal(self, job: SaveJob, *, last: bool = False) -> None:
        """Hand the save ``job``'s files to the writers and its lazy copies to the copier;
        ``last``: the save is sealed for good (``end``), which a writer that takes a save's
        files together (the memory tier's) is told."""
        # A save's files go to the writers and its lazy copies to the copier together, when it
        # is sealed: the pool can size one block for all of them (nothing can change the
        # tensors before the next fence anyway), and no background thread competes with the
        # training thread for the GIL or a core while it is still inside the save (on 2 busy
        # cores, a writer opening its file and writing headers meanwhile made saves slower).
        # Under the seal lock: a fence on another thread and ``end`` (or ``save``) on the
        # training thread must not both take a file (two writers on one file), nor one drop
        # what the other lists meanwhile (a writer waiting for copies never queued: a save
        # that never commits, and a ``wait`` that never returns).
        handle = job.handle
        with self._seal_lock:
            unwritten, job.writes = job.writes, []
            unsubmitted, job.copies = job.copies, []
            try:
                if unwritten:
                    self._persist.pace(handle, job.times["begin"], job.nbytes)
                for path, plans, names, share in unwritten:
                    job.files.append(self._persist.submit(path, plans, part_names=names, share=share))
                if unsubmitted:
                    self._warn_if_pool_too_small(unsubmitted)
                    self.stager.submit(unsubmitted, job=job)
                end = getattr(self._persist, "end", None) if last else None
                if end is not None:  # its copy into the keeper's slot: before the save's record
                    job.dependencies.append(end(handle))
            except BaseException as exc:
                # Cut short (a Ctrl-C while a writer thread starts): copies that may never be
                # queued fail, so that the writers already queued fail on them instead of
                # waiting for them for good (and close() with them).
                for item in unsubmitted:
                    item.fail(exc)
                raise

    def hurry(self) -> None:
        """Someone waits for the saves to be durable: stop pacing their writes."""
        self._persist.hurry()

    def close(self) -> None:
        """Stop the persist worker process, if any (once every file is written)."""
        self._persist.close()

    def _warn_if_pool_too_small(self, items: list[TensorItem]) -> None:
        """Say once when a save's lazy copies need more host staging than ``host_buffer_gb``:
        they then stream through the pool, so the last ones wait for writes to the disk, and
        training waits for them at the fence before the next optimizer step. Not an error (the
        save is correct, and the bound is kept), but the stall is the write's, which the pool
        is there to hide. Seen on an H100: a 1.075 GB ZeRO-1 save with a 1 GiB pool stalled
        ~200 ms per checkpoint instead of a few."""
        if self._warned_pool_too_small:
            return
        need = sum(aligned_size(i.nbytes) for i in items)
        if need > self._pool.capacity_bytes:
            self._warned_pool_too_small = True
            logger.warning(
                "async checkpoint: rank %d stages %.3g GiB per save but "
                "async_checkpoint.host_buffer_gb is %g: the copies stream through the pool as "
                "writes free it, and training waits for them before its next optimizer step; "
                "set host_buffer_gb to at least %.3g (host memory per rank, pinned with CUDA, "
                "allocated as used) to keep the writes out of training's way (logged once)",
                self._rank, need / 2**30, self._config.host_buffer_gb, -(-need * 100 // 2**30) / 100)
