"""A save's handle: what one rank knows of one checkpoint, and the named points to wait at.

Made by :meth:`AsyncCheckpointer.begin <.checkpointer.AsyncCheckpointer.begin>` on the training
thread of every rank. It is a read-only view of the save's :class:`~.job.SaveJob`, which the
training thread (``save``, ``end``), the writers and the copier (its files and copies) and the
committer thread (its outcome, then ``persisted`` and ``committed`` set) fill in. A caller
waits on it from any thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from types import MappingProxyType

from ..commit import Pointer
from .job import SaveJob


@dataclass(frozen=True)
class CommitInfo:
    """What rank 0 knows of a checkpoint once it is committed: what the commit log line says,
    and what an ``on_commit`` callback gets."""

    tag: str
    ckpt_dir: str
    files: int
    bytes: int
    world_size: int
    seconds: float
    """From ``begin`` (once the ranks agreed to save) to the commit (the pointer moved):
    staging, writing, the commit and its finalize steps, beside training. ``str()`` gives
    bytes over it as GB/s, which is not the disk's bandwidth."""
    save_id: str = ""
    save_call_s: float = 0.0
    """The largest over the ranks of the save call: from ``begin`` called to ``end`` called
    (the save sealed) on the training thread, the ranks' agreement included; in sync mode, to
    the rank's files persisted (``end`` writes them)."""
    fence_wait_s: float = 0.0
    """The largest over the ranks of the time the training loop waited at fences for this
    save's copies (the fences before its record: by then its copies are done)."""
    persisted_s: float = 0.0
    """The largest over the ranks of the time from ``begin`` to the rank's files persisted."""
    memory_committed_s: float | None = None
    """With the memory tier: from ``begin`` to the keeper's slot committed (None without)."""
    memory_only: bool = False
    """With the memory tier: the save is in the keeper's memory only, not on disk."""

    def __str__(self) -> str:
        rate = self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")
        where = "in the memory keeper only" if self.memory_only else self.ckpt_dir
        return (f"checkpoint {self.tag} committed: {where}, {self.files} file(s), "
                f"{self.bytes / 1e9:.3g} GB from {self.world_size} rank(s), {self.seconds:.2f} s "
                f"after the save began ({rate:.3g} GB/s)")



class CheckpointHandle:
    """One checkpoint of one rank, with named wait points: staged, persisted, committed.

    "Committed" means: on rank 0, the manifest and pointer are durable; on other ranks, this
    rank's files are durable and its record is published (its part of the commit).
    """

    def __init__(self, ckpt_dir: str, tag: str, save_id: str, pointer: Pointer | None,
                 write_dir: str | None = None, job: SaveJob | None = None,
                 rotation: bool = True) -> None:
        self._ckpt_dir, self._tag, self._save_id, self._pointer = ckpt_dir, tag, save_id, pointer
        self._rotation = rotation
        self._write_dir = write_dir or ckpt_dir
        self._job = job if job is not None else SaveJob()
        self._persisted = threading.Event()
        self._committed = threading.Event()

    # What the save is: fixed at ``begin``.
    ckpt_dir = property(lambda self: self._ckpt_dir)
    tag = property(lambda self: self._tag)
    save_id = property(lambda self: self._save_id)
    pointer = property(lambda self: self._pointer)
    rotation = property(lambda self: self._rotation,
                        doc="False for a save that moves no pointer: retention neither counts nor removes it.")
    write_dir = property(lambda self: self._write_dir,
                         doc="""Where this save's files go: ``ckpt_dir``, or, when that already held files, a
        staging directory beside it that the commit swaps in (see :meth:`AsyncCheckpointer.begin`).""")

    memory_only = property(lambda self: self._job.memory_only,
                           doc="True for a save that stays in the keeper's memory only (the memory tier).")

    # What the pipeline has done of it so far: read from its job, which only the core writes.
    items = property(lambda self: tuple(self._job.items),
                     doc="This rank's tensor items of the save (:meth:`wait_staged` waits for their copies).")
    files = property(lambda self: tuple(self._job.files), doc="This rank's file writes, one future each.")
    dependencies = property(lambda self: tuple(self._job.dependencies),
                            doc="Outside work this save waits for (:meth:`depends_on`).")
    nbytes = property(lambda self: self._job.nbytes)
    error = property(lambda self: self._job.error)
    abandoned = property(lambda self: self._job.abandoned)
    finalize = property(lambda self: self._job.finalize,
                        doc="Rank 0: the steps its commit runs after the manifest (see :mod:`..commit.finalize`).")
    fence_wait_s = property(lambda self: self._job.fence_wait_s,
                            doc="Time the training loop spent blocked at fences waiting for this save's copies.")
    eager_wait_s = property(lambda self: self._job.eager_wait_s,
                            doc="""Time its ``save`` calls waited for earlier saves' eager copies to be written (their
        backpressure: see ``SaveFiles._eager_room`` in :mod:`.files`).""")
    retired = property(lambda self: list(self._job.retired),
                       doc="""Older checkpoints that retention (the checkpointer's policy) removed after this one
        committed (filled in the background, after the commit: see :meth:`AsyncCheckpointer.wait`).""")
    times = property(lambda self: MappingProxyType(self._job.times),
                     doc="``time.perf_counter()`` at the save's named points: begin, called, end, staged, persisted, committed.")
    commit_info = property(lambda self: self._job.commit_info,
                           doc="Rank 0, once committed: what the commit wrote (see :class:`CommitInfo`).")

    def depends_on(self, future: Future) -> None:
        """This rank's part of the save is persisted only once ``future`` is done, and fails
        with its failure (a file an integration writes into the save directory on the writer
        threads, say). Call it on the thread that began the save, before ``end``: in a
        callback of :meth:`AsyncCheckpointer.add_begin_callback
        <.checkpointer.AsyncCheckpointer.add_begin_callback>`, which also makes the failure of
        a write from :meth:`~.checkpointer.AsyncCheckpointer.submit_write` this save's alone."""
        self._job.dependencies.append(future)

    def wait_staged(self) -> None:
        for item in self._job.items:
            item.wait_copied()
        self._job.times.setdefault("staged", time.perf_counter())

    def mark_persisted(self) -> None:
        """This rank's files are durable (or the save failed): the committer calls it."""
        self._persisted.set()

    def mark_settled(self) -> None:
        """The committer is done with the save, committed or failed: every wait returns."""
        self._persisted.set()
        self._committed.set()

    def wait_persisted(self, timeout: float | None = None) -> bool:
        return self._persisted.wait(timeout)

    def wait_committed(self, timeout: float | None = None) -> bool:
        return self._committed.wait(timeout)

    @property
    def committed(self) -> bool:
        return self._committed.is_set() and self.error is None and not self.abandoned

