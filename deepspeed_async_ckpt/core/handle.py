"""A save's handle: what one rank knows of one checkpoint, and the named points to wait at.

Made by :meth:`AsyncCheckpointer.begin <.checkpointer.AsyncCheckpointer.begin>` on the training
thread of every rank; filled in by the training thread (``save``, ``end``), the writers and the
copier (its files and copies) and the committer thread (its outcome, then ``persisted`` and
``committed`` set). A caller waits on it from any thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from ..commit import FinalizeStep, Pointer
from ..snapshot import TensorItem


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

    def __str__(self) -> str:
        rate = self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")
        return (f"checkpoint {self.tag} committed: {self.ckpt_dir}, {self.files} file(s), "
                f"{self.bytes / 1e9:.3g} GB from {self.world_size} rank(s), {self.seconds:.2f} s "
                f"after the save began ({rate:.3g} GB/s)")



class CheckpointHandle:
    """One checkpoint of one rank, with named wait points: staged, persisted, committed.

    "Committed" means: on rank 0, the manifest and pointer are durable; on other ranks, this
    rank's files are durable and its record is published (its part of the commit).
    """

    def __init__(self, ckpt_dir: str, tag: str, save_id: str, pointer: Pointer | None,
                 write_dir: str | None = None, finalize: tuple[FinalizeStep, ...] = (),
                 rotation: bool = True) -> None:
        self.ckpt_dir, self.tag, self.save_id, self.pointer = ckpt_dir, tag, save_id, pointer
        self.rotation = rotation
        """False for a save that moves no pointer: retention neither counts nor removes it."""
        self.write_dir = write_dir or ckpt_dir
        """Where this save's files go: ``ckpt_dir``, or, when that already held files, a
        staging directory beside it that the commit swaps in (see :meth:`AsyncCheckpointer.begin`)."""
        self.finalize = finalize
        """Rank 0: the steps its commit runs after the manifest (see :mod:`..commit.finalize`)."""
        self.items: list[TensorItem] = []
        """This rank's tensor items of the save (:meth:`wait_staged` waits for their copies)."""
        self.files: list[Future] = []
        self.dependencies: list[Future] = []
        """Outside work this save waits for (:meth:`depends_on`)."""
        self.nbytes = 0
        self.error: BaseException | None = None
        self.abandoned = False
        self.fence_wait_s = 0.0
        """Time the training loop spent blocked at fences waiting for this save's copies."""
        self.eager_wait_s = 0.0
        """Time its ``save`` calls waited for earlier saves' eager copies to be written (their
        backpressure: see ``SaveFiles._eager_room`` in :mod:`.files`)."""
        self.retired: list[str] = []
        """Older checkpoints that retention (the checkpointer's policy) removed after this one
        committed (filled in the background, after the commit: see :meth:`AsyncCheckpointer.wait`)."""
        self.times: dict[str, float] = {"begin": time.perf_counter()}
        self.commit_info: CommitInfo | None = None
        """Rank 0, once committed: what the commit wrote (see :class:`CommitInfo`)."""
        self._persisted = threading.Event()
        self._committed = threading.Event()

    def depends_on(self, future: Future) -> None:
        """This rank's part of the save is persisted only once ``future`` is done, and fails
        with its failure (a file an integration writes into the save directory on the writer
        threads, say). Call it on the thread that began the save, before ``end``: in a
        callback of :meth:`AsyncCheckpointer.add_begin_callback
        <.checkpointer.AsyncCheckpointer.add_begin_callback>`, which also makes the failure of
        a write from :meth:`~.checkpointer.AsyncCheckpointer.submit_write` this save's alone."""
        self.dependencies.append(future)

    def wait_staged(self) -> None:
        for item in self.items:
            item.wait_copied()
        self.times.setdefault("staged", time.perf_counter())

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

